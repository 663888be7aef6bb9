"""The ``fused_kernels`` option: a decoder step with ~9 kernels per layer instead of ~40.

Why: under CUDA graphs a small model's step costs what its kernel count costs (~3-4 us each on an
H200, gaps included): SmolLM2's unfused block issues ~42 kernels, 34 of them elementwise (norm,
RoPE, cache writes, SiLU, residual adds). `fuse_model` rebuilds every block around `specpilot.kernels.fused`:

    input_norm   residual add (the previous block's MLP output) + RMSNorm   1 kernel
    qkv_proj     one GEMM over the concatenated q/k/v weights                1
    rope         RoPE of q and k + k/v written to the cache                  1
    core         attention (SDPA, as stock)                                  1-2
                 (graph-safe steps over <= 1024 slots: RoPE + cache write + attention, 1 kernel)
    o_proj                                                                   1
    post_attn_norm  residual add (attention output) + RMSNorm                1
    gate_up_proj one GEMM over the concatenated gate/up weights              1
    silu_mul                                                                 1
    down_proj                                                                1

The residual add of a block's MLP output is deferred into the next block's input norm (and the
last one into the final norm), so a block passes ``(h, delta)`` on instead of ``h + delta``.

With ``fused_gemv`` (on top of ``fused_kernels``) a block's four linears become `GemvLinear`s: at
small M on CUDA (decode and verification steps, <= ``GEMV_MAX_ROWS`` rows) each runs one Triton
GEMV, and the add + norm before the QKV and gate/up GEMVs and the SiLU·mul after gate/up run inside
them (`specpilot.kernels.fused.norm_linear`): 5 kernels a layer (norm+QKV, RoPE+attention, o, norm+gate/up+SiLU,
down) instead of the 8 above. Prefill and CPU steps take the path above.

Contract: the fused model computes the stock model's function. Off CUDA the ops run their PyTorch
references (same values as stock up to the concatenated GEMMs' reduction order); on CUDA the
Triton kernels round every intermediate as stock does, except the norm's reduction order and
``exp`` (and with ``fused_gemv`` the GEMVs' reduction order; kernels/fused/README.md), so outputs
may differ at near-ties and a system with this option must pass token forcing. Eager and
graph-safe (`StaticStep`) forwards are both supported, chains and trees alike, and so are batched ones
(`specpilot.engine.batch`): a static step over R cache rows runs the RoPE kernel with each row's slots,
then one SDPA call over the rows under the step's bias (`reference.rope_attention`); a packed ragged
forward rotates as stock rounds it and attends per row or padded, as the stock layer does; a
graph-safe block of more than `ops.ATTENTION_KERNEL_MAX_ROWS` query rows (a captured prefill) takes
the RoPE kernel and SDPA too. Linear modules stay
``nn.Linear`` (named ``qkv_proj``, ``gate_up_proj``, ``o_proj``, ``down_proj``), so weight formats
and backends that swap linears apply after fusion.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from specpilot.engine.model import (
    Block,
    CacheAttention,
    KVCache,
    RaggedStep,
    RMSNorm,
    StaticStep,
    Transformer,
)
from specpilot.kernels import fused as ops
from specpilot.kernels.fused.reference import rotate

Stream = Tensor | tuple[Tensor, Tensor | None]  # h, or (h, a delta still to be added to it)


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` (weight formats and backends still swap it) whose small-M CUDA calls run
    `specpilot.kernels.fused.norm_linear`'s GEMV; called with a `NormInput` it also applies the add + norm
    before (and SiLU·mul after) and returns ``(y, h + delta)``."""

    def forward(self, x):  # type: ignore[override]
        if isinstance(x, NormInput):
            return ops.norm_linear(x.h, x.delta, x.norm.weight, x.norm.eps, self.weight, x.silu)
        # ops.norm_linear picks the kernel or, off CUDA and past GEMV_MAX_ROWS, F.linear (no bias here)
        return ops.norm_linear(x, None, None, 0.0, self.weight)[0]


class NormInput(NamedTuple):
    """What a `GemvLinear` folds in: the stream ``h``, the delta still to add, the norm, SiLU·mul after."""

    h: Tensor
    delta: Tensor | None
    norm: AddRMSNorm
    silu: bool = False


def _linear(weight: Tensor, gemv: bool) -> nn.Linear:
    out = (GemvLinear if gemv else nn.Linear)(weight.shape[1], weight.shape[0], bias=False, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    return out


def _concat_linear(*linears: nn.Linear, gemv: bool = False) -> nn.Linear:
    return _linear(torch.cat([lin.weight.detach() for lin in linears]), gemv)


class AddRMSNorm(nn.Module):
    """``(RMSNorm(h + delta), h + delta)`` in one kernel; the weight is the stock norm's."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, h: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        return ops.add_rms_norm(h, delta, self.weight, self.eps)


class FinalNorm(AddRMSNorm):
    """The model's last norm over the stream of the last block: returns the hidden states only.
    Its ``gemv`` says how the model was fused."""

    gemv = False

    def forward(self, stream: Stream) -> Tensor:  # type: ignore[override]
        h, delta = stream if isinstance(stream, tuple) else (stream, None)
        return super().forward(h, delta)[0]


class FusedAttention(CacheAttention):
    def __init__(self, block: Block, gemv: bool = False):
        attn = block.attn
        super().__init__(attn.layer, attn.n_heads, attn.n_kv, attn.hd, attn.core)
        self.qkv_proj = _concat_linear(attn.q_proj, attn.k_proj, attn.v_proj, gemv=gemv)
        self.o_proj = _linear(attn.o_proj.weight.detach(), gemv) if gemv else attn.o_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, start: int | StaticStep | RaggedStep,
                mask: Tensor | None, causal: bool) -> Tensor:
        return self.attend(self.qkv_proj(x), cos, sin, cache, start, mask, causal)

    def attend(self, qkv: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, start: int | StaticStep | RaggedStep,
               mask: Tensor | None, causal: bool) -> Tensor:
        """The layer after its QKV projection: RoPE, cache write, attention, o_proj."""
        B, T, _ = qkv.shape
        H, KV, hd = self.n_heads, self.n_kv, self.hd
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        if isinstance(start, StaticStep):
            # graph-safe step: RoPE, cache write and attention in one kernel where it pays (one cache row,
            # a decode step's few tokens); R cache rows: the RoPE kernel writes each row's slots, then SDPA
            slots = start.slots[0] if start.slots.shape[0] == 1 else start.slots
            return self.o_proj(ops.rope_attention(qkv, cos, sin, H, KV, k_cache, v_cache, slots, start.bias,
                                                  start.length))
        if isinstance(start, RaggedStep):
            # a packed batch of rows (eager batched steps, prompt segments): RoPE as stock rounds it, then the
            # per-row (or padded) attention the stock layer runs
            q, k, v = qkv.view(B, T, H + 2 * KV, hd).transpose(1, 2).split([H, KV, KV], dim=1)
            y = self._ragged(rotate(q, cos, sin), rotate(k, cos, sin), v, cache, start)
            return self.o_proj(y)
        slots = torch.arange(start, start + T, device=qkv.device)
        q = ops.rope_qkv(qkv, cos, sin, H, KV, k_cache, v_cache, slots)
        end = start + T
        y = self.core(q, k_cache[:, :, :end], v_cache[:, :, :end], mask, causal).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, H * hd))


class FusedMLP(nn.Module):
    def __init__(self, block: Block, gemv: bool = False):
        super().__init__()
        mlp = block.mlp
        self.gate_up_proj = _concat_linear(mlp.gate_proj, mlp.up_proj, gemv=gemv)
        self.down_proj = _linear(mlp.down_proj.weight.detach(), gemv) if gemv else mlp.down_proj

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class FusedBlock(nn.Module):
    """A `Block` that takes and returns the residual stream as ``(h, delta)`` (see module doc)."""

    def __init__(self, block: Block, gemv: bool = False):
        super().__init__()
        self.input_norm = AddRMSNorm(block.input_norm)
        self.attn = FusedAttention(block, gemv)
        self.post_attn_norm = AddRMSNorm(block.post_attn_norm)
        self.mlp = FusedMLP(block, gemv)

    def folds(self, h: Tensor) -> bool:
        """Whether this step's norms and SiLU·mul run inside the GEMVs (`fused_gemv`, small M on
        CUDA, linears not swapped by a weight format or backend)."""
        return (type(self.attn.qkv_proj) is GemvLinear and type(self.mlp.gate_up_proj) is GemvLinear
                and ops.gemv_applies(h))

    def forward(self, stream: Stream, cos, sin, cache, start, mask, causal) -> tuple[Tensor, Tensor]:
        h, delta = stream if isinstance(stream, tuple) else (stream, None)
        if self.folds(h):
            qkv, h = self.attn.qkv_proj(NormInput(h, delta, self.input_norm))
            attn_out = self.attn.attend(qkv, cos, sin, cache, start, mask, causal)
            act, h = self.mlp.gate_up_proj(NormInput(h, attn_out, self.post_attn_norm, silu=True))
            return h, self.mlp.down_proj(act)
        normed, h = self.input_norm(h, delta)
        normed, h = self.post_attn_norm(h, self.attn(normed, cos, sin, cache, start, mask, causal))
        return h, self.mlp(normed)


def fuse_model(model: Transformer, gemv: bool = False) -> Transformer:
    """Replace every block and the final norm by their fused forms (in place); returns the model.

    The q/k/v and gate/up weights move into concatenated copies; the stock modules are dropped.
    ``gemv``: the blocks' linears are `GemvLinear`s (``fused_gemv``, see the module doc).
    """
    if model.cfg.attn_bias or model.cfg.qk_norm:
        raise ValueError(f"fused_kernels does not cover {model.cfg.name}: its kernels have no q/k/v bias and no q/k "
                         "norm (Qwen2/Qwen3 checkpoints); leave it off")
    if isinstance(model.norm, FinalNorm):
        if gemv != model.norm.gemv:
            raise ValueError(f"the model is already fused with another fused_gemv setting ({model.norm.gemv})")
        return model
    for i, block in enumerate(model.layers):
        if not isinstance(block, Block):
            raise TypeError(f"layer {i} is a {type(block).__name__}, not a stock Block: fuse before swapping modules")
        model.layers[i] = FusedBlock(block, gemv)
    model.norm = FinalNorm(model.norm)
    model.norm.gemv = gemv
    return model


def is_fused(model: Transformer) -> bool:
    return isinstance(model.norm, FinalNorm)
