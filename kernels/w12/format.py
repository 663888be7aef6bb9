"""W12: a lossless 12-bit storage format for BF16 weight matrices (the normative reference).

A BF16 weight is ``sign(1) | exponent E(8) | mantissa m(7)``. In a trained matrix almost every
non-zero weight of one output channel (row ``n``) lies within a few binades, so each row gets a
base exponent ``e0[n]`` and each weight keeps only

    sign (1 bit) + window offset o (4 bits) + mantissa m (7 bits) = 12 bits,

decoded by

    o in 1..15  ->  E = e0[n] + o       (the 15-binade window [e0+1, e0+15])
    o == 0      ->  E = 0               (±0; the packer uses this code only for ±0)

so zeros cost nothing extra. Every other weight (denormals, values outside the window, ±inf, NaN
with any payload) is stored in code as +0 and listed exactly in an *escape list* of
``(flat index n*K + k, original bf16 bits)``, sorted by index; ``esc_ptr`` indexes that list by
groups of ``ESC_GROUP`` rows. ``e0[n]`` is chosen to put the most non-zero normal weights of
row ``n`` inside its window. Decoding reproduces every BF16 tensor bit for bit.

Storage (what the GPU kernel reads; see README.md for why):

* ``r = sign<<15 | o<<7 | m`` is the *window-relative* BF16 pattern of a weight (its value
  is the weight times ``2**-e0``; ±0 stays ±0).
* ``low``  uint8 ``[N, 2*kh]``: byte ``k`` is ``r & 0xFF`` (``o & 1`` and the mantissa).
* ``nib``  uint8 ``[N, kh]``: byte ``j`` holds two 4-bit fields ``sign<<3 | o>>1``; the low
  nibble is weight ``j``, the high nibble weight ``kh + j``. ``kh = 16*ceil(K/32)`` so the rows
  of both planes are 16-byte multiples; columns past ``K`` are zero padding (none when
  ``K % 32 == 0``, which holds for every Llama-family matrix).
* ``e0`` uint8 ``[N]``, ``esc_ptr`` int32 ``[ceil(N/ESC_GROUP)+1]``, ``esc_idx`` int32 (int64
  when ``N*K >= 2**31``) ``[E]``, ``esc_val`` int16 ``[E]``.

This module is pure PyTorch (CPU or CUDA). It does not run the matmul kernel (``kernel.py``) and
knows nothing about models (``linear.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ESC_GROUP = 16  # rows per esc_ptr entry
WINDOW = 15  # binades in the window [e0 + 1, e0 + WINDOW]
E0_MIN, E0_MAX = 1, 254 - WINDOW  # the window never reaches exponent 0 (zero/denormal) or 255 (inf/NaN)
_CHUNK = 1 << 22  # elements per packing chunk (bounds the transient memory of pack())


def half_width(k: int) -> int:
    """Length ``kh`` of a nibble-plane row: ``16 * ceil(K / 32)``."""
    return 16 * ((k + 31) // 32)


@dataclass(frozen=True)
class W12Weight:
    """A packed ``[N, K]`` BF16 matrix. Field layout: see the module docstring."""

    n: int
    k: int
    low: torch.Tensor
    nib: torch.Tensor
    e0: torch.Tensor
    esc_ptr: torch.Tensor
    esc_idx: torch.Tensor
    esc_val: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def kh(self) -> int:
        return self.nib.shape[1]

    @property
    def device(self) -> torch.device:
        return self.low.device

    @property
    def escapes(self) -> int:
        return int(self.esc_idx.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in ("low", "nib", "e0", "esc_ptr", "esc_idx", "esc_val")}

    @property
    def nbytes(self) -> int:
        """Bytes stored, every plane and list included (padding too)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(1, self.n * self.k)

    def to(self, device: torch.device | str) -> W12Weight:
        return W12Weight(n=self.n, k=self.k, **{f: t.to(device) for f, t in self.tensors().items()})


def _bits16(w: torch.Tensor) -> torch.Tensor:
    """BF16 bit patterns as int32 in [0, 65535]."""
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def choose_e0(e: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
    """Per row, the base exponent whose window [e0+1, e0+15] holds the most normal weights.

    ``e``: int32 exponents ``[R, K]``; ``normal``: bool mask of the weights that may sit in a
    window. Ties go to the smallest e0; a row with no normal weight gets E0_MIN.
    """
    rows = e.shape[0]
    hist = torch.zeros(rows, 257, dtype=torch.int32, device=e.device)
    hist[:, 1:].scatter_add_(1, e.long(), normal.to(torch.int32))
    cs = hist.cumsum(1)  # cs[:, i] = count of exponents < i
    lo = torch.arange(E0_MIN, E0_MAX + 1, device=e.device)
    win = cs[:, lo + WINDOW + 1] - cs[:, lo + 1]  # count of E in [e0+1, e0+15]
    return (win.argmax(1) + E0_MIN).to(torch.int32)


def pack(w: torch.Tensor) -> W12Weight:
    """Pack a 2-D BF16 tensor (on any device). Exact for every bit pattern."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"pack expects a 2-D bfloat16 tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    kh = half_width(k)
    dev = w.device
    low = torch.zeros(n, 2 * kh, dtype=torch.uint8, device=dev)
    nib = torch.zeros(n, kh, dtype=torch.uint8, device=dev)
    e0 = torch.empty(n, dtype=torch.uint8, device=dev)
    esc_i: list[torch.Tensor] = []
    esc_v: list[torch.Tensor] = []
    idx_dtype = torch.int32 if n * k < 2**31 else torch.int64
    step = max(1, _CHUNK // max(1, k))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        u = _bits16(w[r0:r1])
        e = (u >> 7) & 0xFF
        normal = (e - 1).to(torch.uint8) < 254  # 1 <= E <= 254 (uint8 wrap-around turns E=0 into 255)
        base = choose_e0(e, normal)
        o = e - base[:, None]
        inwin = normal & ((o - 1).to(torch.uint8) < WINDOW)  # 1 <= o <= 15
        zero = (u & 0x7FFF) == 0
        keep = inwin | zero
        # in-window: r = u - e0<<7 = sign<<15 | o<<7 | m ; ±0 keeps its pattern ; escapes become +0
        r = torch.where(inwin, u - (base << 7)[:, None], u) * keep
        low[r0:r1, :k] = r.to(torch.uint8)
        nibble = torch.zeros(r1 - r0, 2 * kh, dtype=torch.uint8, device=dev)
        nibble[:, :k] = (((r >> 8) & 7) | ((r >> 12) & 8)).to(torch.uint8)  # sign<<3 | o>>1
        nib[r0:r1] = nibble[:, :kh] | (nibble[:, kh:] << 4)
        e0[r0:r1] = base.to(torch.uint8)
        rows, cols = torch.nonzero(~keep, as_tuple=True)
        if rows.numel():
            esc_i.append(((rows.to(torch.int64) + r0) * k + cols).to(idx_dtype))
            esc_v.append(u[rows, cols].to(torch.int16))
    esc_idx = torch.cat(esc_i) if esc_i else torch.zeros(0, dtype=idx_dtype, device=dev)
    esc_val = torch.cat(esc_v) if esc_v else torch.zeros(0, dtype=torch.int16, device=dev)
    groups = (n + ESC_GROUP - 1) // ESC_GROUP
    bounds = torch.arange(groups + 1, device=dev, dtype=torch.int64) * ESC_GROUP * k
    esc_ptr = torch.searchsorted(esc_idx.to(torch.int64), bounds).to(torch.int32)
    return W12Weight(n=n, k=k, low=low, nib=nib, e0=e0, esc_ptr=esc_ptr, esc_idx=esc_idx, esc_val=esc_val)


def window_bits(p: W12Weight) -> torch.Tensor:
    """The window-relative BF16 patterns ``r = sign<<15 | o<<7 | m`` as int32 ``[N, K]``."""
    k = p.k
    nb = p.nib.to(torch.int32)
    nibble = torch.cat([nb & 0xF, nb >> 4], dim=1)[:, :k]
    hi = (nibble & 7) | ((nibble & 8) << 4)  # sign<<7 | o>>1
    return (hi << 8) | p.low[:, :k].to(torch.int32)


def decode(p: W12Weight) -> torch.Tensor:
    """The exact BF16 matrix ``[N, K]`` (normative decoder)."""
    r = window_bits(p)
    o = (r >> 7) & 0xF
    e = torch.where(o == 0, 0, o + p.e0.to(torch.int32)[:, None])
    bits = (r & 0x807F) | (e << 7)
    flat = bits.view(-1)
    if p.escapes:
        flat[p.esc_idx.long()] = p.esc_val.to(torch.int32) & 0xFFFF
    return bits.to(torch.int16).view(torch.bfloat16)


def verify(p: W12Weight, w: torch.Tensor) -> None:
    """Raise unless ``decode(p)`` equals ``w`` bit for bit (the load-time check)."""
    got = decode(p).view(torch.int16)
    want = w.contiguous().view(torch.int16).to(got.device)
    if got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero()[:4].tolist() if got.shape == want.shape else "shape"
        raise ValueError(f"W12 round trip is not bit-exact for a {tuple(w.shape)} tensor (first bad: {bad})")


def pack_verified(w: torch.Tensor) -> W12Weight:
    p = pack(w)
    verify(p, w)
    return p
