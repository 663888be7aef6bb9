"""Triton kernel: ``y = x @ W.T`` straight from the W12 planes (see ``format.py``).

What it computes: for ``x [M, K]`` (bf16, fp16 or fp32) and a packed ``W [N, K]``, ``y [M, N]`` in
``x``'s dtype, accumulated in fp32. BF16 weights are decoded in registers and never written to
memory; escapes are added exactly; the reduction order depends only on the launch configuration,
which is a pure function of ``(M, N, K)`` and the card (``pick_config``; a tuned file read at import,
``TUNED_ENV``, is part of that function), so repeated runs are bitwise identical.

Decode (a few integer ops per weight, no per-weight branch). The planes hold the
*window-relative* pattern ``r = sign<<15 | o<<7 | m``, whose value is ``w * 2**-e0`` (zeros stay
±0: code ``o == 0``). So the kernel never adds ``e0`` per weight nor tests for zero: one 32-bit
register holds four ``nib`` bytes, two SWAR mask/shift ops turn four nibbles into the high bytes
``sign<<7 | o>>1``, and one ``prmt`` builds two BF16 patterns ``hi_byte<<8 | low_byte`` (inline
PTX; plain integer ops under the interpreter). Products of values as small as ``2**-126`` would
leave fp32's normal range, so ``x`` is scaled by ``2**64`` and each output row by
``2**(e0-64)`` (both exact power-of-two multiplies): the result is the fp32 sum of the exact
products, as if the decoded weights had been used. Valid for ``2**-64 <= |x| < 2**64``; outside
that range contributions underflow or overflow.

Structure: one program computes a ``[BM, BN]`` output tile over all of K; each step
covers ``BJ`` bytes of ``nib`` per row, i.e. ``2*BJ`` weights (``j`` and ``kh + j``). Two
kernels:

* ``_w12_dot_kernel`` (``Config.use_dot``): loads ``[BN, BJ]`` byte tiles of ``nib`` and of both
  halves of ``low``, decodes four weights per ``prmt`` pair and runs ``tl.dot`` on BF16 with the
  matching contiguous columns of ``x`` (rows past M masked: no traffic). On Hopper the loads
  become ``cp.async`` into shared memory, pipelined ``num_stages`` deep, and the decode runs in
  the MMA operand layout.
* ``_w12_fma_kernel`` (M <= 8 rows per program): reads the planes as int32 words, decodes each
  word into four fp32 weights (byte ``b`` of word ``w`` = column ``4w + b`` of the half) and
  FMAs them into one fp32 ``[BN, BJ/4]`` accumulator per row of ``x``; the next step's loads are
  issued before this step's math (double buffering by hand: Triton does not pipeline loads that
  do not feed a dot). Weight words are loaded in pairs (8 bytes, the span of one 16-byte load of a
  16-bit ``x``), so with >= 2 of a step's ``x`` words a thread, ``x`` needs no layout conversion; a
  16-bit ``x`` is read as int64 words of four columns and unpacked with a shift or mask per value.

Each program runs over the whole of K and finishes its tile (row scale, escapes, cast, store); escapes
of a tile are added last, in index order, as ``x[:, k] * w_true``. (Split-K, merged in the same launch by
each tile's last program, never became the dispatch's choice: it left the package on 2026-12-07, its code is
``docs/results/w12-kernel/removed-2026-12-07-triton-split-k.patch``. The K range a program covers is still
computed from runtime values, ``[pid_s * cols_per_split, ...)`` over a grid axis launched with one program:
with a constant range Triton 3.9 compiles other, mostly longer, main loops (sm_90 SASS: the FMA 1 x 4 x 256
tile's 319 instructions become 336, the dot 32 x 256 tile's 493 become 507), so this keeps the measured code.)

Under ``TRITON_INTERPRET=1`` (CPU) everything is computed in fp32 (``tl.dot`` with
``input_precision="ieee"``): bf16 arithmetic in the interpreter is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from .cuda_mma import (
    TUNED,
    MmaConfig,
    card_name,
    m_class,
    pick_mma_config,
    supports,
    tuned_mma_config,
    w12_mma_matmul,
)
from .cuda_mma import available as mma_available
from .format import ESC_GROUP, W12Weight

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# Decode of four weights in one instance of inline PTX: one 32-bit register of four ``nib`` bytes
# and one of the four matching ``low`` bytes (``pack=4`` on uint8 tiles, or int32 words with
# ``pack=1``). ``h`` gets the four high bytes ``sign<<7 | o>>1``; each ``prmt`` builds two BF16
# patterns ``hi_byte << 8 | low_byte``; the fp32 variant then splits them (``<< 16``, ``& ~0xFFFF``).
_HI_A = ("and.b32 t, {q}, 0x07070707; shl.b32 h, {q}, 4; and.b32 h, h, 0x80808080; or.b32 h, h, t; ")
_HI_B = ("shr.b32 t, {q}, 4; and.b32 t, t, 0x07070707; and.b32 h, {q}, 0x80808080; or.b32 h, h, t; ")
_PAIRS = "prmt.b32 {p0}, {lo}, h, 0x5140; prmt.b32 {p1}, {lo}, h, 0x7362; "
_TO_F32 = "shl.b32 $0, p0, 16; and.b32 $1, p0, 0xFFFF0000; shl.b32 $2, p1, 16; and.b32 $3, p1, 0xFFFF0000; "


def _asm(hi: str, bf16: bool) -> str:
    if bf16:
        body = hi.format(q="$2") + _PAIRS.format(p0="$0", p1="$1", lo="$3")
    else:
        body = hi.format(q="$4") + _PAIRS.format(p0="p0", p1="p1", lo="$5") + _TO_F32
    return "{ .reg .b32 t, h, p0, p1; " + body + "}"


ASM_F32_A = tl.constexpr(_asm(_HI_A, False))
ASM_F32_B = tl.constexpr(_asm(_HI_B, False))
ASM_BF16_A = tl.constexpr(_asm(_HI_A, True))
ASM_BF16_B = tl.constexpr(_asm(_HI_B, True))


@triton.jit
def _decode(q, lo, HALF: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr):
    """Window-relative weights (``w * 2**-e0``) of half ``HALF`` from uint8 tiles of ``nib``/``low``.

    Element ``j`` of ``q`` holds the nibbles of weights ``j`` (half 0) and ``kh + j`` (half 1);
    ``lo`` holds the low bytes of the half's weights. Returns fp32, or bf16 when ``OUT_BF16``.
    """
    if ASM:
        if OUT_BF16:
            if HALF == 0:
                w = tl.inline_asm_elementwise(ASM_BF16_A, "=r,=r,r,r", [q, lo], dtype=tl.bfloat16,
                                              is_pure=True, pack=4)
            else:
                w = tl.inline_asm_elementwise(ASM_BF16_B, "=r,=r,r,r", [q, lo], dtype=tl.bfloat16,
                                              is_pure=True, pack=4)
        else:
            if HALF == 0:
                w = tl.inline_asm_elementwise(ASM_F32_A, "=r,=r,=r,=r,r,r", [q, lo], dtype=tl.float32,
                                              is_pure=True, pack=4)
            else:
                w = tl.inline_asm_elementwise(ASM_F32_B, "=r,=r,=r,=r,r,r", [q, lo], dtype=tl.float32,
                                              is_pure=True, pack=4)
    else:  # the same bits with plain integer ops (the interpreter's path)
        q = q.to(tl.int32)
        if HALF == 0:
            hi = (q & 7) | ((q & 8) << 4)
        else:
            hi = ((q >> 4) & 7) | (q & 0x80)
        w = ((hi << 24) | (lo.to(tl.int32) << 16)).to(tl.float32, bitcast=True)
        if OUT_BF16:
            w = w.to(tl.bfloat16)  # exact: the low 16 bits are zero
    return w


@triton.jit
def _decode_words(q, lo, HALF: tl.constexpr, ASM: tl.constexpr):
    """The four weights of each int32 word: ``(w0, w1, w2, w3)``, fp32, byte ``b`` -> ``wb``.

    ``q``: words of ``nib`` (four nibble pairs), ``lo``: the matching ``low`` words of half ``HALF``.
    """
    if ASM:
        if HALF == 0:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(ASM_F32_A, "=r,=r,=r,=r,r,r", [q, lo],
                                                       dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(ASM_F32_B, "=r,=r,=r,=r,r,r", [q, lo],
                                                       dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        if HALF == 0:
            hi = (q & 0x07070707) | ((q << 4) & -2139062144)  # 0x80808080
        else:
            hi = ((q >> 4) & 0x07070707) | (q & -2139062144)
        w0 = ((hi << 24) | ((lo & 0xFF) << 16)).to(tl.float32, bitcast=True)
        w1 = (((hi >> 8) << 24) | (((lo >> 8) & 0xFF) << 16)).to(tl.float32, bitcast=True)
        w2 = (((hi >> 16) << 24) | (((lo >> 16) & 0xFF) << 16)).to(tl.float32, bitcast=True)
        w3 = (((hi >> 24) << 24) | (((lo >> 24) & 0xFF) << 16)).to(tl.float32, bitcast=True)
    return w0, w1, w2, w3


@triton.jit
def _dot_step(acc, q, la, lb, X, rm, M, j, kh, K, stride_xm,
              MASK_K: tl.constexpr, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """One ``tl.dot`` step, ``acc[BM, BN] += x @ W.T``: ``nib`` bytes ``j`` (``[BJ]``) hold
    weights ``j`` and ``kh + j``. Rows of ``x`` past ``M`` are zero-filled (no memory traffic)."""
    for h in tl.static_range(2):
        if h == 0:
            w = _decode(q, la, 0, DOT_BF16, ASM)
        else:
            w = _decode(q, lb, 1, DOT_BF16, ASM)
        k = j + h * kh
        xm = (rm < M)[:, None]
        if MASK_K:
            xm = xm & (k < K)[None, :]
        xp = X + rm[:, None] * stride_xm + k[None, :]  # [BM, BJ]
        xv = tl.load(xp, mask=xm, other=0.0).to(tl.float32) * 18446744073709551616.0  # 2**64, exact
        if DOT_BF16:
            acc = tl.dot(xv.to(tl.bfloat16), tl.trans(w), acc)
        else:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _x4(X, XQ, m, M, c0, K, stride_xm, BW: tl.constexpr, XWORDS: tl.constexpr, FP16: tl.constexpr,
        MASK_K: tl.constexpr):
    """Row ``m`` of ``x`` at columns ``c0 + 4w + b`` (``w < BW``), in fp32 times ``2**64`` (exact), as four
    ``[BW]`` tensors ``x_b``; zeros when ``m >= M`` or past ``K``.

    ``XWORDS``: ``x`` is 16-bit and read through ``XQ``, its int64 view, one word of four columns per
    ``w``, and each ``x_b`` is unpacked with a shift or a mask (``K % 8 == 0``). Otherwise ``4*BW``
    contiguous columns are loaded and split by column mod 4 (10% more instructions in the loop).
    Either way the loads match the weight words' layout when a thread holds >= 2 of the ``BW`` words;
    with fewer, Triton converts ``x`` through shared memory every step."""
    if XWORDS:
        # pairs of words (16 bytes) per thread, as the weight words are loaded (``VW``): same layout
        wv = tl.max_contiguous(tl.multiple_of(c0 // 4 + tl.arange(0, BW), 2), 2)
        mm = (tl.full([BW], m, tl.int32) < M) & (wv < K // 4)
        v = tl.load(XQ + tl.multiple_of(m * (stride_xm // 4), 2) + wv, mask=mm, other=0)  # K % 8 == 0
        lo = v.to(tl.int32)  # columns 4w, 4w+1
        hi = (v >> 32).to(tl.int32)  # columns 4w+2, 4w+3
        if FP16:
            x0 = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x2 = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x3 = (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:  # bf16: its bits are the high half of the fp32 pattern
            x0 = (lo << 16).to(tl.float32, bitcast=True)
            x1 = (lo & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
            x2 = (hi << 16).to(tl.float32, bitcast=True)
            x3 = (hi & -65536).to(tl.float32, bitcast=True)
    else:
        k = c0 + tl.arange(0, 4 * BW)
        mm = tl.full(k.shape, m, tl.int32) < M
        if MASK_K:
            mm = mm & (k < K)
        v = tl.load(X + m * stride_xm + k, mask=mm, other=0.0).to(tl.float32)
        e, o = tl.split(tl.reshape(v, (BW, 2, 2)))  # e: columns 4w + {0, 2}, o: 4w + {1, 3}
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
    s = 18446744073709551616.0  # 2**64
    return x0 * s, x1 * s, x2 * s, x3 * s


@triton.jit
def _fma_row(acc, w0, w1, w2, w3, X, XQ, m, M, c0, K, stride_xm, BW: tl.constexpr, XWORDS: tl.constexpr,
             FP16: tl.constexpr, MASK_K: tl.constexpr):
    x0, x1, x2, x3 = _x4(X, XQ, m, M, c0, K, stride_xm, BW, XWORDS, FP16, MASK_K)
    acc += w0 * x0[None, :]
    acc += w1 * x1[None, :]
    acc += w2 * x2[None, :]
    acc += w3 * x3[None, :]
    return acc


@triton.jit
def _fma_step(a0, a1, a2, a3, a4, a5, a6, a7, q, la, lb, X, XQ, m0, M, c0, kh, K, stride_xm,
              BM: tl.constexpr, BW: tl.constexpr, XWORDS: tl.constexpr, FP16: tl.constexpr,
              MASK_K: tl.constexpr, ASM: tl.constexpr):
    """One CUDA-core step on ``[BN, BW]`` words (``4*BW`` weights of each half, from column ``c0`` of
    half 0) for up to eight rows of ``x``: ``a_r[BN, BW] += sum_b w_b * x[m0 + r, c0 + 4w + b]``."""
    for h in tl.static_range(2):
        if h == 0:
            w0, w1, w2, w3 = _decode_words(q, la, 0, ASM)
        else:
            w0, w1, w2, w3 = _decode_words(q, lb, 1, ASM)
        c = c0 + h * kh
        a0 = _fma_row(a0, w0, w1, w2, w3, X, XQ, m0, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
        if BM > 1:
            a1 = _fma_row(a1, w0, w1, w2, w3, X, XQ, m0 + 1, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
        if BM > 2:
            a2 = _fma_row(a2, w0, w1, w2, w3, X, XQ, m0 + 2, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
            a3 = _fma_row(a3, w0, w1, w2, w3, X, XQ, m0 + 3, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
        if BM > 4:
            a4 = _fma_row(a4, w0, w1, w2, w3, X, XQ, m0 + 4, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
            a5 = _fma_row(a5, w0, w1, w2, w3, X, XQ, m0 + 5, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
            a6 = _fma_row(a6, w0, w1, w2, w3, X, XQ, m0 + 6, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
            a7 = _fma_row(a7, w0, w1, w2, w3, X, XQ, m0 + 7, M, c, K, stride_xm, BW, XWORDS, FP16, MASK_K)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _finish_inputs(pid_n, rn, N, E0, ESC_PTR, BN: tl.constexpr, GROUP: tl.constexpr):
    """What `_finish` reads first: the rows' scales ``2**(e0-127)`` and the tile's escape range. Loaded
    at the program's start, before its main loop, so they arrive while the weights stream: read in
    `_finish` they were the first of three dependent round trips to DRAM (range, then escapes, then x)
    after the last weight byte (session 40; ``e0`` and ``esc_ptr`` lines are cold whenever the weights
    are)."""
    e0 = tl.load(E0 + rn, mask=rn < N, other=127).to(tl.int32)
    row_scale = (e0 << 23).to(tl.float32, bitcast=True)  # 2**(e0-127), a normal fp32 (e0 >= 1)
    n0 = pid_n * BN
    p0 = tl.load(ESC_PTR + n0 // GROUP)
    p1 = tl.load(ESC_PTR + (tl.minimum(n0 + BN, N) - 1) // GROUP + 1)
    return row_scale, p0, p1


@triton.jit
def _finish(acc, row_scale, p0, p1, rm, rn, M, N, K, X, stride_xm, Y, stride_ym, ESC_IDX, ESC_VAL,
            EC: tl.constexpr):
    """Scale rows back (``* 2**(e0-64)``), add escapes in index order, cast, store ``[BM, BN]``
    (``row_scale``, ``p0``, ``p1``: `_finish_inputs`)."""
    nmask = rn < N
    mmask = rm < M
    y = (acc * 9223372036854775808.0) * row_scale[None, :]  # * 2**63 * 2**(e0-127) = 2**(e0-64)
    for p in range(p0, p1, EC):
        pe = p + tl.arange(0, EC)
        em = pe < p1
        idx = tl.load(ESC_IDX + pe, mask=em, other=0)
        n_e = idx // K
        k_e = (idx - n_e * K).to(tl.int32)
        v = ((tl.load(ESC_VAL + pe, mask=em, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        xe = tl.load(X + rm[:, None] * stride_xm + k_e[None, :], mask=mmask[:, None] & em[None, :], other=0.0)
        c = xe.to(tl.float32) * v[None, :]  # [BM, EC]
        hit = (n_e[None, :] == rn[:, None]) & em[None, :]  # [BN, EC]
        y += tl.sum(tl.where(hit[None, :, :], c[:, None, :], 0.0), axis=2)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _w12_dot_kernel(X, LOW, NIB, E0, ESC_PTR, ESC_IDX, ESC_VAL, Y,
                    M, N, K, KH, cols_per_split, stride_xm, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr,
                    DOT_BF16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                    EC: tl.constexpr, GROUP: tl.constexpr):
    """``tl.dot`` path; the compiler pipelines the plane loads (``cp.async``, ``num_stages``). Columns
    ``[pid_s * cols_per_split, ...)`` of the planes, ``pid_s`` always 0 (see the module's docstring)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rn_c = tl.minimum(rn, N - 1)  # clamped rows: weight loads stay in bounds without masks
    rj = tl.arange(0, BJ)
    nib_p = NIB + tl.multiple_of(rn_c * KH, 16)[:, None]
    low_p = LOW + tl.multiple_of(rn_c * (2 * KH), 16)[:, None]
    j_lo = pid_s * cols_per_split
    j_hi = tl.minimum(j_lo + cols_per_split, KH)
    j_full = j_lo + ((j_hi - j_lo) // BJ) * BJ
    row_scale, p0, p1 = _finish_inputs(pid_n, rn, N, E0, ESC_PTR, BN, GROUP)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j0 in range(j_lo, j_full, BJ):
        j = tl.max_contiguous(tl.multiple_of(j0 + rj, BJ), BJ)
        jj = j[None, :]
        q = tl.load(nib_p + jj)
        la = tl.load(low_p + jj)
        lb = tl.load(low_p + (KH + jj))
        acc = _dot_step(acc, q, la, lb, X, rm, M, j, KH, K, stride_xm, not EVEN_K, DOT_BF16, ASM)
    if j_full < j_hi:  # tail: fewer than BJ columns left (masked; padding decodes to 0)
        j = j_full + rj
        jj = j[None, :]
        jm = jj < j_hi
        q = tl.load(nib_p + jj, mask=jm, other=0)
        la = tl.load(low_p + jj, mask=jm, other=0)
        lb = tl.load(low_p + (KH + jj), mask=jm, other=0)
        acc = _dot_step(acc, q, la, lb, X, rm, M, j, KH, K, stride_xm, True, DOT_BF16, ASM)
    _finish(acc, row_scale, p0, p1, rm, rn, M, N, K, X, stride_xm, Y, stride_ym, ESC_IDX, ESC_VAL, EC)


@triton.jit
def _put_row(tile, acc, r: tl.constexpr, BM: tl.constexpr):
    """Row ``r`` of an FMA program's ``[BM, BN]`` tile: its ``[BN, BW]`` accumulator summed over the words."""
    return tl.where((tl.arange(0, BM) == r)[:, None], tl.sum(acc, axis=1)[None, :], tile)


@triton.jit
def _w12_fma_kernel(X, XQ, LOW, NIB, E0, ESC_PTR, ESC_IDX, ESC_VAL, Y,
                    M, N, K, KH, cols_per_split, stride_xm, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr,
                    XWORDS: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                    EC: tl.constexpr, GROUP: tl.constexpr):
    """CUDA-core path for up to eight rows of ``x`` per program. The planes are read as int32
    words (``LOW``/``NIB`` are int32 views; ``KH`` and ``cols_per_split`` still count bytes),
    four weights of a half per word; fp32 ``[BN, BJ/4]`` accumulators, one per row of ``x``,
    reduced once at the end. The loads of step ``i + 1`` are issued before the math of step ``i``
    (software double buffering: twice the bytes in flight)."""
    tl.static_assert(BM == 1 or BM == 2 or BM == 4 or BM == 8)
    BW: tl.constexpr = BJ // 4
    # Weight words are loaded two at a time (8 bytes): a thread's two words then cover 8 contiguous
    # columns, exactly what one 16-byte load of a 16-bit x holds, so x needs no layout conversion.
    VW: tl.constexpr = 2
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)  # always 0: the K range stays runtime values (the module's docstring)
    m0 = tl.program_id(2) * BM
    rn = pid_n * BN + tl.arange(0, BN)
    rn_c = tl.minimum(rn, N - 1)
    rw = tl.arange(0, BW)
    KW = KH // 4
    nib_p = NIB + tl.multiple_of(rn_c * KW, VW)[:, None]
    low_p = LOW + tl.multiple_of(rn_c * (2 * KW), VW)[:, None]
    w_lo = (pid_s * cols_per_split) // 4
    w_hi = tl.minimum(w_lo + cols_per_split // 4, KW)
    w_full = w_lo + ((w_hi - w_lo) // BW) * BW
    row_scale, p0, p1 = _finish_inputs(pid_n, rn, N, E0, ESC_PTR, BN, GROUP)
    a0 = tl.zeros((BN, BW), dtype=tl.float32)
    a1 = tl.zeros((BN, BW), dtype=tl.float32)
    a2 = tl.zeros((BN, BW), dtype=tl.float32)
    a3 = tl.zeros((BN, BW), dtype=tl.float32)
    a4 = tl.zeros((BN, BW), dtype=tl.float32)
    a5 = tl.zeros((BN, BW), dtype=tl.float32)
    a6 = tl.zeros((BN, BW), dtype=tl.float32)
    a7 = tl.zeros((BN, BW), dtype=tl.float32)
    ww = tl.max_contiguous(tl.multiple_of(w_lo + rw, VW), VW)[None, :]
    live = tl.full([1, BW], w_lo, tl.int32) < w_full  # a splat: uniform along w, loads stay vectorized
    q = tl.load(nib_p + ww, mask=live, other=0)
    la = tl.load(low_p + ww, mask=live, other=0)
    lb = tl.load(low_p + (KW + ww), mask=live, other=0)
    for w0 in range(w_lo, w_full, BW):
        wn = tl.max_contiguous(tl.multiple_of(w0 + BW + rw, VW), VW)[None, :]
        more = tl.full([1, BW], w0 + BW, tl.int32) < w_full
        qn = tl.load(nib_p + wn, mask=more, other=0)
        lan = tl.load(low_p + wn, mask=more, other=0)
        lbn = tl.load(low_p + (KW + wn), mask=more, other=0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _fma_step(a0, a1, a2, a3, a4, a5, a6, a7, q, la, lb, X, XQ, m0, M,
                                                   4 * w0, KH, K, stride_xm, BM, BW, XWORDS, FP16,
                                                   not EVEN_K, ASM)
        q, la, lb = qn, lan, lbn
    if w_full < w_hi:  # tail: fewer than BW words left (masked; padding decodes to 0)
        w = w_full + rw
        wm = w[None, :] < w_hi
        q = tl.load(nib_p + w[None, :], mask=wm, other=0)
        la = tl.load(low_p + w[None, :], mask=wm, other=0)
        lb = tl.load(low_p + (KW + w[None, :]), mask=wm, other=0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _fma_step(a0, a1, a2, a3, a4, a5, a6, a7, q, la, lb, X, XQ, m0, M,
                                                   4 * w_full, KH, K, stride_xm, BM, BW, XWORDS, FP16,
                                                   True, ASM)
    # one tile of the BM rows, finished in one pass over the escapes (each row had finished on its own: up to
    # eight passes, each a chain of dependent loads, one after another; session 40)
    tile = _put_row(tl.zeros((BM, BN), dtype=tl.float32), a0, 0, BM)
    if BM > 1:
        tile = _put_row(tile, a1, 1, BM)
    if BM > 2:
        tile = _put_row(tile, a2, 2, BM)
        tile = _put_row(tile, a3, 3, BM)
    if BM > 4:
        tile = _put_row(tile, a4, 4, BM)
        tile = _put_row(tile, a5, 5, BM)
        tile = _put_row(tile, a6, 6, BM)
        tile = _put_row(tile, a7, 7, BM)
    _finish(tile, row_scale, p0, p1, m0 + tl.arange(0, BM), rn, M, N, K, X, stride_xm, Y, stride_ym, ESC_IDX, ESC_VAL,
            EC)


# --------------------------------------------------------------------------------------------
# Launch configuration and wrapper
# --------------------------------------------------------------------------------------------


# Where the code of a launch kind that left the package lives (a patch that re-adds it, beside its figures)
REMOVED_SPLIT_K = "docs/results/w12-kernel/removed-2026-12-07-triton-split-k.patch"


@dataclass(frozen=True)
class Config:
    """One launch configuration. ``bj`` counts ``nib`` bytes per step (2*bj weights per row)."""

    bm: int
    bn: int
    bj: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2
    asm: bool = True  # inline-PTX decode (GPU); the interpreter always uses plain integer ops

    def key(self) -> str:
        # "_s1": one K split, as in the keys of the records written while split-K was a launch option
        return (f"{'dot' if self.use_dot else 'fma'}_bm{self.bm}_bn{self.bn}_bj{self.bj}_s1"
                f"_w{self.num_warps}_st{self.num_stages}{'' if self.asm else '_noasm'}")

    @classmethod
    def from_fields(cls, fields: dict) -> Config:
        """A launch from its fields (``asdict``). Tuned files and bench records written before split-K left the
        package (2026-12-07) carry ``split``: 1 is the launch that remains; more names the patch that re-adds it."""
        fields = dict(fields)
        if (split := fields.pop("split", 1)) != 1:
            raise ValueError(f"a Triton launch with split = {split}: split-K left the package (its code: "
                             f"{REMOVED_SPLIT_K})")
        return cls(**fields)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _fma(bm: int, bn: int, bj: int, warps: int) -> Config:
    return Config(bm=bm, bn=bn, bj=bj, use_dot=False, num_warps=warps, num_stages=1)


def _dot(bm: int, bn: int, bj: int, stages: int) -> Config:
    return Config(bm=bm, bn=bn, bj=bj, use_dot=True, num_warps=4, num_stages=stages)


_DOT16 = _dot(16, 32, 256, 3)
# Best per (N, K) and batch class (1, 2, 4 = M 3..4, 8 = M 5..8, 16 = M 9..32 with BM = 16 or 32,
# 64 = M > 32) of three sweeps on one H200 (bench/w12_bench.py --sweep; README.md): one-warp CUDA-core
# tiles for the smallest classes, tl.dot tiles above, 2-stage ones at M = 4-16 on the two widest shapes
# (which sweep gave which, and its timings: docs/FIGURES.md, "Lab notes moved from code").
TUNED_H200: dict[tuple[int, int], dict[int, Config]] = {
    (6144, 4096): {1: _fma(1, 4, 512, 1), 2: _fma(2, 4, 256, 1), 4: _fma(4, 4, 256, 1), 8: _DOT16, 16: _DOT16,
                   64: _dot(64, 16, 64, 4)},
    (4096, 4096): {1: _fma(1, 2, 256, 1), 2: _fma(2, 4, 512, 2), 4: _fma(4, 4, 256, 1), 8: _dot(16, 32, 256, 4),
                   16: _dot(16, 32, 256, 4), 64: _dot(64, 16, 128, 3)},
    (28672, 4096): {1: _fma(1, 4, 512, 1), 2: _fma(2, 4, 256, 1), 4: _dot(16, 32, 128, 2), 8: _dot(16, 32, 128, 2),
                    16: _dot(16, 32, 128, 2),
                    64: _dot(64, 32, 64, 3)},
    (4096, 14336): {1: _fma(1, 4, 1024, 2), 2: _fma(2, 4, 512, 2), 4: _dot(16, 32, 256, 4), 8: _dot(16, 32, 256, 4),
                    16: _dot(16, 32, 256, 4), 64: _dot(64, 16, 128, 3)},
    (128256, 4096): {1: _fma(1, 4, 512, 1), 2: _fma(2, 4, 256, 1), 4: _dot(16, 32, 128, 2), 8: _dot(16, 32, 128, 2),
                     16: _dot(16, 32, 256, 2), 64: _dot(64, 32, 64, 3)},
}


# Triton launches a sweep on a card found faster than `pick_config`'s own choice there, by card (torch's device
# name), (N, K) and M class (`cuda_mma.m_class`): none built in (the H200 table above is every card's default);
# a tuned file adds them (`TUNED_ENV`).
TUNED_TRITON: dict[str, dict[tuple[int, int], dict[int, Config]]] = {}

# A JSON file of a card's winners, both kinds (bench/w12_bench.py --write-tuned), read when this module is imported:
# tensor-core launches go to `cuda_mma.TUNED`, Triton ones to `TUNED_TRITON`.
TUNED_ENV = "SPECPILOT_W12_TUNED"
Tuned = dict[str, dict[tuple[int, int], dict[int, "MmaConfig | Config"]]]


def tuned_to_json(table: Tuned) -> dict:
    """``table`` as JSON: ``{card: {"NxK": {"M class": MmaConfig or Config fields}}}``."""
    return {card: {f"{n}x{k}": {str(mc): asdict(cfg) for mc, cfg in by_m.items()} for (n, k), by_m in shapes.items()}
            for card, shapes in table.items()}


def launch_from_fields(fields: dict) -> MmaConfig | Config:
    """A launch from its dataclass fields (a tuned file's entry, a bench record's ``launch``): Triton's has ``bj``.
    Raises ValueError for a launch of a kind that left the package."""
    if "bj" in fields:
        return Config.from_fields(fields)
    return MmaConfig.from_fields(fields)


def tuned_from_json(doc: dict) -> Tuned:
    """The inverse of `tuned_to_json`; raises ValueError naming what is malformed."""
    out: Tuned = {}
    try:
        for card, shapes in doc.items():
            for shape, by_m in shapes.items():
                n, k = (int(v) for v in shape.split("x"))
                for mc, fields in by_m.items():
                    out.setdefault(card, {}).setdefault((n, k), {})[int(mc)] = launch_from_fields(fields)
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError("a W12 tuned table must be {card: {'NxK': {'M class': MmaConfig or Config fields}}}: "
                         f"{e}") from e
    return out


def merge_tuned(extra: Tuned) -> None:
    """Add ``extra``'s winners to the dispatch (an entry replaces the built-in one for its case, and a tensor-core
    entry and a Triton one for the same case replace each other)."""
    for card, shapes in extra.items():
        for shape, by_m in shapes.items():
            for mc, launch in by_m.items():
                mine, other = (TUNED, TUNED_TRITON) if isinstance(launch, MmaConfig) else (TUNED_TRITON, TUNED)
                mine.setdefault(card, {}).setdefault(shape, {})[mc] = launch
                other.get(card, {}).get(shape, {}).pop(mc, None)


def _load_tuned_env() -> None:
    path = os.environ.get(TUNED_ENV)
    if not path:
        return
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{TUNED_ENV}={path}: cannot read a W12 tuned table ({e}); unset it or write it with "
                           "bench/w12_bench.py --write-tuned") from e
    merge_tuned(tuned_from_json(doc))


def _batch_class(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 32 else 64


def pick_config(m: int, n: int, k: int, card: str = "") -> Config:
    """The launch configuration for ``(M, N, K)`` on ``card``: a pure function, so results are reproducible
    (an autotuner that times candidates at run time could pick differently in another process
    and change the reduction order). The card's own swept winners come first (``TUNED_TRITON``), then
    the H200's (``TUNED_H200``); others from the rule those results suggest: the CUDA-core path with one
    warp and 4 rows a program at M <= 2 (and at M <= 4 below 8192 rows), ``tl.dot`` with BN = 32 above.
    """
    if INTERPRET:  # small tiles: the interpreter's cost is per element
        if m <= 8:
            return _fma(_next_pow2(m), 16, 16, 1)
        return Config(bm=16 if m <= 16 else 32, bn=16, bj=16, use_dot=True, num_warps=1, num_stages=1)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    own = TUNED_TRITON.get(card, {}).get((n, k), {}).get(m_class(m)) if m <= 32 else None
    cfg = own if own is not None else TUNED_H200.get((n, k), {}).get(_batch_class(m))
    if cfg is not None:
        return cfg if not cfg.use_dot else replace(cfg, bm=bm)
    if m <= 2 or (m <= 4 and n <= 8192):
        return _fma(_next_pow2(m), 4, 512 if k >= 2048 else 256, 1)
    if m > 32:
        return _dot(64, 16, 64, 3)
    return replace(_DOT16, bm=bm)


def _esc_chunk(bm: int, bn: int) -> int:
    return max(1, min(16, 4096 // (bm * bn)))


# Where bf16 calls with 1-32 rows go: "auto" (default) sends the cases the sweep found faster on tensor
# cores (cuda_mma.TUNED, per card) there and the rest to Triton; "on" sends every such call; "off" none.
# SPECPILOT_W12_TENSOR_CORES = auto | 1 | 0 (docs/DESIGN.md §4 quotes the default; a test checks it).
TENSOR_CORE_MODES = ("auto", "on", "off")
DEFAULT_TENSOR_CORE_MODE = "auto"
_tensor_cores = {"1": "on", "0": "off"}.get(os.environ.get("SPECPILOT_W12_TENSOR_CORES", DEFAULT_TENSOR_CORE_MODE),
                                            DEFAULT_TENSOR_CORE_MODE)


def use_tensor_core_kernel(mode: bool | str | None = None) -> str:
    """Set where bf16 calls with 1-32 rows go (True/"on", False/"off", "auto": the swept table; None only
    asks) and return the setting. The CUDA C++ kernel is used only where it builds (``cuda_mma.available``)."""
    global _tensor_cores
    if mode is not None:
        mode = {True: "on", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
        if mode not in TENSOR_CORE_MODES:
            raise ValueError(f"tensor-core mode must be one of {TENSOR_CORE_MODES}, got {mode!r}")
        _tensor_cores = mode
    return _tensor_cores


def tensor_core_config(m: int, n: int, k: int, device: torch.device) -> MmaConfig | None:
    """The tensor-core launch the current mode picks for a bf16 call of ``m`` rows on an ``[n, k]`` weight
    on ``device`` (the kernel's contract assumed), or None for the Triton kernels."""
    if _tensor_cores == "off" or INTERPRET or not mma_available():
        return None
    card = card_name(device)
    if _tensor_cores == "on":
        return pick_mma_config(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count, card)
    return tuned_mma_config(m, n, k, card)


def _tensor_core_config(x: torch.Tensor, p: W12Weight) -> MmaConfig | None:
    """The tensor-core launch for this call under the current mode, or None for the Triton kernels."""
    if x.dim() != 2 or x.shape[1] != p.k or x.device != p.device or not supports(x, p):
        return None
    return tensor_core_config(x.shape[0], p.n, p.k, x.device)


def w12_matmul(x: torch.Tensor, p: W12Weight, config: Config | MmaConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x [M, K]`` on the packed weight ``p`` (same device). Returns ``[M, N]``
    in ``x``'s dtype. Without a ``config``, bf16 calls with 1-32 rows go to the tensor-core kernel
    as `use_tensor_core_kernel` says (by default where the sweep found it faster), everything else to
    the Triton kernels."""
    if isinstance(config, MmaConfig):
        return w12_mma_matmul(x, p, config)
    if config is None and (mma := _tensor_core_config(x, p)) is not None:
        return w12_mma_matmul(x, p, mma)
    if x.dim() != 2 or x.shape[1] != p.k:
        raise ValueError(f"x must be [M, {p.k}], got {tuple(x.shape)}")
    if x.device != p.device:
        raise ValueError(f"x is on {x.device}, the weight on {p.device}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    n = p.n
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or pick_config(m, n, k, card_name(x.device) if x.is_cuda else "")
    kh = p.kh
    cols_per_split = triton.cdiv(kh, cfg.bj) * cfg.bj  # all of K: one program on the grid's axis 1
    dot_bf16 = cfg.use_dot and x.dtype == torch.bfloat16 and not INTERPRET
    asm = cfg.asm and not INTERPRET
    grid = (triton.cdiv(n, cfg.bn), 1, triton.cdiv(m, cfg.bm))
    planes = (p.low, p.nib, p.e0, p.esc_ptr, p.esc_idx, p.esc_val, y, m, n, k, kh, cols_per_split, x.stride(0),
              y.stride(0))
    common = dict(BM=cfg.bm, BN=cfg.bn, BJ=cfg.bj, ASM=asm, EVEN_K=(k == 2 * kh),
                  EC=_esc_chunk(cfg.bm, cfg.bn), GROUP=ESC_GROUP, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, enable_fp_fusion=True)
    if cfg.use_dot:
        _w12_dot_kernel[grid](x, *planes, DOT_BF16=dot_bf16, **common)
    else:  # the FMA path reads the planes as int32 words, and a 16-bit x as int64 words of 4 columns
        # rows of x 16-byte aligned (pairs of int64 words): K % 8 == 0 and an aligned start
        xwords = x.dtype != torch.float32 and k % 8 == 0 and x.storage_offset() % 8 == 0
        planes = (p.low.view(torch.int32), p.nib.view(torch.int32), *planes[2:])
        _w12_fma_kernel[grid](x, x.view(torch.int64) if xwords else x, *planes, XWORDS=xwords,
                              FP16=x.dtype == torch.float16, **common)
    return y


_load_tuned_env()
