"""W12 Triton kernel against the PyTorch reference: under ``TRITON_INTERPRET=1`` on CPU (in a
subprocess, so the variable is set before triton's decorators run; fp32 there), and on CUDA when
a GPU is present (``gpu`` marker). Also determinism: two runs are bitwise identical."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specpilot.kernels.w12 import decode, pack

from .w12_cases import case_inputs, kernel_cases

REPO = Path(__file__).resolve().parents[2]


CASES = kernel_cases()


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 product of the exact BF16 weights (NaN/inf propagate as in any matmul)."""
    return x.double() @ w.double().T


def check_close(y: torch.Tensor, ref: torch.Tensor, rtol: float):
    """NaN exactly where the reference has NaN, same infinities, finite values within rtol of
    the row scale (fp32 accumulation in another order; BF16 output rounding)."""
    y, ref = y.double(), ref.double()
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    inf = torch.isinf(ref)
    assert torch.equal(y[inf], ref[inf])
    fin = torch.isfinite(ref)
    scale = ref.where(fin, 0).abs().amax(dim=-1, keepdim=True).clamp_min(1e-30).expand_as(ref)
    err = ((y - ref).abs() / scale)[fin]
    assert err.numel() == 0 or float(err.max()) <= rtol, float(err.max())


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    d = tmp_path_factory.mktemp("w12_interp")
    torch.save(CASES, d / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.w12_cases", str(d / "cases.pt"), str(d / "out.pt")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(d / "out.pt")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_interpreter_matches_reference(interpreted, case):
    x, w = case_inputs(case)
    y1, y2 = interpreted[case["name"]]
    assert y1.dtype == x.dtype and y1.shape == (case["m"], case["n"])
    assert torch.equal(y1.view(torch.int8), y2.view(torch.int8))  # deterministic, bit for bit
    # output rounding: bf16 (the interpreter casts by truncation), fp16, or fp32 accumulation only
    rtol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(x.dtype, 1e-5)
    check_close(y1, reference(x.float(), w), rtol)


# ---------------------------------------------------------------------------------------------
# CUDA

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_SHAPES = [(4096, 4096), (1000, 577), (123, 14336)]
GPU_MS = [1, 3, 16, 64]


def gpu_inputs(n, k, m, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    return x, w


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", GPU_MS)
def test_cuda_matches_reference(n, k, m):
    from specpilot.kernels.w12.kernel import w12_matmul

    x, w = gpu_inputs(n, k, m, torch.bfloat16, seed=n + k + m)
    p = pack(w)
    y = w12_matmul(x, p)
    assert y.dtype == torch.bfloat16
    check_close(y, reference(x.float(), decode(p).float()), rtol=1e-2)
    if m in (1, 16):
        y32 = w12_matmul(x.float(), p)
        assert y32.dtype == torch.float32
        check_close(y32, reference(x.float(), w.float()), rtol=1e-5)


def _configs(m, n, k):
    from specpilot.kernels.w12.kernel import Config, pick_config

    base = pick_config(m, n, k)
    out = [base, replace(base, asm=False)]
    bm = 16 if m <= 16 else 64
    out += [Config(bm=bm, bn=16, bj=256 if bm == 16 else 64, use_dot=True, num_stages=4),
            Config(bm=bm, bn=64, bj=64, use_dot=True, num_stages=3, asm=False),
            Config(bm=bm, bn=256, bj=32, use_dot=True, num_stages=3)]
    if m <= 8:
        bm = 1 << (m - 1).bit_length()
        out += [Config(bm=bm, bn=16, bj=128, use_dot=False),
                Config(bm=bm, bn=4, bj=512, use_dot=False, num_warps=2),
                Config(bm=bm, bn=4, bj=256, use_dot=False, num_warps=1)]
    return out


def with_every_escape(w: torch.Tensor) -> None:
    """Put every kind of escape into a [>= 13, K] bf16 weight, in place: +inf, a denormal, a NaN with a
    payload, -inf, 50 values above the row's window, 50 below it, and a row of zeros (not escapes)."""
    k = w.shape[1]
    flat = w.view(torch.int16).reshape(-1)
    flat[[7, k + 3, 2 * k + 9, 5 * k + 100]] = torch.tensor([0x7F80, 0x0001, 0x7FC3, 0xFF80], device=w.device,
                                                            dtype=torch.int32).to(torch.int16)
    w[10, :50] = 3e30
    w[11, :50] = 1e-30
    w[12] = 0


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 5, 40])
def test_cuda_configs_and_escapes(m):
    from specpilot.kernels.w12.kernel import w12_matmul

    n, k = 300, 2080
    x, w = gpu_inputs(n, k, m, torch.bfloat16, seed=m)
    with_every_escape(w)
    p = pack(w)
    assert p.escapes >= 104
    ref = reference(x.float(), w.float())
    for cfg in _configs(m, n, k):
        y = w12_matmul(x, p, cfg)
        check_close(y, ref, rtol=1e-2)
        assert torch.equal(y.view(torch.int16), w12_matmul(x, p, cfg).view(torch.int16)), cfg


@gpu
@needs_cuda
def test_cuda_deterministic_across_runs():
    from specpilot.kernels.w12.kernel import w12_matmul

    x, w = gpu_inputs(4096, 4096, 8, torch.bfloat16, seed=0)
    p = pack(w)
    ys = [w12_matmul(x, p).view(torch.int16).clone() for _ in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@gpu
@needs_cuda
def test_cuda_w12linear_forward():
    from torch import nn

    from specpilot.kernels.w12 import W12Linear

    lin = nn.Linear(576, 1536, bias=True).cuda().to(torch.bfloat16).requires_grad_(False)
    q = W12Linear.from_linear(lin)
    x = torch.randn(2, 5, 576, device="cuda", dtype=torch.bfloat16)
    check_close(q(x).reshape(10, -1), reference(x.reshape(10, -1).float(), lin.weight.float()) + lin.bias.double(),
                rtol=1e-2)
