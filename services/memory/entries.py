"""Memory entries: validated mechanisms that later rounds and other deployments can reuse (DESIGN §7).

An entry (``MemoryEntryProposed``) carries a code delta against stock, option settings,
requirements (predicates on the deployment), the correctness contract it was checked under,
evidence (event ids), and the sha256 of every file of its source system under ``engine/`` and
``kernels/``. It is accepted only if applying the delta to stock reproduces those files exactly
(`validate`). `matches` filters entries by a deployment's facts.

Pure apart from `validate`, which works in a temporary directory with ``git apply``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from specpilot.paths import REPO_ROOT

ROOTS = ("engine", "kernels")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


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


def validate(delta: str, source_files: dict[str, str], stock: Path = REPO_ROOT) -> str:
    """'' if ``delta`` applied to stock reproduces ``source_files`` exactly, else why not."""
    if not source_files:
        return "the entry names no source files to check the delta against"
    with tempfile.TemporaryDirectory(prefix="sp-entry-") as tmp:
        work = Path(tmp)
        for r in ROOTS:
            if (Path(stock) / r).exists():
                shutil.copytree(Path(stock) / r, work / r, ignore=_IGNORE)
        if delta.strip():
            res = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=work, input=delta, text=True,
                                 capture_output=True, timeout=60)
            if res.returncode != 0:
                return f"the delta does not apply to stock: {res.stderr.strip()[:300]}"
        got = tree_hashes(work)
    missing = sorted(set(source_files) - set(got))
    extra = sorted(set(got) - set(source_files))
    differ = sorted(p for p in set(got) & set(source_files) if got[p] != source_files[p])
    if missing or extra or differ:
        parts = [f"{name}: {', '.join(paths[:5])}" for name, paths in
                 (("missing", missing), ("unexpected", extra), ("different", differ)) if paths]
        return "stock + delta does not reproduce the source system (" + "; ".join(parts) + ")"
    return ""


def requirements_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The predicates an entry found on ``deployment`` states (the facts it was validated under)."""
    return {k: deployment[k] for k in ("device_kind", "model_family", "dtype", "mode") if k in deployment}


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
