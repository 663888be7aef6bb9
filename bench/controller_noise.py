"""Controller benchmark: stock-versus-stock timing noise and the time to a verdict.

Runs the controller's own timing (sandboxed fresh workers, ABBA trials, controller clock) with the
stock system on both sides, ``--runs`` times, and reports:
- the per-trial SD of log r (how noisy one paired trial is),
- the noise of the gain estimate at ``--trials`` trials (``stats.noise_from_stock_runs``),
- the false-promotion check: how many stock-vs-stock runs the promotion rule would promote (must be 0),
- seconds per trial and per verdict (one noise-free verdict = one timing experiment).
Prints a table and, last, one JSON line.

    python bench/controller_noise.py --deployment smollm2-cpu --trials 8 --runs 2
    python bench/controller_noise.py --deployment smollm2-h200 --device cuda --options '{"cuda_graphs": true}'

``--options`` (engine options as JSON) times that system against itself instead of stock.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from specpilot import canary  # noqa: E402
from specpilot.engine.options import options_from_dict  # noqa: E402
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT  # noqa: E402
from specpilot.services.controller import stats, timing  # noqa: E402
from specpilot.services.controller.evaluate import Evaluator, System  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or two devices: cuda:0,cuda:1 (both at once, swapped)")
    ap.add_argument("--trials", type=int, default=stats.DEFAULT_TRIALS)
    ap.add_argument("--runs", type=int, default=2, help="stock-vs-stock experiments")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (rounds on CPU use 1)")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="both workers of a trial alive, requests answered by both in turn (Evaluator.interleave; "
                         "default: on for one device)")
    ap.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                    help="pin the workers to one core beside the device (Evaluator.pin_cpus; default: on for GPUs)")
    ap.add_argument("--prestart", action="store_true",
                    help="start each trial's workers while the trial before it is timed (Evaluator.prestart)")
    ap.add_argument("--options", type=json.loads, default={},
                    help='engine options of the system timed against itself, as JSON (default: stock)')
    ap.add_argument("--data", type=Path, default=None, help="data directory (default: a temporary one)")
    args = ap.parse_args()
    data = args.data or Path(tempfile.mkdtemp(prefix="sp-noise-"))
    console = Console(stderr=True)
    canary.require(data, what="the timed systems")  # workers run only in a proved sandbox, as in the controller
    ev = Evaluator(data, args.deployment, device=args.device, n_requests=args.requests,
                   max_new_tokens=args.max_new_tokens, trials=args.trials, threads=args.threads,
                   interleave=args.interleave, pin_cpus=args.pin_cpus, prestart=args.prestart)
    with console.status("preparing stock"):
        stock = System(ev.prepare(), options_from_dict(args.options).changed())
        ev.reference(stock)
    runs, orders, seconds, carryovers = [], [], [], []
    for i in range(args.runs):
        with console.status(f"stock vs stock, run {i + 1}/{args.runs} ({args.trials} trials)"):
            t0 = time.perf_counter()
            trial = timing.paired(ev, stock, stock)
            seconds.append(time.perf_counter() - t0)
        if trial.problem:
            raise SystemExit(f"timing failed: {trial.problem}")
        runs.append((trial.incumbent_s, trial.candidate_s))
        orders.append(trial.order)
        carryovers.append(trial.carryover)
        # one line per finished run, so a run cut short by a time limit still leaves its figures; the
        # per-request seconds of every worker tell jitter between requests from a slow worker
        console.print(json.dumps({"run": i + 1, "seconds": round(seconds[-1], 1),
                                  "gain": stats.paired_gain(*runs[-1], order=trial.order).gain,
                                  "incumbent_s": trial.incumbent_s, "candidate_s": trial.candidate_s,
                                  "order": trial.order,
                                  "request_s": [[who, [round(t, 5) for t in ts]] for who, ts in trial.request_s]}),
                      soft_wrap=True)
    # the crossover fit, as the controller analyses its timings (stats, "Position")
    noise = stats.noise_from_stock_runs(runs, orders=orders)
    estimates = [stats.paired_gain(a, b, order=o) for (a, b), o in zip(runs, orders, strict=True)]
    decisions = [stats.decide(e, noise, outputs_identical=True) for e in estimates]
    gains = [e.gain for e in estimates]
    result = {"bench": "controller_noise", "deployment": args.deployment, "device": args.device,
              "options": stock.options,
              "trials": args.trials, "runs": args.runs, "requests": args.requests, "threads": args.threads,
              "interleave": ev.interleave, "prestart": ev.prestart, "cpus": ev.workers.cpus(ev.device),
              "max_new_tokens": args.max_new_tokens, "per_trial_sd": noise.per_trial_sd,
              "noise_gain": noise.noise, "noise_within": noise.within, "noise_between": noise.between,
              "run_gains": gains, "false_promotions": sum(d.promoted for d in decisions),
              "seconds_per_trial": sum(seconds) / (args.runs * args.trials),
              "seconds_per_verdict": sum(seconds) / args.runs}
    # The target (noise <= 1% within 10 minutes a verdict), extrapolated from this design:
    # the gain's SD falls as 1 / sqrt(trials).
    result["trials_for_1pct"] = math.ceil((noise.per_trial_sd / 0.01) ** 2)
    result["minutes_for_1pct"] = result["trials_for_1pct"] * result["seconds_per_trial"] / 60
    carry = [c for c in carryovers if c is not None]
    result["carryover_effects"] = [c.effect for c in carry]
    table = Table(title=f"same system vs itself on {args.deployment} ({args.device}, options {stock.options or 'stock'})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("per-trial SD of log r", f"{noise.per_trial_sd:.4f}")
    table.add_row(f"noise of the gain at {args.trials} trials", f"{noise.noise:.4f} ({100 * noise.noise:.2f}%)")
    table.add_row("gains of the stock-vs-stock runs", ", ".join(f"{g:+.4f}" for g in gains))
    table.add_row("false promotions", f"{result['false_promotions']} / {args.runs}")
    table.add_row("seconds per trial / per verdict", f"{result['seconds_per_trial']:.1f} / {result['seconds_per_verdict']:.0f}")
    table.add_row("trials / minutes a verdict for 1% noise", f"{result['trials_for_1pct']} / {result['minutes_for_1pct']:.1f}")
    if carry:
        table.add_row("carry-over effect (interleaved)", ", ".join(f"{c.effect:+.4f} (p {c.p_value:.2f})" for c in carry))
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
