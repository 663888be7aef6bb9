"""Memory entries: validated mechanisms that later rounds and other deployments can reuse (docs/DESIGN.md §7).

An entry (``MemoryEntryProposed``) carries a code delta against stock, option settings,
requirements (predicates on the deployment, `requirements_for`: only what the entry changes needs),
the correctness contract it was checked under, evidence (event ids), and the sha256 of every file of
its source system and of its stock under ``engine/`` and ``kernels/``. It is accepted
only if applying the delta to *its* stock reproduces those files exactly (`validate`). Stocks are kept
in a content-addressed snapshot store (``<store>/<sha256>``, `snapshot`): the memory service files its
checkout's runtime there when it starts and whenever an entry names files the checkout still holds, and
`specpilot memory import` brings an exported entry's stock with it; a check then never depends on what
the host's checkout holds today. `matches` filters entries by a deployment's facts.

Everything in an entry is hostile input (an import, a shipped file, another host's ledger): `files_problem`
refuses a path that is absolute, climbs (``..``), is not normalised or lies outside the runtime's folders
(today's or 0.2's), and a hash that is not 64 hex digits; `validate` refuses such an entry, and a delta that
the patch policy refuses (`policy.check`), before any file is read or written or any ``git apply`` runs.
Files are read and written without following links (`read_regular`), and a snapshot's blob is filed only
when its content hashes to its name.

Pure apart from `snapshot` and `validate`, which copy files and work in a temporary directory with
``git apply``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from specpilot import policy
from specpilot.layout import RUNTIME_FOLDERS
from specpilot.paths import REPO_ROOT

ROOTS = RUNTIME_FOLDERS
# where an entry's files may lie: today's runtime folders, and 0.2's (entries recorded before session 42)
FILE_ROOTS = (*policy.ALLOWED_ROOTS, *policy.LEGACY_ROOTS)
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_FILE_BYTES = 64 << 20  # a runtime file (the drafters' weights are ~10 MB)
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def files_problem(files: object) -> str:
    """Why a ``{relative path: sha256}`` map from an entry may not be used ('' when it may)."""
    if not isinstance(files, dict):
        return "its file list is not a mapping"
    for rel, sha in files.items():
        if problem := policy.path_problem(rel, FILE_ROOTS):
            return f"file {problem}"
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            return f"file {rel}: {sha!r} is not a sha256"
    return ""


def read_regular(path: Path, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes reached without following a
    link in its last component (None otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return f.read(limit + 1)[:limit]


def file_blob(store: Path, data: bytes, sha: str) -> bool:
    """File ``data`` as ``store/sha`` (atomically, mode 0644) when it hashes to ``sha``; whether it did."""
    if not SHA256.fullmatch(sha) or hashlib.sha256(data).hexdigest() != sha:
        return False
    tmp = Path(store) / f".{sha}.tmp"
    tmp.write_bytes(data)
    tmp.rename(Path(store) / sha)
    return True


def tree_hashes(root: Path, roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root/<roots>`` (caches excluded)."""
    out = {}
    for r in roots:
        base = Path(root) / r
        if not base.exists():
            continue
        for p in sorted(base.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _compare(want: dict[str, str], got: dict[str, str]) -> str:
    """What differs between two ``tree_hashes`` ('' if nothing)."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(p for p in set(got) & set(want) if got[p] != want[p])
    return "; ".join(f"{name}: {', '.join(paths[:5])}" for name, paths in
                     (("missing", missing), ("unexpected", extra), ("different", differ)) if paths)


def snapshot(store: Path, files: dict[str, str] | None = None, live: Path = REPO_ROOT) -> int:
    """File into ``store`` every file of ``files`` (default: all of ``live``'s runtime) that ``live``
    holds with that content and the store lacks; returns how many were added. Written atomically."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    files = tree_hashes(live) if files is None else files
    if files_problem(files):
        return 0
    added = 0
    for rel, sha in files.items():
        if (store / sha).exists() or (data := read_regular(Path(live) / rel)) is None:
            continue
        added += file_blob(store, data, sha)
    return added


def _stock_tree(dest: Path, stock: Path, stock_files: dict[str, str] | None, store: Path | None) -> str:
    """Write the stock a delta was made against into ``dest``; why not ('' when written)."""
    if store is not None and stock_files:
        snapshot(store, stock_files, stock)
        missing = sorted(rel for rel, sha in stock_files.items() if not (Path(store) / sha).exists())
        if missing:
            return (f"the stock this entry was made against is not in the snapshot store {store} ({len(missing)} "
                    f"files, e.g. {', '.join(missing[:3])}): import it with the entry (`specpilot memory import`)")
        for rel, sha in stock_files.items():
            data = read_regular(Path(store) / sha)
            if data is None or hashlib.sha256(data).hexdigest() != sha:
                return f"the snapshot store's {sha[:12]} (for {rel}) is not that file: it was changed or replaced"
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
        return ""
    if stock_files and (changed := _compare(stock_files, tree_hashes(stock))):
        return ("the stock here is not the stock the delta was made against (" + changed + "): engine/ or "
                "kernels/ changed since the deployment was registered; validate where that stock is")
    for r in ROOTS:
        if (Path(stock) / r).exists():
            shutil.copytree(Path(stock) / r, dest / r, ignore=_IGNORE)
    return ""


def validate(delta: str, source_files: dict[str, str], stock: Path = REPO_ROOT,
             stock_files: dict[str, str] | None = None, store: Path | None = None) -> str:
    """'' if ``delta`` applied to its stock reproduces ``source_files`` exactly, else why not.

    The stock is ``stock_files`` from the snapshot ``store`` (filed from ``stock`` first where it holds
    them) when both are given; else the tree at ``stock``, checked against ``stock_files`` first so a
    stock edited since the deployment was registered is reported as such rather than as a delta that
    does not reproduce its source."""
    if not source_files:
        return "the entry names no source files to check the delta against"
    for name, files in (("source", source_files), ("stock", stock_files or {})):
        if problem := files_problem(files):
            return f"its {name} {problem}"
    if not isinstance(delta, str):
        return "its delta is not text"
    if delta.strip() and (refusal := policy.check(policy.current_paths(delta), {})):
        return f"its delta breaks the patch policy ({refusal.rule}: {refusal.reason})"
    if not delta.strip() and stock_files and source_files == stock_files:
        return ""  # options on stock, no code: nothing to reproduce (each use re-times it on its own stock)
    with tempfile.TemporaryDirectory(prefix="sp-entry-") as tmp:
        work = Path(tmp)
        if problem := _stock_tree(work, Path(stock), stock_files, store):
            return problem
        if delta.strip():
            res = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=work, input=delta, text=True,
                                 capture_output=True, timeout=60)
            if res.returncode != 0:
                return f"the delta does not apply to stock: {res.stderr.strip()[:300]}"
        got = tree_hashes(work)
    if problem := _compare(source_files, got):
        return "stock + delta does not reproduce the source system (" + problem + ")"
    return ""


def requirements_for(options: dict[str, Any], facts: dict[str, Any], code_delta: bool, outputs_identical: bool,
                     devices: dict[str, tuple[str, ...]], per_target: dict[str, tuple[Any, ...]],
                     device_kinds: tuple[str, ...]) -> dict[str, Any]:
    """What an entry needs of a deployment, from what it changes (so it carries as far as it holds):

    - ``mode``: always the one it was found in (a batched engine is another engine);
    - ``device_kind``: the kinds every option it sets means something on (``devices``: option -> kinds,
      each option's `OptionInfo.devices`), narrowed to the kind it ran on when it carries code (timed
      there only);
    - ``model_family``: the architecture, when it carries code (it may touch the model's blocks);
    - ``target``: when it sets a value with weights trained for one target (``per_target``: option ->
      such values, `OptionInfo.per_target`);
    - ``dtype``: when its contract is forcing (it changed tokens: judged against that dtype's stock).

    ``device_kinds``: every kind there is. Pure: the caller reads the option table (the core imports no
    runtime)."""
    req: dict[str, Any] = {"mode": facts.get("mode")}
    kinds = set(device_kinds)
    for name in options:
        kinds &= set(devices.get(name, device_kinds))
    if code_delta:
        kinds &= {facts.get("device_kind")}
        req["model_family"] = facts.get("model_family")
    if kinds != set(device_kinds):
        req["device_kind"] = sorted(kinds)
    if any(value in per_target.get(name, ()) for name, value in options.items()):
        req["target"] = facts.get("target")
    if not outputs_identical:
        req["dtype"] = facts.get("dtype")
    return req


def matches(requirements: dict[str, Any], deployment: dict[str, Any]) -> bool:
    """Every predicate holds: equal, or one of a list. A fact the deployment lacks fails the predicate."""
    for key, want in requirements.items():
        have = deployment.get(key)
        if isinstance(want, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True
