"""Llama-family decoder with a static KV cache that takes a block of tokens under any mask.

Contract:
- `Transformer.forward(tokens, positions, cache, start, mask)` runs ``T`` new tokens whose keys and
  values are written to cache slots ``start .. start+T-1``. Each new token attends to every slot
  before ``start`` and to the new tokens that ``mask[i, j]`` allows (``None``: causal). RoPE uses
  ``positions`` (a token's depth in the sequence), not its slot, so a tree's siblings share a
  position while occupying different slots.
- Rows of a batch share ``positions`` and ``mask`` unless ``positions`` is [B, T] and ``mask`` is a
  full per-row mask [B, 1, T, start+T] (used for left-padded batches, e.g. drafter training).
- It returns ``(logits, hidden)``: logits for every new token (or only the last, when
  ``last_only``) and the final-norm hidden states that feed the LM head (what a drafter reads).
- `KVCache.compact(start, keep)` moves the slots of an accepted tree path into consecutive slots;
  everything after them is dead and will be overwritten.
- `Transformer.forward_static(tokens, positions, start, block_mask, cache, length)` is the same
  computation in a form a CUDA graph can capture (`specpilot.engine.graphs`), on every row of the cache at
  once: ``start`` is a device scalar (or one a row), K/V are written through an index at slots ``start +
  i``, and attention reads the fixed first ``length`` cache slots under an additive bias built on the
  device (slot < start, or a block slot that ``block_mask`` allows). Every shape depends only on (rows,
  T, length); nothing syncs the host.

Every linear layer is a plain ``nn.Linear`` attribute (``q_proj`` .. ``down_proj``, ``lm_head``) so
a weight format can swap the module. The attention core is its own module (`Attention.core`) so
a profiler can time it. This module knows nothing about tokenizers, drafters or files.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specpilot.engine.config import CONFIGS, ModelConfig, RopeScaling

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
__all__ = ["CONFIGS", "DTYPES", "ModelConfig", "RopeScaling", "Transformer", "get_config"]  # configs re-exported


def get_config(name: str) -> ModelConfig:
    """A named configuration, or ``hf:<folder>``: a Hugging Face checkpoint's (`specpilot.engine.checkpoint`)."""
    if name.startswith("hf:"):
        from specpilot.engine.checkpoint import read_config

        return read_config(name[3:], name=name)
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}, or hf:<checkpoint folder>") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and scale in the model dtype, as the reference (HF Llama) does, so bf16
        # runs round the same way.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def scaled_inv_freq(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.x's ``llama3`` RoPE scaling of the inverse frequencies (as transformers computes it)."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, between, scaled)


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of every position, [max_seq_len, head_dim], fp32 (the "rotate half" layout)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_scaling is not None:
        inv_freq = scaled_inv_freq(inv_freq, cfg.rope_scaling)
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, hd]; cos/sin: [T, hd] already in x's dtype."""
    return x * cos + _rotate_half(x) * sin


class KVCache(nn.Module):
    """Keys and values of every layer in two static buffers, [layers, B, kv_heads, max_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1, device=None, dtype=torch.float32):
        super().__init__()
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k/v ([B, kv_heads, T, hd]) at slots start.., return every live slot up to them."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def update_row(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """`update` of one cache row: k/v [1, kv_heads, T, hd] at its slots start..; returns that row's
        live slots up to them, [1, kv_heads, start + T, hd]."""
        end = start + k.shape[2]
        self.k[layer, row, :, start:end] = k[0]
        self.v[layer, row, :, start:end] = v[0]
        return self.k[layer, row:row + 1, :, :end], self.v[layer, row:row + 1, :, :end]

    def compact_row(self, row: int, start: int, keep: list[int]) -> None:
        """`compact` of one cache row."""
        if keep == list(range(len(keep))):
            return
        src = torch.tensor(keep, device=self.k.device) + start
        dst = slice(start, start + len(keep))
        self.k[:, row, :, dst] = self.k[:, row, :, src]
        self.v[:, row, :, dst] = self.v[:, row, :, src]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k/v ([B, kv_heads, T, hd]) of every cache row at the slots named by a device tensor
        ``slots`` [B, T] (graph-safe)."""
        if slots.shape[0] == 1:  # one row: the same slots for the whole batch dimension
            self.k[layer].index_copy_(2, slots[0], k)
            self.v[layer].index_copy_(2, slots[0], v)
            return
        index = slots[:, None, :, None].expand_as(k)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)

    def compact(self, start: int, keep: list[int]) -> None:
        """Move slots ``start + keep[j]`` to ``start + j`` (keep is increasing, keep[j] >= j).

        A chain's accepted prefix is already in place (keep == [0, 1, ..]) and costs nothing.
        """
        if keep == list(range(len(keep))):
            return
        src = torch.tensor(keep, device=self.k.device) + start
        dst = slice(start, start + len(keep))
        # Advanced indexing gathers into a new tensor first, so overlapping moves are safe.
        self.k[:, :, :, dst] = self.k[:, :, :, src]
        self.v[:, :, :, dst] = self.v[:, :, :, src]


# SDPA backends of the eager forward on CUDA (set once a forward, `Transformer._sdpa_backends`;
# entering the context costs ~10 us): every one but cuDNN's, which plans a kernel for each new
# shape, and an eager decode step attends over a new cache length each time: measured far slower
# with cuDNN allowed (docs/FIGURES.md, "Lab notes moved from code"). `forward_static` keeps cuDNN:
# each captured graph has one length.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class BlockMask:
    """A block's attention mask, prepared once a forward for every layer's `SDPA`.

    ``allowed`` [T, L] bool is the mask as given; ``bias`` [G*T, L] is its additive form (0 or -inf,
    in the queries' dtype) tiled over the G query heads of a KV head (row g*T + t is token t's row),
    which is what the grouped path hands SDPA. SDPA adds exactly that bias for a bool mask, so the
    result is bit for bit the same; preparing it once spares each of the 30 layers a tiling copy and
    a bool -> float conversion (measured: docs/FIGURES.md, "Lab notes moved from code").
    """

    allowed: Tensor
    bias: Tensor

    @staticmethod
    def of(allowed: Tensor, groups: int, dtype: torch.dtype) -> BlockMask:
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return BlockMask(allowed, bias.repeat(groups, 1))


class SDPA(nn.Module):
    """The attention core as a module, so hooks and profilers can time it apart from the linears.

    q [B, H, T, hd], k/v [B, KV, L, hd]; ``gqa``: H is a multiple of KV (head h reads KV head h // G).
    With a mask, and for a single new token, grouped heads go through SDPA as G*T query rows of their
    KV head (the mask tiled G times over the rows). SDPA's own ``enable_gqa`` with a mask falls back
    to its math path, which copies K/V once per query head; without a mask its CPU flash kernel is
    slow for one query row (both measured: docs/FIGURES.md, "Lab notes moved from code"). The
    graph-safe forward does the same (`Attention._static_attention`).
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None, causal: bool,
                gqa: bool = True) -> Tensor:
        B, H, T, hd = q.shape
        KV = k.shape[1]
        if gqa and KV < H and (mask is not None or (T == 1 and not causal)):
            G = H // KV
            if isinstance(mask, BlockMask):
                rows = mask.bias
            else:
                rows = None if mask is None else mask.repeat(G, 1) if mask.ndim == 2 else mask.repeat(1, 1, G, 1)
            # row g*T + t of a KV head: query head kv*G + g at token t, which mask row t describes
            y = F.scaled_dot_product_attention(q.reshape(B, KV, G * T, hd), k, v, attn_mask=rows)
            return y.view(B, KV, G, T, hd).reshape(B, H, T, hd)
        if isinstance(mask, BlockMask):
            mask = mask.allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


@dataclass(frozen=True)
class StaticStep:
    """What a graph-safe forward needs beyond the token block (see `Transformer.forward_static`)."""

    slots: Tensor  # [R, T] int64 cache slots of each cache row's new tokens
    bias: Tensor  # [R, 1, G*T, length] additive attention bias (0 or -inf), rows ordered (group, token)
    length: int  # cache slots attention reads: 0 .. length-1 (static per graph)


@dataclass(frozen=True)
class RaggedStep:
    """What a ragged batched forward needs (see `Transformer.forward_ragged`): per batch row, its cache
    row, the cache slot of its first new token, how many tokens are its own, its attention mask as
    `Transformer._attention_mask` makes it for that row alone, and where its tokens begin in the packed
    block; with ``padded``, one attention call for all rows instead (`PaddedRows`)."""

    rows: tuple[int, ...]  # cache row of each batch row
    starts: tuple[int, ...]  # first cache slot of each row's new tokens
    lengths: tuple[int, ...]  # each row's own tokens
    masks: tuple[tuple[Tensor | BlockMask | None, bool], ...]  # (mask, is_causal) of each row
    offsets: tuple[int, ...]  # where each row's tokens begin in the packed block (the rows back to back)
    padded: PaddedRows | None = None


@dataclass(frozen=True)
class PaddedRows:
    """One attention call over every cache row for a ragged step (``EngineOptions.batch_attention =
    "padded"``), built once a forward for all layers. The queries are laid out ``[R, T]`` (R cache rows,
    T the longest row's new tokens, each packed token at its row and its place in the row) and attend over
    the first ``length`` slots of every cache row in place (a view: no gather of K/V) through ``bias``, an
    additive mask ``[R, 1, G*T, length]`` already tiled over the G query heads of a KV head: 0 where the
    row's own mask allows, -inf elsewhere. Pad queries (rows without tokens this step, and a row's places
    past its own tokens) see slot 0 only, so they stay finite; their outputs are dropped. A row's result
    is the same attention as the per-row call's, but the sum over keys runs over ``length`` slots with
    -inf weights for the others, so its bits may differ: forcing, not construction, says it is lossless."""

    write_rows: Tensor  # [N] cache row of each packed token
    write_slots: Tensor  # [N] cache slot of each packed token
    gather: Tensor  # [R * T] packed index of each padded query (pads: 0)
    scatter: Tensor  # [N] padded index (row * T + place) of each packed token
    bias: Tensor  # [R, 1, G * T, length]
    length: int
    tokens: int  # T


class CacheAttention(nn.Module):
    """Attention of a layer's rotated queries over its KV cache rows, for each kind of step (`StaticStep`,
    `RaggedStep`); shared by the stock `Attention` and the fused one (`specpilot.engine.fused`)."""

    def __init__(self, layer: int, n_heads: int, n_kv: int, hd: int, core: SDPA):
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.hd = layer, n_heads, n_kv, hd
        self.core = core

    def _static_attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, step: StaticStep) -> Tensor:
        """Graph-safe attention: K/V written through an index tensor, then every query of a KV head's
        group reads the fixed first ``step.length`` slots as one batch of G*T rows (no K/V repeat)."""
        B, H, T, hd = q.shape
        G = H // self.n_kv
        cache.write(self.layer, step.slots, k, v)
        keys = cache.k[self.layer, :, :, : step.length]
        values = cache.v[self.layer, :, :, : step.length]
        y = self.core(q.reshape(B, self.n_kv, G * T, hd), keys, values, step.bias, False, gqa=False)
        # [B, KV, G*T, hd] -> [B, T, KV, G, hd] -> [B, T, H*hd] (head h = kv * G + g, as enable_gqa)
        return y.view(B, self.n_kv, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)

    def _ragged(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, step: RaggedStep) -> Tensor:
        """A packed block's attention: one padded call (``step.padded``) or one call a row."""
        if step.padded is not None:
            return self._padded_attention(q, k, v, cache, step.padded)
        return self._ragged_attention(q, k, v, cache, step)

    def _ragged_attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, step: RaggedStep) -> Tensor:
        """Over a packed block (q [1, H, N, hd], the rows' tokens back to back): each row's tokens attend
        over exactly its own cache row's live slots, through the same SDPA call a batch-1 forward of that
        row makes, so a row's result does not depend on its batch-mates."""
        _, H, N, hd = q.shape
        y = q.new_empty(1, N, H * hd)
        for row, start, n, (mask, causal), o in zip(step.rows, step.starts, step.lengths, step.masks, step.offsets,
                                                    strict=True):
            keys, values = cache.update_row(self.layer, row, start, k[:, :, o:o + n], v[:, :, o:o + n])
            out = self.core(q[:, :, o:o + n], keys, values, mask, causal)
            y[0, o:o + n] = out[0].transpose(0, 1).reshape(n, H * hd)
        return y

    def _padded_attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, p: PaddedRows) -> Tensor:
        """Over a packed block (q [1, H, N, hd]): the new keys written with one indexed store, then every
        cache row's queries in one SDPA call (`PaddedRows`): the launch count does not grow with the rows."""
        H, hd = q.shape[1], q.shape[3]
        KV, G, T = self.n_kv, H // self.n_kv, p.tokens
        cache.k[self.layer, p.write_rows, :, p.write_slots] = k[0].transpose(0, 1)  # [N, KV, hd]
        cache.v[self.layer, p.write_rows, :, p.write_slots] = v[0].transpose(0, 1)
        keys = cache.k[self.layer, :, :, :p.length]  # [R, KV, length, hd], a view
        values = cache.v[self.layer, :, :, :p.length]
        R = keys.shape[0]
        # [H, R*T, hd] -> [R, KV, G*T, hd]: row g*T + t of a KV head is query head kv*G + g at place t
        qp = q[0].index_select(1, p.gather).view(KV, G, R, T, hd).permute(2, 0, 1, 3, 4).reshape(R, KV, G * T, hd)
        y = F.scaled_dot_product_attention(qp, keys, values, attn_mask=p.bias)
        y = y.view(R, KV, G, T, hd).permute(0, 3, 1, 2, 4).reshape(R * T, H * hd)  # [R*T, H*hd]
        return y.index_select(0, p.scatter).unsqueeze(0)


class Attention(CacheAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, SDPA())
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, start: int | StaticStep,
                mask: Tensor | None, causal: bool) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(start, StaticStep):
            return self.o_proj(self._static_attention(q, k, v, cache, start))
        if isinstance(start, RaggedStep):
            return self.o_proj(self._ragged(q, k, v, cache, start))
        k, v = cache.update(self.layer, start, k, v)
        y = self.core(q, k, v, mask, causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, start, mask, causal):
        x = x + self.attn(self.input_norm(x), cos, sin, cache, start, mask, causal)
        return x + self.mlp(self.post_attn_norm(x))


class FP32Head(nn.Module):
    """An LM head that computes in fp32 from an fp32 copy of the weight (the forcer's reference head)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().clone(), persistent=False)

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(h.float(), self.weight)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def init_buffers(self) -> None:
        """Compute the RoPE tables on the model's device (after weights are loaded or moved)."""
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, self.device)

    def use_fp32_head(self) -> None:
        """Compute the LM head in fp32, whatever the model's dtype (unties it from the embedding)."""
        self.lm_head = FP32Head(self.lm_head.weight)

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.cfg, max_len, batch, self.device, self.dtype)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, start: int,
                mask: Tensor | None = None, last_only: bool = False) -> tuple[Tensor, Tensor]:
        """tokens [B, T] (int64), positions [T] (int64) -> (logits [B, T or 1, V], hidden [B, T, D])."""
        T = tokens.shape[1]
        if start + T > cache.max_len:
            raise ValueError(f"{start + T} cache slots needed, the cache holds {cache.max_len}")
        attn_mask, causal = self._attention_mask(T, start, mask)
        cos = self.rope_cos[positions].to(self.dtype)
        sin = self.rope_sin[positions].to(self.dtype)
        if positions.ndim == 2:  # per-row positions: broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = self.embed(tokens)
        with self._sdpa_backends():
            for layer in self.layers:
                x = layer(x, cos, sin, cache, start, attn_mask, causal)
        hidden = self.norm(x)
        logits = self.lm_head(hidden[:, -1:] if last_only else hidden)
        return logits, hidden

    def forward_ragged(self, tokens: Tensor, positions: Tensor, cache: KVCache, starts: list[int],
                       lengths: list[int], rows: list[int], masks: list[Tensor | None],
                       last_only: bool = False, logit_index: list[int] | None = None,
                       padded: bool = False) -> tuple[Tensor, Tensor]:
        """One forward over a ragged batch, packed: tokens and positions [N] hold the rows' new tokens back
        to back, row b's ``lengths[b]`` tokens for cache row ``rows[b]`` at slots ``starts[b]``.., with
        ``masks[b]`` as `forward`'s ``mask`` for them (None: causal). Linears and norms run once over all
        N tokens, attention per row (`Attention._ragged_attention`). Returns (logits [N, V], or [B, V] of
        each row's last token with ``last_only``, or of the packed tokens ``logit_index`` lists, and hidden
        [N, D]). ``padded``: attention as one call over every cache row (`PaddedRows`; may change bits)."""
        if sum(lengths) != tokens.shape[0]:
            raise ValueError(f"the rows' lengths {lengths} do not add up to the {tokens.shape[0]} packed tokens")
        for start, n, row in zip(starts, lengths, rows, strict=True):
            if n < 1 or start + n > cache.max_len or not 0 <= row < cache.k.shape[1]:
                raise ValueError(f"row {row}: {n} tokens at slot {start} do not fit the cache "
                                 f"({cache.k.shape[1]} rows of {cache.max_len} slots)")
        offsets = [sum(lengths[:b]) for b in range(len(lengths))]
        if padded:
            step = RaggedStep(tuple(rows), tuple(starts), tuple(lengths), (), tuple(offsets),
                              self._padded_rows(cache, starts, lengths, rows, masks, offsets))
        else:
            step = RaggedStep(tuple(rows), tuple(starts), tuple(lengths),
                              tuple(self._attention_mask(n, start, mask) for n, start, mask in
                                    zip(lengths, starts, masks, strict=True)), tuple(offsets))
        cos = self.rope_cos[positions].to(self.dtype)  # [N, hd]: one position a packed token
        sin = self.rope_sin[positions].to(self.dtype)
        x = self.embed(tokens.unsqueeze(0))
        with self._sdpa_backends():
            for layer in self.layers:
                x = layer(x, cos, sin, cache, step, None, False)
        hidden = self.norm(x)[0]  # [N, D]
        if last_only:
            logit_index = [o + n - 1 for o, n in zip(offsets, lengths, strict=True)]
        if logit_index is not None:
            return self.lm_head(hidden[logit_index]), hidden
        return self.lm_head(hidden), hidden

    def forward_static(self, tokens: Tensor, positions: Tensor, start: Tensor, block_mask: Tensor,
                       cache: KVCache, length: int) -> tuple[Tensor, Tensor]:
        """Graph-safe forward of a block of T tokens on each of the cache's R rows; returns (logits
        [R, T, V], hidden [R, T, D]).

        tokens [R, T]; positions [T] (R = 1) or [R, T]; ``start`` a 0-d (R = 1) or [R] int64 device
        tensor, the first slot of each row's block; ``block_mask`` [T, T] or [R, T, T] bool, which block
        tokens each block token sees (itself included). ``length`` (fixed per captured graph, ``start + T
        <= length <= cache.max_len`` on every row) is how many cache slots attention reads. Every shape
        depends on (R, T, length) only, and no value reaches the host.
        """
        R, T = tokens.shape
        if R != cache.k.shape[1]:
            raise ValueError(f"a static step runs every cache row: {R} token rows, {cache.k.shape[1]} cache rows")
        starts = start.view(R)
        slots = starts[:, None] + torch.arange(T, device=tokens.device)  # [R, T]
        step = StaticStep(slots, self._static_bias(starts, block_mask.view(R, T, T), length), length)
        cos = self.rope_cos[positions].to(self.dtype)
        sin = self.rope_sin[positions].to(self.dtype)
        if positions.ndim == 2:  # per-row positions: broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = self.embed(tokens)
        for layer in self.layers:  # cuDNN allowed: one length per captured graph, planned once
            x = layer(x, cos, sin, cache, step, None, False)
        hidden = self.norm(x)
        return self.lm_head(hidden), hidden

    def _static_bias(self, starts: Tensor, block_mask: Tensor, length: int) -> Tensor:
        """[R, 1, G*T, length] additive bias (0 or -inf) of R blocks of T tokens at slots ``starts`` [R]..:
        a token sees its row's slots before its block and the block tokens ``block_mask`` [R, T, T] allows,
        tiled over the G query heads of a KV head (row g*T + t)."""
        R, T, _ = block_mask.shape
        rel = torch.arange(length, device=starts.device)[None, :] - starts[:, None]  # [R, length]: < 0 before
        in_block = (rel >= 0) & (rel < T)
        seen = block_mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(R, T, length))
        allowed = (rel < 0)[:, None, :] | (in_block[:, None, :] & seen)  # [R, T, length]
        return self._row_bias(allowed)

    def _row_bias(self, allowed: Tensor) -> Tensor:
        """[R, 1, G*T, L] additive bias (0 or -inf) of ``allowed`` [R, T, L], tiled over the G query heads of
        a KV head (row g*T + t), as the grouped SDPA path takes it."""
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return bias.repeat(1, self.cfg.n_heads // self.cfg.n_kv_heads, 1).unsqueeze(1)

    def _padded_rows(self, cache: KVCache, starts: list[int], lengths: list[int], rows: list[int],
                     masks: list[Tensor | None], offsets: list[int]) -> PaddedRows:
        """The index tensors and the tiled bias of a padded ragged step (`PaddedRows`); each batch row's
        mask is None (causal) or its own [n, n] bool mask over its new tokens."""
        if len(set(rows)) != len(rows):
            raise ValueError(f"a padded step takes each cache row once, got rows {rows}")
        dev, R, T = self.device, cache.k.shape[1], max(lengths)
        length = max(s + n for s, n in zip(starts, lengths, strict=True))
        allowed = torch.zeros(R, T, length, dtype=torch.bool, device=dev)
        allowed[:, :, 0] = True  # pads see slot 0 (finite); a real query's row is overwritten below
        gather = torch.zeros(R * T, dtype=torch.int64)
        scatter, write_rows, write_slots = [], [], []
        for row, start, n, mask, o in zip(rows, starts, lengths, masks, offsets, strict=True):
            if mask is not None and tuple(mask.shape) != (n, n):
                raise ValueError(f"a padded step takes [n, n] row masks, got {tuple(mask.shape)} for {n} tokens")
            own = torch.ones(n, n, dtype=torch.bool, device=dev).tril() if mask is None else mask.to(dev)
            allowed[row, :n, :start] = True
            allowed[row, :n, start:start + n] = own
            gather[row * T:row * T + n] = torch.arange(o, o + n)
            scatter.extend(range(row * T, row * T + n))
            write_rows.extend([row] * n)
            write_slots.extend(range(start, start + n))
        as_index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
        return PaddedRows(write_rows=as_index(write_rows), write_slots=as_index(write_slots), gather=gather.to(dev),
                          scatter=as_index(scatter), bias=self._row_bias(allowed), length=length, tokens=T)

    def _sdpa_backends(self):
        return sdpa_kernel(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()

    def _attention_mask(self, T: int, start: int, mask: Tensor | None) -> tuple[Tensor | BlockMask | None, bool]:
        """(mask or None, is_causal) for every layer's SDPA, built once a forward: a full per-row
        mask [B, 1, T, start+T] as given, else a `BlockMask` over [T, start+T]."""
        if mask is not None and mask.ndim == 4:  # already a full per-row mask
            return mask, False
        if mask is None:
            if T == 1:
                return None, False  # one new token sees every live slot
            if start == 0:
                return None, True
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        prefix = torch.ones(T, start, dtype=torch.bool, device=self.device)
        allowed = torch.cat([prefix, mask.to(self.device)], dim=1)
        return BlockMask.of(allowed, self.cfg.n_heads // self.cfg.n_kv_heads, self.dtype), False


def greedy_ids(logits: Tensor) -> Tensor:
    """The index of each row's largest logit (the first one on ties; NaN counts as largest), as
    ``argmax(-1)`` gives. ``max(-1).indices`` is the same index, and on CPU bf16 logits it measured
    several times faster than ``argmax`` (docs/FIGURES.md, "Lab notes moved from code")."""
    return logits.max(dim=-1).indices


def init_random(model: Transformer, seed: int = 0) -> Transformer:
    """Random weights that give peaked, well separated logits (so greedy ties are rare)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # linears: variance-preserving
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


def build_random(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0) -> Transformer:
    """A model with random weights. Large configs are materialised directly on ``device``."""
    if cfg.dim * cfg.n_layers <= 1 << 16:  # small: deterministic CPU generator, then move
        model = init_random(Transformer(cfg), seed).to(device=device, dtype=dtype)
    else:
        with torch.device("meta"):
            model = Transformer(cfg)
        model = model.to_empty(device=device).to(dtype)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.embed.weight
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 1.0 if name == "embed.weight" else 1.0 / math.sqrt(p.shape[1]))
    model.init_buffers()
    return model.eval()
