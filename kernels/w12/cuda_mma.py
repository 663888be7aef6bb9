"""W12 on tensor cores: the CUDA C++ kernel (``csrc/w12_mma.cu``) for 1-32 rows of bf16 ``x``.

What it computes: ``y [M, N] = x [M, K] @ W.T`` in bf16 from the W12 planes (``format.py``), the
fp32 sum of the exact products (same scale trick as the Triton kernel, ``kernel.py``), escapes added
exactly after the row scale. The reference is ``format.decode`` and a matmul; tests compare the two.

Why a second kernel. A decode step reads every weight once with 1-17 rows of ``x`` (AR, and the
verification of up to 16 drafted tokens and their root: hence up to 32 rows here). The Triton paths reach
3-4.4 TB/s at M = 1 but fall to 2-3 TB/s at M = 4-16 (README.md), below torch's bf16 GEMV, because Triton's ``tl.dot`` stages the
planes through shared memory and converts layouts. Here the weights are ``mma.sync``'s A operand:
each thread loads 16 contiguous bytes of each plane straight into registers (no shared memory, no
shuffles; the k-order of the MMA is chosen per thread so that its bytes decode in place), and the
MMA makes the cost of 16 rows of ``x`` the cost of one. One launch kind: a warp takes one 16-row tile
of weights, and each step's loads go out before the previous step's math (two steps' fragments in
registers). The kinds no dispatch reached (non-pipelined steps, two tiles a warp, the TMA launch and its
persistent grid) left the package on 2026-12-07: `REMOVED_LAUNCHES` is the patch that re-adds them.

Contract: CUDA, compute capability >= 8.0, ``x`` bf16 with 1-32 rows, ``K % 8 == 0``, rows
contiguous and 16-byte aligned (`supports`). The launch configuration (`MmaConfig`) is a pure
function of ``(M, N, K)`` and the device's SM count (`pick_mma_config`), so results are
deterministic: same inputs, same device, same bits. Split-K partials are merged in split order in
the same launch (``specpilot.kernels.counters``).

Build: ``torch.utils.cpp_extension`` with the machine's ``nvcc`` (``CUDA_HOME``), once per source
version and device capability, cached under the torch extensions directory (about a minute).
`build` raises RuntimeError saying what is missing; `available` answers without raising.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specpilot.kernels.counters import arrival_counters

from .format import W12Weight

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("w12_mma.cu", "w12_mma_binding.cpp")
MAX_ROWS = 32  # rows of x (a verification of 16 drafts and its root is 17)
MAX_PIPELINED = 4  # chunks x row groups of a launch: two steps' fragments in registers (csrc: kMaxPipelined)
# The launch kinds that left the package on 2026-12-07 (no dispatch reached them): the patch that re-adds them
REMOVED_LAUNCHES = "docs/results/w12-kernel/removed-2026-12-07-tma-persistent-rows2-unpipelined.patch"
# Their fields, as tuned files and bench records written before then carry them, with the value each has in the
# launch that remains (one 16-row tile a warp, pipelined, no TMA ring, a block a (row tile, split))
_REMOVED_FIELDS = {"rows": 1, "pipelined": True, "stages": 0, "persistent": 0}


@dataclass(frozen=True)
class MmaConfig:
    """A launch: ``chunks`` 64-column chunks loaded together (1, 2, 4), ``warps`` a block (1..8), each warp one
    16-row tile of weights, ``splits`` K splits (merged in the same launch). Pipelined: each step's loads go out
    before the previous step's math, so two steps' fragments are in registers."""

    chunks: int = 2
    warps: int = 4
    splits: int = 1

    def key(self) -> str:
        # "r1" (one tile a warp) and "_pipe" as in the keys of the records written while there were other kinds
        return f"mma_r1_c{self.chunks}_w{self.warps}_s{self.splits}_pipe"

    def fits(self, m: int) -> bool:
        """Whether the kernel has this launch for ``m`` rows of x: two steps' fragments in registers, so chunks x
        row groups is at most 4."""
        return 1 <= m <= MAX_ROWS and self.chunks * row_groups(m) <= MAX_PIPELINED

    @classmethod
    def from_fields(cls, fields: dict) -> MmaConfig:
        """A launch from its fields (``asdict``). Tuned files and bench records written before 2026-12-07 carry the
        fields of the kinds that left the package then: with the remaining launch's values they are dropped; a
        launch of a removed kind names the patch that re-adds it."""
        fields = dict(fields)
        gone = {f: v for f, keep in _REMOVED_FIELDS.items() if (v := fields.pop(f, keep)) != keep}
        if gone:
            raise ValueError(f"a tensor-core launch with {gone}: that launch kind left the package (its code: "
                             f"{REMOVED_LAUNCHES})")
        return cls(**fields)


def row_groups(m: int) -> int:
    """8-row groups of x (mma B operands) for ``m`` rows."""
    return -(-m // 8)


def _digest() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, "w12_mma.h"):
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:12]


def cuda_ready() -> tuple[bool, str]:
    """Whether this process can build and run the kernel, and if not, why."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"compute capability {major}.x < 8.0 (mma.sync bf16)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found: set CUDA_HOME"
    return True, ""


@functools.lru_cache(maxsize=1)
def build():
    """Build (or load the cached build of) the extension; returns ``torch.ops.specpilot_w12``."""
    ok, why = cuda_ready()
    if not ok:
        raise RuntimeError(f"the W12 tensor-core kernel cannot run here: {why}")
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major == 9 else ''}"  # sm_90a: Hopper's own target
    # ptxas takes most of the build, one kernel after another unless split (a fresh GPU host builds in about
    # half the time with it); Hopper needs CUDA >= 12, whose nvcc has the flag, older cards may not
    split = ["-split-compile=0"] if major >= 9 else []
    load(name=f"specpilot_w12_{_digest()}_sm{arch}", sources=[str(CSRC / s) for s in SOURCES],
         extra_include_paths=[str(CSRC)], extra_cflags=["-O3"],
         extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", *split],
         is_python_module=False, verbose=False)
    return torch.ops.specpilot_w12


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """The kernel built and loaded (False, never raising, where it cannot)."""
    try:
        build()
    except Exception:  # noqa: BLE001 - any build failure means "use the Triton kernel"
        return False
    return True


def supports(x: torch.Tensor, p: W12Weight) -> bool:
    """Whether ``x`` and ``p`` meet the kernel's contract (not whether it built: `available`)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and p.k % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0)


# The launches the sweep (bench/w12_bench.py --sweep --kinds mma) found faster than the Triton kernels' own
# choice, per card (torch's device name), Llama-8B shape and M class; `w12_matmul` routes exactly these
# cases here by default ("auto"). H100 80GB HBM3, 2026-12-05: the cases where a pipelined register launch
# beat Triton by >= 3% (docs/results/w12-kernel/h100-2026-12-05-mma-pipelined-sweep.jsonl; M = 1, 4, 16
# swept). Not yet swept on the H200: no entries, so the H200 stays on Triton. A tuned file adds entries when
# `kernel` (the dispatch) is imported (`kernel.TUNED_ENV`).
_PIPE_R1_C4_W2 = MmaConfig(chunks=4, warps=2)
TUNED: dict[str, dict[tuple[int, int], dict[int, MmaConfig]]] = {
    "NVIDIA H100 80GB HBM3": {
        (6144, 4096): {4: _PIPE_R1_C4_W2},  # 20.6 us against Triton's 21.6
        (28672, 4096): {4: _PIPE_R1_C4_W2},  # 68.3 against 73.4
        (128256, 4096): {4: _PIPE_R1_C4_W2},  # 279.4 against 293.1
    },
}


def m_class(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 16 else 32


def tuned_mma_config(m: int, n: int, k: int, card: str) -> MmaConfig | None:
    """The swept launch for ``(M, N, K)`` on ``card`` where the tensor-core kernel beat Triton there, else None."""
    return TUNED.get(card, {}).get((n, k), {}).get(m_class(m))


@functools.cache
def card_name(device: torch.device) -> str:
    """torch's name of ``device``'s card (the key of `TUNED`)."""
    return torch.cuda.get_device_name(device)


def pick_mma_config(m: int, n: int, k: int, sms: int, card: str = "") -> MmaConfig:
    """The launch for ``(M, N, K)`` on a device of ``sms`` multiprocessors: a pure function (no
    run-time autotuning, so another process picks the same and gets the same bits). Swept shapes
    come from ``TUNED`` (``card``); otherwise what won the H100 sweeps of 2026-12-05 at every shape: 2 warps
    a block, with as many chunks a step as the pipeline's registers allow (4 up to 8 rows of x, 2 up to 16, 1
    beyond), and enough K splits that about two blocks run on every multiprocessor, keeping >= 2 steps a
    split."""
    tuned = tuned_mma_config(m, n, k, card)
    if tuned is not None:
        return tuned
    cfg = MmaConfig(chunks=MAX_PIPELINED // row_groups(m), warps=2)
    tiles = -(-n // (cfg.warps * 16))
    steps = max(1, (16 * -(-k // 32)) // (64 * cfg.chunks))
    splits = 1
    while tiles * splits < 2 * sms and steps // (2 * splits) >= 2:
        splits *= 2
    return replace(cfg, splits=splits)


def w12_mma_matmul(x: torch.Tensor, p: W12Weight, config: MmaConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for bf16 ``x [M, K]``, 1 <= M <= 32, on the packed ``p`` (same device); bf16 ``[M, N]``."""
    if not supports(x, p):
        x = x.contiguous()
        if not supports(x, p):
            raise ValueError(f"the tensor-core W12 kernel needs bf16 CUDA x with 1-{MAX_ROWS} rows and K % 8 == 0, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device} (K = {p.k})")
    if x.shape[1] != p.k or x.device != p.device:
        raise ValueError(f"x {tuple(x.shape)} on {x.device} does not fit a [{p.n}, {p.k}] weight on {p.device}")
    cfg = config or pick_mma_config(x.shape[0], p.n, p.k, torch.cuda.get_device_properties(x.device).multi_processor_count,
                                    card_name(x.device))
    if not cfg.fits(x.shape[0]):
        raise ValueError(f"the launch {cfg.key()} does not take {x.shape[0]} rows of x (MmaConfig.fits)")
    tiles = -(-p.n // (cfg.warps * 16))
    counters = arrival_counters(x.device, tiles)
    return build().mma(x, p.low, p.nib, p.e0, p.esc_ptr, p.esc_idx, p.esc_val, counters, p.k, cfg.chunks,
                       cfg.warps, cfg.splits)


__all__ = ["MAX_ROWS", "MmaConfig", "REMOVED_LAUNCHES", "TUNED", "available", "build", "cuda_ready",
           "pick_mma_config", "supports", "card_name", "m_class", "tuned_mma_config", "w12_mma_matmul"]
