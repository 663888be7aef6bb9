"""The host's part of a batched decode step: `BatchDecoder.step`'s wall time less the target forward's
(`StepRecord.forward_s`), by drafter, over full steps only. On a GPU a graphed SmolLM2 step is ~1 ms, so the
per-row host work (drafting, acceptance, bookkeeping) decides what batched speculation gains there; this
measures it anywhere (the tiny random-weight model by default: its forward is cheap, so the host part shows).

    PYTHONPATH=. python bench/batch_host.py [--model tiny] [--rows 32] [--requests 64] [--max-new-tokens 96]

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

from specpilot.engine.batch import BatchDecoder, BatchRequest  # noqa: E402
from specpilot.engine.decode import DecodeConfig  # noqa: E402
from specpilot.engine.drafters.ngram import NgramDrafter  # noqa: E402
from specpilot.engine.model import build_random, get_config  # noqa: E402


def host_time(model, drafter: str, rows: int, prompts: list[list[int]], max_new: int, block: int) -> dict:
    """Mean wall, forward and host seconds of the full steps (every row busy, no prefill) of one run."""
    drafters = [NgramDrafter(min_match=1) if drafter == "ngram" else None for _ in range(rows)]
    dec = BatchDecoder(model, drafters, DecodeConfig(block_size=block), rows=rows,
                       max_len=max(map(len, prompts)) + max_new + block + 1, stop_ids=())
    for i, p in enumerate(prompts):
        dec.submit(BatchRequest(f"r{i}", p, max_new))
    full = []
    while dec.busy:
        t0 = time.perf_counter()
        record = dec.step()
        wall = time.perf_counter() - t0
        if record is not None and record.rows == rows and not record.prefills:
            full.append((wall, record.forward_s, record.committed))
    n = max(1, len(full))
    wall, fwd = sum(f[0] for f in full) / n, sum(f[1] for f in full) / n
    return {"drafter": drafter, "steps": len(full), "step_ms": 1e3 * wall, "forward_ms": 1e3 * fwd,
            "host_ms": 1e3 * (wall - fwd), "host_us_a_row": 1e6 * (wall - fwd) / rows,
            "tokens_a_step": sum(f[2] for f in full) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a config of specpilot.engine.model.CONFIGS (random weights)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if min(args.rows, args.requests, args.prompt_tokens, args.max_new_tokens, args.block_size) < 1:
        ap.error("rows, requests, prompt tokens, max new tokens and block size must be positive")
    torch.set_num_threads(args.threads)
    model = build_random(get_config(args.model), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompts = []
    for _ in range(args.requests):  # half random, half a repeat: the n-gram drafter finds matches
        body = torch.randint(0, vocab, (args.prompt_tokens // 2,), generator=g).tolist()
        prompts.append(body + body)
    rows = [host_time(model, d, args.rows, prompts, args.max_new_tokens, args.block_size) for d in ("none", "ngram")]
    cpu = platform.processor() or platform.machine()
    print(f"host part of a batched step: {args.model} (random weights), {args.rows} rows, {args.threads} thread(s), {cpu}")
    print(f"{'drafter':>8} {'steps':>6} {'step ms':>8} {'fwd ms':>8} {'host ms':>8} {'us/row':>7} {'tok/step':>9}")
    for r in rows:
        print(f"{r['drafter']:>8} {r['steps']:>6} {r['step_ms']:>8.2f} {r['forward_ms']:>8.2f} {r['host_ms']:>8.2f} "
              f"{r['host_us_a_row']:>7.0f} {r['tokens_a_step']:>9.1f}")
    print(json.dumps({"bench": "batch_host", "model": args.model, "rows": args.rows, "threads": args.threads,
                      "cpu": cpu, "date": time.strftime("%Y-%m-%d"), "results": rows}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
