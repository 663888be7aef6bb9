"""`specpilot bench` on a batched deployment (``mode = "batched"``): throughput under closed-loop load.

Figures (greedy, one engine process, `specpilot.engine.batch` through `Engine.batch_decoder`):
- Per system, the same dev requests sent by ``--clients`` closed-loop clients (default: the deployment's
  concurrency, which is also the decoder's rows; more clients than rows queue, never crash, and the table
  says how many waited): output tokens/s, time to first token and per-request latency (p50/p99), tau
  (tokens committed per row a step), draft tokens verified per row a step, the forward's seconds by
  rows in flight, the host's share of the steps (their time outside the forward: prefills, drafting,
  acceptance) and the steps' time split (prefill, draft, forward, other). Systems: batched AR (no
  drafter), the deployment's stock speculation (or, with ``--stock-options``, another system to A/B against
  in the same process: batched AR stays the deployment's), and the system (stock with the option flags) when it
  differs; speedups over batched AR and over stock speculation (ratios of the median loads' tokens/s; with
  ``--runs`` > 1 also the geometric mean of each load's ratio to the batched-AR load beside it, with its 95%
  interval: ``paired_over_batched_ar``, robust to a drift that moves every system alike); whether each one's
  tokens equal batched AR's (lossless: equal wherever the rows are batch-invariant). ``--passes`` sends the
  request set that many times a load (each pass's answers checked too): the whole load's tokens/s counts its
  drain, where the last requests finish with fewer clients busy (on a GPU at 32 clients and one pass, the
  slowest request lasted ~90% of a load, 2026-12-06); the steady tokens/s is the rate until the last request
  is sent, every client busy: throughput at the load's concurrency.
- ``c(N, B)``: the forward of B rows of N + 1 new tokens each (a root and N drafts) over a context of the
  requests' mean prompt length plus half the output, against the forward of B rows of one token (batched
  AR's step), median of ``--reps`` (replayed as CUDA graphs when the system runs them); and AR's own cost by
  rows, ``t(0, B) / t(0, 1)``. The ceiling of
  speculation at B rows with N drafts, were every draft accepted, is ``(N + 1) / c(N, B)``: where it is
  under the target, no drafter reaches it on this machine.

- llama.cpp's server as a peer (SmolLM2 targets on the CPU, when ``scripts/build_llamacpp.sh`` has built it):
  ``llama-server`` with one slot a client (``--parallel``) under the same closed-loop clients (threads over
  HTTP), AR and with its n-gram speculation (``--llamacpp-spec``), on the shipped Q4_1 GGUF: tokens/s beside
  this engine's.

Prints tables, writes ``batch_throughput.png`` and ``c_nb.png`` and ``bench.json`` into ``--out`` and the
whole result as JSON on the last line. The command's half for batched deployments (`specpilot.app.cmd_bench`
resolves the deployment and calls `run_batched`); the measurements are the harness's
(`specpilot.harness.loadgen`, `.step_cost`, `.peer`). It only measures.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specpilot import output
from specpilot.app.bench_common import draft_lengths, llamacpp_rows, output_dir, report
from specpilot.errors import UserError
from specpilot.harness.deployment import Deployment


def run_batched(args: argparse.Namespace, dep: Deployment) -> int:
    """`specpilot bench` on a batched deployment (see the module docstring)."""
    import platform

    import torch

    from specpilot.engine.api import Engine, apply_model_options
    from specpilot.engine.graphs import graphs_supported
    from specpilot.engine.options import overrides_from_args
    from specpilot.engine.weights import load_model
    from specpilot.harness.loadgen import closed_loop, frozen_heap
    from specpilot.harness.peer import llamacpp_closed_loop
    from specpilot.harness.requests import bench_requests, encode_requests, fit_context
    from specpilot.harness.speed import paired_speedup, system_and_stock_models
    from specpilot.harness.step_cost import cost_table

    opts = dep.options(overrides_from_args(args))
    stock = dep.options()
    compared = stock  # the 'stock' row: the deployment's stock, or the options to A/B against (--stock-options)
    if args.stock_options is not None:  # a JSON object (`json_object`)
        try:
            compared = dep.options(args.stock_options)
        except ValueError as exc:
            raise UserError(f"--stock-options: {exc}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or dep.device)
    max_new = args.max_new_tokens or dep.max_new_tokens
    rows = dep.concurrency
    clients = args.clients or rows
    ns = draft_lengths(args.ns)
    try:
        batch_sizes = sorted({int(x) for x in (args.batch_sizes or f"1,2,4,{rows}").split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--batch-sizes are comma-separated integers, got {args.batch_sizes!r}") from None
    if any(b < 1 for b in batch_sizes):
        raise UserError("--batch-sizes must be at least 1")
    model, stock_model, tok = system_and_stock_models(dep, opts, device, args.data_dir)
    # both models were loaded at the system's dtype (`system_and_stock_models`)
    compared_model = next((m for m, o in ((stock_model, stock), (model, opts))
                           if compared.dtype == opts.dtype and _same_model(o, compared)), None)
    if compared_model is None:  # --stock-options changed the target's own options: a third copy of it
        compared_model = apply_model_options(load_model(dep.target, dtype=compared.dtype, device=device,
                                                        data_dir=args.data_dir)[0], compared)
    prompts = fit_context(encode_requests(bench_requests(dep, args.set, args.limit), tok), model.cfg.max_seq_len, max_new)
    systems = {"batched AR": (stock_model, stock.replace(drafter="none")), "stock": (compared_model, compared)}
    if opts != compared:
        systems["system"] = (model, opts)
    result: dict = {
        "bench": "batched", "deployment": dep.name, "target": dep.target,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "options": opts.changed(), "rows": rows, "clients": clients, "requests": len(prompts), "passes": args.passes,
        **({"stock_options": compared.changed()} if compared is not stock else {}),
        "request_set": args.set or "all", "max_new_tokens": max_new, "date": time.strftime("%Y-%m-%d"), "systems": {},
    }
    if clients > rows:
        result["queued"] = f"{clients} clients on {rows} rows: requests beyond the rows wait in the queue"
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in systems}
    loads: dict[str, list[dict]] = {name: [] for name in systems}
    decoders = {}
    for name, (m, o) in systems.items():
        decoder = decoders[name] = Engine(m, tok, o).batch_decoder(rows, max(map(len, prompts)) + max_new)
        # warm up kernels, rows and drafters; with CUDA graphs the whole load once, so that every graph the
        # timed run replays (prompt buckets, blocks, attention lengths) is captured before it, as a serving
        # engine captures its graphs at start-up
        graphed = decoder.runner is not None
        warm = prompts if graphed else prompts[:rows]
        closed_loop(decoder, warm, min(clients, rows), max_new if graphed else 8, len(warm))
    with frozen_heap():  # started: what is alive now leaves the collector's full passes
        for run in range(args.runs):  # interleaved: a drift of the machine touches every system alike
            for name, decoder in decoders.items():
                load = closed_loop(decoder, prompts, clients, max_new, args.passes * len(prompts))
                by_prompt: dict[int, list[list[int]]] = defaultdict(list)
                for r in load.requests:
                    by_prompt[r.prompt_index].append(r.tokens)
                # a prompt sent in several passes is one more check: each answer must be the first pass's
                outputs[name] += [[by_prompt[i][p] for i in range(len(prompts))] for p in range(args.passes)]
                loads[name].append(load.summary())
                output.console(stderr=True).print(f"{name}{f' (run {run + 1})' if args.runs > 1 else ''}: "
                                 f"{loads[name][-1]['tok_s']:.1f} tok/s")
    for name, (_, o) in systems.items():
        runs = sorted(loads[name], key=lambda s: s["tok_s"])
        result["systems"][name] = {**runs[(len(runs) - 1) // 2], "tok_s_runs": [s["tok_s"] for s in loads[name]],
                                   "options": o.changed()}
    ar, spec = result["systems"]["batched AR"]["tok_s"], result["systems"]["stock"]["tok_s"]
    ar_steady = result["systems"]["batched AR"]["steady_tok_s"]
    for name, s in result["systems"].items():
        s["speedup_over_batched_ar"] = s["tok_s"] / ar
        s["speedup_over_stock"] = s["tok_s"] / spec
        s["steady_speedup_over_batched_ar"] = s["steady_tok_s"] / ar_steady if ar_steady > 0 else 0.0
        s["lossless"] = all(run == outputs["batched AR"][0] for run in outputs[name] + outputs["batched AR"])
        if args.runs > 1:  # loads interleaved: load i of each system ran back to back, so they pair
            s["paired_over_batched_ar"] = paired_speedup(
                [math.log(a / b) for a, b in zip(s["tok_s_runs"], result["systems"]["batched AR"]["tok_s_runs"],
                                                 strict=True)])
    if ns:
        context = int(statistics.fmean(len(p) for p in prompts) + max_new / 2)
        graphs = opts.cuda_graphs and graphs_supported(device)  # c(N, B) of the steps the system runs
        result["cost"] = cost_table(model, batch_sizes, ns, context, args.reps, graphs=graphs)
    peer_rows = llamacpp_rows(args, dep, device,
                              lambda spec: llamacpp_closed_loop(prompts, max_new, clients, spec, tok))
    if peer_rows is not None:
        result["llamacpp"] = peer_rows
    return report(result, output_dir(args, dep), _table, None if args.no_plots else _plots)


def _same_model(a, b) -> bool:
    """Whether two option sets run the same target model (its `MODEL_OPTIONS` agree)."""
    from specpilot.engine.api import MODEL_OPTIONS

    return all(getattr(a, k) == getattr(b, k) for k in MODEL_OPTIONS)


def _rows_range(by_rows: dict[str, float]) -> str:
    """'1: 3.62 .. 32: 4.27' (ms a forward at the fewest and the most rows in flight; JSON has them all)."""
    if not by_rows:
        return ""
    keys = sorted(by_rows, key=int)
    return f"{keys[0]}: {1e3 * by_rows[keys[0]]:.2f} .. {keys[-1]}: {1e3 * by_rows[keys[-1]]:.2f}"


def _table(result: dict) -> None:
    from rich.table import Table

    console = output.console(stderr=True)
    passes = f" x {result['passes']} passes" if result.get("passes", 1) > 1 else ""
    if "stock_options" in result:  # the 'stock' row is another system (--stock-options)
        console.print(f"stock row: {result['stock_options']}")
    t = Table(title=f"{result['deployment']}: {result['clients']} closed-loop clients on {result['rows']} rows, "
                    f"{result['requests']} requests{passes} x {result['max_new_tokens']} tokens, {result['device']}; "
                    f"steady: until the last request is sent, every client busy")
    for col in ("system", "tok/s", "x batched AR", "paired x AR (95% CI)", "x stock", "steady tok/s", "steady x AR",
                "tau", "drafts/row", "p50 s", "p99 s", "TTFT p50 s", "TTFT p99 s", "host", "prefill/draft/fwd/other", "lossless",
                "step ms by rows"):
        t.add_column(col, justify="right")
    for name, s in result["systems"].items():
        runs = s.get("tok_s_runs", [])
        spread = f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""  # every load's, when several ran
        paired = s.get("paired_over_batched_ar")  # each load against the AR load beside it (--runs > 1)
        paired_text = f"{paired['speedup']:.3f} ({paired['ci95'][0]:.2f}-{paired['ci95'][1]:.2f})" if paired else ""
        t.add_row(name, f"{s['tok_s']:.1f}{spread}", f"{s['speedup_over_batched_ar']:.2f}", paired_text,
                  f"{s['speedup_over_stock']:.2f}",
                  f"{s['steady_tok_s']:.1f}", f"{s['steady_speedup_over_batched_ar']:.2f}",
                  f"{s['tau']:.2f}", f"{s['verified_per_row'] - 1:.2f}", f"{s['latency_p50_s']:.2f}",
                  f"{s['latency_p99_s']:.2f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.3f}",
                  f"{s['host_share']:.0%}", "/".join(f"{v:.0%}" for v in s.get("time_split", {}).values()),
                  str(s["lossless"]), _rows_range(s["step_s_by_rows"]))
    console.print(t)
    if "queued" in result:
        console.print(result["queued"])
    if rows := result.get("llamacpp", {}).get("rows"):
        lc = result["llamacpp"]
        t = Table(title=f"peer: llama.cpp {lc['format']}, {lc['slots']} slots, {lc['threads']} threads, same clients")
        for col in ("system", "tok/s", "x its AR", "x this engine's batched AR", "p50 s", "p99 s", "identical to its AR"):
            t.add_column(col, justify="right")
        ours = result["systems"]["batched AR"]["tok_s"]
        for name, r in rows.items():
            t.add_row(f"llama.cpp {name}", f"{r['tok_s']:.1f}", f"{r['tok_s'] / rows['AR']['tok_s']:.2f}",
                      f"{r['tok_s'] / ours:.2f}", f"{r['latency_p50_s']:.2f}", f"{r['latency_p99_s']:.2f}",
                      str(r.get("identical_to_ar", "")))
        console.print(t)
    elif "llamacpp" in result:
        console.print(f"llama.cpp: {result['llamacpp'].get('skipped') or result['llamacpp'].get('error')}")
    if "cost" in result:
        cost = result["cost"]
        ns = list(cost["rows"][0]["c"])
        t = Table(title=f"c(N, B): B rows of N drafts + a root against B rows of one token, context {cost['context']}")
        for col in ("B", "t_AR ms", "AR vs B=1", *[f"c({n})" for n in ns], *[f"ceiling N={n}" for n in ns]):
            t.add_column(col, justify="right")
        for r in cost["rows"]:
            t.add_row(str(r["b"]), f"{r['t_ar_ms']:.1f}", f"{r['ar_scaling']:.2f}", *[f"{r['c'][n]:.2f}" for n in ns],
                      *[f"{r['ceiling'][n]:.2f}" for n in ns])
        console.print(t)


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    names = list(result["systems"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, [result["systems"][n]["tok_s"] for n in names], color=["grey", "tab:blue", "tab:green"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['deployment']}: {result['clients']} clients, {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "batch_throughput.png", dpi=120)
    plt.close(fig)
    files.append(str(out / "batch_throughput.png"))
    if "cost" in result:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for r in result["cost"]["rows"]:
            ns = [int(n) for n in r["c"]]
            ax.plot(ns, list(r["c"].values()), marker="o", label=f"B = {r['b']}")
        ax.set_xlabel("N (draft tokens a row)")
        ax.set_ylabel("c(N, B): step cost in batched AR steps")
        ax.legend()
        ax.set_title(f"{result['deployment']} · {result['device']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "c_nb.png", dpi=120)
        plt.close(fig)
        files.append(str(out / "c_nb.png"))
    return files

