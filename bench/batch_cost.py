"""Batched step cost c(N, B) of any model config (random weights), on any device: the table the cost model's
batched ceiling reads (`specpilot.services.master.costmodel.batched_ceiling`).

For each B rows and N drafts a row: the ragged forward of B rows of 1 + N new tokens each over a context of
``--context`` cached slots a row, against B rows of one token (batched AR's step), median of ``--reps``
(`specpilot.harness.step_cost.step_cost`; each cell's first call is untimed); also AR's own growth with the
rows, t(0, B) / t(0, 1), and the full-acceptance ceiling (N + 1) / c(N, B). Needs no model files.

    PYTHONPATH=. python bench/batch_cost.py --model llama3-8b --device cuda --dtype bf16 \
        --batch-sizes 1,2,4,8,16,32,64 --ns 1,2,4,8,16 [--cuda-graphs]

``--cuda-graphs``: each step as the batched decoder replays it under ``cuda_graphs`` (every row padded, one
graph a shape; `GraphRunner.run_rows`).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.engine.model import DTYPES, build_random, get_config  # noqa: E402
from specpilot.harness.step_cost import cost_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a config of specpilot.engine.model.CONFIGS")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=512, help="cached slots a row attends to")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay each step as a CUDA graph (CUDA only)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        ns = [int(n) for n in args.ns.split(",")]
    except ValueError:
        ap.error("--batch-sizes and --ns are comma-separated integers")
    if min(batch_sizes + ns) < 1 or args.context < 0 or args.reps < 1:
        ap.error("batch sizes, draft counts and reps must be positive, the context >= 0")
    device = torch.device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        ap.error("--cuda-graphs needs a CUDA device (--device cuda)")
    model = build_random(get_config(args.model), device=device, dtype=DTYPES[args.dtype])
    model.eval()
    table = cost_table(model, sorted(set(batch_sizes)), ns, args.context, args.reps, graphs=args.cuda_graphs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"c(N, B) of {args.model} ({args.dtype}, random weights{', CUDA graphs' if args.cuda_graphs else ''}) on "
          f"{name}, context {args.context}; "
          "maxN: (N + 1) / c(N, B), the speedup over batched AR if every draft were accepted")
    print(f"{'B':>4} {'t_AR ms':>8} {'AR vs 1':>8} " + " ".join(f"{'c(' + str(n) + ')':>7}" for n in ns)
          + " " + " ".join(f"{'max' + str(n):>7}" for n in ns))
    for row in table["rows"]:
        print(f"{row['b']:>4} {row['t_ar_ms']:>8.3f} {row['ar_scaling']:>8.2f} "
              + " ".join(f"{row['c'][str(n)]:>7.2f}" for n in ns) + " "
              + " ".join(f"{row['ceiling'][str(n)]:>7.2f}" for n in ns))
    print(json.dumps({"bench": "batch_cost", "model": args.model, "dtype": args.dtype, "device": name,
                      "date": time.strftime("%Y-%m-%d"), **table}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
