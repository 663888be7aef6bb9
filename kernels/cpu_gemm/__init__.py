"""A weight-streaming small-M GEMM for CPUs with AVX2 and FMA (AVX-512 where the CPU has it), for
decode steps, verification blocks and prefill: ``y = x @ W.T`` with W fp32 or bf16 packed once
(`pack`), x fp32 or bf16, fp32 arithmetic, the result in x's dtype (`packed_linear`). On CPUs with
AMX-BF16 a second path for bf16 x and W (`pack_amx`, `packed_linear_amx`) runs on the tiles.

Why: on AVX2 machines PyTorch's CPU linears are slow exactly where speculative decoding lives: MKL's
GEMV and few-row products read the weights well below a streaming read's bandwidth, and bf16
multi-row matmuls are slower still (docs/FIGURES.md, "Lab notes moved from code").

How (stream_gemm.cpp): `pack` lays W out as panels of 16 output columns, k-major ([ceil(N/16), K,
16]), so each thread reads one sequential stream; a row of x is broadcast against 16 columns at a
time, rows in groups of up to 6 (12 FMA chains), and a 128-k chunk of a panel streamed for the first
group is reused from L1 by the others, so M rows cost one pass over the weights plus M x the FMAs.
bf16 is widened exactly in registers (x as well), and a bf16 result is rounded to nearest even in
the kernel (no dispatched dtype conversions around the call). Where the CPU has AVX-512F, calls of
4 rows or more run the same arithmetic 16 lanes a vector, groups of up to 12 rows (`use_avx512`).

Contract: each output is, chunk by chunk, one fixed sequence of fp32 FMAs over k, the chunk sums
added in order, whatever M is and whichever rows share the call, so a row's result is
**bit-identical whatever the other rows are** (batch invariance: a T-token verification block
computes exactly what T one-token steps would, and a prefill what the decode steps would). Columns
are computed independently too: packing the concatenation of two weights gives each the bits it
gets alone. It differs from `reference.stream_linear` (and from MKL) in the last bits. CPU only; the
C++ source is compiled once per machine with the system's C++ compiler through
`torch.utils.cpp_extension` (cached under the torch extensions directory, ~30 s the first time;
`build()` does it up front). `available()` says whether this machine can run it.

The AMX path keeps the same two invariants (rows batch-invariant, columns independent: every output
accumulates the tile instruction's products over k in chunks of 32, in one order for every row) but
gives other bits than the FMA path, so the path belongs to the packed weight: `amx_suits` decides
at packing (bf16, K a multiple of 32, `use_amx`, `cpu_has_amx`) and every call of that weight takes
it, whatever its row count. See README.md for the schedule and the measurements.
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
AMX_DEPTH = 32  # k values a tile row: the AMX path takes weights whose K is a multiple of it


@functools.lru_cache(maxsize=1)
def _read_cpu_flags() -> frozenset[str] | None:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return frozenset(next((line for line in info.splitlines() if line.startswith("flags")), "").split())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's ``flags``); empty where that cannot be read."""
    return _read_cpu_flags() or frozenset()


def cpu_supported() -> tuple[bool, str]:
    """(ok, why not): AVX2 + FMA on this CPU and a C++ compiler to build the kernel."""
    words = _read_cpu_flags()
    if words is None:
        return False, "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    if not {"avx2", "fma"} <= words:
        return False, "this CPU lacks AVX2 or FMA"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False, "no C++ compiler on PATH (apt-get install g++)"
    return True, ""


def available() -> bool:
    return cpu_supported()[0]


def cpu_has_avx512() -> bool:
    """Whether calls of 4+ rows can take the kernel's AVX-512 code (same bits, 16 lanes a vector)."""
    return "avx512f" in cpu_flags()


_amx_wanted = True  # use_amx's switch; read when a weight is packed


def cpu_has_amx() -> bool:
    """Whether bf16 weights can take the kernel's AMX-BF16 path: the CPU has AMX tiles and BF16, and
    Linux granted this process the tile state (asked for on the first call)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags() and build().amx_ready()


def use_amx(enabled: bool | None = None) -> bool:
    """Pack bf16 weights for the AMX path from now on (the default where `cpu_has_amx`) or not; None
    only asks. Returns whether new bf16 packs take it. Weights packed earlier keep their path: the
    choice is made at packing, and the two paths give different bits (each batch-invariant)."""
    global _amx_wanted
    if enabled is not None:
        _amx_wanted = bool(enabled)
    return _amx_wanted and cpu_has_amx()


def amx_suits(weight: Tensor) -> bool:
    """Whether `specpilot.engine.packed.StreamLinear` packs ``weight`` for the AMX path: bf16, K a multiple of
    32, `use_amx`."""
    return weight.dtype == torch.bfloat16 and weight.shape[-1] % AMX_DEPTH == 0 and use_amx()


def use_avx512(enabled: bool | None = None) -> bool:
    """Turn the AVX-512 code on (the default where the CPU has it) or off for this process; None only
    asks. Returns whether it is used now: never on a CPU without AVX-512F. For tests and benchmarks:
    the results are the same bits either way."""
    return build().set_avx512(-1 if enabled is None else int(enabled))


@functools.lru_cache(maxsize=1)
def build():
    """Build (or load the cached build of) the extension once per process; returns its op namespace
    (``pack``, ``linear``). Raises RuntimeError naming what is missing when `cpu_supported` says no."""
    ok, why = cpu_supported()
    if not ok:
        raise RuntimeError(f"specpilot.kernels.cpu_gemm cannot run here: {why}; use linear_backend='default'")
    from torch.utils.cpp_extension import load

    # The build runs `ninja` from PATH; the `ninja` package puts it beside this interpreter, which
    # is not on PATH when the venv's python is run without activating the venv.
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # -fopenmp: ATen's parallel_for is header code that runs serially without it.
    load(name=EXTENSION, sources=[str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.specpilot_cpu


def pack(weight: Tensor) -> Tensor:
    """``weight`` [N, K] (fp32 or bf16, CPU) in the kernel's layout: [ceil(N / 16), K, 16], same dtype."""
    return build().pack(weight)


def pack_amx(weight: Tensor) -> Tensor:
    """bf16 ``weight`` [N, K] (K a multiple of 32) in the AMX layout: [ceil(N / 16), K, 16] bf16,
    each panel as K / 2 rows of 16 column pairs. Raises where `cpu_has_amx` is false."""
    return build().pack_amx(weight)


def packed_linear_amx(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """``x @ W.T`` for bf16 x [..., K] and ``packed = pack_amx(W)``, on AMX tiles; bf16 result."""
    return build().linear_amx(x, packed, out_features)


def packed_linear(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """``x @ W.T`` for x [..., K] (fp32 or bf16) and ``packed = pack(W)`` (W has ``out_features``
    rows); the result in x's dtype. See the module docstring for the contract."""
    return build().linear(x, packed, out_features)


def stream_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` through the kernel, packing ``weight`` on the way (for tests and one-off
    calls; a model packs once, as `specpilot.engine.packed.StreamLinear` does)."""
    return packed_linear(x, pack(weight), weight.shape[0])


__all__ = ["AMX_DEPTH", "amx_suits", "available", "build", "cpu_flags", "cpu_has_amx", "cpu_has_avx512",
           "cpu_supported", "pack", "pack_amx", "packed_linear", "packed_linear_amx", "reference", "stream_linear",
           "use_amx", "use_avx512"]
