"""`specpilot round`: run one round on a deployment, following it in the ledger, and report.

Starts what is not running (local NATS, the five services; the controller with this command's
timing flags), asks the master to start or resume a round, prints each event of the round as it is
recorded (phase, directions, candidates, verdicts), and ends with the sealed table, PNG charts
under ``DATA/rounds/<round id>/`` and, with ``--json``, one JSON line:
``{round_id, stock_over_ar, final_over_ar, final_over_stock, lossless, ledger, final_commit, ...}``.
Interrupt it at any time: the round goes on in the services, and running the command again follows
(resumes) the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from rich.console import Console
from rich.markup import escape

from specpilot import bus, output, schema
from specpilot.app import cli
from specpilot.errors import (
    UserError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from specpilot.reads import Reads
from specpilot.service import add_connection_flags
from specpilot.services.master import plots
from specpilot.services.master.main import RPC_ROUND, round_defaults

console = output.console(stderr=True)
out = output.console()
ROUND_MINUTES = 15.0  # the default round's wall-clock budget (the master stops trying candidates in time)


def add_commands(sub) -> None:
    d = round_defaults()
    p = sub.add_parser("round", help="run a round: measure, plan, patch, time, promote, sealed final",
                       description=__doc__.split("\n\n")[0])
    add_connection_flags(p)
    p.add_argument("--deployment", default=d["deployment"])
    p.add_argument("--planner", default=d["planner"],
                   help="planner: rules (offline, the default), anthropic[:MODEL], openai[:MODEL], openai-compatible:URL[|MODEL]")
    p.add_argument("--coder", default=d["coder"],
                   help="subagent provider: sweep, memory, anthropic[:MODEL], openai[:MODEL], openai-compatible:URL[|MODEL]")
    p.add_argument("--rounds", type=non_negative_int, default=d["rounds"],
                   help="waves of directions (0, the default: until nothing is left to try or the --minutes "
                        "budget ends)")
    p.add_argument("--directions", type=non_negative_int, default=d["directions"],
                   help="directions a wave plans, worked on at once by the subagents (0: 2 on a CPU, one per device "
                        "on GPUs)")
    p.add_argument("--sealed-requests", type=non_negative_int, default=d["sealed_requests"], help="sealed requests in phase 4 (0: all)")
    p.add_argument("--sealed-trials", type=positive_int, default=d["sealed_trials"])
    p.add_argument("--minutes", type=non_negative_float, default=ROUND_MINUTES,
                   help="wall-clock budget: once earlier timings show that another candidate would not end "
                        "before the sealed final must start, no more are tried (0: no budget)")
    from specpilot.harness.deployment import TIMING_DEFAULTS

    for name, value in TIMING_DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                       help=f"controller timing: {name} (default: the deployment's [timing] table, else {value}; "
                            "only when this command starts the controller)")
    p.add_argument("--device", default=None, help="device the controller times on (default: the deployment's)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="controller timing: both workers of a trial alive, taking turns request by request "
                        "(default: on for one device; only when this command starts the controller)")
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                   help="controller timing: pin the workers to one core beside the device (default: on for GPUs; "
                        "only when this command starts the controller)")
    p.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds to follow the round before giving up")
    p.add_argument("--shipped-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="on a data directory with no memory entries yet, propose the ones shipped in "
                        "deployments/shipped-memory (recorded by real rounds; re-validated and re-timed)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.set_defaults(func=cmd_round)


def controller_flags(args: argparse.Namespace) -> list[str]:
    """The controller's flags for this round: each setting from the command line, else from the
    deployment (its device, its [timing] table), else `TIMING_DEFAULTS`."""
    from specpilot.harness.deployment import load_deployment

    dep = load_deployment(args.deployment)
    flags = ["--device", args.device or dep.device]
    for name, value in dep.timing_settings().items():
        given = getattr(args, name)
        flags += [f"--{name.replace('_', '-')}", str(value if given is None else given)]
    if args.interleave is not None:
        flags.append("--interleave" if args.interleave else "--no-interleave")
    if args.pin_cpus is not None:
        flags.append("--pin-cpus" if args.pin_cpus else "--no-pin-cpus")
    return flags


def cmd_round(args: argparse.Namespace) -> int:
    data = cli.data_dir(args)
    local = not args.nats and args.bundle is None  # else the services run elsewhere (their hosts, their data)
    if local:
        cli.ensure_up(args, extra_flags={"controller": controller_flags(args)}, timeout=120.0)
        if args.shipped_memory:
            from specpilot.app.cmd_memory import import_shipped

            if shipped := import_shipped(args):
                console.print(f"a fresh ledger: proposed {len(shipped)} shipped memory entr"
                              f"{'y' if len(shipped) == 1 else 'ies'} (validated, then applied and timed where "
                              "their requirements hold)")
    request = {"deployment": args.deployment, "planner": args.planner, "coder": args.coder, "rounds": args.rounds,
               "sealed_requests": args.sealed_requests, "sealed_trials": args.sealed_trials, "minutes": args.minutes,
               "directions": args.directions}
    reply = asyncio.run(_call(args, RPC_ROUND, request))
    round_id = reply["round_id"]
    console.print(f"[bold]{'resuming' if reply.get('resumed') else 'started'} {round_id}[/bold] on {args.deployment}")
    finished = asyncio.run(follow(args, round_id))
    summary = finished.summary
    folder = data / "rounds" / round_id
    charts = _charts(summary, folder)
    shown = console if args.json else out  # with --json, stdout holds the JSON object only
    _table(summary, shown)
    result = {"round_id": round_id, **summary.get("headline", {}),
              "ledger": str(data / "ledger.duckdb") if local else "the memory service's data directory (specpilot sql)",
              "final_commit": summary.get("final_commit", ""), "charts": [str(c) for c in charts],
              "timeline": summary.get("timeline", {}),
              "final_system": f"git branch best/{args.deployment} in "
                              f"{data / 'controller' / 'systems' if local else 'the controller host systems repository'}"}
    shown.print(f"ledger: {result['ledger']}; final system: {result['final_system']}")
    if local:  # they stay up so the next round starts at once; say so, and how to stop them
        shown.print(f"the local NATS server and services keep running; stop them with: specpilot down --data {data}")
    if args.json:
        print(json.dumps(result, separators=(",", ":")))
    # 0: the round finished and its final passed forcing; 1: the forcer rejected the final (see the table)
    return output.EXIT_REJECTED if result.get("lossless") is False else output.EXIT_OK


async def _call(args: argparse.Namespace, subject: str, payload: dict, timeout: float = 60) -> dict:
    b = await cli.admin_bus(args)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await b.request(subject, payload, timeout=30)
            except bus.BusError as exc:
                starting = "no service answers" in str(exc) or "did not answer" in str(exc) or "starting" in str(exc)
                if not starting:  # the master refused the request: say why at once
                    raise UserError(f"the master refused the round: {exc}") from exc
                if time.monotonic() > deadline:
                    raise UserError(f"the master did not answer: {exc}; see {cli.data_dir(args)}/logs/master.log") from exc
                await asyncio.sleep(1.0)
    finally:
        await b.close()


async def follow(args: argparse.Namespace, round_id: str) -> schema.RoundFinished:
    """Print the round's events as they are recorded; return its RoundFinished."""
    b = await cli.admin_bus(args)
    reads = Reads.over(b, retry=False)
    seen = 0
    deadline = time.monotonic() + args.timeout
    t0 = time.monotonic()
    try:
        with console.status("waiting for the round's events") as status:
            while True:
                try:
                    events = await reads.events(round_id=round_id, offset=seen)
                except bus.BusError:
                    events = []
                for event in events:
                    seen += 1
                    line = describe(event)
                    if line:
                        console.print(f"[dim]{time.monotonic() - t0:6.0f}s[/dim] {line}")
                    status.update(f"round {round_id}: {event.tag}")
                    if isinstance(event, schema.RoundFinished):
                        return event
                if time.monotonic() > deadline:
                    raise UserError(f"round {round_id} did not finish within {args.timeout:.0f} s; it goes on in "
                                    "the services: run the same command again to follow it")
                await asyncio.sleep(1.0)
    finally:
        await b.close()


def describe(e: schema.Event) -> str:
    """One progress line per event worth showing."""
    match e:
        case schema.RoundStarted():
            waves = f"{e.rounds} waves" if e.rounds > 0 else "waves until the budget"
            return f"phase 0: measuring the device and profiling the best system ({waves}, coder {e.coder})"
        case schema.HardwareMeasured():
            return f"hardware: {e.bandwidth_bytes_s / 1e9:.1f} GB/s, {e.flops_s / 1e12:.2f} TFLOP/s ({e.device})"
        case schema.ProfileMeasured():
            if e.step_s <= 0:
                return "profile: failed (see the controller's log)"
            costs = ", ".join(f"c({n}) {c:.2f}" for n, c in sorted(e.batch_cost.items()))
            one_row = f" (one row of {e.rows} tokens {e.t_one_row_s * 1e3:.1f} ms)" if e.t_one_row_s > 0 else ""
            rows = f"; at {e.rows} rows: AR step {e.t_ar_rows_s * 1e3:.1f} ms{one_row}, {costs}" if e.rows > 1 else ""
            return f"profile: tau {e.tau:.2f}, step {e.step_s * 1e3:.1f} ms, AR step {e.t_ar_s * 1e3:.1f} ms{rows}"
        case schema.CeilingComputed():
            f = ", ".join(f"{k} {v:.2f}x" for k, v in e.factors.items())
            if b := e.batched:
                return (f"batched ceiling at {b['rows']} rows: {e.ceiling_speedup:.2f}x over batched AR at the floors "
                        f"(N = {b['budget']}), {b['measured_speedup']:.2f}x with the measured step costs "
                        f"(N = {b['measured_budget']}); factors: {f}")
            return f"ceiling {e.ceiling_speedup:.1f}x over AR; factors: {f}"
        case schema.DirectionPlanned():
            guess = e.hints.get("predicted_gain")
            return escape(f"direction [{e.provider}] {e.title}" + (f" (cost model predicts {guess})" if guess else ""))
        case schema.PatchProposed():
            return f"  patch {e.patch_id}: options {e.options}" + (" + code" if e.diff.strip() else "")
        case schema.DirectionFailed():
            return escape(f"  direction failed [{e.provider}]: {e.reason[:200]}")
        case schema.PatchRefused():
            return f"  [red]refused[/red] {e.patch_id}: {e.rule}: {e.reason}"
        case schema.TimingMeasured() if e.kind == "noise" and e.reused_from:
            return f"  noise {e.noise * 100:.1f}%, reused from this machine's earlier measurement ({e.reused_from})"
        case schema.TimingMeasured() if e.kind == "noise":
            return f"  timed stock against itself (noise {e.noise * 100:.1f}%): {len(e.incumbent_s)} trials"
        case schema.TimingMeasured():
            return f"  timed {e.patch_id}: {len(e.incumbent_s)} trials"
        case schema.VerdictIssued():
            color = "green" if e.decision == "promote" else "yellow"
            return (f"  [{color}]{e.decision}[/{color}] {e.patch_id}: gain {e.gain * 100:+.1f}% "
                    f"(lower bound {e.lower_bound * 100:+.1f}%, bar {e.bar * 100:.1f}%) {e.reason[:80]}")
        case schema.BestAdvanced():
            return f"  [green]best advanced[/green] to {e.commit[:10]} ({e.options})"
        case schema.MemoryEntryAccepted():
            return f"  memory entry {e.entry_id} accepted"
        case schema.MemoryEntryRejected():
            return f"  memory entry {e.entry_id} rejected: {e.reason}"
        case schema.SealedFinalRequested():
            return "phase 4: final, stock and AR on the sealed requests"
        case schema.SealedFinalReported():
            return f"sealed final reported (lossless: {e.lossless})"
    return ""


def _charts(summary: dict, folder) -> list:
    charts = []
    ceiling = summary.get("ceiling") or {}
    if ceiling.get("factors"):
        charts.append(plots.factor_chart(ceiling["factors"], ceiling["speedup"], folder / "factors.png"))
    if summary.get("sealed"):
        charts.append(plots.sealed_chart(summary["sealed"], folder / "sealed.png"))
    return charts


def _table(summary: dict, out: Console = out) -> None:
    sealed = summary.get("sealed", {})
    if "error" in sealed:
        console.print(f"[red]sealed final failed[/red]: {sealed['error']}")
    t = output.table(f"sealed split: {sealed.get('requests', '?')} requests x {sealed.get('max_new_tokens', '?')} "
                     f"tokens, {sealed.get('trials', '?')} trials",
                     ("system", "tokens/s", "over AR (95% CI)", "over stock (95% CI)", "identical to stock"))
    for name in ("ar", "stock", "final"):
        row = sealed.get(name)
        if not row:
            continue
        t.add_row(name, f"{row['tok_s']:.1f}", _ci(row, "over_ar"), _ci(row, "over_stock"),
                  str(row.get("identical_to_stock")))
    peer = sealed.get("peer", {})
    if isinstance(peer, dict) and "speedup" in peer:
        t.add_row("transformers prompt lookup", f"{peer['prompt_lookup_tok_s']:.1f}", f"{peer['speedup']:.2f}", "", "")
    out.print(t)
    forcing = sealed.get("forcing", {})
    if forcing:
        out.print(f"forcing verdict on the final: {'passed' if forcing.get('passed') else 'FAILED'} ({forcing.get('reason', '')})")
    c = output.table("candidates", ("patch", "provider", "options", "gain", "lower bound", "bar", "trials", "verdict"))
    for cand in summary.get("candidates", []):
        c.add_row(cand["patch_id"], cand.get("provider", ""), json.dumps(cand.get("options", {})),
                  _pct(cand.get("gain")), _pct(cand.get("lower_bound")), _pct(cand.get("bar")),
                  str(cand.get("n_trials", "")), cand["decision"])
    out.print(c)
    _timeline(summary.get("timeline") or {}, out)
    if sandbox := summary.get("sandbox"):  # how agent code ran: a development override is never silent
        out.print(f"sandbox: {sandbox}")


TIMELINE_PARTS = ("checks", "start_up", "measured", "timing_other", "forcing", "other")


def _timeline(timeline: dict, out: Console = out) -> None:
    """Where the round's time went (`services.master.timeline`): a row a phase or candidate, seconds."""
    if not timeline.get("rows"):
        return
    t = output.table(f"where the time went: {timeline['total_s']:.0f} s",
                     ("phase", "seconds", "trials", *(p.replace("_", " ") for p in TIMELINE_PARTS)))
    for row in timeline["rows"]:
        t.add_row(row["what"] + (" (reused)" if row.get("reused") else ""), f"{row['s']:.0f}",
                  str(row.get("trials", "")), *(f"{row[p]:.0f}" if p in row else "" for p in TIMELINE_PARTS))
    t.add_row("idle (planning, writing patches)", f"{timeline['idle_s']:.0f}", "", *("" for _ in TIMELINE_PARTS))
    out.print(t)


def _ci(row: dict, key: str) -> str:
    if key not in row:
        return ""
    lo, hi = row.get(f"{key}_ci95", [float("nan")] * 2)
    return f"{row[key]:.2f}x ({lo:.2f}-{hi:.2f})"


def _pct(x) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"

