"""Build candidate patches for controller tests: unified diffs made from the stock engine's own files."""

from __future__ import annotations

import difflib
import textwrap

from specpilot.paths import REPO_ROOT

WORKER = "engine/worker.py"
READY = '    send({"ready": True})\n'
REPLY = '            send({"tokens": result.tokens, "steps": result.steps})\n'


def diff(path: str, new_text: str) -> str:
    old = (REPO_ROOT / path).read_text()
    return "".join(difflib.unified_diff(old.splitlines(True), new_text.splitlines(True), f"a/{path}", f"b/{path}"))


def worker_patch(before_ready: str = "", before_reply: str = "") -> str:
    """A diff of engine/worker.py running ``before_ready`` once at start-up and ``before_reply`` before
    each reply (``result`` is the GenerationResult; ``req`` the request)."""
    text = (REPO_ROOT / WORKER).read_text()
    assert READY in text and REPLY in text, "engine/worker.py changed: update the probe anchors"
    if before_ready:
        text = text.replace(READY, textwrap.indent(textwrap.dedent(before_ready), "    ") + READY)
    if before_reply:
        text = text.replace(REPLY, textwrap.indent(textwrap.dedent(before_reply), "            ") + REPLY)
    return diff(WORKER, text)
