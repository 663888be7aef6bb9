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

from specpilot.engine.api import Engine  # noqa: E402
from specpilot.engine.options import add_option_flags, overrides_from_args  # noqa: E402
from specpilot.harness.deployment import load_deployment  # noqa: E402
from specpilot.harness.loadgen import closed_loop  # noqa: E402
from specpilot.harness.requests import bench_requests, encode_requests, fit_context  # noqa: E402
from specpilot.harness.speed import system_and_stock_models  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default="smollm2-h200-batched")
    ap.add_argument("--limit", type=int, default=None, help="dev requests (default: the deployment's bench_requests)")
    ap.add_argument("--set", default=None, help="only dev requests of this request set")
    ap.add_argument("--top", type=int, default=25, help="functions listed a table")
    ap.add_argument("--gpu-times", action="store_true",
                    help="CUDA: after the loads, replay each captured graph alone (verify steps by (T, length), "
                         "prompt buckets, the device chain proposal) and print its GPU and host-launch time")
    add_option_flags(ap)
    args = ap.parse_args()
    dep = load_deployment(args.deployment)
    if dep.mode != "batched":
        ap.error(f"{dep.name} is not a batched deployment")
    opts = dep.options(overrides_from_args(args))
    device = torch.device(dep.device)
    model, _, tok = system_and_stock_models(dep, opts, device)
    prompts = fit_context(encode_requests(bench_requests(dep, args.set, args.limit), tok), model.cfg.max_seq_len, dep.max_new_tokens)
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
    graph_times = replay_times(decoder) if args.gpu_times and device.type == "cuda" else {}
    for name, (gpu_ms, launch_ms) in graph_times.items():
        print(f"{name:>28}: {gpu_ms:.3f} ms on the GPU, {launch_ms:.3f} ms to launch")
    print(json.dumps({"bench": "batch_profile", "deployment": dep.name, "options": opts.changed(),
                      "tok_s": summary["tok_s"], "time_split": summary["time_split"], "steps": len(load.step_rows),
                      "graph_ms": graph_times}))
    return 0


def replay_times(decoder, reps: int = 100) -> dict[str, tuple[float, float]]:
    """Each captured graph of ``decoder`` replayed alone ``reps`` times after a warm-up: (median GPU ms a
    replay, from CUDA events; median host ms to launch one). A replay rewrites what its last use wrote (the
    load is over), so nothing is changed."""
    import statistics
    import time

    graphs = {}
    for kind, runner in (("verify", decoder.runner), ("prompt", decoder.prefill_runner)):
        if runner is not None:  # none without cuda_graphs
            graphs.update({f"{kind} T={T} len={length}": c.graph for (T, length), c in runner._graphs.items()})
    shared = getattr(decoder.drafters[0], "shared", None)
    if shared is not None and getattr(shared, "chains", None) is not None and shared.chains.graph is not None:
        graphs[f"device chains, {shared.chains.rows} rows"] = shared.chains.graph
    out = {}
    for name, graph in sorted(graphs.items()):
        gpu, launch = [], []
        for i in range(reps + 10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            if i >= 10:
                gpu.append(a.elapsed_time(b))
                launch.append(1e3 * (t1 - t0))
        out[name] = (round(statistics.median(gpu), 4), round(statistics.median(launch), 4))
    return out


if __name__ == "__main__":
    sys.exit(main())
