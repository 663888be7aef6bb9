"""A subagent's workspace (a git copy of the current best system) and the tools an agent uses on it.

Contract:
- ``build_workspace(root, promotions)``: stock is ``root``'s own ``engine/``, ``kernels/``,
  ``deployments/`` and ``tests/engine/`` (plus ``tests/__init__.py`` and a ``pytest.ini``) committed as
  "stock" in a fresh git repository; each ``(patch_id, diff)`` of ``promotions`` (ledger order) is then
  applied with ``git apply`` and committed. The last commit is the workspace's *base*: the patch a
  subagent proposes is ``git diff`` of the workspace against it, restricted to ``engine/`` and
  ``kernels/``. No network, no NATS: the service feeds it what it read from the ledger.
- ``apply_diff`` applies a diff as it is (then with recounted hunks); ``merge_from_stock`` applies a diff
  written against stock (a memory entry) to a later commit, by a 3-way merge when it does not apply as is.
- ``Tools`` executes the provider-neutral tools in ``TOOL_SPECS`` (``list_files``, ``read_file``,
  ``apply_diff``, ``run_tests``, ``quick_time`` and ``profile`` (advice: `advice.Advisor`), ``finish``)
  and never raises for an agent's mistake: every problem is a ``ToolResult`` with ``error=True`` and a message saying what to do. Reading is confined to
  ``READABLE`` (request sets are off limits); diffs go through the controller's own policy
  (``specpilot.policy.check``: only ``engine/`` and ``kernels/``, no tests, no ``..``).
  ``run_tests`` runs ``python -m pytest -q -x tests/engine -k PATTERN`` over the workspace.
- Agent-written code never runs in the service's process nor outside a sandbox: ``run_tests`` and
  ``validate_options`` run through `Workspace.run`, a `specpilot.sandbox.Sandbox` (the controller's
  rules: read-only system, private ``/tmp``, no network, cleared environment, the service's data
  directory hidden, process/memory/wall limits) over a read-only bind of the workspace.
- ``finish(options, notes)`` is accepted only when the options pass the policy and the workspace's own
  ``specpilot.engine.options.options_from_dict`` (a patch may add options); then ``Tools.finished`` is set.

This module imports no LLM SDK.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specpilot import policy
from specpilot.errors import UserError
from specpilot.layout import RUNTIME_FOLDERS
from specpilot.llm import ToolResult
from specpilot.sandbox import Limits, Sandbox, WorkerFailed

PATCH_ROOTS = RUNTIME_FOLDERS  # what a proposed patch is made of (policy.ALLOWED_ROOTS)
STOCK_DIRS = (*PATCH_ROOTS, "deployments", "tests/engine")
STOCK_FILES = ("tests/__init__.py",)
READABLE = tuple(f"{d}/" for d in STOCK_DIRS)
UNREADABLE_SUFFIXES = (".json", ".jsonl")  # request sets live in deployments/ as JSON: off limits
MAX_READ_CHARS = 60_000
MAX_LIST = 400
TEST_OUTPUT_TAIL = 6_000
DEFAULT_TEST_TIMEOUT_S = 600.0
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
_GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n"
_PYTEST_INI = ("[pytest]\naddopts = -m \"not long\" -p no:cacheprovider\n"
               "markers =\n    slow: slow\n    gpu: needs CUDA\n    long: many minutes\n")
_GIT_ENV = {"GIT_AUTHOR_NAME": "specpilot-subagent", "GIT_AUTHOR_EMAIL": "subagent@specpilot.local",
            "GIT_COMMITTER_NAME": "specpilot-subagent", "GIT_COMMITTER_EMAIL": "subagent@specpilot.local",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}
# What agent code may use in one sandboxed run (tests load SmolLM2: ~1 GB; pytest, torch's threads).
RUN_LIMITS = Limits(memory_bytes=6 << 30, pids=256)


class WorkspaceError(UserError):
    pass


def git(cwd: Path, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **_GIT_ENV}
    res = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, text=True, env=env, timeout=120)
    if check and res.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args[:2])} failed in {cwd}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def apply_diff(cwd: Path, diff: str) -> str:
    """Apply a unified diff to the work tree (as it is, then with recounted hunks).

    Returns how it applied; raises ``WorkspaceError`` with git's message when it does not."""
    if not diff.strip():
        return "empty"
    diff = policy.current_paths(diff)  # a promotion recorded by SpecPilot 0.2
    errors = []
    for how, extra in (("plain", []), ("recount", ["--recount"])):
        res = git(cwd, "apply", "--whitespace=nowarn", *extra, "-", input=diff, check=False)
        if res.returncode == 0:
            return how
        errors.append(f"{how}: {res.stderr.strip()}")
    raise WorkspaceError("the diff does not apply: " + " | ".join(errors))


def merge_from_stock(cwd: Path, diff: str) -> str:
    """Apply a diff *against stock* to a workspace at a later commit: directly when it applies, else as a
    3-way merge (the diff committed on top of the ``stock`` tag, then cherry-picked without committing).

    Needs a clean work tree. Returns how it applied; on a conflict the work tree is restored and
    ``WorkspaceError`` says which files conflicted."""
    try:
        return apply_diff(cwd, diff)
    except WorkspaceError as exc:
        direct = str(exc)
    with tempfile.TemporaryDirectory(prefix="sp-merge-") as tmp:
        side = Path(tmp) / "stock"
        git(cwd, "worktree", "add", "-q", "--detach", str(side), "stock")
        try:
            apply_diff(side, diff)
            commit = commit_all(side, "memory entry on stock")
        except WorkspaceError as exc:
            raise WorkspaceError(f"{direct} | on stock: {exc}") from exc
        finally:
            git(cwd, "worktree", "remove", "--force", str(side), check=False)
    res = git(cwd, "cherry-pick", "--no-commit", commit, check=False)
    if res.returncode != 0:
        conflicts = git(cwd, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
        git(cwd, "cherry-pick", "--abort", check=False)
        git(cwd, "reset", "-q", "--hard")
        raise WorkspaceError(f"{direct} | 3-way merge from stock conflicts in {', '.join(conflicts) or '?'}: "
                             f"{(res.stderr or res.stdout).strip()[:1000]}")
    git(cwd, "reset", "-q")  # keep the merged files in the work tree, not staged
    return "3-way"


def commit_all(cwd: Path, message: str) -> str:
    git(cwd, "add", "-A")
    git(cwd, "commit", "-q", "--allow-empty", "-m", message)
    return git(cwd, "rev-parse", "HEAD").stdout.strip()


def build_workspace(root: Path, promotions: list[tuple[str, str]], dest: Path | None = None,
                    trees: dict[str, str] | None = None) -> Path:
    """A git repository holding stock from ``root`` with each promoted ``(patch_id, diff)`` applied in order.

    ``dest`` (a directory that must not exist yet) defaults to a fresh temporary directory; the caller
    removes it. ``trees``: the git tree id each runtime root must end with (the controller's best);
    a mismatch raises `WorkspaceError` (this host's stock is not the controller's)."""
    root = Path(root)
    if dest is None:
        dest = Path(tempfile.mkdtemp(prefix="sp-subagent-")) / "ws"
    dest = Path(dest)
    dest.mkdir(parents=True)
    for d in STOCK_DIRS:
        if (root / d).is_dir():
            shutil.copytree(root / d, dest / d, ignore=_IGNORE)
    for f in STOCK_FILES:
        if (root / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dest / f)
    (dest / ".gitignore").write_text(_GITIGNORE)
    (dest / "pytest.ini").write_text(_PYTEST_INI)
    git(dest, "init", "-q", "-b", "work")
    commit_all(dest, "stock")
    git(dest, "tag", "stock")
    for patch_id, diff in promotions:
        try:
            apply_diff(dest, diff)
        except WorkspaceError as exc:
            raise WorkspaceError(f"cannot rebuild the current best: promoted patch {patch_id}: {exc}") from exc
        commit_all(dest, f"promoted {patch_id}")
    for sub, want in (trees or {}).items():
        got = git(dest, "rev-parse", f"HEAD:{sub}").stdout.strip()
        if got != want:
            raise WorkspaceError(f"the best system rebuilt here differs from the controller's in {sub}/ (tree {got[:12]}, "
                                 f"the controller's {want[:12]}): does this host run the same SpecPilot checkout?")
    return dest


class Workspace:
    """A built workspace: its base commit (the current best), its diff against it, and sandboxed runs of its code.

    ``hide``: paths a run must not see (the service's data directory: credentials, and the ledger where
    memory shares the host); covered by empty directories inside the sandbox."""

    def __init__(self, path: Path, hide: tuple[Path, ...] = (), limits: Limits = RUN_LIMITS):
        self.path = Path(path)
        self.hide, self.limits = tuple(Path(h) for h in hide), limits
        self.base = git(self.path, "rev-parse", "HEAD").stdout.strip()

    def run(self, cmd: list[str], timeout_s: float, tail: int = 4000) -> dict:
        """Run ``cmd`` (the workspace's code) in a fresh sandbox over a read-only bind of the workspace;
        `specpilot.sandbox.Sandbox.run`'s result: returncode, output tail, timed_out, oom_killed."""
        limits = Limits(wall_s=timeout_s, memory_bytes=self.limits.memory_bytes, pids=self.limits.pids)
        with Sandbox(src=self.path, models=self.path / ".no-models", hide=list(self.hide), limits=limits) as sbx:
            return sbx.run(cmd, timeout=timeout_s, tail=tail)

    def diff(self) -> str:
        """The proposed patch: every change to engine/ and kernels/ since the base (new files included)."""
        git(self.path, "add", "-A", "--", *PATCH_ROOTS)
        return git(self.path, "diff", "--cached", "--no-color", "--no-ext-diff", self.base, "--", *PATCH_ROOTS).stdout

    def remove(self) -> None:
        shutil.rmtree(self.path.parent if self.path.parent.name.startswith("sp-subagent-") else self.path,
                      ignore_errors=True)


def validate_options(workspace: Workspace, options: dict, timeout_s: float = 60.0) -> str | None:
    """Why ``options`` are not valid for the workspace's own engine (None when they are).

    Runs the workspace's ``specpilot.engine.options.options_from_dict`` in its sandbox (`Workspace.run`): a
    patch may add options, and the agent's code is never imported into the service."""
    code = ("import json, sys\nfrom specpilot.engine.options import options_from_dict\n"
            "try:\n    options_from_dict(json.loads(sys.argv[1]))\n"
            "except (ValueError, TypeError) as exc:\n    print(exc); sys.exit(3)\n")
    res = workspace.run([sys.executable, "-c", code, json.dumps(options)], timeout_s, tail=2000)
    if res["timed_out"]:
        return f"checking the options took over {timeout_s:.0f} s"
    if res["returncode"] == 0:
        return None
    return res["output"].strip() or f"exit status {res['returncode']}"


# --- tools ---------------------------------------------------------------------------------------

TOOL_SPECS: list[dict] = [
    {"name": "list_files",
     "description": "List the files under a folder of the workspace (engine/, kernels/, tests/engine/, deployments/). "
                    "An empty path lists the top-level folders.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string", "description": "folder, e.g. engine/"}},
                      "required": []}},
    {"name": "read_file",
     "description": "Read a text file of the workspace, optionally only lines start_line..end_line (1-based).",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
         "required": ["path"]}},
    {"name": "apply_diff",
     "description": "Apply a unified diff (git diff format, paths a/engine/... b/engine/...) to the workspace. Only "
                    "files under engine/ and kernels/ may change, tests may not. Diffs accumulate; read the file "
                    "again before a second diff to the same place.",
     "input_schema": {"type": "object", "properties": {"diff": {"type": "string"}}, "required": ["diff"]}},
    {"name": "run_tests",
     "description": "Run the engine's tests in the workspace: python -m pytest -q -x tests/engine -k PATTERN "
                    "(optionally only one test file under tests/engine/). Returns the exit status and the output's tail.",
     "input_schema": {"type": "object", "properties": {
         "pattern": {"type": "string", "description": "pytest -k expression; empty runs all (slow)"},
         "path": {"type": "string", "description": "a test file under tests/engine/ (optional)"}},
         "required": []}},
    {"name": "quick_time",
     "description": "Advice, not a verdict: time the workspace (with these engine options, on top of the best's) "
                    "against the current best on two public dev requests, in a sandbox; says the speed ratio and "
                    "whether the tokens are the best's. Takes a minute or so.",
     "input_schema": {"type": "object", "properties": {
         "options": {"type": "object", "description": "engine option name -> value (your mechanism's)"}},
         "required": []}},
    {"name": "profile",
     "description": "Advice, not a verdict: the workspace's tokens per step and milliseconds per kernel class "
                    "(with these options) on two public dev requests, in a sandbox.",
     "input_schema": {"type": "object", "properties": {
         "options": {"type": "object", "description": "engine option name -> value"}}, "required": []}},
    {"name": "finish",
     "description": "Finish: the workspace's changes are the patch. options are the engine option settings that "
                    "enable the new mechanism (relative to stock); notes say what changed and why it is faster.",
     "input_schema": {"type": "object", "properties": {
         "options": {"type": "object", "description": "engine option name -> value"},
         "notes": {"type": "string"}}, "required": ["options", "notes"]}},
]


@dataclass(frozen=True)
class Finished:
    options: dict
    notes: str


class Tools:
    """Executes tool calls on one workspace; ``finished`` is set by an accepted ``finish``."""

    specs = TOOL_SPECS

    def __init__(self, workspace: Workspace, test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S, advisor=None):
        """``advisor``: an `advice.Advisor` for ``quick_time`` and ``profile`` (None: they say they are off)."""
        self.ws = workspace
        self.test_timeout_s = test_timeout_s
        self.advisor = advisor
        self.finished: Finished | None = None
        self.calls: list[tuple[str, dict, ToolResult]] = []

    def call(self, name: str, args: dict | None) -> ToolResult:
        args = args if isinstance(args, dict) else {}
        fn = {"list_files": self.list_files, "read_file": self.read_file, "apply_diff": self.apply_diff,
              "run_tests": self.run_tests, "quick_time": self.quick_time, "profile": self.profile,
              "finish": self.finish}.get(name)
        if fn is None:
            res = ToolResult(f"unknown tool {name!r}; tools: {', '.join(t['name'] for t in TOOL_SPECS)}", True)
        else:
            try:
                res = fn(**args)
            except TypeError as exc:
                res = ToolResult(f"bad arguments for {name}: {exc}", True)
            except (WorkspaceError, OSError, subprocess.SubprocessError, ValueError) as exc:
                res = ToolResult(f"{name} failed: {exc}", True)
        self.calls.append((name, args, res))
        return res

    # --- paths -----------------------------------------------------------------------------------

    def _path(self, path: str, *, folder: bool = False) -> Path | ToolResult:
        p = str(path or "").strip().replace("\\", "/")
        if p.startswith("./"):
            p = p[2:]
        parts = p.rstrip("/").split("/")
        if p.startswith("/") or ".." in parts or "." in parts:
            return ToolResult(f"{path!r}: give a relative path inside the workspace, without '..'", True)
        rel = p.rstrip("/")
        if not any(rel == r.rstrip("/") or rel.startswith(r) for r in READABLE):
            return ToolResult(f"{path!r} is outside {', '.join(READABLE)}", True)
        if not folder and rel.endswith(UNREADABLE_SUFFIXES) and rel.startswith("deployments/"):
            return ToolResult(f"{path!r}: request sets are off limits", True)
        full = (self.ws.path / p).resolve()
        if not full.is_relative_to(self.ws.path.resolve()):
            return ToolResult(f"{path!r} leaves the workspace", True)
        return full

    # --- the tools -------------------------------------------------------------------------------

    def list_files(self, path: str = "") -> ToolResult:
        if not str(path or "").strip("./"):
            return ToolResult("\n".join(READABLE))
        full = self._path(path, folder=True)
        if isinstance(full, ToolResult):
            return full
        if full.is_file():
            return ToolResult(str(full.relative_to(self.ws.path)))
        if not full.is_dir():
            return ToolResult(f"{path!r}: no such folder", True)
        files = sorted(str(f.relative_to(self.ws.path)) for f in full.rglob("*")
                       if f.is_file() and "__pycache__" not in f.parts)
        more = f"\n... and {len(files) - MAX_LIST} more" if len(files) > MAX_LIST else ""
        return ToolResult("\n".join(files[:MAX_LIST]) + more)

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> ToolResult:
        full = self._path(path)
        if isinstance(full, ToolResult):
            return full
        if not full.is_file():
            return ToolResult(f"{path!r}: no such file", True)
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            return ToolResult(f"{path!r} is a binary file ({len(data)} bytes)", True)
        text = data.decode("utf-8", errors="replace")
        if start_line or end_line:
            lines = text.splitlines(True)
            lo, hi = max(1, int(start_line or 1)), min(len(lines), int(end_line or len(lines)))
            text = "".join(lines[lo - 1:hi])
        if len(text) > MAX_READ_CHARS:
            text = text[:MAX_READ_CHARS] + f"\n... truncated at {MAX_READ_CHARS} characters; read a line range"
        return ToolResult(text)

    def apply_diff(self, diff: str) -> ToolResult:
        if not isinstance(diff, str) or not diff.strip():
            return ToolResult("the diff is empty", True)
        if not diff.endswith("\n"):
            diff += "\n"
        if refusal := policy.check(diff, {}):
            return ToolResult(f"refused ({refusal.rule}): {refusal.reason}", True)
        how = apply_diff(self.ws.path, diff)
        return ToolResult(f"applied ({how}) to {', '.join(sorted(policy.touched_paths(diff)))}")

    def run_tests(self, pattern: str = "", path: str = "") -> ToolResult:
        target = "tests/engine"
        if path:
            full = self._path(path)
            if isinstance(full, ToolResult):
                return full
            target = str(full.relative_to(self.ws.path.resolve()))
            if not target.startswith("tests/engine"):
                return ToolResult(f"{path!r}: tests live under tests/engine/", True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", target]
        if pattern:
            cmd += ["-k", str(pattern)]
        res = self.ws.run(cmd, self.test_timeout_s, tail=TEST_OUTPUT_TAIL)
        if res["timed_out"]:
            return ToolResult(f"tests timed out after {self.test_timeout_s:.0f} s (killed{res['memory_note']})\n"
                              f"{res['output']}", True)
        if res["oom_killed"]:
            return ToolResult(f"tests ran out of memory (limit {self.ws.limits.memory_bytes >> 20} MiB; killed)\n"
                              f"{res['output']}", True)
        return ToolResult(f"exit status {res['returncode']}\n{res['output']}", res["returncode"] not in (0, 5))

    def _advice(self, what: str, options: dict | None, run: Callable[[dict], str]) -> ToolResult:
        """``run(options)`` of the advisor, after the checks ``finish`` makes of the options."""
        if self.advisor is None:
            return ToolResult(f"{what} is not available for this direction", True)
        options = options or {}
        if not isinstance(options, dict):
            return ToolResult("options must be an object of option name -> value", True)
        if problem := validate_options(self.ws, options):
            return ToolResult(f"the options are not valid for the workspace's engine: {problem}", True)
        try:
            return ToolResult(run(options))
        except WorkerFailed as exc:
            return ToolResult(f"{what} failed (a sandboxed worker): {exc}", True)

    def quick_time(self, options: dict | None = None) -> ToolResult:
        return self._advice("quick_time", options, lambda o: self.advisor.quick_time(self.ws.path, self.ws.base, o))

    def profile(self, options: dict | None = None) -> ToolResult:
        return self._advice("profile", options, lambda o: self.advisor.profile(self.ws.path, o))

    def finish(self, options: dict | None = None, notes: str = "") -> ToolResult:
        options = options or {}
        if not isinstance(options, dict):
            return ToolResult("options must be an object of option name -> value", True)
        diff = self.ws.diff()
        if refusal := policy.check(diff, options):
            return ToolResult(f"not finished, the controller would refuse it ({refusal.rule}): {refusal.reason}", True)
        if problem := validate_options(self.ws, options):
            return ToolResult(f"not finished, the options are not valid for the workspace's engine: {problem}", True)
        self.finished = Finished(options=dict(options), notes=str(notes or ""))
        return ToolResult(f"finished: the patch changes {len(policy.touched_paths(diff))} file(s), "
                          f"options {json.dumps(options, sort_keys=True)}")
