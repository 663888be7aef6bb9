"""A certified exact-argmax LM head for greedy decoding on CPU (``screened_head = True``).

Why: greedy decoding and verification read only each row's argmax, yet the LM head computes every
logit, and on a small model it is the largest matrix: SmolLM2-135M's 49152 x 576 head is 113 MB in
fp32, read once per forward (5.2 of 42 ms of a 3-token `stream` forward on a 2-core AMX Xeon).

How: keep a bf16 copy Ŵ of the fp32 weight W (half the bytes), packed for `specpilot_kernels.cpu_gemm`.
Per call, for the rows h of the call:

1. *screen*: s = h Ŵᵀ through the kernel (fp32 arithmetic over exactly widened bf16 weights; on
   AMX-BF16 CPUs on the tiles, h rounded to bf16 and s returned in bf16);
2. *bound*: |s_i - e_i| <= b_i for the logit e_i that the model's own head computes, by
   Cauchy-Schwarz and the standard summation bound γ_K = K u / (1 - K u) (u = 2^-24, any order):
   b_i = |h| (|w_i - ŵ_i| + γ_K (|w_i| + |ŵ_i|)), plus on AMX (γ_K |ĥ| + |h - ĥ|) |ŵ_i| and the bf16
   rounding of s (2^-8 |s_i|); a small relative slack covers the rounding of the bound itself;
3. *candidates*: C = {i : s_i + b_i >= max_j (s_j - b_j)}, over the union of the call's rows. Every
   index whose computed logit equals the row's maximum is in C (its e_i >= that maximum >= s_j - b_j);
4. *exact*: the model's head on the rows of W in C only. For a `specpilot_engine.packed.StreamLinear`
   head the kernel's columns are independent, so these are the full head's bits; for another head
   ``F.linear`` over the gathered rows (other bits than the full GEMV only in the last place).

Contract: logits [..., V] that are -inf outside C and the head's exact values on C, so every row's
``argmax`` (first index on ties) is the full head's: bit-exact with ``linear_backend = "stream"``,
up to a last-bit reduction-order difference (a near-tie, which token forcing allows) otherwise. Only
for argmax consumers (decoding); the forcer and drafter training build stock heads of their own.
Falls back to the wrapped head (same result, no saving) when the rows are not finite, when C would
exceed `MAX_CANDIDATES`, and always where the head is not a known linear (``nn.Linear``, `StreamLinear`,
`PackedLinear`: another module's ``weight`` need not say what it computes), its weight is not fp32 or
the kernel cannot run here (no screening then: `active` is False). `reference_argmax_candidates` is the PyTorch reference
of steps 1-3.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

UNIT_ROUNDOFF = 2.0 ** -24  # fp32
BF16_OUTPUT_ROUNDING = 2.0 ** -8  # |bf16(y) - y| <= 2^-9 |y|; 2^-8 leaves room for the bound's own rounding
SLACK = 1e-4  # relative, on every bound: covers the fp32 rounding of computing s +- b
MAX_CANDIDATES = 1024  # beyond this many candidate rows the exact pass costs more than it saves


def gamma(k: int) -> float:
    """The summation error factor of a K-term fp32 dot product, in any order: K u / (1 - K u)."""
    return k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)


def row_constants(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(ŵ = bf16(W), the bound's per-column factors [2, V]: a_i = |w_i - ŵ_i| + γ_K (|w_i| + |ŵ_i|) and
    |ŵ_i|) for an fp32 ``weight`` [V, K]; norms in fp64, rounded up."""
    w64 = weight.detach().double()
    w_hat = weight.detach().to(torch.bfloat16)
    hat64 = w_hat.double()
    w_hat_norm = hat64.norm(dim=1)
    a = (w64 - hat64).norm(dim=1) + gamma(weight.shape[1]) * (w64.norm(dim=1) + w_hat_norm)
    return w_hat, torch.stack([a, w_hat_norm]).mul(1.0 + 1e-6).float()


def candidate_columns(h: Tensor, s: Tensor, coefficients: Tensor, amx_rows: Tensor | None = None) -> Tensor | None:
    """Steps 2-3: the sorted candidate column indices for rows ``h`` [M, K] (fp32) and their screen
    ``s`` [M, V] (fp32), given ``coefficients`` [2, V] = (|w_i - ŵ_i| + γ_K (|w_i| + |ŵ_i|), |ŵ_i|)
    (`row_constants`); ``amx_rows`` = bf16(h) when the screen ran on AMX tiles (bf16 rows, bf16 result).
    None when a row or its screen is not finite (the caller computes the full head).

    The bound is one [M, 2] x [2, V] product: b = |h| a_i + c(h) |ŵ_i|, where c = 0 on the FMA path
    and, on AMX, c = γ_K |ĥ| + |h - ĥ| + 2^-8 (1 + γ_K) |ĥ| (the bf16 rounding of s, as |s_i| <= (1 + γ_K) |ĥ| |ŵ_i|)."""
    g = gamma(h.shape[-1])
    h_norm = h.norm(dim=-1)
    c = torch.zeros_like(h_norm)
    if amx_rows is not None:
        hat = amx_rows.float()
        hat_norm = hat.norm(dim=-1)
        c = g * hat_norm + (h - hat).norm(dim=-1) + BF16_OUTPUT_ROUNDING * (1.0 + g) * hat_norm
    bound = torch.stack([h_norm, c], dim=1).mul_(1.0 + SLACK) @ coefficients
    floor = (s - bound).amax(dim=-1, keepdim=True)
    if not (torch.isfinite(floor).all() and torch.isfinite(h_norm).all()):
        return None
    return ((s + bound) >= floor).any(dim=0).nonzero().squeeze(1)


def reference_argmax_candidates(h: Tensor, weight: Tensor) -> Tensor | None:
    """The PyTorch reference of steps 1-3 (the FMA path's arithmetic: fp32 rows, widened bf16 weights)."""
    w_hat, coefficients = row_constants(weight)
    s = F.linear(h.float(), w_hat.float())
    return candidate_columns(h.float(), s, coefficients)


class ScreenedHead(nn.Module):
    """Wraps a model's LM head (``nn.Linear``, `StreamLinear`, `PackedLinear`): same output argmax,
    exact logits only where they can be the argmax. ``weight`` stays the head's own (tied) weight."""

    def __init__(self, head: nn.Module):
        super().__init__()
        from specpilot_engine.packed import PackedLinear, StreamLinear
        from specpilot_kernels import cpu_gemm

        self.weight = head.weight
        self.out_features = head.weight.shape[0]
        object.__setattr__(self, "_head", head)  # not a child: the profiler sees one leaf named lm_head
        self.bit_exact = isinstance(head, StreamLinear)
        # Only heads known to compute x @ weight.T: another module's weight may not say what it computes.
        known = isinstance(head, (nn.Linear, StreamLinear, PackedLinear))
        self.active = known and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu" \
            and cpu_gemm.available()
        self.candidates: list[int] = []  # candidate counts of recent calls (diagnostics)
        if not self.active:
            log.warning("screened_head: no effect on a %s head here (needs an fp32 linear CPU head and "
                        "specpilot_kernels.cpu_gemm)", type(head).__name__)
            return
        w_hat, self.coefficients = row_constants(head.weight)
        self.amx = cpu_gemm.amx_suits(w_hat)
        self.ops = cpu_gemm.build()
        self.screen_packed = cpu_gemm.pack_amx(w_hat) if self.amx else cpu_gemm.pack(w_hat)

    def _screen(self, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.amx:
            hat = rows.to(torch.bfloat16)
            return self.ops.linear_amx(hat, self.screen_packed, self.out_features).float(), hat
        return self.ops.linear(rows, self.screen_packed, self.out_features), None

    def _exact(self, rows: Tensor, cols: Tensor) -> Tensor:
        w = self.weight.detach().index_select(0, cols)
        if self.bit_exact:  # columns are independent in the kernel: the full head's bits
            return self.ops.linear(rows, self.ops.pack(w), cols.numel())
        return F.linear(rows, w)

    def forward(self, x: Tensor) -> Tensor:
        if not self.active or x.dtype != torch.float32:
            return self._head(x)
        rows = x.reshape(-1, x.shape[-1])
        s, hat = self._screen(rows)
        cols = candidate_columns(rows, s, self.coefficients, hat)
        if cols is None or cols.numel() > MAX_CANDIDATES:
            return self._head(x)
        del self.candidates[:-63]
        self.candidates.append(cols.numel())
        out = torch.full((rows.shape[0], self.out_features), float("-inf"), dtype=torch.float32)
        out[:, cols] = self._exact(rows, cols)
        return out.view(*x.shape[:-1], self.out_features)
