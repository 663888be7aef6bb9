"""Token forcing on the real target, SmolLM2-135M (fp32, CPU): three chat prompts x 64 tokens.

Stock's outputs are generated once (the forcer memoises them, as the service does for repeated
dev prompts); each test builds a system's outputs from them and runs the whole forcing.
"""

from __future__ import annotations

import numpy as np
import pytest

from specpilot import forcing_rules
from specpilot.forcing_rules import Output
from specpilot.harness.forcing import Forcer
from tests.forcer.conftest import generate, quantised_head

pytestmark = pytest.mark.slow

PROMPTS = ["Write a haiku about the sea.", "What is the capital of France? Explain briefly.",
           "List three uses of Python."]
N_TOKENS = 64


@pytest.fixture(scope="module")
def stock(smollm2_forcer) -> list[Output]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [tuple(smollm2_forcer.engine.tokenize(p, chat=True)) for p in PROMPTS]
        return [Output(ids, smollm2_forcer.stock_output(ids, N_TOKENS)) for ids in prompts]
    finally:
        torch.set_num_threads(before)


def test_stock_forced_against_itself_passes(smollm2_forcer, stock, one_thread):
    rep = smollm2_forcer.run(stock)
    assert rep.passed, rep.reason
    assert rep.stats["system"]["positions"] == sum(len(o.tokens) for o in stock) > 150
    assert rep.stats["system"]["mismatches"] <= 1  # one teacher-forced pass vs speculative decoding, fp32
    assert rep.stats["system"]["events"] == 0 and rep.stats["stock_generated"] == 3


def test_tokens_perturbed_at_large_margins_are_rejected(smollm2_forcer, stock, one_thread):
    """The runner-up at the 3 clearest positions of each output (top-2 gap > 2 logits): 9 flips."""
    faulty, flipped = [], []
    for i, o in enumerate(stock):
        f = smollm2_forcer.force(o.prompt_ids, o.tokens)
        where = [int(j) for j in np.argsort(-f.top2_gap)[:3]]
        assert (f.top2_gap[where] > 2.0).all()
        toks = list(o.tokens)
        for j in where:
            toks[j] = int(f.runner_up[j])
        faulty.append(Output(o.prompt_ids, tuple(toks)))
        flipped += [(i, j) for j in where]
    rep = smollm2_forcer.run(faulty)
    assert not rep.passed and not rep.stats["event_rule"]["passed"], rep.reason
    audited = {(a["prompt_index"], a["position"]): a for a in rep.audited}
    for key in flipped:
        a = audited[key]
        assert not a["explained"] and a["margin"] > 2.0 and a["stock_token"] == a["argmax_token"]


def test_outputs_that_differ_only_at_near_ties_pass(smollm2_forcer, stock, one_thread):
    """At the first position of each output whose top-2 gap is under 2δ, take the runner-up and let
    stock continue greedily from there: a different output, every difference a near-tie."""
    threshold = forcing_rules.EVENT_FACTOR * forcing_rules.DELTA_FLOOR
    system, changed = [], 0
    for o in stock:
        f = smollm2_forcer.force(o.prompt_ids, o.tokens)
        near = np.flatnonzero(f.top2_gap < threshold)
        if near.size == 0:
            system.append(o)
            continue
        j = int(near[0])
        head = [*o.tokens[:j], int(f.runner_up[j])]
        rest = generate(smollm2_forcer, [*o.prompt_ids, *head], len(o.tokens) - j - 1) if j + 1 < len(o.tokens) else []
        system.append(Output(o.prompt_ids, tuple(head + rest)))
        changed += 1
    assert changed >= 2  # these prompts have near-ties at positions 17 (haiku) and 17 (France)
    assert [s.tokens for s in system] != [o.tokens for o in stock]
    rep = smollm2_forcer.run(system)
    assert rep.passed, rep.reason
    assert rep.stats["system"]["mismatches"] >= changed and rep.stats["system"]["events"] == 0


def test_output_of_a_4_bit_lm_head_is_rejected(smollm2_forcer: Forcer, stock, one_thread):
    """A faster numerical shortcut: the same model with a 4-bit quantised LM head."""
    with quantised_head(smollm2_forcer.model, bits=4):
        faulty = [Output(o.prompt_ids, tuple(generate(smollm2_forcer, o.prompt_ids, 32))) for o in stock[:2]]
    assert any(f.tokens != o.tokens[:32] for f, o in zip(faulty, stock, strict=False))
    rep = smollm2_forcer.run(faulty, max_audit=8)
    assert not rep.passed, rep.reason
    assert not rep.stats["rate_rule"]["passed"]
    assert rep.audited and sum(not a["explained"] for a in rep.audited) >= 4
