"""How SpecPilot's commands speak: consoles, tables and exit codes, written once.

- Messages and progress go to stderr, results to stdout (`console`). A console on a terminal wraps
  at the terminal's width; one writing to a pipe or file is wide enough (`PIPE_WIDTH`) that ids,
  options and summaries come out whole, and its tables fold long cells instead of cutting them.
- Exit codes (every command): 0 done (promoted, passed); 1 rejected (a verdict or a forcing run said
  no); 2 refused or bad input (a `UserError`, an argument the parser refuses, a patch the policy
  refuses); 3 an internal error (its traceback with ``SPECPILOT_DEBUG=1``); 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_REJECTED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
PIPE_WIDTH = 400


def console(stderr: bool = False) -> Console:
    """A console on stderr (messages, progress) or stdout (results); see the module docstring. It writes
    to whatever ``sys.stderr``/``sys.stdout`` is when it prints (a test's capture, a redirect)."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH)


def table(title: str | None, columns: Iterable[str], right: Iterable[str] = ()) -> Table:
    """A table whose cells fold (wrap mid-word) rather than being cut with an ellipsis."""
    t = Table(title=title)
    right = set(right)
    for c in columns:
        t.add_column(c, overflow="fold", justify="right" if c in right else "left")
    return t


def error_line(message: str, prog: str = "specpilot") -> None:
    """One line on stderr: ``prog: error: message`` (newlines folded, so scripts can grep it)."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
