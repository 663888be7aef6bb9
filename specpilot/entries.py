"""Memory entries: validated mechanisms that later rounds and other deployments can reuse (docs/DESIGN.md §7).

An entry (``MemoryEntryProposed``) carries a code delta against stock, option settings,
requirements (predicates on the deployment), the correctness contract it was checked under,
evidence (event ids), and the sha256 of every file of its source system under ``specpilot_engine/`` and
``specpilot_kernels/``. It is accepted only if applying the delta to stock reproduces those files exactly
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

ROOTS = ("specpilot_engine", "specpilot_kernels")
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


def _compare(want: dict[str, str], got: dict[str, str]) -> str:
    """What differs between two ``tree_hashes`` ('' if nothing)."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(p for p in set(got) & set(want) if got[p] != want[p])
    return "; ".join(f"{name}: {', '.join(paths[:5])}" for name, paths in
                     (("missing", missing), ("unexpected", extra), ("different", differ)) if paths)


def validate(delta: str, source_files: dict[str, str], stock: Path = REPO_ROOT,
             stock_files: dict[str, str] | None = None) -> str:
    """'' if ``delta`` applied to stock reproduces ``source_files`` exactly, else why not.

    ``stock_files`` (the hashes of the stock the delta was made against, when the entry names them)
    are checked first, so a stock tree edited since the deployment was registered is reported as
    such rather than as a delta that does not reproduce its source."""
    if not source_files:
        return "the entry names no source files to check the delta against"
    if stock_files and (changed := _compare(stock_files, tree_hashes(stock))):
        return ("the stock here is not the stock the delta was made against (" + changed + "): specpilot_engine/ or "
                "specpilot_kernels/ changed since the deployment was registered; validate where that stock is")
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
    if problem := _compare(source_files, got):
        return "stock + delta does not reproduce the source system (" + problem + ")"
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
