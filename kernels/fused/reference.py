"""PyTorch references of the fused decode-step kernels: the normative semantics.

Each function computes, op for op and rounding for rounding, what the unfused engine
(`specpilot.engine.model`) computes for the same step, so a fused model emits the stock model's values
wherever the Triton kernel reproduces the reference's arithmetic (see README.md for where it
cannot: reduction order of the norm, ``exp``).

- `add_rms_norm(h, delta, weight, eps)`: ``h' = h + delta`` (rounded to h's dtype; ``delta`` may
  be None), then the engine's RMSNorm of ``h'``: normalise in fp32, round to the dtype, scale by
  the weight in the dtype. Returns ``(normed, h')``.
- `rope_qkv(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots)`: split a fused QKV projection
  ``[B, T, (H + 2 KV) * hd]`` into heads, rotate q and k ("rotate half" RoPE, products and sum
  each rounded to the dtype), write k and v into the cache at ``slots`` (``[T]``: the same slots in
  every cache row; ``[B, T]``: each row its own, a batched step) and return q ``[B, H, T, hd]``
  (contiguous).
- `rope_attention(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots, bias, length)`: `rope_qkv`
  and the graph-safe attention of a decode step (`specpilot.engine.model.StaticStep`'s additive bias over the
  first ``length`` cache slots) in one op; returns ``[B, T, H * hd]``. The Triton kernel computes
  the same attention in another order (online softmax), so its values differ in the last bits.
- `silu_mul(gate_up)`: ``silu(gate) * up`` over a fused gate/up projection ``[..., 2 I]``.
- `norm_linear(h, delta, norm_weight, eps, weight, silu=False)`: `add_rms_norm` (skipped when
  ``norm_weight`` is None), the linear layer ``normed @ weight.T`` (accumulated in fp32, rounded to
  the dtype, as ``F.linear``), then `silu_mul` when ``silu`` (``weight`` is then the concatenated
  gate/up weight ``[2 I, K]``). Returns ``(y, h')``. The Triton kernel reduces the norm and the
  dot products in its own order (another reduction order than cuBLAS's), nothing else differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if delta is not None:
        h = h + delta
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype), h


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """"Rotate half" RoPE of x [..., T, hd] by cos/sin broadcastable to it (the engine's apply_rope)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
             v_cache: Tensor, slots: Tensor) -> Tensor:
    """qkv [B, T, (H+2KV)*hd]; cos/sin [T, hd] or [B, 1, T, hd] in qkv's dtype; k_cache/v_cache
    [B, KV, max_len, hd] (one layer's); slots [T] int64 (every cache row the same) or [B, T] (cache row b
    at its own). Returns q [B, H, T, hd]."""
    B, T, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    heads = qkv.view(B, T, n_heads + 2 * n_kv, hd).transpose(1, 2)
    q, k, v = heads.split([n_heads, n_kv, n_kv], dim=1)
    k = rotate(k, cos, sin)
    if slots.ndim == 1:
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
    else:
        index = slots[:, None, :, None].expand_as(k)
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
    return rotate(q, cos, sin).contiguous()


def silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_attention(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
                   v_cache: Tensor, slots: Tensor, bias: Tensor, length: int, rope=None) -> Tensor:
    """`rope_qkv` (or ``rope``, a function with its signature), then attention of every query over cache slots ``0 .. length-1`` under an additive
    ``bias`` [1, 1, G*T, length] (rows ordered (group member, token), as `specpilot.engine.model.StaticStep`);
    returns the attention output [B, T, H*hd] (what o_proj reads). Scale 1/sqrt(hd), as SDPA's."""
    B, T, _ = qkv.shape
    q = (rope or rope_qkv)(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots)
    hd, G = q.shape[-1], n_heads // n_kv
    y = F.scaled_dot_product_attention(q.view(B, n_kv, G * T, hd), k_cache[:, :, :length], v_cache[:, :, :length],
                                       attn_mask=bias)
    return y.view(B, n_kv, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, n_heads * hd)


def norm_linear(h: Tensor, delta: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
                silu: bool = False) -> tuple[Tensor, Tensor]:
    if norm_weight is None:
        if delta is not None:
            raise ValueError("norm_linear: a delta needs a norm (the residual add is the norm's)")
        x = h
    else:
        x, h = add_rms_norm(h, delta, norm_weight, eps)
    y = F.linear(x, weight)
    return (silu_mul(y) if silu else y), h
