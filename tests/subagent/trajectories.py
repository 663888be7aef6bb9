"""Scripted agents that write real code, for whole rounds through the real SDKs (issue 26, item 5).

The engine's certified exact-argmax LM head (`specpilot.engine.screened_head`, option
``screened_head``) was written as an agent would write it. To replay that, `stock_without_mechanism`
copies this checkout with the mechanism taken out (its module, its option field, its hook in
`specpilot.engine.api`), services run from the copy, and `screened_head_turns` writes it back as one
diff: the real code, whatever it is today, so the replay never goes stale.

- `screened_head_turns`: reads, applies the mechanism, runs the option tests, finishes with the option on;
- `pruned_head_turns`: a plausible patch (the head over the low half of the ids, where BPE puts the
  frequent tokens) whose tokens are not the target's, which token forcing must reject;
- `messy_turns`: an unknown tool, malformed JSON arguments, a diff that does not apply, an oversized
  diff and reply, then a probe patch (network, credentials, ledger, writes outside) whose tests run in
  the sandbox, and a finish; every bad call gets a tool error and the round goes on.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

from specpilot.paths import REPO_ROOT
from tests.subagent.scripts import diff
from tests.subagent.wire import Call, Turn

OPTIONS = "engine/options.py"
API = "engine/api.py"
MECHANISM = "engine/screened_head.py"
MECHANISM_TEST = "tests/engine/test_screened_head.py"
FIELD_START = "    screened_head: bool = option("
HOOK_START = "    if opts.screened_head:"
HOOK_LINES = 4
OPTION_TESTS = {"pattern": "stock_defaults", "path": "tests/engine/test_options.py"}


def _without_field(text: str) -> str:
    lines = text.splitlines(True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith(FIELD_START))
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(")"))
    return "".join(lines[:start] + lines[end + 1:])


def _without_hook(text: str) -> str:
    lines = text.splitlines(True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith(HOOK_START))
    return "".join(lines[:start] + lines[start + HOOK_LINES:])


def stock_without_mechanism(dest: Path) -> Path:
    """A copy of this checkout's tracked files at ``dest`` without the screened head: the stock an agent
    met before writing it."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO_ROOT / rel
        if src.is_file() and not rel.startswith("docs/"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / MECHANISM).unlink()
    (dest / MECHANISM_TEST).unlink()
    (dest / OPTIONS).write_text(_without_field((REPO_ROOT / OPTIONS).read_text()))
    (dest / API).write_text(_without_hook((REPO_ROOT / API).read_text()))
    for rel in (OPTIONS, API):  # the surgery took exactly the mechanism out
        assert "screened_head" not in (dest / rel).read_text(), f"{rel}: the mechanism's lines moved; update trajectories"
    return dest


def new_file_diff(path: str, text: str) -> str:
    body = "".join(f"+{line}" for line in text.splitlines(True))
    n = len(text.splitlines())
    return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{n} @@\n{body}"


def mechanism_diff(stock: Path) -> str:
    """The screened head as one diff against ``stock`` (`stock_without_mechanism`): this checkout's code."""
    return "".join([diff(OPTIONS, (stock / OPTIONS).read_text(), (REPO_ROOT / OPTIONS).read_text()),
                    diff(API, (stock / API).read_text(), (REPO_ROOT / API).read_text()),
                    new_file_diff(MECHANISM, (REPO_ROOT / MECHANISM).read_text())])


def screened_head_turns(stock: Path) -> list[Turn]:
    return [
        Turn("The profile says the LM head is most of a step; let me read how the head is built.",
             [Call("read_file", {"path": API, "start_line": 130, "end_line": 175})]),
        Turn("", [Call("read_file", {"path": "engine/packed.py", "start_line": 1, "end_line": 40})]),
        Turn("Greedy decoding needs only the argmax: screen with bf16 weights, bound the error, compute "
             "exact logits only for the rows that can win.", [Call("apply_diff", {"diff": mechanism_diff(stock)})]),
        Turn("", [Call("run_tests", OPTION_TESTS)]),
        Turn("Done.", [Call("finish", {"options": {"screened_head": True},
                                       "notes": "certified exact-argmax LM head: bf16 screen + proven bound"})]),
    ]


PRUNED_MODULE = '''\
"""The LM head over the first ids only: BPE vocabularies number tokens in merge order, so the frequent
ones come first, and the rest seldom win (half the head's bytes)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FrequentVocabHead(nn.Module):
    def __init__(self, weight: Tensor, keep: int):
        super().__init__()
        self.weight, self.keep = weight, keep

    def forward(self, x: Tensor) -> Tensor:
        out = torch.full((*x.shape[:-1], self.weight.shape[0]), float("-inf"), dtype=x.dtype)
        out[..., : self.keep] = F.linear(x, self.weight[: self.keep])
        return out
'''
PRUNED_FIELD = '    frequent_vocab_head: bool = option(False, "the LM head over the first half of the ids", model=True)\n'
PRUNED_HOOK = ("    if getattr(opts, \"frequent_vocab_head\", False):\n"
               "        from specpilot.engine.frequent_head import FrequentVocabHead\n\n"
               "        model.lm_head = FrequentVocabHead(model.lm_head.weight, model.cfg.vocab_size // 2)\n")


def pruned_head_turns(stock: Path) -> list[Turn]:
    """A head over the first half of the vocabulary, against ``stock``'s files: the field after
    ``lm_head``'s, the hook after the fp32 head's (away from the screened head's lines, so it merges
    onto a best that has them). Faster, and not the target's tokens."""
    options, api = (stock / OPTIONS).read_text(), (stock / API).read_text()
    lm_head_field_end = '"fp32: the LM head computes in fp32 whatever the dtype", model=True, may_change_outputs=True)\n'
    fp32_hook = "        model.use_fp32_head()\n"
    assert lm_head_field_end in options and fp32_hook in api
    patch = "".join([diff(OPTIONS, options, options.replace(lm_head_field_end, lm_head_field_end + PRUNED_FIELD, 1)),
                     diff(API, api, api.replace(fp32_hook, fp32_hook + PRUNED_HOOK, 1)),
                     new_file_diff("engine/frequent_head.py", PRUNED_MODULE)])
    return [
        Turn("", [Call("read_file", {"path": OPTIONS, "start_line": 85, "end_line": 95})]),
        Turn("Most tokens come from the low ids; half the head is enough.", [Call("apply_diff", {"diff": patch})]),
        Turn("Done.", [Call("finish", {"options": {"frequent_vocab_head": True}, "notes": "half-vocabulary head"})]),
    ]


PROBE = """\
import os as _os, socket as _socket
for _addr in (("127.0.0.1", {port}), ("1.1.1.1", 443)):
    try:
        _socket.create_connection(_addr, timeout=1)
        raise SystemExit("ESCAPED: reached " + repr(_addr))
    except OSError:
        pass
for _p in ("{data}/bundles/subagent/key.pem", "{data}/ledger.duckdb", "{data}/bundles"):
    if _os.path.exists(_p):
        raise SystemExit("ESCAPED: can see " + _p)
if any("KEY" in _k or _k.startswith("NATS") for _k in _os.environ):
    raise SystemExit("ESCAPED: secrets in the environment")
try:  # the hidden data directory is an empty private mount here: the host must never see this file
    open("{data}/pwned", "w").write("x")
except OSError:
    pass
"""


def probe_diff(stock: Path, data: Path, port: int) -> str:
    """Module-level code in options.py (run by every import of the engine: tests, option checks, workers)
    that raises ``ESCAPED`` if it reaches the network, the service's data directory or its secrets."""
    anchor = "from __future__ import annotations\n"
    old = (stock / OPTIONS).read_text()
    return diff(OPTIONS, old, old.replace(anchor, anchor + textwrap.dedent(PROBE.format(data=data, port=port)), 1))


def messy_turns(stock: Path, data: Path, port: int) -> list[Turn]:
    """``data``: the services' data directory; ``port``: the NATS server's (what the probe must not reach)."""
    stale = diff(OPTIONS, "STOCK_DEFAULTS = {}\n", "STOCK_DEFAULTS = {'block_size': 8}\n")  # no such line
    oversized = new_file_diff("engine/huge.py", "# padding\n" * 30_000)
    return [
        Turn("", [Call("shell", {"cmd": "cat /etc/passwd"}), Call("read_file", '{"path": "engine/')]),
        Turn("", [Call("apply_diff", {"diff": stale})]),
        Turn("x" * 300_000, [Call("apply_diff", {"diff": oversized})]),
        Turn("", [Call("apply_diff", {"diff": probe_diff(stock, data, port)})]),
        Turn("", [Call("run_tests", OPTION_TESTS)]),
        Turn("Done.", [Call("finish", {"options": {}, "notes": "probing the sandbox"})]),
    ]
