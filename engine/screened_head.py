"""A certified exact-argmax LM head for greedy decoding on CPU (``screened_head = True``).

Why: greedy decoding and verification read only each row's argmax, yet the LM head computes every
logit, and on a small model it is the largest matrix: SmolLM2-135M's 49152 x 576 head is 113 MB in
fp32, read once per forward (5.2 of 42 ms of a 3-token `stream` forward on a 2-core AMX Xeon).

How: keep a bf16 copy Ŵ of the fp32 weight W (half the bytes), packed for `specpilot.kernels.cpu_gemm`.
Per call, for the rows h of the call:

1. *screen*: s = h Ŵᵀ through the kernel (fp32 arithmetic over exactly widened bf16 weights; on
   AMX-BF16 CPUs on the tiles, h rounded to bf16 and s returned in bf16);
2. *bound*: |s_i - e_i| <= b_i for the logit e_i that the model's own head computes, by
   Cauchy-Schwarz and the standard summation bound γ_K = K u / (1 - K u) (u = 2^-24, any order):
   b_i = |h| (|w_i - ŵ_i| + γ_K (|w_i| + |ŵ_i|)), plus on AMX (γ_K |ĥ| + |h - ĥ|) |ŵ_i| and the bf16
   rounding of s (at most 2^-8 (1 + γ_K) |ĥ| |ŵ_i|); a relative slack covers the rounding of the
   bound itself and a tiny absolute term AMX's flushed denormals;
3. *candidates*: C = {i : s_i + b_i >= max_j (s_j - b_j)}, over the union of the call's rows. Every
   index whose computed logit equals the row's maximum is in C (its e_i >= that maximum >= s_j - b_j);
4. *exact*: the model's head on the rows of W in C only. For a `specpilot.engine.packed.StreamLinear`
   head the kernel's columns are independent, so these are the full head's bits; for another head
   ``F.linear`` over the gathered rows (other bits than the full GEMV only in the last place).

Contract: logits [..., V] that are -inf outside C and the head's exact values on C, so every row's
``argmax`` (first index on ties) is the full head's: bit-exact with ``linear_backend = "stream"``,
up to a last-bit reduction-order difference (a near-tie, which token forcing allows) otherwise. Only
for argmax consumers (decoding); the forcer and drafter training build stock heads of their own.
Falls back to the wrapped head (same result, no saving) when the rows are not finite or C would
exceed `MAX_CANDIDATES` (recorded as -1 in ``candidates``), and always where the head is not a known
linear (``nn.Linear``, `StreamLinear`, `PackedLinear`, bias-free: another module's ``weight`` need
not say what it computes), its weight is not fp32 or the kernel cannot run here (no screening then:
`active` is False). The screen is built once from the head's weight: wrap the head after its weights
are final (`api.apply_model_options`). `reference_argmax_candidates` is the PyTorch reference of
steps 1-3.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

UNIT_ROUNDOFF = 2.0 ** -24  # fp32
BF16_OUTPUT_ROUNDING = 2.0 ** -8  # bf16's unit roundoff: |bf16(y) - y| <= 2^-8 |y| (SLACK covers the rest)
SLACK = 1e-4  # relative, on every bound: covers the rounding of the norms to fp32 and of the bound's product
TINY = 1e-30  # absolute, on every bound: AMX flushes denormal products to zero, outside γ_K
ROW_CHUNK = 8192  # rows of W per fp64 pass in `row_constants` (bounds its transient memory)
MAX_CANDIDATES = 1024  # beyond this many candidate rows the exact pass costs more than it saves


def gamma(k: int) -> float:
    """The summation error factor of a K-term fp32 dot product, in any order: K u / (1 - K u)."""
    return k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)


def row_constants(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(ŵ = bf16(W), the bound's per-column factors [3, V]: a_i = |w_i - ŵ_i| + γ_K (|w_i| + |ŵ_i|),
    |ŵ_i| and 1) for an fp32 ``weight`` [V, K]; norms in fp64 (``ROW_CHUNK`` rows at a time), rounded up."""
    w = weight.detach()
    w_hat = w.to(torch.bfloat16)
    g = gamma(w.shape[1])
    parts = []
    for lo in range(0, w.shape[0], ROW_CHUNK):
        w64, hat64 = w[lo:lo + ROW_CHUNK].double(), w_hat[lo:lo + ROW_CHUNK].double()
        hat_norm = hat64.norm(dim=1)
        parts.append(torch.stack([(w64 - hat64).norm(dim=1) + g * (w64.norm(dim=1) + hat_norm), hat_norm]))
    factors = torch.cat(parts, dim=1).mul(1.0 + 1e-6)
    return w_hat, torch.cat([factors, torch.ones_like(factors[:1])]).float()


def candidate_columns(h: Tensor, s: Tensor, coefficients: Tensor, amx_rows: Tensor | None = None) -> Tensor | None:
    """Steps 2-3: the sorted candidate column indices for rows ``h`` [M, K] (fp32) and their screen
    ``s`` [M, V] (fp32), given the per-column ``coefficients`` of `row_constants`; ``amx_rows`` = bf16(h)
    when the screen ran on AMX tiles (bf16 rows, bf16 result). None when a row or its screen is not
    finite (the caller computes the full head).

    The bound is one [M, 3] x [3, V] product: b = |h| a_i + c(h) |ŵ_i| + TINY, where c = 0 on the FMA
    path and, on AMX, c = γ_K |ĥ| + |h - ĥ| + 2^-8 (1 + γ_K) |ĥ| (the last term bounds the bf16
    rounding of s, as |s_i| <= (1 + γ_K) |ĥ| |ŵ_i|). Row norms in fp64 (no underflow, exact enough)."""
    g = gamma(h.shape[-1])
    h64 = h.double()
    h_norm = h64.norm(dim=-1)
    c = torch.zeros_like(h_norm)
    if amx_rows is not None:
        hat = amx_rows.double()
        hat_norm = hat.norm(dim=-1)
        c = g * hat_norm + (h64 - hat).norm(dim=-1) + BF16_OUTPUT_ROUNDING * (1.0 + g) * hat_norm
    factors = torch.stack([h_norm, c, torch.full_like(h_norm, TINY)], dim=1).mul_(1.0 + SLACK).float()
    bound = factors @ coefficients
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
        from specpilot.engine.packed import PackedLinear, StreamLinear
        from specpilot.kernels import cpu_gemm

        self.weight = head.weight
        self.out_features = head.weight.shape[0]
        object.__setattr__(self, "_head", head)  # not a child: the profiler sees one leaf named lm_head
        self.bit_exact = isinstance(head, StreamLinear)
        # Only heads known to compute x @ weight.T (no bias, no subclass): another module's weight need
        # not say what it computes.
        known = type(head) in (nn.Linear, StreamLinear, PackedLinear) and getattr(head, "bias", None) is None
        self.active = known and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu" \
            and cpu_gemm.available()
        self.amx = False
        self.candidates: list[int] = []  # candidate columns of recent calls; -1: the call fell back
        if self.active:
            try:
                w_hat, self.coefficients = row_constants(head.weight)
                self.ops = cpu_gemm.build()
                self.amx = cpu_gemm.amx_suits(w_hat)
                self.screen_packed = cpu_gemm.pack_amx(w_hat) if self.amx else cpu_gemm.pack(w_hat)
            except RuntimeError as exc:  # the kernel did not build here: the wrapped head, unscreened
                log.warning("screened_head: the kernel cannot run here (%s)", exc)
                self.active = False
        if not self.active:
            log.warning("screened_head: no effect on a %s head here (needs an fp32 bias-free linear CPU head and "
                        "specpilot.kernels.cpu_gemm)", type(head).__name__)

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
        if not self.active or x.dtype != torch.float32 or x.numel() == 0:
            return self._head(x)
        rows = x.reshape(-1, x.shape[-1])
        s, hat = self._screen(rows)
        cols = candidate_columns(rows, s, self.coefficients, hat)
        del self.candidates[:-63]
        if cols is None or cols.numel() > MAX_CANDIDATES:
            self.candidates.append(-1)
            return self._head(x)
        self.candidates.append(cols.numel())
        out = torch.full((rows.shape[0], self.out_features), float("-inf"), dtype=torch.float32)
        out[:, cols] = self._exact(rows, cols)
        return out.view(*x.shape[:-1], self.out_features)
