"""The ``fused_kernels`` option (`specpilot.engine.fused`) on the CPU: the stock model's tokens, bit for bit.

Off CUDA the fused blocks run the PyTorch references (`specpilot.kernels.fused.reference`); in fp32 they
must reproduce stock exactly, with every drafter shape (AR, chain, tree) and through the
graph-safe static forward. The Triton kernels themselves are tested in tests/kernels.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.fused import FusedBlock, fuse_model, is_fused
from specpilot.engine.model import build_random, get_config
from specpilot.harness.deployment import load_engine


@pytest.mark.parametrize("opts", [{}, {"drafter": "none"}, {"verify": "tree", "tree_nodes": 8}])
def test_tiny_tokens_equal_stock(opts):
    prompt = list(range(40, 90))
    stock = load_engine("tiny", opts).generate(prompt, 32)
    fused = load_engine("tiny", {**opts, "fused_kernels": True})
    assert is_fused(fused.model) and isinstance(fused.model.layers[0], FusedBlock)
    assert fused.generate(prompt, 32).tokens == stock.tokens


@pytest.mark.parametrize("gemv", [False, True])
def test_smollm2_tokens_and_logits_equal_stock(smollm2, gemv):
    model, tok = smollm2
    fused = load_engine("smollm2-cpu", {"fused_kernels": True, "fused_gemv": gemv})
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))
    with torch.no_grad():
        a, _ = model(ids, pos, model.new_cache(128), 0)
        b, _ = fused.model(ids, pos, fused.model.new_cache(128), 0)
    assert torch.equal(a, b)
    stock = load_engine("smollm2-cpu").generate(prompt, 24)
    assert fused.generate(prompt, 24).tokens == stock.tokens


def test_fusing_moves_weights_not_copies_them():
    model = build_random(get_config("tiny"))
    q = model.layers[0].attn.q_proj.weight.detach().clone()
    before = sum(p.numel() for p in model.parameters())
    fuse_model(model)
    assert sum(p.numel() for p in model.parameters()) == before
    assert torch.equal(model.layers[0].attn.qkv_proj.weight[: q.shape[0]], q)
    assert fuse_model(model) is model  # idempotent


def test_fused_with_w12_reference_path():
    """Weight formats swap the fused linears (the W12 reference runs on the CPU)."""
    prompt = list(range(40, 70))
    a = load_engine("tiny", {"weight_format": "w12"}).generate(prompt, 16).tokens
    b = load_engine("tiny", {"weight_format": "w12", "fused_kernels": True}).generate(prompt, 16).tokens
    assert a == b


@pytest.mark.parametrize("opts", [{}, {"verify": "tree", "tree_nodes": 8}])
def test_fused_gemv_tokens_equal_stock(opts):
    """``fused_gemv`` off CUDA: the GEMV modules run F.linear after the reference norm (stock's values)."""
    from specpilot.engine.fused import GemvLinear

    prompt = list(range(40, 90))
    stock = load_engine("tiny", opts).generate(prompt, 32)
    engine = load_engine("tiny", {**opts, "fused_kernels": True, "fused_gemv": True})
    block = engine.model.layers[0]
    assert all(type(m) is GemvLinear for m in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj,
                                               block.mlp.down_proj))
    assert not block.folds(torch.zeros(1, 1, 64))  # CPU tensors: the kernels stay out
    assert engine.generate(prompt, 32).tokens == stock.tokens


def test_fused_gemv_needs_fused_kernels_and_yields_to_weight_formats():
    with pytest.raises(ValueError, match="fused_gemv.*needs fused_kernels"):
        load_engine("tiny", {"fused_gemv": True})
    prompt = list(range(40, 70))
    a = load_engine("tiny", {"weight_format": "w12"}).generate(prompt, 16).tokens
    w12 = load_engine("tiny", {"weight_format": "w12", "fused_kernels": True, "fused_gemv": True})
    from specpilot.kernels.w12 import W12Linear

    attn, mlp = w12.model.layers[0].attn, w12.model.layers[0].mlp
    # W12 swapped the GEMV linears, so FusedBlock.folds is False on any device (its type checks)
    assert all(type(m) is W12Linear for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    assert w12.generate(prompt, 16).tokens == a
    with pytest.raises(ValueError, match="another fused_gemv"):
        fuse_model(w12.model)
