"""Scripted agent transcripts and small diffs against this repository's own engine files."""

from __future__ import annotations

import difflib

from specpilot.paths import REPO_ROOT
from tests.subagent.wire import Call, Turn

OPTIONS = "engine/options.py"
ANCHOR = "    drafter_weights: str = option("  # a one-line field: new ones go after it
DEMO_FIELD = "    demo_flag: bool = False  # a scripted agent's option: does nothing; stock when False"


def diff(path: str, old: str, new: str) -> str:
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n{body}"


def add_field(text: str, field_line: str, after: str = ANCHOR) -> str:
    """``text`` of engine/options.py with ``field_line`` inserted after the line starting with ``after``."""
    line = next(ln for ln in text.splitlines(True) if ln.startswith(after))
    return text.replace(line, line + field_line + "\n", 1)


def option_diff(field_line: str = DEMO_FIELD, after: str = ANCHOR) -> str:
    """A diff of the real engine/options.py adding one option field with a stock default."""
    old = (REPO_ROOT / OPTIONS).read_text()
    return diff(OPTIONS, old, add_field(old, field_line, after))


def agent_turns(with_tests: bool = True) -> list[Turn]:
    """list_files -> read_file engine/options.py -> apply_diff -> run_tests (tiny) -> finish."""
    turns = [
        Turn("Let me look around.", [Call("list_files", {"path": "engine"})]),
        Turn("", [Call("read_file", {"path": OPTIONS})]),
        Turn("Adding the option with a stock default.", [Call("apply_diff", {"diff": option_diff()})]),
    ]
    if with_tests:
        turns.append(Turn("", [Call("run_tests", {"pattern": "test_stock_defaults", "path": "tests/engine/test_options.py"})]))
    turns.append(Turn("Done.", [Call("finish", {"options": {"demo_flag": True}, "notes": "demo flag behind an option"})]))
    return turns
