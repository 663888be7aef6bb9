"""``model check`` and ``model export-smollm2``: what a user runs before pointing a deployment at a model.

- ``specpilot model check TARGET`` (a checkpoint folder, ``hf:<folder>``, a deployment or a built-in
  model name) reads the checkpoint as a deployment would (config, every tensor's shape through the
  memory-mapped safetensors, the tokenizer and its chat template) without loading the weights, and
  prints what it found: family, sizes, parameters, bytes in each dtype against the memory free on
  the CPU (and the GPU when there is one), the EOS ids and the drafters trained for it. A checkpoint
  this engine cannot run fails here with the reason (`specpilot.engine.checkpoint.CheckpointError`).
- ``specpilot model export-smollm2 DIR`` writes the shipped SmolLM2 as a Hugging Face checkpoint
  (``weights.export_smollm2``): the example checkpoint of the README and of ``deployments/smollm2-hf-cpu``.

Both print a table, then one JSON line (``--json``: the JSON line alone on stdout).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.errors import UserError


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("model", help="check a checkpoint before a deployment uses it; export SmolLM2 as one")
    sub = p.add_subparsers(dest="model_command", required=True)
    c = sub.add_parser("check", help="read a checkpoint as a deployment would (no weights loaded) and report",
                       description=__doc__.split("\n\n")[1].split("\n- ")[0].removeprefix("- "))
    c.add_argument("target", help="a checkpoint folder, hf:<folder>, a deployment (name or TOML) or a built-in model")
    c.add_argument("--json", action="store_true", help="print only the JSON line")
    c.set_defaults(func=_check)
    e = sub.add_parser("export-smollm2", help="write the shipped SmolLM2-135M as a Hugging Face checkpoint folder")
    e.add_argument("dest", type=Path, help="the folder to write (created; must be empty or absent)")
    e.add_argument("--json", action="store_true", help="print only the JSON line")
    e.set_defaults(func=_export)


def _target(given: str) -> str:
    """A target name (built-in or ``hf:<absolute folder>``) from what the user typed."""
    from specpilot.engine.model import CONFIGS
    from specpilot.harness.deployment import DeploymentError, deployment_path, load_deployment

    if given in CONFIGS:
        return given
    if given.startswith("hf:"):
        return f"hf:{Path(given[3:]).resolve()}"
    if Path(given).is_dir():
        return f"hf:{Path(given).resolve()}"
    if deployment_path(given).is_file():
        return load_deployment(given).target
    try:
        load_deployment(given)
    except DeploymentError as exc:
        raise UserError(f"{given!r} is neither a checkpoint folder nor a model name: {exc}") from None
    raise AssertionError("unreachable")


def facts(target: str) -> dict:
    """What a deployment of ``target`` would run: the checkpoint read without loading its weights."""
    import torch

    from specpilot.engine import checkpoint
    from specpilot.engine.model import Transformer, get_config

    cfg = get_config(target)
    with torch.device("meta"):
        model = Transformer(cfg)
    params = sum(p.numel() for p in model.parameters())
    out = {"target": target, "family": cfg.family, "layers": cfg.n_layers, "dim": cfg.dim, "heads": cfg.n_heads,
           "kv_heads": cfg.n_kv_heads, "head_size": cfg.head_dim, "intermediate": cfg.intermediate,
           "vocab": cfg.vocab_size, "context": cfg.max_seq_len, "tied_head": cfg.tie_embeddings,
           "qkv_bias": cfg.attn_bias, "qk_norm": cfg.qk_norm, "rope_theta": cfg.rope_theta,
           "rope_scaling": (f"llama3 x{cfg.rope_scaling.factor:g} from {cfg.rope_scaling.original_max_position}"
                            if cfg.rope_scaling else "none"),
           "eos_ids": list(cfg.stop_ids), "parameters": params,
           "gib": {"fp32": round(params * 4 / 2**30, 3), "bf16": round(params * 2 / 2**30, 3)},
           "free_gib": {"cpu": round((checkpoint.free_bytes("cpu") or 0) / 2**30, 2)}}
    if torch.cuda.is_available():
        out["free_gib"]["cuda"] = round(checkpoint.free_bytes("cuda") / 2**30, 2)
    if target.startswith(checkpoint.PREFIX):
        folder = Path(target[len(checkpoint.PREFIX):])
        expected = {name: t.shape for name, t in model.state_dict().items()}
        checkpoint.read_state(folder, cfg, expected)  # every shape, memory-mapped: nothing is copied
        tok = checkpoint.CheckpointTokenizer(folder, eos_id=cfg.eos_id)
        out["chat_template"] = tok.chat_prompt("hi")[:80]
        out["drafters"] = {kind: str(f) for kind in ("parallel", "eagle")
                           if (f := checkpoint.drafter_file(target, kind)).is_file()}
    return out


def _print(title: str, rows: dict, as_json: bool) -> None:
    from specpilot import output

    if not as_json:
        table = output.table(title, ("", "value"))
        for k, v in rows.items():
            table.add_row(k, v if isinstance(v, str) else json.dumps(v))
        output.console().print(table)
    print(json.dumps(rows, separators=(",", ":")))


def _check(args: argparse.Namespace) -> int:
    from specpilot.engine.checkpoint import CheckpointError

    target = _target(args.target)
    try:
        found = facts(target)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    _print(f"model {target}", found, args.json)
    return 0


def _export(args: argparse.Namespace) -> int:
    from specpilot.engine.weights import export_smollm2

    dest = args.dest.resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest} exists and is not an empty folder: give a new one")
    export_smollm2(dest)
    _print(f"SmolLM2-135M written to {dest}", {"checkpoint": str(dest), "files": sorted(p.name for p in dest.iterdir()),
                                                "target": f"hf:{dest}"}, args.json)
    return 0
