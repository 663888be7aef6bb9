"""CPU linears other than PyTorch's default: oneDNN with weights packed once at load (the
``linear_backend = "onednn"`` / ``"onednn_all"`` options), or the AVX2 weight-streaming kernel of
`specpilot.kernels.cpu_gemm` (``"stream"``).

Why: on a CPU, PyTorch's default fp32 ``F.linear`` (MKL) is good for one row but slow for the few
rows of a verification block: on the 2-core AVX2 machine of the embedded default a 5-token SmolLM2
forward costs ~1.9x a 1-token one, while the weights it reads are the same. oneDNN's matmul over a
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) avoids
re-packing the weight on every call and runs those blocks ~15-40% faster (measurements in
engine/README.md). With ``linear_backend = "onednn"`` one-row calls keep the default path
(bit-identical to stock, and faster at one row on 1 thread); with ``"onednn_all"`` they take the
packed path too, measured faster than MKL's one-row path on a 2-core VM (both: docs/FIGURES.md,
"Lab notes moved from code").

Contract: `PackedLinear` computes ``x @ W.T`` like the ``nn.Linear`` it replaces, for any leading
shape, in fp32 or bf16. Packed results may differ from the default path in the last bits (another
reduction order), so a system with this option can emit other tokens at near-ties and must pass
token forcing. It holds a second copy of every weight (the packed one). No-op off CPU.

`StreamLinear` (``"stream"``) computes through `specpilot.kernels.cpu_gemm.packed_linear` over a copy of the
weight packed once into the kernel's layout; it keeps the module's own weight as ``weight`` (a tied
LM head stays tied to the embedding, which reads it). Its rows are batch-invariant: a T-row
verification block gives each row bit for bit what a one-row step gives it. Other bits than the
default path, so the same forcing rule applies. On CPUs with AMX-BF16 a bf16 weight is packed for
the kernel's AMX path (every call of that linear, whatever its row count, then runs on tiles: rows
stay batch-invariant; other bits than the FMA path, and a verification block of up to 16 rows costs
about one row's time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACK_ROWS_HINT = 16  # oneDNN picks the packed layout for about this many rows (verification blocks)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Module, one_row: bool = False):
        super().__init__()
        self.one_row = one_row  # one-row calls packed too (else the default path, bit for bit)
        weight = linear.weight.detach()
        self.weight = weight  # the original (possibly tied) weight: the one-row path reads it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1 and not self.one_row:
            return F.linear(x, self.weight)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class StreamLinear(nn.Module):
    """``x @ weight.T`` through `specpilot.kernels.cpu_gemm` over ``weight`` [N, K] packed once: on AMX tiles
    where `specpilot.kernels.cpu_gemm.amx_suits` says so (bf16, chosen at packing), else on the FMA code."""

    def __init__(self, weight: Tensor):
        from specpilot.kernels.cpu_gemm import amx_suits, build

        super().__init__()
        self.weight = weight  # a linear's own Parameter stays shared: tied weights stay tied
        self.out_features = weight.shape[0]
        ops = build()
        self.amx = amx_suits(weight)
        pack, self._linear = (ops.pack_amx, ops.linear_amx) if self.amx else (ops.pack, ops.linear)
        self.register_buffer("packed", pack(weight.detach()), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self._linear(x, self.packed, self.out_features)


BACKENDS = ("onednn", "onednn_all", "stream")  # the `linear_backend` values this module serves


def pack_linears(model: nn.Module, backend: str = "onednn") -> int:
    """Replace every bias-free ``nn.Linear`` of a CPU model by the backend's module (`PackedLinear`
    for ``"onednn"``, one-row calls too for ``"onednn_all"``, `StreamLinear` for ``"stream"``);
    returns how many."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if next(model.parameters()).device.type != "cpu":
        return 0
    if backend == "stream":
        from specpilot.kernels.cpu_gemm import build

        build()  # here, not in the first forward; raises naming what this machine lacks
    elif not available():
        raise RuntimeError(f"linear_backend={backend!r} needs a PyTorch build with oneDNN (mkldnn); "
                           "this one has none: use linear_backend='default'")
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                new = StreamLinear(child.weight) if backend == "stream" else PackedLinear(child, backend == "onednn_all")
                setattr(module, name, new)
                swapped += 1
    return swapped
