"""What the cost model reads from a system: matched drafter depths and the profile, in process and
through the worker protocol."""

import json
import subprocess
import sys

from specpilot.engine.tree import matched_depth
from specpilot.harness.replay import chain_cost, matched_depths, measure
from specpilot.paths import REPO_ROOT
from specpilot.services.master.costmodel import replay_tau
from tests.engine.conftest import make_engine
from tests.engine.test_lossless import _tiny_prompts


def test_matched_depth_is_the_deepest_trie_match():
    assert matched_depth([[5, 6, 7], [5, 9], [1]], [5, 6, 8]) == 2
    assert matched_depth([], [1, 2]) == 0
    assert matched_depth([[1, 2, 3, 4]], [1, 2]) == 2


def test_replayed_tau_bounds_the_chain_that_was_run(tiny):
    # The best candidate in hindsight matches at least as deep as the chain's top candidate, so the
    # replayed tau at budget k is never below the tau the chain of k drafts achieved.
    for prompt in _tiny_prompts(1, n=3):
        engine = make_engine(tiny, drafter="ngram", block_size=4, ngram_min_match=1)
        run = engine.generate(prompt, 64)
        depths = matched_depths(engine, prompt, run.tokens, depth=4, nodes=16)
        assert len(depths) == len(run.tokens) and depths[0] == 0
        assert all(0 <= d <= min(4, len(run.tokens) - p) for p, d in enumerate(depths))
        actual = (len(run.tokens) - 1) / run.steps
        assert replay_tau(depths, budgets=(4,))[4] >= actual - 1e-9


def test_no_drafter_means_no_depth(tiny):
    engine = make_engine(tiny, drafter="none")
    prompt = _tiny_prompts(2, n=1)[0]
    tokens = engine.generate(prompt, 16).tokens
    assert matched_depths(engine, prompt, tokens) == [0] * len(tokens)


def test_measure_through_the_worker_protocol():
    prompt = _tiny_prompts(3, n=1)[0]
    request = json.dumps({"measure": {"prompt_ids": prompt, "max_new_tokens": 24}}) + "\n"
    res = subprocess.run([sys.executable, "-m", "specpilot.harness.worker", "--deployment", "tiny-cpu", "--threads", "1"],
                         input=request, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert lines[0] == {"ready": True}
    reply = lines[1]
    assert len(reply["tokens"]) == 24 and reply["steps"] >= 1 and len(reply["depths"]) == 24
    assert reply["profile_ms"]["step_total"] > 0 and "lm_head" in reply["profile_ms"]
    assert sorted(map(int, reply["chain_cost"])) == [2, 4, 8]  # JSON keys: the controller casts them back


def test_measure_in_process(tiny):
    prompt = _tiny_prompts(4, n=1)[0]
    m = measure(make_engine(tiny, drafter="ngram"), prompt, 20)
    assert m["context"] >= len(prompt) and len(m["depths"]) == len(m["tokens"]) == len(m["chain_depths"]) == 20
    # the first candidate never matches deeper than the best of all candidates
    assert all(c <= t for c, t in zip(m["chain_depths"], m["depths"], strict=True))


def test_other_drafters_are_replayed_on_the_same_output(tiny):
    from specpilot.harness.replay import alternative_drafters

    prompt = _tiny_prompts(1, n=1)[0]
    ar = make_engine(tiny, drafter="none")
    output = ar.generate(prompt, 48).tokens
    others = alternative_drafters(ar, prompt, output, depth=4)
    ngram = make_engine(tiny, drafter="ngram", block_size=4)
    assert others["ngram"]["chain_depths"] == matched_depths(ngram, prompt, output, depth=4, nodes=1)
    assert others["ngram"]["draft_s"] > 0
    # and as a tree (best in hindsight): never shallower than its chain
    assert others["ngram"]["depths"] == matched_depths(ngram, prompt, output, depth=4, nodes=64)
    assert all(c <= t for c, t in zip(others["ngram"]["chain_depths"], others["ngram"]["depths"], strict=True))
    # the tiny target has no trained neural drafters: said, not hidden
    assert "no parallel drafter weights" in others["parallel"]["error"]
    assert set(others) == {"ngram", "parallel", "eagle"}
    own = alternative_drafters(ngram, prompt, output, depth=4)
    assert "ngram" not in own
    # the n-gram drafter's other min_match values, replayed as that setting
    assert set(own) == {"parallel", "eagle", "ngram_min_match=1", "ngram_min_match=3"}
    loose = make_engine(tiny, drafter="ngram", block_size=4, ngram_min_match=1)
    assert own["ngram_min_match=1"]["chain_depths"] == matched_depths(loose, prompt, output, depth=4, nodes=1)
    assert own["ngram_min_match=1"]["draft_s"] > 0
    assert "depths" not in own["ngram_min_match=1"]  # a setting of the system's own drafter: its chain


def test_chain_cost_times_full_chains_without_disturbing_generation(tiny):
    engine = make_engine(tiny, drafter="ngram")
    prompt = _tiny_prompts(5, n=1)[0]
    tokens = engine.generate(prompt, 24).tokens
    cost = chain_cost(engine, prompt, tokens, ns=(2, 4, 8, 30))
    assert sorted(cost) == [2, 4, 8]  # a chain longer than the output cannot be timed
    assert all(0.3 < c < 30 for c in cost.values())
    assert engine.generate(prompt, 24).tokens == tokens  # the engine's cache was reused, not spoiled
    assert chain_cost(engine, prompt, tokens[:1]) == {}
