"""Patch policy, pure: what a patch may touch before anything of it runs.

A patch is a unified diff (``git diff`` format) plus option settings. It may only add, modify or
delete regular text files under the runtime's folders, ``engine/`` and ``kernels/`` (`ALLOWED_ROOTS`), and
must stay under a size limit.
Everything else — the harness, tests, services, request sets, deployments, packaging, symlinks,
binary patches, renames or copies out of the allowed folders, paths that climb out with ``..`` —
is refused with the rule that caught it (`refused` turns that into the controller's `PatchRefused`).
Option values are checked later by the candidate's own engine (a patch may add options), inside the
sandbox. The harness lives in ``specpilot/`` (``specpilot/harness/``: worker, replay, request sets and
their dev/sealed split, deployments, profiler, forcing), so no patch can reach it. Diffs recorded by
SpecPilot 0.2, whose runtime folders were ``specpilot_engine/`` and ``specpilot_kernels/``, are read with
today's names (`current_paths`) wherever a recorded diff is applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specpilot import schema
from specpilot.layout import RUNTIME_FOLDERS

ALLOWED_ROOTS = tuple(f"{folder}/" for folder in RUNTIME_FOLDERS)
LEGACY_ROOTS = {"specpilot_engine/": "engine/", "specpilot_kernels/": "kernels/"}  # SpecPilot 0.2's names
MAX_DIFF_BYTES = 200_000
MAX_FILES = 40
MAX_OPTIONS = 16

_HEADER = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|--- (\S+)|\+\+\+ (\S+)|rename (?:from|to) (\S+)|"
                     r"copy (?:from|to) (\S+))")
_MODE = re.compile(r"^(?:new file mode|deleted file mode|old mode|new mode) (\d+)")


@dataclass(frozen=True)
class Refusal:
    rule: str
    reason: str


def touched_paths(diff: str) -> set[str]:
    """Every path a diff names (both sides, renames and copies included), without a/ b/ prefixes."""
    paths: set[str] = set()
    for line in diff.splitlines():
        m = _HEADER.match(line)
        if not m:
            continue
        for p in m.groups():
            if p is None or p == "/dev/null":
                continue
            if line.startswith(("--- ", "+++ ")) and p[:2] in ("a/", "b/"):
                p = p[2:]
            paths.add(p)
    return paths


def current_paths(diff: str) -> str:
    """``diff`` with the runtime's folders named as today (`LEGACY_ROOTS`: a diff recorded by SpecPilot 0.2,
    in a ledger's patch, a memory entry's delta or a best branch); other diffs come back unchanged."""
    out = []
    for line in diff.splitlines(keepends=True):
        if _HEADER.match(line):
            for old, new in LEGACY_ROOTS.items():
                line = line.replace(f"a/{old}", f"a/{new}").replace(f"b/{old}", f"b/{new}").replace(f" {old}", f" {new}")
        out.append(line)
    return "".join(out)


def path_problem(path: str, roots: tuple[str, ...] = ALLOWED_ROOTS) -> str | None:
    """Why ``path`` (from a diff or a memory entry: hostile input) may not be touched, None when it may: it
    must be relative, normalised, under one of ``roots`` and name no test."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or "\0" in path:
        return f"{path!r}: absolute or odd path"
    parts = path.split("/")
    if ".." in parts or "." in parts or "" in parts:
        return f"{path}: path climbs or is not normalised"
    if not path.startswith(roots):
        return f"{path}: outside {', '.join(roots)} (harness, tests, services and request sets are off limits)"
    if "/tests/" in f"/{path}" or path.rsplit("/", 1)[-1].startswith("test_"):
        return f"{path}: tests are off limits"
    return None


def check(diff: str, options: dict, *, max_bytes: int = MAX_DIFF_BYTES) -> Refusal | None:
    """None when the patch may be tried; otherwise the rule it breaks."""
    if not isinstance(diff, str):
        return Refusal("format", "the diff must be text")
    size = len(diff.encode())
    if size > max_bytes:
        return Refusal("size", f"diff is {size} bytes, over the {max_bytes}-byte limit")
    if not isinstance(options, dict) or len(options) > MAX_OPTIONS:
        return Refusal("options", f"options must be a dict of at most {MAX_OPTIONS} settings")
    for k, v in options.items():
        if not isinstance(k, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", k):
            return Refusal("options", f"bad option name {k!r}")
        if not isinstance(v, str | int | float | bool):
            return Refusal("options", f"option {k!r} must be a string, number or boolean")
    if "GIT binary patch" in diff or re.search(r"^Binary files .* differ$", diff, re.M):
        return Refusal("binary", "binary patches are not allowed")
    for line in diff.splitlines():
        m = _MODE.match(line)
        if m and m.group(1) not in ("100644", "100755"):
            return Refusal("mode", f"file mode {m.group(1)} is not allowed (symlinks and submodules are refused)")
    paths = touched_paths(diff)
    if not paths and diff.strip():
        return Refusal("format", "no file headers found: send a unified diff (git diff format)")
    if len(paths) > MAX_FILES:
        return Refusal("size", f"diff touches {len(paths)} files, over the limit of {MAX_FILES}")
    for p in sorted(paths):
        if problem := path_problem(p):
            return Refusal("paths", problem)
    return None


def refused(patch: schema.PatchProposed) -> schema.PatchRefused | None:
    """The controller's refusal of ``patch`` (None when it may be tried): the rule and why."""
    if refusal := check(patch.diff, patch.options):
        return schema.PatchRefused(patch_id=patch.patch_id, rule=refusal.rule, reason=refusal.reason)
    return None
