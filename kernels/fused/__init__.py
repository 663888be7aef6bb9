"""Fused decode-step kernels: residual add + RMSNorm, RoPE + KV-cache write (+ attention), SiLU·mul,
and small-M GEMVs with the add + norm before and SiLU·mul after them (`norm_linear`).

Each op runs its Triton kernel (`kernel`) on CUDA tensors, or anywhere under
``TRITON_INTERPRET=1``, and its PyTorch reference (`reference`, the normative semantics) otherwise.
The engine uses them when ``fused_kernels`` is on (`specpilot.engine.fused`; `norm_linear` with
``fused_gemv``). README.md: why, what each kernel does, where it can differ from the reference,
tests and figures.
"""

from __future__ import annotations

import os

from torch import Tensor

from . import reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_triton(t: Tensor) -> bool:
    return t.is_cuda or INTERPRET


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(h + delta) * weight, h + delta); see `reference.add_rms_norm`."""
    if uses_triton(h):
        from .kernel import add_rms_norm as fused
        return fused(h, delta, weight, eps)
    return reference.add_rms_norm(h, delta, weight, eps)


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
             v_cache: Tensor, slots: Tensor) -> Tensor:
    """RoPE'd q [B, H, T, hd]; RoPE'd k and v written to the caches at ``slots``; see `reference.rope_qkv`."""
    if uses_triton(qkv):
        from .kernel import rope_qkv as fused
        return fused(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots)
    return reference.rope_qkv(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots)


# One program per KV head walks the whole context in `rope_attention`'s kernel: good for a short
# context and few heads (SmolLM2's decode steps); beyond this many slots SDPA does the attention.
ATTENTION_KERNEL_MAX_SLOTS = 1024
# ... and it holds a KV head's G*T query rows in registers: a decode step's few tokens, not a prompt
# (a captured prefill of hundreds of tokens takes the RoPE kernel and SDPA instead).
ATTENTION_KERNEL_MAX_ROWS = 128


def rope_attention(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv: int, k_cache: Tensor,
                   v_cache: Tensor, slots: Tensor, bias: Tensor, length: int) -> Tensor:
    """RoPE + cache write + a decode step's attention, [B, T, H*hd]; see `reference.rope_attention`.
    ``slots`` [T] (every cache row the same) or [B, T] (a batched step: each row its own, its positions
    in cos/sin [B, 1, T, hd])."""
    one_block = cos.ndim == 2 and slots.ndim == 1
    rows = n_heads // n_kv * qkv.shape[1]
    if uses_triton(qkv) and one_block and length <= ATTENTION_KERNEL_MAX_SLOTS and rows <= ATTENTION_KERNEL_MAX_ROWS:
        from .kernel import rope_attention as fused
        return fused(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots, bias, length)
    if uses_triton(qkv):  # the RoPE kernel, then SDPA
        from .kernel import rope_qkv as fused_rope
        return reference.rope_attention(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots, bias, length,
                                        rope=fused_rope)
    return reference.rope_attention(qkv, cos, sin, n_heads, n_kv, k_cache, v_cache, slots, bias, length)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused [..., 2 I] projection; see `reference.silu_mul`."""
    if uses_triton(gate_up):
        from .kernel import silu_mul as fused
        return fused(gate_up)
    return reference.silu_mul(gate_up)


def gemv_applies(x: Tensor) -> bool:
    """Whether `norm_linear` runs its Triton kernel on ``x`` (else the reference: norm, F.linear)."""
    from .kernel import GEMV_MAX_ROWS

    return uses_triton(x) and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS


def norm_linear(h: Tensor, delta: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
                silu: bool = False) -> tuple[Tensor, Tensor]:
    """(y, h + delta): y = [silu_mul of] RMSNorm(h + delta) @ weight.T, one kernel at small M;
    ``norm_weight`` None: a plain ``h @ weight.T``. See `reference.norm_linear`."""
    if gemv_applies(h):
        from .kernel import norm_linear as fused
        return fused(h, delta, norm_weight, eps, weight, silu)
    return reference.norm_linear(h, delta, norm_weight, eps, weight, silu)


__all__ = ["ATTENTION_KERNEL_MAX_SLOTS", "INTERPRET", "add_rms_norm", "gemv_applies", "norm_linear", "reference",
           "rope_attention", "rope_qkv", "silu_mul", "uses_triton"]
