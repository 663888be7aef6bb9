"""Triton kernels of the fused decode step (semantics: `specpilot.kernels.fused.reference`).

One program per row for the norm, per (row, head) for RoPE + cache write, per (row, block of
columns) for SiLU·mul. Every intermediate the reference rounds to the model's dtype is rounded
here too (``.to(dtype)``), so the kernels differ from the reference only where README.md says.
Under ``TRITON_INTERPRET=1`` (CPU) only fp32 is exact: the interpreter's bf16 arithmetic is not
(kernels/w12 found the same).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels.counters import arrival_counters


def on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s (a model on cuda:1, say)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, h_out_ptr, y_ptr, D, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < D
    dtype = y_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * D + cols, mask=live, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * D + cols, mask=live, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + row * D + cols, h, mask=live)
    x = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv).to(dtype)
    w = tl.load(w_ptr + cols, mask=live, other=0.0)
    tl.store(y_ptr + row * D + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=live)


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    D = h.shape[-1]
    h = h.contiguous()
    y = torch.empty_like(h)
    h_out = torch.empty_like(h) if delta is not None else h
    block = triton.next_power_of_2(D)
    with on_device(h):
        _add_rms_norm_kernel[(h.numel() // D,)](
            h, delta.contiguous() if delta is not None else h, weight, h_out, y, D, eps,
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
            enable_fp_fusion=True)  # as measured; Triton 3.10 turns the default off
    return y, h_out


@triton.jit
def _rotated(x_ptr, cos_ptr, sin_ptr, d, HALF: tl.constexpr):
    """RoPE ("rotate half") of the head vector at x_ptr by the cos/sin rows at cos_ptr/sin_ptr, at
    the indices ``d`` (any shape broadcast against them), rounded as the reference rounds."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + d).to(tl.float32)
    partner = tl.load(x_ptr + (d + HALF) % (2 * HALF)).to(tl.float32)
    partner = tl.where(d < HALF, -partner, partner)
    c = tl.load(cos_ptr + d).to(tl.float32)
    s = tl.load(sin_ptr + d).to(tl.float32)
    return ((x * c).to(dtype).to(tl.float32) + (partner * s).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rope_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr,
                     T, n_heads, n_kv, cos_sb, cos_st, slots_sb, cache_sb, cache_sh, cache_ss,
                     HALF: tl.constexpr):
    row = tl.program_id(0)  # b * T + t
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    b = row // T
    t = row % T
    hd = 2 * HALF
    d = tl.arange(0, 2 * HALF)
    src = qkv_ptr + row.to(tl.int64) * ((n_heads + 2 * n_kv) * hd) + head * hd
    if head < n_heads + n_kv:
        trig = b.to(tl.int64) * cos_sb + t * cos_st
        out = _rotated(src, cos_ptr + trig, sin_ptr + trig, d, HALF)
    else:
        out = tl.load(src + d)
    if head < n_heads:
        dst = q_ptr + ((b * n_heads + head) * T + t).to(tl.int64) * hd
    else:
        slot = tl.load(slots_ptr + b * slots_sb + t)
        kv_head = (head - n_heads) % n_kv
        offset = b.to(tl.int64) * cache_sb + kv_head * cache_sh + slot * cache_ss
        if head < n_heads + n_kv:
            dst = k_ptr + offset
        else:
            dst = v_ptr + offset
    tl.store(dst + d, out)


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
             v_cache: Tensor, slots: Tensor) -> Tensor:
    B, T, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    if hd % 2 or hd & (hd - 1):
        raise ValueError(f"the fused RoPE kernel needs a power-of-two head_dim, got {hd}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides and be contiguous in head_dim")
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must share strides and be contiguous in head_dim")
    cos_sb, cos_st = (0, cos.stride(0)) if cos.ndim == 2 else (cos.stride(0), cos.stride(-2))
    if slots.shape[-1] != T or (slots.ndim == 2 and slots.shape[0] != B) or slots.ndim > 2:
        raise ValueError(f"slots must be [{T}] or [{B}, {T}], got {tuple(slots.shape)}")
    slots = slots.contiguous()
    slots_sb = T if slots.ndim == 2 else 0  # [B, T]: each cache row its own slots
    q = torch.empty(B, n_heads, T, hd, dtype=qkv.dtype, device=qkv.device)
    with on_device(qkv):
        _rope_qkv_kernel[(B * T, n_heads + 2 * n_kv)](
            qkv.contiguous(), cos, sin, q, k_cache, v_cache, slots, T, n_heads, n_kv, cos_sb, cos_st, slots_sb,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HALF=hd // 2, num_warps=1,
            enable_fp_fusion=False)
    return q


@triton.jit
def _silu_mul(g, u, dtype: tl.constexpr):
    """silu(g) * u as the reference rounds it: the activation to the dtype, then the product."""
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (act.to(tl.float32) * u).to(dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inner
    dtype = y_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * inner + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inner + inner + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * inner + cols, _silu_mul(g, u, dtype), mask=live)


SILU_BLOCK = 1024


def silu_mul(gate_up: Tensor) -> Tensor:
    inner = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    y = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * inner)
    with on_device(gate_up):
        _silu_mul_kernel[(rows, triton.cdiv(inner, SILU_BLOCK))](gate_up, y, inner, BLOCK=SILU_BLOCK, num_warps=4)
    return y


@triton.jit
def _rope_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slots_ptr, bias_ptr, y_ptr,
                           part_ptr, stats_ptr, count_ptr,
                           T, n_heads, n_kv, length, cache_sb, cache_sh, cache_ss, bias_sr, scale, span,
                           G: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLITS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)  # b * n_kv + kv
    split = tl.program_id(1)  # which ``span`` slots of the context this program reads (SPLITS of them)
    b = pid // n_kv
    kv = pid % n_kv
    HD: tl.constexpr = 2 * HALF
    dtype = y_ptr.dtype.element_ty
    width = (n_heads + 2 * n_kv) * HD
    d = tl.arange(0, HD)
    cache = b.to(tl.int64) * cache_sb + kv * cache_sh
    # 1. this head's new keys (rotated) and values into the cache
    for t in range(T):
        row = qkv_ptr + (b * T + t).to(tl.int64) * width
        slot = tl.load(slots_ptr + t).to(tl.int64)
        k = _rotated(row + (n_heads + kv) * HD, cos_ptr + t * HD, sin_ptr + t * HD, d, HALF)
        tl.store(k_ptr + cache + slot * cache_ss + d, k)
        tl.store(v_ptr + cache + slot * cache_ss + d, tl.load(row + (n_heads + n_kv + kv) * HD + d))
    # The block's own slots are read back below by other threads of this program (a split program
    # that reads them wrote the same values itself: programs never wait on one another's writes).
    tl.debug_barrier()
    # 2. the G*T queries of this KV head's group, rows r = g * T + t (query head kv * G + g)
    r = tl.arange(0, ROWS)
    live = r < G * T
    t_r = tl.where(live, r % T, 0)
    head_r = kv * G + tl.where(live, r // T, 0)
    q_rows = qkv_ptr + (b * T + t_r).to(tl.int64)[:, None] * width + (head_r * HD)[:, None]
    q = _rotated(q_rows, cos_ptr + (t_r * HD)[:, None], sin_ptr + (t_r * HD)[:, None], d[None, :], HALF)
    # 3. online softmax over this program's slots (all of 0 .. length-1 when SPLITS == 1)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HD], tl.float32)
    for n0 in range(split * span, tl.minimum(length, (split + 1) * span), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_live = n < length
        kv_off = cache + n.to(tl.int64)[:, None] * cache_ss + d[None, :]
        keys = tl.load(k_ptr + kv_off, mask=n_live[:, None], other=0.0, cache_modifier=".cg")
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        bias = tl.load(bias_ptr + r[:, None] * bias_sr + n[None, :], mask=live[:, None] & n_live[None, :],
                       other=float("-inf"))
        s = s * scale + bias.to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + kv_off, mask=n_live[:, None], other=0.0, cache_modifier=".cg")
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m_i = m_new
    y_rows = y_ptr + (b * T + t_r).to(tl.int64)[:, None] * (n_heads * HD) + (head_r * HD)[:, None]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(y_rows + d[None, :], out.to(dtype), mask=live[:, None])  # 4. the layout o_proj reads
    else:
        # 4'. partial results out; the last program of this KV head to finish merges all of them
        mine = pid * SPLITS + split
        tl.store(part_ptr + (mine * ROWS + r)[:, None] * HD + d[None, :], acc)
        tl.store(stats_ptr + (2 * mine) * ROWS + r, m_i)
        tl.store(stats_ptr + (2 * mine + 1) * ROWS + r, l_i)
        tl.debug_barrier()  # every thread's partials are written before the (release) count
        if tl.atomic_add(count_ptr + pid, 1) == SPLITS - 1:
            tl.debug_barrier()
            m_all = tl.full([ROWS], float("-inf"), tl.float32)
            for s_ in range(SPLITS):
                m_s = tl.load(stats_ptr + (2 * (pid * SPLITS + s_)) * ROWS + r, cache_modifier=".cg")
                m_all = tl.maximum(m_all, m_s)
            m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            l_all = tl.zeros([ROWS], tl.float32)
            out = tl.zeros([ROWS, HD], tl.float32)
            for s_ in range(SPLITS):
                other = pid * SPLITS + s_
                w = tl.exp(tl.load(stats_ptr + (2 * other) * ROWS + r, cache_modifier=".cg") - m_safe)
                l_all += w * tl.load(stats_ptr + (2 * other + 1) * ROWS + r, cache_modifier=".cg")
                out += w[:, None] * tl.load(part_ptr + (other * ROWS + r)[:, None] * HD + d[None, :],
                                            cache_modifier=".cg")
            out = out / tl.where(l_all > 0, l_all, 1.0)[:, None]
            tl.store(y_rows + d[None, :], out.to(dtype), mask=live[:, None])
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (and graph replay)


ATTENTION_BLOCK_N = 64
# Context slots one program reads; None: one program per KV head reads them all (5.3 us a SmolLM2
# layer on the H200). A number splits the context over more programs, whose partial softmaxes the
# last one to finish merges: 64 made the SmolLM2 step slower there, so it is off (docs/FIGURES.md,
# "Lab notes moved from code").
SLOTS_PER_PROGRAM: int | None = None


def rope_attention(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
                   v_cache: Tensor, slots: Tensor, bias: Tensor, length: int) -> Tensor:
    B, T, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    G = n_heads // n_kv
    if hd < 16 or hd & (hd - 1):
        raise ValueError(f"the fused attention kernel needs a power-of-two head_dim >= 16, got {hd}")
    if cos.ndim != 2 or cos.stride() != (hd, 1) or sin.stride() != (hd, 1):
        raise ValueError("the fused attention kernel needs contiguous cos/sin of shape [T, head_dim]")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides and be contiguous in head_dim")
    if bias.shape[-2:] != (G * T, length) or bias.stride(-1) != 1:
        raise ValueError(f"bias must be [.., {G * T}, {length}] and contiguous in its last dim, got {tuple(bias.shape)}")
    y = torch.empty(B, T, n_heads * hd, dtype=qkv.dtype, device=qkv.device)
    rows = max(16, triton.next_power_of_2(G * T))
    span = length if SLOTS_PER_PROGRAM is None else -(-SLOTS_PER_PROGRAM // ATTENTION_BLOCK_N) * ATTENTION_BLOCK_N
    splits = -(-length // span)
    if splits > 1:
        part = torch.empty(B * n_kv * splits * rows * hd, dtype=torch.float32, device=qkv.device)
        stats = torch.empty(B * n_kv * splits * 2 * rows, dtype=torch.float32, device=qkv.device)
        counts = arrival_counters(qkv.device, B * n_kv)
    else:
        part = stats = counts = y  # unused
    with on_device(qkv):
        _rope_attention_kernel[(B * n_kv, splits)](
            qkv.contiguous(), cos, sin, k_cache, v_cache, slots, bias, y, part, stats, counts,
            T, n_heads, n_kv, length, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bias.stride(-2),
            1.0 / hd ** 0.5, span, G=G, ROWS=rows, HALF=hd // 2, BLOCK_N=ATTENTION_BLOCK_N, SPLITS=splits,
            IEEE=qkv.dtype == torch.float32, num_warps=4, enable_fp_fusion=False)
    return y


@triton.jit
def _row_products(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc [BM, BN] + x [BM, BK] . w [BN, BK]^T: tl.dot (fp32 inputs exactly), or multiply-adds."""
    if DOT:
        if IEEE:
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        return acc + tl.dot(x, tl.trans(w))
    return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _norm_linear_kernel(h_ptr, delta_ptr, nw_ptr, w_ptr, up_ptr, h_out_ptr, y_ptr, M, N, K, eps,
                        NORM: tl.constexpr, HAS_DELTA: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT: tl.constexpr, IEEE: tl.constexpr):
    """y[rows, cols] of ``norm(h + delta) @ W.T`` (then SiLU·mul); program (n, m) owns BLOCK_N
    output columns of BLOCK_M rows and walks K in BLOCK_K steps, in one fixed order."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_live = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < N
    x_rows = rows.to(tl.int64)[:, None] * K
    w_rows = cols.to(tl.int64)[:, None] * K
    if NORM:  # pass 1: each row's sum of squares (program column 0 also stores h + delta)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            live = row_live[:, None] & (ks < K)[None, :]
            x = tl.load(h_ptr + x_rows + ks[None, :], mask=live, other=0.0)
            if HAS_DELTA:
                d = tl.load(delta_ptr + x_rows + ks[None, :], mask=live, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
                if pid_n == 0:
                    tl.store(h_out_ptr + x_rows + ks[None, :], x, mask=live)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
        inv = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 2: the (normed) rows against BLOCK_N weight rows
        ks = k0 + tl.arange(0, BLOCK_K)
        k_live = ks < K
        live = row_live[:, None] & k_live[None, :]
        x = tl.load(h_ptr + x_rows + ks[None, :], mask=live, other=0.0)
        if NORM:
            if HAS_DELTA:
                d = tl.load(delta_ptr + x_rows + ks[None, :], mask=live, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
            normed = (x.to(tl.float32) * inv[:, None]).to(dtype)
            nw = tl.load(nw_ptr + ks, mask=k_live, other=0.0)
            x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
        w_live = col_live[:, None] & k_live[None, :]
        acc = _row_products(acc, x, tl.load(w_ptr + w_rows + ks[None, :], mask=w_live, other=0.0), DOT, IEEE)
        if SILU:  # the up rows (up_ptr: the weight's row N on, N rows below the gate rows)
            up = tl.load(up_ptr + w_rows + ks[None, :], mask=w_live, other=0.0)
            acc_up = _row_products(acc_up, x, up, DOT, IEEE)
    y = acc.to(dtype)
    if SILU:  # silu_mul of the rounded gate and up, as the reference rounds them
        y = _silu_mul(y.to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    out = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + out, y, mask=row_live[:, None] & col_live[None, :])


@dataclass(frozen=True)
class GemvConfig:
    """A tile of `_norm_linear_kernel`: rows x output columns x K step, and the launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    @property
    def dot(self) -> bool:  # tl.dot needs 16 rows; fewer rows multiply-add in registers
        return self.block_m >= 16

    @property
    def name(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"


# Tiles from an H200 sweep (bench/gemv_bench.py --sweep, SmolLM2's four layer shapes, README.md; dated
# in docs/FIGURES.md, "Lab notes moved from code"). Past 16 rows cuBLAS (after the norm kernel) was
# faster: 17-row steps take the unfolded path.
GEMV_MAX_ROWS = 16


def pick_gemv_config(M: int, N: int, K: int, silu: bool = False) -> GemvConfig:
    """The tile for an M x K by K x N product (N: output columns; ``silu``: twice N weight rows).

    One or two rows: multiply-adds in registers, one or two weight rows a program and the whole K
    (<= 1024) in one step, so each program issues all its loads at once (the step is latency-bound:
    at M = 1 SmolLM2's four GEMVs took 11.5 us a layer this way against 20.5 for norm + cuBLAS).
    More rows: tl.dot over 16-row tiles."""
    block_k = min(1024, triton.next_power_of_2(K))
    if M == 1:
        return GemvConfig(1, 1 if silu or K > 1024 else 2, block_k, num_warps=1, num_stages=1)
    if M == 2:
        if silu or K > 1024:
            return GemvConfig(2, 2 if silu else 1, block_k, num_warps=2, num_stages=1)
        return GemvConfig(2, 4 if N > 640 else 2, block_k, num_warps=4, num_stages=1)
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    if not silu and N <= 640 and K <= 640:
        return GemvConfig(block_m, 32, 128, num_warps=4, num_stages=3)
    return GemvConfig(block_m, 32 if silu else 16, 256, num_warps=4, num_stages=3)


def norm_linear(h: Tensor, delta: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
                silu: bool = False, config: GemvConfig | None = None) -> tuple[Tensor, Tensor]:
    K = h.shape[-1]
    if weight.shape[1] != K or weight.dtype != h.dtype:
        raise ValueError(f"norm_linear: weight {tuple(weight.shape)} {weight.dtype} does not fit h [.., {K}] {h.dtype}")
    if delta is not None and norm_weight is None:
        raise ValueError("norm_linear: a delta needs a norm (the residual add is the norm's)")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype):
        raise ValueError(f"norm_linear: delta {tuple(delta.shape)} {delta.dtype} must match h {tuple(h.shape)} {h.dtype}")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != h.dtype):
        raise ValueError(f"norm_linear: the norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be "
                         f"[{K}] {h.dtype}")
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    h, weight = h.contiguous(), weight.contiguous()
    M = h.numel() // K
    y = torch.empty(*h.shape[:-1], N, dtype=h.dtype, device=h.device)
    h_out = torch.empty_like(h) if delta is not None else h
    cfg = config or pick_gemv_config(M, N, K, silu)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))
    with on_device(h):
        _norm_linear_kernel[grid](
            h, delta.contiguous() if delta is not None else h, norm_weight.contiguous() if norm_weight is not None else h,
            weight, weight[N:] if silu else weight, h_out, y, M, N, K, eps,
            NORM=norm_weight is not None, HAS_DELTA=delta is not None, SILU=silu, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.dot, IEEE=h.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True)  # FMA contraction, as its tiles were measured (Triton 3.10 defaults to off)
    return y, h_out
