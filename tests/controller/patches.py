"""Build candidate patches for controller tests: unified diffs made from the stock engine's own files.

The worker (`specpilot.harness.worker`) is harness and never patched; a candidate's code runs inside it
through the runtime, so probes hook the two runtime places every timed run passes: `build_engine` (once,
before the worker says it is ready; ``engine`` is the loaded engine) and `Engine.generate` (each request,
the worker's warm-up included; ``result`` is the GenerationResult, ``prompt_ids`` and ``max_new_tokens``
the request, ``engine`` the engine)."""

from __future__ import annotations

import difflib
import textwrap

from specpilot.paths import REPO_ROOT

API = "engine/api.py"
READY = "    return engine\n"
REPLY = "        return result\n"


def diff(path: str, new_text: str) -> str:
    old = (REPO_ROOT / path).read_text()
    return "".join(difflib.unified_diff(old.splitlines(True), new_text.splitlines(True), f"a/{path}", f"b/{path}"))


def worker_patch(before_ready: str = "", before_reply: str = "") -> str:
    """A diff of engine/api.py running ``before_ready`` once when the engine is built and
    ``before_reply`` before each generation returns (see the module docstring for the names in scope)."""
    text = (REPO_ROOT / API).read_text()
    assert text.count(READY) == 1 and text.count(REPLY) == 1, f"{API} changed: update the probe anchors"
    if before_ready:
        text = text.replace(READY, textwrap.indent(textwrap.dedent(before_ready), "    ") + READY)
    if before_reply:
        code = "engine = self\n" + textwrap.dedent(before_reply)
        text = text.replace(REPLY, textwrap.indent(code, "        ") + REPLY)
    return diff(API, text)

# Probe code that forks until the process cap stops it, each child asleep for an hour (the controller's
# and the subagent's sandbox probes run it; underscored names keep it from shadowing a module's own).
FORK_BOMB = """
import os as _os, time as _time
while True:
    try:
        if _os.fork() == 0:
            _time.sleep(3600)
            _os._exit(0)
    except OSError:
        _time.sleep(0.01)
"""

OPTIONS = "engine/options.py"
OPTION_ANCHOR = "    drafter_weights: str = option("  # a one-line field: new ones go after it


def with_option(field: str, before_ready: str = "", before_reply: str = "") -> str:
    """A patch adding an engine option (default off, as policy requires) used by worker code."""
    opts = (REPO_ROOT / OPTIONS).read_text()
    line = next(ln for ln in opts.splitlines(True) if ln.startswith(OPTION_ANCHOR))
    opts = opts.replace(line, line + f"    {field}  # added by a test patch\n", 1)
    return diff(OPTIONS, opts) + worker_patch(before_ready=before_ready, before_reply=before_reply)


SKIP_LAYERS = with_option("skip_layers: int = 0", before_ready="""
if engine.options.skip_layers:  # faulty and fast: drop the last layers
    import torch as _torch
    engine.model.layers = _torch.nn.ModuleList(list(engine.model.layers)[: -engine.options.skip_layers])
""")

NEAR_TIE_FLIP = with_option("near_tie_flip: float = 0.0", before_ready="""
if engine.options.near_tie_flip:  # pick the runner-up wherever the top two logits are within the threshold
    _forward, _thr = engine.model.forward, engine.options.near_tie_flip

    def _flip(*a, **k):
        logits, hidden = _forward(*a, **k)
        top = logits.topk(2, dim=-1)
        gap = top.values[..., 0] - top.values[..., 1]
        bump = ((gap < _thr).to(logits.dtype) * (gap + 1e-3)).unsqueeze(-1)
        return logits.scatter_add(-1, top.indices[..., 1:2], bump), hidden

    engine.model.forward = _flip
""")
