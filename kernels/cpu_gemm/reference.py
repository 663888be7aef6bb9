"""PyTorch reference of `stream_linear` / `packed_linear`: the normative semantics (fp32
accumulation of x @ W.T, the result in x's dtype). The AVX2 kernel agrees to fp32 rounding (another
summation order)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def stream_linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)
