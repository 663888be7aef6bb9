"""A weight-streaming small-M GEMM for CPUs with AVX2 and FMA (`stream_linear`), for decode steps
and verification blocks: ``y = x @ W.T`` with W fp32 or bf16 (bf16 widened exactly to fp32 in
registers), fp32 accumulation, the result in x's dtype.

Why: on AVX2 machines PyTorch's CPU linears are slow exactly where speculative decoding lives. On
the 2-core AMD EPYC (Zen 3) VM of 2026-12-02, MKL's fp32 GEMV reads the weights at ~7 GB/s against
~17-24 GB/s that a copy reaches, an 8-row ``x @ W.T`` at ~2 GB/s (so a verification block costs
~1.7x an AR step), and bf16 multi-row matmuls are slower still (no AVX512-BF16 there). This kernel
streams each block of four weight rows from memory once per call for up to 8 x rows (R weight rows
x M x rows <= 12 accumulators in registers, R = 4, 2 or 1), so M = 1-8 costs close to one pass over
the weights; more rows take further passes over a block already in L1.

Contract: every output element is one fixed sequence of fp32 FMAs over k (eight lanes, then a fixed
lane sum), whatever M is and whichever rows share the call, so a row's result is **bit-identical
whatever the other rows are** (batch invariance: a T-token verification block computes exactly
what T one-token steps would). It differs from `reference.stream_linear` (and from MKL) in the
last bits. CPU only; the C++ source (`stream_gemm.cpp`) is compiled once per machine with the
system's C++ compiler through `torch.utils.cpp_extension` (cached under the torch extensions
directory, ~30 s the first time; `build()` does it up front). `available()` says whether this
machine can run it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import Tensor

from . import reference

SOURCE = Path(__file__).with_name("stream_gemm.cpp")
EXTENSION = "specpilot_cpu_gemm"


def cpu_supported() -> tuple[bool, str]:
    """(ok, why not): AVX2 + FMA on this CPU and a C++ compiler to build the kernel."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    words = set(next((line for line in flags.splitlines() if line.startswith("flags")), "").split())
    if not {"avx2", "fma"} <= words:
        return False, "this CPU lacks AVX2 or FMA"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False, "no C++ compiler on PATH (apt-get install g++)"
    return True, ""


def available() -> bool:
    return cpu_supported()[0]


@functools.lru_cache(maxsize=1)
def build():
    """Build (or load the cached build of) the extension once per process; returns the op. Raises
    RuntimeError naming what is missing when `cpu_supported` says no."""
    ok, why = cpu_supported()
    if not ok:
        raise RuntimeError(f"kernels.cpu_gemm cannot run here: {why}; use linear_backend='default'")
    from torch.utils.cpp_extension import load

    # The build runs `ninja` from PATH; the `ninja` package puts it beside this interpreter, which
    # is not on PATH when the venv's python is run without activating the venv.
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # -fopenmp: ATen's parallel_for is header code that runs serially without it.
    load(name=EXTENSION, sources=[str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.specpilot_cpu.stream_linear


def stream_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` for CPU tensors (x any float dtype and leading shape; weight [N, K] fp32 or
    bf16, contiguous) through the AVX2 kernel; see the module docstring for the contract."""
    return build()(x, weight)


__all__ = ["available", "build", "cpu_supported", "reference", "stream_linear"]
