"""Benchmark: a drafter's chain tau on a request set by exact replay of the target's AR outputs.

Greedy acceptance makes a chain's tau a function of the AR output alone: at each step the drafter
proposes from the committed context (and, for hidden-state drafters, the target's hidden state
before the root), the target accepts the longest matching prefix and adds its bonus token. So
the AR outputs are generated once (cached in ``--outputs``) and any drafter, weights file or
drafter setting is then scored in about a minute on 72 requests instead of a timed bench's
eleven (`specpilot.harness.replay.Replay`, pooled as the planner pools it: `costmodel.pooled_replay`). On
2026-12-01 the replayed tau of the 72 HumanEval dev requests matched `specpilot bench`'s
measured 2.4599 to four digits. Prints a table and a JSON line (with each request's own tau).

    python bench/drafter_replay.py --deployment smollm2-cpu --set humaneval --limit 72 \\
        --outputs /tmp/ar-humaneval.json --drafter parallel --parallel-config '{"copy_min_match": 0}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, load_deployment, load_engine
from specpilot.harness.replay import Replay
from specpilot.harness.requests import encode_requests, load_requests
from specpilot.services.master.costmodel import pooled_replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    ap.add_argument("--set", default=None, help="one request set of the deployment (default: all)")
    ap.add_argument("--limit", type=int, default=72, help="first dev requests of the set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--outputs", type=Path, default=None,
                    help="AR outputs cache (JSON): read when it exists and matches, else generated and written")
    ap.add_argument("--drafter", default="parallel")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--options", default="{}", help="other engine options (JSON), e.g. drafter_weights")
    ap.add_argument("--parallel-config", default="{}",
                    help="inference fields of the parallel drafter's config replaced (JSON), e.g. copy_min_match")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    dep = load_deployment(args.deployment)
    reqs = [r for r in load_requests(dep, "dev") if args.set in (None, r.set)][: args.limit]
    if not reqs:
        raise SystemExit(f"no dev requests in set {args.set!r} of {dep.name}: sets are {dep.request_sets}")
    engine = load_engine(dep, {**json.loads(args.options), "drafter": args.drafter, "block_size": args.block_size})
    prompts = encode_requests(reqs, engine.tokenizer)
    # AR runs with the same engine options (dtype, backend) as the drafter's engine: its outputs are
    # what that system must reproduce.
    ar_options = {**json.loads(args.options), "drafter": "none"}
    for drafting_only in ("block_size", "drafter_weights"):  # AR's outputs (and their cache) do not depend on them
        ar_options.pop(drafting_only, None)
    key = {"deployment": dep.name, "requests": [r.id for r in reqs], "max_new_tokens": args.max_new_tokens,
           **({"options": ar_options} if len(ar_options) > 1 else {})}
    cached = json.loads(args.outputs.read_text()) if args.outputs and args.outputs.is_file() else None
    if cached is None or cached.get("key") != key:
        ar = load_engine(dep, ar_options)
        outputs = [ar.generate(p, args.max_new_tokens).tokens for p in track(prompts, "AR outputs")]
        if args.outputs:
            args.outputs.write_text(json.dumps({"key": key, "outputs": outputs}))
    else:
        outputs = cached["outputs"]

    changes = json.loads(args.parallel_config)
    t0, depth_lists = time.perf_counter(), []
    for prompt, out in track(list(zip(prompts, outputs, strict=True)), "replay"):
        replay = Replay(engine, prompt, out)
        drafter = replay.drafter(args.drafter)
        if changes and drafter is not None:
            drafter.cfg = drafter.net.cfg = dataclasses.replace(drafter.cfg, **changes)
        depth_lists.append(replay.depths(args.drafter, args.block_size, 1))  # the first candidate: a chain
    tau = pooled_replay(depth_lists, budgets=(args.block_size,))[args.block_size]
    tokens = sum(len(d) - 1 for d in depth_lists)
    result = {"bench": "drafter_replay", "deployment": dep.name, "set": args.set, "requests": len(depth_lists),
              "drafter": args.drafter, "block_size": args.block_size, "options": json.loads(args.options),
              "parallel_config": changes, "tokens": tokens, "tau": round(tau, 4),
              "replay_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d"),
              # each request's own tau, to see where a drafter gains (e.g. against what it was trained on)
              "per_request": {r.id: round(pooled_replay([d], budgets=(args.block_size,))[args.block_size], 4)
                              for r, d in zip(reqs, depth_lists, strict=True)}}
    table = Table(title=f"{args.drafter} chain of {args.block_size}, {len(depth_lists)} {args.set or 'dev'} requests")
    for col in ("tokens", "steps", "tau"):
        table.add_column(col, justify="right")
    table.add_row(str(tokens), f"{tokens / tau:.0f}", f"{tau:.4f}")
    Console(stderr=True).print(table)
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
