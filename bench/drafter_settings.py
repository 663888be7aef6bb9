"""Benchmark: several decoding settings of one model side by side, request by request, against AR.

One process loads the model once; AR and every ``--setting`` (engine options that do not change the
model: drafter, block size, verification, tree nodes, ...) answer each request in turn, so all of
them see the same machine state (a noisy VM drifts by 10-30% over minutes). Per setting: tokens/s
and its ratio to AR's, tau, the share of outputs identical to AR's, and the mean host time of a
step's drafting and of its verification with the mean tokens a verification runs (T). Prints a
table, then one JSON line.

    python bench/drafter_settings.py --set humaneval --limit 16 --options '{"dtype": "bf16",
        "linear_backend": "onednn_all", "drafter": "parallel"}' --setting block_size=4 \\
        --setting block_size=8 --setting block_size=8,verify=tree,tree_nodes=12

The timed comparison with a confidence interval is `specpilot bench`; this is for choosing
settings quickly (2026-12-02: 16 requests x 5 settings in about 4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from specpilot.engine.api import MODEL_OPTIONS, Engine
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, load_deployment, load_engine
from specpilot.harness.requests import encode_requests, load_requests


def parse_setting(text: str) -> dict[str, str]:
    """``"block_size=8,verify=tree"`` -> {"block_size": "8", "verify": "tree"} (values coerced later)."""
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--setting {text!r}: expected option=value[,option=value...]")
    setting = dict(pairs)
    if shared := sorted(set(setting) & set(MODEL_OPTIONS)):
        raise SystemExit(f"--setting {text!r} changes the model ({', '.join(shared)}): put it in --options, "
                         "which every setting and AR share")
    return setting


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    ap.add_argument("--set", default=None, help="one request set of the deployment (default: all)")
    ap.add_argument("--limit", type=int, default=16, help="dev requests")
    ap.add_argument("--offset", type=int, default=0, help="skip this many dev requests first")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--options", default="{}", help="engine options every setting and AR share (JSON)")
    ap.add_argument("--setting", action="append", default=[], type=parse_setting,
                    help="option=value[,option=value...] on top of --options; repeat for each setting")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.setting:
        ap.error("give at least one --setting")
    torch.set_num_threads(args.threads)

    dep = load_deployment(args.deployment)
    reqs = [r for r in load_requests(dep, "dev") if args.set in (None, r.set)][args.offset: args.offset + args.limit]
    if not reqs:
        raise SystemExit(f"no dev requests in set {args.set!r} of {dep.name}: sets are {dep.request_sets}")
    shared = json.loads(args.options)
    ar = load_engine(dep, {**shared, "drafter": "none"})
    engines = {"AR": ar}
    for setting in args.setting:
        name = ",".join(f"{k}={v}" for k, v in setting.items())
        engines[name] = Engine(ar.model, ar.tokenizer, dep.options({**shared, **setting}))
    prompts = encode_requests(reqs, ar.tokenizer)

    stats = {name: {"s": 0.0, "tokens": 0, "steps": 0, "committed": 0, "identical": 0,
                    "draft": [], "verify": [], "verified": []} for name in engines}
    for prompt in track(prompts, "requests", console=Console(stderr=True)):
        reference = None
        for name, engine in engines.items():
            t0 = time.perf_counter()
            g = engine.generate(prompt, args.max_new_tokens)
            s = stats[name]
            s["s"] += time.perf_counter() - t0
            reference = g.tokens if reference is None else reference
            s["tokens"] += len(g.tokens)
            s["identical"] += g.tokens == reference
            s["steps"] += g.steps
            s["committed"] += sum(g.accepted_per_step)
            s["draft"] += g.draft_s
            s["verify"] += g.verify_s
            s["verified"] += g.verified_per_step

    ar_rate = stats["AR"]["tokens"] / stats["AR"]["s"]
    rows = []
    for name, s in stats.items():
        rate = s["tokens"] / s["s"]
        rows.append({"setting": name, "tok_s": round(rate, 2), "speedup": round(rate / ar_rate, 3),
                     "tau": round(s["committed"] / max(1, s["steps"]), 3),
                     "identical": f"{s['identical']}/{len(prompts)}",
                     "draft_ms": round(statistics.fmean(s["draft"]) * 1e3, 2),
                     "verify_ms": round(statistics.fmean(s["verify"]) * 1e3, 2),
                     "T": round(statistics.fmean(s["verified"]), 2)})
    table = Table(title=f"{len(prompts)} {args.set or 'dev'} requests x {args.max_new_tokens} tokens, {dep.name}, "
                        f"options {shared}")
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in rows:
        table.add_row(*map(str, row.values()))
    Console(stderr=True).print(table)
    print(json.dumps({"bench": "drafter_settings", "deployment": dep.name, "set": args.set, "requests": len(prompts),
                      "offset": args.offset, "max_new_tokens": args.max_new_tokens, "options": shared,
                      "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "rows": rows},
                     separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
