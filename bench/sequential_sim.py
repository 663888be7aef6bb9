"""Sequential verdicts, simulated: false promotions, power and trials a verdict (issue 54, item 1).

Every simulated timing goes through the controller's own rule (`sequential.look` at each look, from a
stock-versus-stock noise run drawn the same way, as `verdict.evaluate_patch` does), and, beside it, the
fixed-count rule the controller used before (`stats.decide` after all ``--fixed`` trials), on:

- ``--source recorded`` (default): recorded timings (`bench.timing_model.Recorded`: ledgers and
  bench/controller_noise.py output), resampled in ABBA blocks; a candidate ``x2``/``x3`` noisier than
  stock is a stress row (its log ratios scaled);
- ``--source model``: the noise model of the controller's tests (`bench.timing_model.simulate`).

Cases: gains of -25%, 0 (a stock copy), +1%, +5% and +66%, each ``--runs`` timings. Prints a table and,
last, one JSON line: false_promotion (the worst stock-copy row), power_5pct, mean_trials per gain.

    python bench/sequential_sim.py --recorded docs/results/timing-noise-cpu-2026-12-07.jsonl --cap 16 --noise-trials 8
    python bench/sequential_sim.py --source model --cap 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.timing_model import Recorded, model_draw, read_runs  # noqa: E402
from specpilot.services.controller import sequential, stats  # noqa: E402

GAINS = {"-25%": math.log(0.75), "0": 0.0, "+1%": math.log(1.01), "+5%": math.log(1.05), "+66%": math.log(1.66)}
REQ_SIGMA = 0.02  # the model's per-request noise (tests/controller/test_stats.py runs 2% and 5%)


def sequential_verdict(inc: np.ndarray, cand: np.ndarray, reference: sequential.Reference, cap: int,
                       ) -> sequential.Look:
    """The controller's sequential rule over one timing of ``cap`` trials (revealed look by look)."""
    order = stats.abba_order(cap)
    for k in sequential.looks(cap):
        found = sequential.look(inc[:k], cand[:k], order[:k], reference, cap)
        if found.action != "continue":
            return found
    raise AssertionError("the last look always decides")


def fixed_verdict(inc: np.ndarray, cand: np.ndarray, noise: float) -> bool:
    """The fixed-count rule: all trials, then `stats.decide` (noise: of a gain of that many trials)."""
    estimate = stats.paired_gain(inc, cand, order=stats.abba_order(inc.size))
    return stats.decide(estimate, noise, outputs_identical=True, ceiling=0.0).promoted


def run_case(draw, gain: float, scale: float, runs: int, cap: int, noise_trials: int, fixed: int,
             seed: int) -> dict:
    """``runs`` timings of one case; ``draw(rng, n, gain, scale)`` gives one timing's trial times."""
    rng = np.random.default_rng(seed)
    promoted, trials, fixed_promoted = 0, [], 0
    for _ in range(runs):
        a0, b0 = draw(rng, noise_trials, 0.0, 1.0)
        noise = stats.noise_from_stock_runs([(a0, b0)], orders=[stats.abba_order(noise_trials)]).noise
        reference = sequential.Reference.from_noise(noise, noise_trials)
        inc, cand = draw(rng, max(cap, fixed), gain, scale)
        sized = sequential.cap_for(reference, cap)  # as the controller sizes it from its noise run
        found = sequential_verdict(inc[:sized], cand[:sized], reference, sized)
        promoted += found.action == "promote"
        trials.append(found.k)
        fixed_promoted += fixed_verdict(inc[:fixed], cand[:fixed], reference.per_trial_sd / math.sqrt(fixed))
    t = np.asarray(trials)
    return {"promoted": promoted / runs, "mean_trials": float(t.mean()), "p95_trials": float(np.percentile(t, 95)),
            "fixed_promoted": fixed_promoted / runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=("recorded", "model"), default="recorded")
    ap.add_argument("--recorded", type=Path, nargs="*", default=[],
                    help="ledgers (*.duckdb) and JSON-lines files of recorded timings (bench/controller_noise.py)")
    ap.add_argument("--runs", type=int, default=1000, help="simulated timings a case")
    ap.add_argument("--cap", type=int, default=24,
                    help="the most trials a verdict runs (the controller sizes each cap within it: sequential.cap_for)")
    ap.add_argument("--noise-trials", type=int, default=8, help="trials of the stock-versus-stock noise run")
    ap.add_argument("--fixed", type=int, default=6, help="trials of the fixed-count rule it is compared with")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--write", type=Path, default=None,
                    help="also write the recorded runs read as one JSON-lines file (a fixed input for the tests)")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    if args.source == "recorded":
        runs = read_runs(args.recorded)
        if args.write:
            args.write.write_text("".join(json.dumps({"source": r.source, "incumbent_s": r.incumbent_s,
                                                      "candidate_s": r.candidate_s, "order": r.order}) + "\n"
                                          for r in runs))
        recorded = Recorded(runs)
        what = (f"{len(recorded.runs)} recorded runs, {recorded.trials} trials, per-trial SD "
                f"{100 * recorded.per_trial_sd():.2f}%")
        draw = recorded.draw
    else:
        what = f"the noise model, {100 * REQ_SIGMA:.0f}% per request"

        def draw(rng, n, gain, scale):
            return model_draw(rng, n, gain, scale, req_sigma=REQ_SIGMA)

    cases = [(name, g, 1.0) for name, g in GAINS.items()] + [("0", 0.0, 2.0), ("0", 0.0, 3.0), ("+5%", GAINS["+5%"], 2.0)]
    table = Table(title=f"sequential verdicts (cap {args.cap}, noise run {args.noise_trials} trials) on {what}")
    for col in ("true gain", "candidate noise", "runs", "promoted", "mean trials", "p95 trials",
                f"fixed {args.fixed}: promoted"):
        table.add_column(col, justify="right")
    rows = []
    for i, (name, gain, scale) in enumerate(cases):
        console.print(f"case {i + 1}/{len(cases)}: gain {name}, candidate noise x{scale:g}", highlight=False)
        r = run_case(draw, gain, scale, args.runs, args.cap, args.noise_trials, args.fixed, args.seed + i)
        rows.append({"gain": name, "scale": scale, **r})
        table.add_row(name, f"x{scale:g}", str(args.runs), f"{r['promoted']:.3f}", f"{r['mean_trials']:.1f}",
                      f"{r['p95_trials']:.0f}", f"{r['fixed_promoted']:.3f}")
    Console().print(table)
    plain = {r["gain"]: r for r in rows if r["scale"] == 1.0}
    print(json.dumps({"bench": "sequential_sim", "source": args.source, "what": what, "cap": args.cap,
                      "noise_trials": args.noise_trials, "runs": args.runs, "seed": args.seed,
                      "false_promotion": max(r["promoted"] for r in rows if r["gain"] == "0"),
                      "power_5pct": plain["+5%"]["promoted"],
                      "mean_trials": {g: round(r["mean_trials"], 2) for g, r in plain.items()},
                      "fixed": {"trials": args.fixed, "power_5pct": plain["+5%"]["fixed_promoted"]},
                      "rows": rows}))


if __name__ == "__main__":
    main()
