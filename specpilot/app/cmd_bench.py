"""`specpilot bench`: where a deployment's speed comes from, measured on its dev requests.

Figures (all greedy, batch 1, one engine process):
- ``t_AR``: mean time of one AR step (one target forward of one token + argmax), from plain decoding.
- ``tau(N)``, ``t_step(N)``: mean tokens committed per step and mean step time (draft + verify)
  with N draft tokens per step; ``c(N) = t_step(N) / t_AR``; ``S(N) = tau(N) / c(N)``.
- End to end: the system (the deployment's options plus overrides) against AR, request by
  request, alternating which runs first (ABBA); per pair ``r = t_AR / t_system``; the speedup is
  ``exp(mean log r)`` with a 95% t-interval. Also whether the outputs were identical.
- Profile: one request through the system with timers around every module of a kernel class
  (attention core, q/k/v/o/gate/up/down linears, LM head, norms, embedding), the drafter, and host
  overhead = step time minus all of those. On CUDA a class's time is its kernels' device time (the
  PyTorch profiler), so a launch-bound step shows up as host overhead; the CPU uses the wall clock.
- CUDA graphs (``--cuda-graphs``): every shape a run needs is captured in an untimed warm-up pass
  over all the prompts; the end-to-end AR reference keeps the deployment's stock setting, so graphs
  count towards the speedup, while ``c(N)`` compares steps under the same setting. The per-module
  profile is skipped under graphs (a replay runs no module hooks).
- Peer: transformers' assisted generation with prompt lookup (``prompt_lookup_num_tokens``) on the
  same weights, against transformers' own greedy generation, when transformers is installed.
- llama.cpp, side by side (SmolLM2 targets, when ``scripts/build_llamacpp.sh`` has built it here; it is
  never built for a bench): ``llama-server`` with the stock flags of ``llamacpp-smollm2-cpu`` (AR) and
  with ``--llamacpp-spec`` (its n-gram speculation) on the same prompts, paired as above, for each of
  the shipped Q4_1 GGUF and BF16/F32 GGUFs made from it by ``llama-quantize --allow-requantize``
  (cached in the data folder): tokens/s and speedup over its own AR, beside this engine's.

A batched deployment (``mode = "batched"``) is measured by throughput under closed-loop load instead
(`specpilot.app.cmd_bench_batched`): tokens/s, latency, time to first token, tau and ``c(N, B)``.

Prints a rich table, writes ``tau.png`` and ``speedup.png`` (matplotlib) and ``bench.json`` into
``--out``, and prints the whole result as JSON on the last line. This module is the command (flags,
tables, plots); the measurements are the harness's (`specpilot.harness.speed`, `.profile`, `.peer`), and
it changes nothing it measures. Torch loads when the command runs, not when the CLI starts.

    python -m specpilot.app.cmd_bench --deployment smollm2-cpu   # the same as `specpilot bench`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specpilot import output
from specpilot.app.bench_common import draft_lengths, llamacpp_rows, output_dir, report
from specpilot.errors import UserError, json_object, positive_int
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, Deployment, load_deployment


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="deployment name or TOML path")
    ap.add_argument("--limit", type=positive_int, default=None, help="dev requests to use (default: the deployment's bench_requests)")
    ap.add_argument("--set", default=None, help="only dev requests of this request set (e.g. humaneval, chat)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the deployment's")
    ap.add_argument("--ns", default="1,2,4,8", help="draft lengths N for tau(N), c(N), S(N); '' skips the sweep")
    ap.add_argument("--trials", type=positive_int, default=1, help="paired AR/system runs per request")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="folder for plots and bench.json (default: <data>/bench/<deployment>)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-requests", type=positive_int, default=4,
                    help="first requests the peer (transformers' prompt lookup) runs on; the e2e comparison "
                         "covers the same ones when this equals --limit")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--clients", type=positive_int, default=None,
                    help="batched deployments: closed-loop clients (default: the deployment's concurrency; more than "
                         "its rows queue)")
    ap.add_argument("--batch-sizes", default=None,
                    help="batched deployments: rows B of the c(N, B) table (default: 1,2,4,<concurrency>)")
    ap.add_argument("--reps", type=positive_int, default=5, help="batched deployments: timed forwards a c(N, B) cell")
    ap.add_argument("--runs", type=positive_int, default=1,
                    help="batched deployments: closed-loop loads a system, interleaved across systems; the median "
                         "one is reported (one GPU run's throughput moved ~10%% between loads, 2026-12-06)")
    ap.add_argument("--passes", type=positive_int, default=1,
                    help="batched deployments: times a load sends the request set (a longer load shortens its "
                         "drain, where the last requests finish with fewer clients busy)")
    ap.add_argument("--stock-options", type=json_object, default=None,
                    help="batched deployments: JSON of option overrides the 'stock' row runs instead of the "
                         "deployment's stock (batched AR stays the deployment's): two systems A/B'd in one "
                         "process, both beside batched AR in every load, e.g. '{\"drafter\": \"parallel\"}'")
    ap.add_argument("--server-options", default="{}",
                    help="server deployments: JSON of the system's [server.options] settings, e.g. "
                         "'{\"spec_type\": \"ngram-simple\"}' (AR: the deployment's stock flags)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp rows (run when it is built)")
    ap.add_argument("--llamacpp-spec", default='{"spec_type": "ngram-map-k", "map_k_size_n": 3, "map_k_size_m": 8}',
                    help="JSON of llamacpp-smollm2-cpu's [server.options]: llama.cpp's speculative system "
                         "in the side-by-side rows")
    from specpilot.engine.options import add_option_flags

    add_option_flags(ap)


def add_commands(subparsers) -> None:
    """Register ``bench`` on an argparse subparsers object (its ``func`` returns an exit status)."""
    p = subparsers.add_parser("bench", help="measure tau(N), c(N), S(N), end-to-end speedup and a profile",
                              description=__doc__.split("\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpilot bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`specpilot bench`: the deployment resolved once, then the bench of its kind."""
    dep = load_deployment(args.deployment)
    if dep.mode != "batched" and (args.passes > 1 or args.stock_options is not None):
        raise UserError(f"--passes and --stock-options are for batched deployments; {dep.name} is "
                        f"mode {dep.mode!r}")
    if dep.server:
        return run_server(args, dep)
    if dep.mode == "batched":
        from specpilot.app.cmd_bench_batched import run_batched

        return run_batched(args, dep)
    return run_engine(args, dep)


def run_engine(args: argparse.Namespace, dep: Deployment) -> int:
    """`specpilot bench` on a batch-1 engine deployment (see the module docstring)."""
    import platform

    import torch

    from specpilot.engine.api import MODEL_OPTIONS, Engine
    from specpilot.engine.options import overrides_from_args
    from specpilot.harness.peer import llamacpp_side_by_side, peer
    from specpilot.harness.profile import profile
    from specpilot.harness.requests import bench_requests, encode_requests, fit_context
    from specpilot.harness.speed import end_to_end, sweep, system_and_stock_models, warm_up

    opts = dep.options(overrides_from_args(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or dep.device)
    max_new = args.max_new_tokens or dep.max_new_tokens
    ns = draft_lengths(args.ns)

    model, stock_model, tok = system_and_stock_models(dep, opts, device, args.data_dir)
    stock = dep.options()
    requests = bench_requests(dep, args.set, args.limit)
    prompts = fit_context(encode_requests(requests, tok), model.cfg.max_seq_len, max_new)
    sys_engine = Engine(model, tok, opts)
    # AR keeps the deployment's stock model and CUDA-graph setting, so they count towards the speedup too.
    ar_opts = opts.replace(drafter="none", cuda_graphs=stock.cuda_graphs, **{k: getattr(stock, k) for k in MODEL_OPTIONS})
    ar_engine = Engine(stock_model, tok, ar_opts)
    for e in (sys_engine, ar_engine):
        warm_up(e, prompts, max_new)

    result: dict = {
        "bench": "engine", "deployment": dep.name, "target": dep.target,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "options": opts.to_dict(), "requests": len(prompts), "request_set": args.set or "all", "max_new_tokens": max_new,
        "date": time.strftime("%Y-%m-%d"),
    }
    if ns:
        result["sweep"] = sweep(model, tok, opts, ns, prompts, max_new)
    result["e2e"] = end_to_end(sys_engine, ar_engine, prompts, max_new, args.trials)
    if not args.no_profile and sys_engine.graphs:
        result["profile_skipped"] = "CUDA graphs: a replay runs no module hooks"
    elif not args.no_profile:
        result["profile_ms"] = profile(sys_engine, prompts[0], max_new)
    if not args.no_peer:
        try:
            few = prompts[: max(1, min(args.peer_requests, len(prompts)))]
            reference = [ar_engine.generate(p, max_new).tokens for p in few]
            result["peer"] = peer(stock_model, dep, opts, few, max_new, reference)
        except Exception as e:  # the peer is a comparison, never a reason to lose the bench
            result["peer"] = {"error": f"{type(e).__name__}: {e}"}
    peer_rows = llamacpp_rows(args, dep, device, lambda spec: llamacpp_side_by_side(
        prompts, max_new, args.trials, spec, tok, args.data_dir))
    if peer_rows is not None:
        result["llamacpp"] = peer_rows
    return report(result, output_dir(args, dep), _table, None if not ns or args.no_plots else _plots)


def run_server(args: argparse.Namespace, dep: Deployment) -> int:
    """`run` for a server deployment: the server with ``--server-options`` against its stock flags (AR,
    when stock runs no speculative decoding), paired end to end on the dev requests; one server each."""
    import platform

    from specpilot.engine.weights import load_tokenizer
    from specpilot.harness.requests import bench_requests, encode_requests
    from specpilot.harness.server import ServerEngine
    from specpilot.harness.speed import end_to_end, warm_up

    try:
        overrides = json.loads(args.server_options)
        spec = dep.server_spec()
        spec.settings(overrides)
    except ValueError as exc:
        raise UserError(f"--server-options: {exc}") from None
    max_new = args.max_new_tokens or dep.max_new_tokens
    tok = load_tokenizer(dep.target, data_dir=args.data_dir)
    prompts = encode_requests(bench_requests(dep, args.set, args.limit), tok)
    with ServerEngine(spec, overrides, tok) as system, ServerEngine(spec, {}, tok) as ar:
        for e in (system, ar):
            warm_up(e, prompts, max_new)
        e2e = end_to_end(system, ar, prompts, max_new, args.trials)
        argv = system.argv
    result = {"bench": "server", "deployment": dep.name, "target": dep.target, "api": spec.api,
              "device": f"cpu ({platform.machine()})", "options": spec.settings(overrides), "command": argv,
              "requests": len(prompts), "request_set": args.set or "all", "max_new_tokens": max_new,
              "date": time.strftime("%Y-%m-%d"), "e2e": e2e}
    return report(result, output_dir(args, dep), _table)


def _table(result: dict) -> None:
    from rich.table import Table

    console = output.console(stderr=True)
    if "sweep" in result:
        t = Table(title=f"{result['deployment']}: t_AR = {result['sweep']['t_ar_ms']:.2f} ms")
        for col in ("N", "tau", "t_step ms", "c", "S"):
            t.add_column(col, justify="right")
        for r in result["sweep"]["rows"]:
            t.add_row(str(r["n"]), f"{r['tau']:.2f}", f"{r['t_step_ms']:.2f}", f"{r['c']:.2f}", f"{r['S']:.2f}")
        console.print(t)
    e = result["e2e"]
    console.print(f"end to end: AR {e['ar_tok_s']:.1f} tok/s, system {e['sys_tok_s']:.1f} tok/s, speedup "
                  f"{e['speedup']:.3f} (95% CI {e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}, {e['pairs']} pairs), "
                  f"tau {e['tau']:.2f}, identical outputs {100 * e['identical_outputs']:.0f}%")
    if "profile_ms" in result:
        t = Table(title="per-step profile (ms)")
        t.add_column("class")
        t.add_column("ms/step", justify="right")
        t.add_column("share", justify="right")
        total = result["profile_ms"]["step_total"]
        for k, v in result["profile_ms"].items():
            if k != "step_total":
                t.add_row(k, f"{v:.3f}", f"{100 * v / total:.1f}%")
        t.add_row("step total", f"{total:.3f}", "100%")
        console.print(t)
    if "llamacpp" in result and "rows" in result["llamacpp"]:
        t = Table(title=f"side by side, {e['pairs']} requests: this engine ({result['options'].get('dtype')}) and "
                        f"llama.cpp ({result['llamacpp']['threads']} threads, {json.dumps(result['llamacpp']['options'])})")
        for col in ("system", "AR tok/s", "system tok/s", "speedup over its AR", "identical"):
            t.add_column(col, justify="right")
        t.add_row("this engine", f"{e['ar_tok_s']:.1f}", f"{e['sys_tok_s']:.1f}", f"{e['speedup']:.2f}x",
                  f"{100 * e['identical_outputs']:.0f}%")
        for fmt, r in result["llamacpp"]["rows"].items():
            t.add_row(f"llama.cpp {fmt}", f"{r['ar_tok_s']:.1f}", f"{r['sys_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{100 * r['identical_outputs']:.0f}%")
        console.print(t)
    elif "llamacpp" in result:
        console.print(f"llama.cpp: {result['llamacpp'].get('skipped') or result['llamacpp'].get('error')}")
    if "peer" in result and "speedup" in result["peer"]:
        p = result["peer"]
        console.print(f"peer (transformers prompt lookup, k={p['prompt_lookup_num_tokens']}): "
                      f"{p['prompt_lookup_tok_s']:.1f} vs greedy {p['greedy_tok_s']:.1f} tok/s = {p['speedup']:.2f}x")


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sweep"]["rows"]
    ns = [r["n"] for r in rows]
    files = []
    for key, label, fname in (("tau", "tau(N): tokens per step", "tau.png"), ("S", "S(N) = tau / c", "speedup.png")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(ns, [r[key] for r in rows], marker="o")
        if key == "S":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("N (draft tokens per step)")
        ax.set_ylabel(label)
        ax.set_title(f"{result['deployment']} · {result['options']['verify']} · {result['device']}")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        files.append(str(out / fname))
    return files



if __name__ == "__main__":
    sys.exit(main())
