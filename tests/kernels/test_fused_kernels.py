"""Fused decode-step kernels (`specpilot.kernels.fused`) against their PyTorch references.

CPU (always): the Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess (fp32: the
interpreter's bf16 arithmetic is not exact): residual add and RoPE + cache write bit for bit, norm
and SiLU·mul within fp32 rounding; a fused tiny model running those kernels gives the stock
model's logits for a prefill, a chain step and a graph-safe tree step.
CUDA (``gpu`` marker): the kernels in bf16 and fp32 against the references, bit for bit where the
arithmetic is the same (add, RoPE, cache writes) and within one bf16 rounding elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpilot.kernels.fused import reference

from .fused_cases import HEADS, kernel_inputs, model_forwards, run_kernels

REPO = Path(__file__).resolve().parents[2]
EXACT = ("h", "q", "k", "v", "q_rows", "k_rows", "v_rows", "q_slots_rows", "k_slots_rows", "v_slots_rows", "attn_k", "attn_v", "gemv_h", "gemv_h3", "gemv_h1",
         "gemv_h2")
CLOSE = ("norm", "norm_no_delta", "silu", "attn", "attn_long")  # another reduction order, or another exp
# a dot over 577 terms in another order than F.linear's
GEMV = ("gemv_norm", "gemv_silu", "gemv_norm1", "gemv_silu1", "gemv_silu2", "gemv_plain", "gemv_plain2")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_interp") / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.fused_cases", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_interpreted_kernels_match_reference(interpreted):
    x = interpreted["inputs"]
    ref = run_kernels(x, reference)
    got = interpreted["kernels"]
    assert set(got) == set(ref)
    for name in EXACT:
        assert torch.equal(got[name], ref[name]), name
    for name in CLOSE:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
    for name in GEMV:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)
    # the cache rows the slots name were written, the others not
    written = got["k"].abs().sum(-1) != 0
    assert written[:, :, [7, 8, 9]].all() and not written[:, :, :7].any() and not written[:, :, 10:].any()
    # per-row slots: row 0 at 7..9, row 1 at 3..5, nothing else
    written = got["k_slots_rows"].abs().sum(-1) != 0
    assert written[0, :, 7:10].all() and written[0, :, :7].sum() == 0 and written[0, :, 10:].sum() == 0
    assert written[1, :, 3:6].all() and written[1, :, :3].sum() == 0 and written[1, :, 6:].sum() == 0


def test_interpreted_split_attention_matches_reference(interpreted):
    """The context split over 4 programs per KV head (SLOTS_PER_PROGRAM = 64): the last program
    to finish merges the partial softmaxes; counters are back at 0, so a second launch agrees."""
    ref = run_kernels(interpreted["inputs"], reference)
    first, again = interpreted["split"]["first"], interpreted["split"]["again"]
    torch.testing.assert_close(first["attn_long"], ref["attn_long"], rtol=1e-5, atol=1e-6)
    assert torch.equal(first["attn_long"], again["attn_long"])
    assert not interpreted["split_counts"].any()


@pytest.mark.parametrize("variant", ["model", "model_gemv"])
def test_interpreted_fused_model_matches_stock(interpreted, variant):
    """The fused tiny model running the kernels (``model_gemv``: its chain, one-token and tree steps
    through the norm + GEMV kernel, the 20-row prefill through the unfolded path) against stock."""
    stock = model_forwards(fused=False)
    got = interpreted[variant]
    for name in ("prefill", "chain", "step", "tree_hidden", "rows_prefill", "rows_padded", "rows_hidden"):
        torch.testing.assert_close(got[name], stock[name], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["tree_argmax"], stock["tree_argmax"])
    assert torch.equal(got["rows_argmax"], stock["rows_argmax"])


def test_reference_fused_model_is_stock_bit_for_bit():
    """Off CUDA the fused model runs the references: the stock model's values exactly (fp32)."""
    stock = model_forwards(fused=False)
    for fused in (model_forwards(fused=True), model_forwards(fused=True, gemv=True)):
        for name, value in stock.items():
            assert torch.equal(fused[name], value), name


def test_rope_kernel_refuses_odd_head_dim():
    from specpilot.kernels.fused.kernel import rope_qkv

    qkv = torch.zeros(1, 1, 8 * 12)
    cache = torch.zeros(1, 2, 4, 12)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rope_qkv(qkv, torch.zeros(1, 12), torch.zeros(1, 12), *HEADS, cache, cache.clone(), torch.tensor([0]))


# ---------------------------------------------------------------------------------------------
# CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_reference(dtype):
    from specpilot.kernels.fused import kernel

    x = {k: (v.to(dtype) if v.is_floating_point() else v).cuda() for k, v in kernel_inputs(1).items()}
    got, ref = run_kernels(x, kernel), run_kernels(x, reference)
    # fp32: the GPU compiler may contract RoPE's a*b + c*d into an FMA (one rounding fewer), so only
    # bf16 (whose products are rounded explicitly) is bit for bit there.
    exact = EXACT if dtype == torch.bfloat16 else ("h", "v", "v_rows", "attn_v")
    report = {}
    for name in got:
        if name in exact:
            ok = torch.equal(got[name], ref[name])
        elif dtype == torch.bfloat16 and name not in ("attn", "attn_long", *GEMV):  # another summation order
            ok = _ulps_bf16(got[name], ref[name]) <= 1
        else:
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            ok = torch.allclose(got[name].float(), ref[name].float(), rtol=tol, atol=tol)
        if not ok:
            report[name] = float((got[name].float() - ref[name].float()).abs().max())
    assert not report, report


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_split_attention_matches_reference(dtype, monkeypatch):
    from specpilot.kernels.fused import kernel

    monkeypatch.setattr(kernel, "SLOTS_PER_PROGRAM", 64)
    x = {k: (v.to(dtype) if v.is_floating_point() else v).cuda() for k, v in kernel_inputs(2).items()}
    ref = run_kernels(x, reference)["attn_long"].float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for _ in range(3):  # the arrival counters must be back at 0 after every launch
        torch.testing.assert_close(run_kernels(x, kernel)["attn_long"].float(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemv", [False, True])
def test_cuda_fused_smollm2_shape_step(gemv):
    """SmolLM2-shaped random bf16 model: fused (``gemv``: + fused_gemv) and stock static steps,
    captured as CUDA graphs, agree to bf16 rounding."""
    from dataclasses import replace

    from specpilot.engine.fused import fuse_model
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.model import build_random, get_config
    from specpilot.engine.tree import DraftTree

    cfg = replace(get_config("smollm2-135m"), n_layers=4, max_seq_len=512)
    outs = []
    for fused in (False, True):
        model = build_random(cfg, device="cuda", dtype=torch.bfloat16, seed=1)
        if fused:
            fuse_model(model, gemv=gemv)
        cache = model.new_cache(512)
        with torch.no_grad():
            model(torch.arange(100, 140, device="cuda").view(1, -1), torch.arange(40, device="cuda"), cache, 0)
            runner = GraphRunner(model, cache)
            chain = runner.run(DraftTree.chain(7, [8, 9, 10]), 40)[1].float().clone()
            step = runner.run(DraftTree.chain(11, []), 44)[1].float().clone()  # AR: the 1-row GEMV tiles
            outs.append(torch.cat([chain.flatten(), step.flatten()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=5e-2, atol=5e-2)
