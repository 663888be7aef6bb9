"""Two-device timing: each trial runs both systems at once, then swaps devices (here two "devices"
that are both the CPU, on the tiny deployment: the design and its bookkeeping, not the speed)."""

import pytest

from specpilot.sandbox import Limits, bwrap_available
from specpilot.services.controller import timing
from specpilot.services.controller.evaluate import Evaluator, System

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")]


def test_both_systems_run_at_once_then_swap(tmp_path):
    ev = Evaluator(tmp_path, "tiny-cpu", device="cpu, cpu", n_requests=2, max_new_tokens=16, trials=2, threads=1,
                   limits=Limits(wall_s=60.0))
    assert ev.devices == ("cpu", "cpu") and ev.device == "cpu"
    stock = System(ev.prepare())
    tree = System(stock.commit, {"verify": "tree"})
    res = timing.paired(ev, stock, tree)
    assert res.problem == ""
    assert len(res.incumbent_s) == len(res.candidate_s) == 2
    assert res.order == ["A@0B@1|A@1B@0", "B@0A@1|B@1A@0"]
    assert res.candidate_outputs == ev.reference(stock)  # greedy tree verification is exact
    assert all(t > 0 for t in res.incumbent_s + res.candidate_s)
