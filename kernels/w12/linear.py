"""``W12Linear``: an ``nn.Linear`` whose weight is stored in W12, and the model-wide swap.

On CUDA the forward runs the Triton kernel (``kernel.w12_matmul``); anywhere else it runs the
reference: decode to BF16, cast to the input's dtype, ``F.linear``. The reference decodes on
first use and keeps the dense weight (``cache_reference``), since the CPU path exists for
correctness, not memory. This module does not pick engine options; the engine calls
``quantize_model_linears`` when its weight format is ``w12``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .format import W12Weight, decode, pack, verify

_PLANES = ("low", "nib", "e0", "esc_ptr", "esc_idx", "esc_val")
HEAD_NAMES = ("lm_head", "output")


class W12Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in W12 (12 bits per weight, bit-exact BF16)."""

    def __init__(self, weight: W12Weight, bias: torch.Tensor | None = None, cache_reference: bool = True):
        super().__init__()
        self.in_features = weight.k
        self.out_features = weight.n
        for name, t in weight.tensors().items():
            self.register_buffer(name, t)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.cache_reference = cache_reference
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, check: bool = True, cache_reference: bool = True) -> W12Linear:
        """Pack ``linear.weight`` (rounded to BF16 if it is not BF16) and, with ``check``, decode it
        again and compare every bit (the load-time check)."""
        w = linear.weight.detach().to(torch.bfloat16)
        p = pack(w)
        if check:
            verify(p, w)
        return cls(p, linear.bias, cache_reference=cache_reference)

    @property
    def packed(self) -> W12Weight:
        return W12Weight(n=self.out_features, k=self.in_features, **{f: getattr(self, f) for f in _PLANES})

    def dense_weight(self) -> torch.Tensor:
        """The exact BF16 weight (decoded; cached when ``cache_reference``)."""
        if self._dense is not None and self._dense.device == self.low.device:
            return self._dense
        w = decode(self.packed)
        if self.cache_reference:
            self._dense = w
        return w

    def _apply(self, fn, recurse=True):  # .to()/.cuda() drop the cached dense weight
        self._dense = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.low.is_cuda:
            from .kernel import w12_matmul  # imported lazily: triton is only needed on CUDA

            y = w12_matmul(x.reshape(-1, self.in_features), self.packed).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        w = self.dense_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        p = self.packed
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits_per_weight={p.bits_per_weight:.3f}, escapes={p.escapes}")


def _tied_to_embedding(model: nn.Module, linear: nn.Linear) -> bool:
    w = linear.weight
    for m in model.modules():
        if isinstance(m, nn.Embedding) and (m.weight is w or m.weight.data_ptr() == w.data_ptr()):
            return True
    return False


def tensor_stats(p: W12Weight) -> dict:
    bf16 = 2 * p.n * p.k
    return {"shape": [p.n, p.k], "bits_per_weight": p.bits_per_weight, "escapes": p.escapes,
            "bytes": p.nbytes, "bf16_bytes": bf16, "bytes_saved": bf16 - p.nbytes}


def summarize(per_tensor: dict[str, dict]) -> dict:
    """Totals over per-tensor stats (``tensor_stats``)."""
    weights = sum(s["shape"][0] * s["shape"][1] for s in per_tensor.values())
    stored = sum(s["bytes"] for s in per_tensor.values())
    bf16 = sum(s["bf16_bytes"] for s in per_tensor.values())
    return {"weights": weights, "bits_per_weight": 8.0 * stored / max(1, weights),
            "escapes": sum(s["escapes"] for s in per_tensor.values()), "bytes": stored, "bf16_bytes": bf16,
            "bytes_saved": bf16 - stored}


def quantize_model_linears(model: nn.Module, include_lm_head: bool = False, check: bool = True) -> dict:
    """Replace every ``nn.Linear`` of ``model`` by a ``W12Linear`` (in place).

    Skipped: modules named ``lm_head``/``output`` unless ``include_lm_head``, and linears whose
    weight is tied to an ``nn.Embedding``. Weights that are not BF16 are rounded to BF16 first
    (W12 stores BF16 exactly). Returns ``{"tensors": {name: stats}, "skipped": [...], **totals}``.
    """
    targets: list[tuple[str, nn.Linear]] = []
    skipped: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (leaf in HEAD_NAMES and not include_lm_head) or _tied_to_embedding(model, mod):
            skipped.append(name)
            continue
        targets.append((name, mod))
    per_tensor: dict[str, dict] = {}
    rounded = sorted({str(m.weight.dtype) for _, m in targets if m.weight.dtype != torch.bfloat16})
    for name, mod in targets:
        new = W12Linear.from_linear(mod, check=check)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], new)
        per_tensor[name] = tensor_stats(new.packed)
    return {"tensors": per_tensor, "skipped": skipped, "rounded_from": rounded, **summarize(per_tensor)}
