"""The version handshake: every service announces which SpecPilot it runs and which stock it expects.

Contract:
- `identity()` is this process's announcement, put in its micro service metadata
  (`specpilot.service.run`): ``version`` (``__version__`` plus a digest of its own code: the
  ``specpilot`` package, the services and ``deployments/``, so two checkouts of one release that differ still
  differ here), ``stock_tree`` (a digest of the runtime it treats as stock, `entries.tree_hashes`) and
  ``host``.
- `mismatches(own, services)` is pure: one line per discovered service whose version or stock tree
  differs from ``own``, naming the service, its host and what differs. The master refuses to plan a
  round while it is not empty.
"""

from __future__ import annotations

import hashlib
import json
import socket
from functools import lru_cache

from specpilot import __version__
from specpilot.entries import tree_hashes
from specpilot.paths import REPO_ROOT

CODE_ROOTS = ("specpilot", "services", "deployments")  # the runtime is `stock_tree`
KEYS = ("version", "stock_tree")


def digest(files: dict[str, str]) -> str:
    """A short digest of a ``{path: sha256}`` map."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def identity() -> dict[str, str]:
    return {"version": f"{__version__}+{digest(tree_hashes(REPO_ROOT, CODE_ROOTS))}",
            "stock_tree": digest(tree_hashes(REPO_ROOT)), "host": socket.gethostname()}


def mismatches(own: dict[str, str], services: list[dict]) -> list[str]:
    """What differs between ``own`` and each discovered service (micro INFO replies with metadata)."""
    out = []
    for svc in services:
        meta = svc.get("metadata") or {}
        differ = [f"{key} {meta.get(key) or 'unannounced'} (here {own[key]})" for key in KEYS if meta.get(key) != own[key]]
        if differ:
            out.append(f"{svc.get('name', '?')} on host {meta.get('host') or '?'} runs {', '.join(differ)}")
    return out
