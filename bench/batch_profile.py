"""Where a batched deployment's host time goes: cProfile over one warm closed-loop load.

`specpilot bench` on a batched deployment says how a step's wall time splits (prefill, draft, forward,
other); this names the functions behind the host's part, for the system the option flags describe. The
load runs once untimed first (every CUDA graph captured), then once under cProfile.

    PYTHONPATH=. python bench/batch_profile.py --deployment smollm2-h200-batched --drafter parallel [--limit 64]

Prints the loop's tokens/s and time split, the top functions by own time and by cumulative time, then one
JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.harness.bench import dev_requests, system_and_stock_models  # noqa: E402
from specpilot.harness.deployment import load_deployment  # noqa: E402
from specpilot.harness.loadgen import closed_loop  # noqa: E402
from specpilot.harness.requests import encode_requests, fit_context  # noqa: E402
from specpilot_engine.api import Engine  # noqa: E402
from specpilot_engine.options import add_option_flags, overrides_from_args  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default="smollm2-h200-batched")
    ap.add_argument("--limit", type=int, default=None, help="dev requests (default: the deployment's bench_requests)")
    ap.add_argument("--set", default=None, help="only dev requests of this request set")
    ap.add_argument("--top", type=int, default=25, help="functions listed a table")
    add_option_flags(ap)
    args = ap.parse_args()
    dep = load_deployment(args.deployment)
    if dep.mode != "batched":
        ap.error(f"{dep.name} is not a batched deployment")
    opts = dep.options(overrides_from_args(args))
    device = torch.device(dep.device)
    model, _, tok = system_and_stock_models(dep, opts, device)
    prompts = fit_context(encode_requests(dev_requests(dep, args), tok), model.cfg.max_seq_len, dep.max_new_tokens)
    decoder = Engine(model, tok, opts).batch_decoder(dep.concurrency, max(map(len, prompts)) + dep.max_new_tokens)
    closed_loop(decoder, prompts, dep.concurrency, dep.max_new_tokens, len(prompts))  # captures every graph
    profile = cProfile.Profile()
    profile.enable()
    load = closed_loop(decoder, prompts, dep.concurrency, dep.max_new_tokens, len(prompts))
    profile.disable()
    summary = load.summary()
    print(f"{dep.name} {opts.changed()}: {summary['tok_s']:.1f} tok/s (under cProfile), tau {summary['tau']:.2f}, "
          f"split {summary['time_split']}")
    tables = {}
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        tables[key] = out.getvalue()
        print(tables[key][tables[key].index("ncalls") - 2:] if "ncalls" in tables[key] else tables[key])
    print(json.dumps({"bench": "batch_profile", "deployment": dep.name, "options": opts.changed(),
                      "tok_s": summary["tok_s"], "time_split": summary["time_split"], "steps": len(load.step_rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
