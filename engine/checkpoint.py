"""Hugging Face checkpoints on disk as targets: their config, their weights, read without a hub.

Contract:
- A deployment names a checkpoint as its target ``hf:<folder>`` (`model.get_config` and
  `weights.load_model` route such names here).
- `read_config(folder)` maps ``config.json`` of a supported architecture (``ARCHITECTURES``: Llama 2/3/3.x
  with ``rope_scaling`` of type ``llama3``, Mistral, Qwen2 with its q/k/v bias, Qwen3 with its per-head
  q/k norm and explicit ``head_dim``) to a `ModelConfig` named ``hf:<folder>``; both the
  ``rope_theta``/``rope_scaling`` keys and transformers 5's ``rope_parameters`` are read. EOS ids come
  from ``generation_config.json`` where present, else ``config.json``. Anything else (another
  architecture, an active sliding window, another rope type, sizes the tensors contradict) raises
  `CheckpointError` naming what and where, before any weight is read.
- `weights.load_checkpoint(folder)` builds the model from them. `read_state(folder, cfg)` reads ``model.safetensors`` or the shards its ``model.safetensors.index.json``
  names (memory-mapped through ``safetensors``) into this engine's parameter names, each tensor's
  shape checked against ``cfg``; a missing shard, a broken index or a missing tensor raises
  `CheckpointError`. A checkpoint without ``lm_head.weight`` has a tied head.

- `export_checkpoint(...)` writes a model of this engine (a Llama) as such a folder: SmolLM2 from its GGUF
  becomes a checkpoint that loads through this path with the same logits (`weights.export_smollm2`).
- `drafter_file(target, kind)`: a drafter trained for a checkpoint lives beside it (``<folder>/specpilot/``).
- `CheckpointTokenizer(folder)` is its tokenizer: ``tokenizer.json`` (the `tokenizers` library, no special
  tokens added on encode) and the checkpoint's own chat template (``chat_template.jinja`` or
  ``tokenizer_config.json``'s ``chat_template``) rendered by Jinja in a sandboxed environment, as
  transformers renders it.

The layouts agree: Hugging Face's q/k projections use the same "rotate half" RoPE layout as
`model.apply_rope`, so weights load as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from specpilot.engine.config import ModelConfig, RopeScaling

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
PREFIX = "hf:"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.q_proj.weight", "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight", "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias", "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight", "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_norm.weight", "post_attention_layernorm.weight": "post_attn_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}


class CheckpointError(ValueError):
    pass


def drafter_file(target: str, kind: str) -> Path | None:
    """Where ``specpilot drafter train`` puts, and the engine looks for, a ``kind`` drafter trained for the
    checkpoint target ``hf:<folder>``: beside its weights, in ``<folder>/specpilot/`` (None: not a checkpoint)."""
    return Path(target[len(PREFIX):]) / "specpilot" / f"{kind}_drafter.pt" if target.startswith(PREFIX) else None


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: a Hugging Face checkpoint folder needs config.json, its "
                              "*.safetensors (with model.safetensors.index.json when sharded) and tokenizer.json") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None


def _eos_ids(folder: Path, config: dict) -> tuple[int, ...]:
    gen = folder / "generation_config.json"
    raw = _json(gen).get("eos_token_id") if gen.exists() else None
    if raw is None:
        raw = config.get("eos_token_id")
    ids = raw if isinstance(raw, list) else [raw] if raw is not None else []
    return tuple(int(i) for i in ids)


def _rope(config: dict, where: Path) -> tuple[float, RopeScaling | None]:
    params = dict(config.get("rope_parameters") or {})  # transformers 5
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope scaling of type {kind!r} is not supported (only 'llama3')")
    return theta, RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                              high_freq_factor=float(scaling["high_freq_factor"]),
                              original_max_position=int(scaling["original_max_position_embeddings"]))


def read_config(folder: Path | str, name: str | None = None) -> ModelConfig:
    """The `ModelConfig` of the checkpoint in ``folder`` (module docstring), named ``name`` (default
    ``hf:<folder>``, the form a deployment's ``target`` takes)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint folder {folder}")
    where = folder / "config.json"
    config = _json(where)
    archs = config.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise CheckpointError(f"{where}: architecture {archs or 'unnamed'} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    if config.get("use_sliding_window") or (family == "mistral" and config.get("sliding_window")
                                            and config["sliding_window"] < config.get("max_position_embeddings", 0)):
        raise CheckpointError(f"{where}: sliding-window attention is not supported (sliding_window "
                              f"{config.get('sliding_window')})")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{where}: MLP biases (mlp_bias) are not supported")
    theta, scaling = _rope(config, where)
    n_heads = int(config["num_attention_heads"])
    eos = _eos_ids(folder, config)
    try:
        return ModelConfig(
            name=name or f"{PREFIX}{folder}", vocab_size=int(config["vocab_size"]),
            dim=int(config["hidden_size"]), n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads), intermediate=int(config["intermediate_size"]),
            rope_theta=theta, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_seq_len=int(config.get("max_position_embeddings", 8192)),
            bos_id=config.get("bos_token_id"), eos_id=eos[0] if eos else None, stop_ids=eos, family=family,
            head_size=int(config.get("head_dim") or 0),
            attn_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3", rope_scaling=scaling)
    except KeyError as exc:
        raise CheckpointError(f"{where} has no {exc.args[0]!r}") from None


def engine_name(hf_name: str, layers: int) -> str | None:
    """This engine's parameter name for a Hugging Face tensor name (None: not a model parameter)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and int(m.group(1)) < layers and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _shards(folder: Path) -> dict[str, list[str]]:
    """``{shard file: [tensor names]}``: from the index when sharded, else the single file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map: the index is broken")
        out: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            out.setdefault(str(shard), []).append(name)
        return out
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    return {single.name: []}  # every tensor in it


def read_state(folder: Path | str, cfg: ModelConfig, expected: dict[str, torch.Size]) -> dict[str, Tensor]:
    """This engine's state dict from the checkpoint in ``folder``; ``expected`` is the model's own
    ``{name: shape}`` (a tied head's ``lm_head.weight`` may be absent)."""
    from safetensors import safe_open

    folder = Path(folder)
    state: dict[str, Tensor] = {}
    for shard, names in _shards(folder).items():
        path = folder / shard
        if not path.exists():
            raise CheckpointError(f"shard {path} named by the index is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for hf_name in names or list(f.keys()):
                    ours = engine_name(hf_name, cfg.n_layers)
                    if ours is None:
                        continue
                    t = f.get_tensor(hf_name)
                    if ours not in expected:
                        raise CheckpointError(f"{path}: tensor {hf_name} has no place in a {cfg.family} model of this "
                                              "config")
                    if tuple(t.shape) != tuple(expected[ours]):
                        raise CheckpointError(f"{path}: {hf_name} is {tuple(t.shape)} but config.json makes it "
                                              f"{tuple(expected[ours])}")
                    state[ours] = t
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors' own errors: a truncated or foreign file
            raise CheckpointError(f"{path} cannot be read as safetensors ({exc})") from None
    missing = sorted(set(expected) - set(state) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if missing:
        raise CheckpointError(f"{folder}: the checkpoint has no {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}")
    return state


def export_checkpoint(state: dict[str, Tensor], cfg: ModelConfig, tokenizer_json: str, chat_template: str,
                      dest: Path | str, eos_token: str = "", bos_token: str = "") -> Path:
    """Write a Llama-family model (``state`` in this engine's names) as a Hugging Face checkpoint folder."""
    from safetensors.torch import save_file

    if cfg.family not in ("llama", "mistral") or cfg.attn_bias or cfg.qk_norm or cfg.rope_scaling is not None:
        raise CheckpointError(f"export_checkpoint writes plain Llama models, not {cfg.family}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    ours_to_hf = {v: k for k, v in _TOP_NAMES.items()}
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    tensors = {}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # tied: the embedding is the head
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            hf_name = f"model.layers.{i}.{layer_names[rest]}"
        else:
            hf_name = ours_to_hf[name]
        tensors[hf_name] = t.detach().to(torch.float32).contiguous()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    eos = list(cfg.stop_ids) or ([cfg.eos_id] if cfg.eos_id is not None else [])
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_id, "eos_token_id": eos}))
    (dest / "tokenizer.json").write_text(tokenizer_json)
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token or None, "bos_token": bos_token or None,
        "chat_template": chat_template}, indent=2))
    return dest


def free_bytes(device: str | torch.device) -> int | None:
    """Memory free for a model on ``device`` (CUDA: the device's; CPU: MemAvailable); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CheckpointTokenizer:
    """A checkpoint's tokenizer and chat template (module docstring)."""

    def __init__(self, folder: Path | str, eos_id: int | None = None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path} is missing: the checkpoint's tokenizer is needed to encode requests")
        self._tok = Tokenizer.from_file(str(path))
        self.eos_id = eos_id
        config = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
        template = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").exists() \
            else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise CheckpointError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json's "
                                  "chat_template): requests are chat turns")

        def special(key: str) -> str:
            value = config.get(key) or ""
            return value.get("content", "") if isinstance(value, dict) else str(value)

        def raise_exception(message: str) -> None:
            raise CheckpointError(f"{folder}'s chat template refused the request: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template)
        self._specials = {"bos_token": special("bos_token"), "eos_token": special("eos_token")}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
