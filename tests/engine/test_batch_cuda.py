"""Continuous batching (`specpilot.engine.batch`) on a CUDA GPU (``gpu`` marker; skipped without one).

The tiny model in fp32 (TF32 off) on the GPU: every request of a batch with staggered arrivals over fewer
rows than requests gets batch-1 AR's tokens, with AR, an n-gram chain and an n-gram tree in the batch.
cuBLAS picks its kernels by the row count, so a batch's logits need not equal batch-1's bit for bit (the
bit-exact guarantee is fp32 on the CPU, `test_batch.py`): two outputs agree up to their first difference,
and there the batch-1 model's logits of the two tokens lie within 0.1 standard deviations (forcing's
near-tie rule)."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.batch import BatchDecoder, BatchRequest
from specpilot.engine.decode import DecodeConfig
from specpilot.engine.drafters.ngram import NgramDrafter
from tests.engine.conftest import agree_up_to_near_ties, make_engine
from tests.engine.test_lossless import _tiny_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_batch_on_cuda_gives_each_request_its_batch_one_tokens():
    from specpilot.engine.weights import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_model("tiny", dtype="fp32", device="cuda")
    prompts = _tiny_prompts(3, n=8)
    max_new = [40, 24, 40, 8, 33, 40, 1, 17]
    engine = make_engine((model, tok), drafter="none")
    reference = [engine.generate(p, n).tokens for p, n in zip(prompts, max_new, strict=True)]
    requests = [BatchRequest(f"r{i}", p, n, arrival_step=(0, 0, 0, 2, 5, 5, 9, 30)[i])
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    for name, tree in (("none", False), ("ngram", False), ("ngram", True)):
        drafters = [NgramDrafter(min_match=1) if name == "ngram" else None for _ in range(3)]
        decoder = BatchDecoder(model, drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3,
                               max_len=256, stop_ids=model.cfg.stop_ids)
        result = decoder.run(requests)
        got = [result.generations[f"r{i}"].tokens for i in range(len(prompts))]
        agree_up_to_near_ties(model, prompts, got, reference, (name, tree))
        assert max(s.rows for s in result.steps) == 3  # the rows were full: later requests waited
        if name == "ngram":
            assert sum(s.committed for s in result.steps) > len(result.steps)  # drafts were accepted


@pytest.mark.parametrize("fused", [False, True])
def test_batched_cuda_graphs_replay_the_static_step(fused):
    """``cuda_graphs`` in a batch: decode steps replay one captured graph per (T, length) over every row
    (`GraphRunner.run_rows`), and each prompt's prefill a captured chain on the scratch row; each request's
    tokens equal the same static steps run eagerly bit for bit
    (a replay is that computation) and batch-1 AR's up to near-ties; the engine builds its batched decoder
    with the graphs when the option is on. ``fused``: the same with ``fused_kernels`` (the RoPE kernel
    writing each row's slots, then one attention over the rows; prefills through the RoPE kernel and SDPA)."""
    from specpilot.engine.fused import fuse_model
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.weights import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_model("tiny", dtype="fp32", device="cuda")
    if fused:
        fuse_model(model)
    prompts = _tiny_prompts(3, n=8)
    max_new = [40, 24, 40, 8, 33, 40, 1, 17]
    reference = [make_engine((model, tok), drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    requests = [BatchRequest(f"r{i}", p, n, arrival_step=(0, 0, 0, 2, 5, 5, 9, 30)[i])
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    for name, tree in (("none", False), ("ngram", False), ("ngram", True)):
        got = {}
        for capture in (True, False):
            drafters = [NgramDrafter(min_match=1) if name == "ngram" else None for _ in range(3)]
            decoder = BatchDecoder(model, drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3,
                                   max_len=256, stop_ids=model.cfg.stop_ids,
                                   static_steps=lambda cache, c=capture: GraphRunner(model, cache, bucket=64, capture=c))
            result = decoder.run(requests)
            got[capture] = [result.generations[f"r{i}"].tokens for i in range(len(prompts))]
            if capture:
                assert decoder.runner.captures == len(decoder.runner.shapes) > 0
                assert decoder.prefill_runner.captures > 0  # the prompts' prefills were replayed too
        assert got[True] == got[False], (name, tree)
        agree_up_to_near_ties(model, prompts, got[True], reference, (name, tree))
    engine = make_engine((model, tok), drafter="ngram", cuda_graphs=True)
    assert engine.batch_decoder(3, 128).runner is not None
