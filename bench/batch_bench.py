"""Batched serving on the CPU: throughput of continuous batching with and without speculation, same load.

SmolLM2-135M (fp32 or bf16, the ``stream`` linears: rows batch-invariant) answers the dev requests of a
deployment (HumanEval and chat) under ``--concurrency`` closed-loop clients (`specpilot.harness.loadgen`):
batched AR (no drafter) against batched speculation (the n-gram drafter, chain of ``--block`` tokens; and
the parallel drafter where its weights ship), every system on the same requests in the same order. The
stock of a batched deployment is the same draft length and chain for every request and each prompt
admitted as a step of its own (`specpilot.engine.batch`). Reports output tokens/s, p50/p99 latency and
time to first token, tau, the forward's seconds by rows in flight, and the speedup over batched AR;
checks that every system's tokens equal batched AR's (lossless). Prints a table, then one JSON line.

Usage: ``python bench/batch_bench.py [--concurrency 8] [--requests 16] [--max-new-tokens 128]
[--dtype fp32] [--drafters none,ngram,parallel] [--block 4] [--threads 2] [--node-budget N]
[--adaptive-block]`` (the last two: `specpilot.engine.batch.BatchPolicy`; AR drafts nothing either way)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specpilot.engine.api import apply_model_options
from specpilot.engine.batch import BatchDecoder, BatchPolicy
from specpilot.engine.decode import DecodeConfig
from specpilot.engine.drafters import make_drafter
from specpilot.engine.options import EngineOptions
from specpilot.engine.weights import load_model
from specpilot.harness.deployment import load_deployment
from specpilot.harness.loadgen import closed_loop
from specpilot.harness.requests import encode_requests, fit_context, load_requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default="smollm2-cpu")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16, help="requests answered in all (the load's length)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--drafters", default="none,ngram,parallel")
    ap.add_argument("--block", type=int, default=4, help="draft tokens a step (a chain)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--node-budget", type=int, default=0, help="BatchPolicy.node_budget of the speculative systems")
    ap.add_argument("--adaptive-block", action="store_true", help="BatchPolicy.adaptive_block of the speculative systems")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dep = load_deployment(args.deployment)
    model, tok = load_model(dep.target, dtype=args.dtype)
    base = EngineOptions(linear_backend="stream").resolved(dtype=args.dtype)
    model = apply_model_options(model, base)
    prompts = fit_context(encode_requests(load_requests(dep, "dev"), tok), model.cfg.max_seq_len, args.max_new_tokens)
    max_len = max(map(len, prompts)) + args.max_new_tokens + args.block + 1
    cfg = DecodeConfig(block_size=args.block)
    rows, reference = [], None
    for name in args.drafters.split(","):
        opts = base.replace(drafter=name)
        drafters = [make_drafter(opts, model) for _ in range(args.concurrency)]
        policy = BatchPolicy(node_budget=args.node_budget, adaptive_block=args.adaptive_block)
        decoder = BatchDecoder(model, drafters, cfg, rows=args.concurrency, max_len=max_len,
                               stop_ids=model.cfg.stop_ids, policy=policy)
        closed_loop(decoder, prompts[:2], min(2, args.concurrency), 8, 2)  # warm up kernels and caches
        load = closed_loop(decoder, prompts, args.concurrency, args.max_new_tokens, args.requests)
        outputs = {r.request_id: r.tokens for r in load.requests}
        if reference is None:
            reference = outputs
        summary = load.summary()
        summary.update(system=name, lossless=outputs == reference)
        rows.append(summary)
    ar = rows[0]["tok_s"]
    print(f"{args.concurrency} clients, {args.requests} requests x {args.max_new_tokens} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'system':>9} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'p50 s':>6} {'p99 s':>6} {'ttft p50':>9} "
          f"{'lossless':>8}  step s by rows")
    for r in rows:
        r["speedup_over_batched_ar"] = r["tok_s"] / ar
        print(f"{r['system']:>9} {r['tok_s']:>7.1f} {r['speedup_over_batched_ar']:>7.2f}x {r['tau']:>5.2f} "
              f"{r['latency_p50_s']:>6.2f} {r['latency_p99_s']:>6.2f} {r['ttft_p50_s']:>9.3f} {r['lossless']!s:>8}  "
              f"{r['step_s_by_rows']}")
    print(json.dumps({"bench": "batch", "date": time.strftime("%Y-%m-%d"), "deployment": dep.name,
                      "dtype": args.dtype, "concurrency": args.concurrency, "requests": args.requests,
                      "max_new_tokens": args.max_new_tokens, "block": args.block, "threads": torch.get_num_threads(),
                      "machine": platform.processor() or platform.machine(), "systems": rows}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
