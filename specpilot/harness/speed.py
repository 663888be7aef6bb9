"""Speed of a system on prompts, measured in this process: the figures `specpilot bench` and the benches report.

- `sync(device)`: wait for the device (a timer around GPU work must include it).
- `timed(engine, prompt, max_new)`: one generation and its wall seconds.
- `sweep(model, tok, opts, ns, prompts, max_new)`: tau(N), t_step(N), c(N), S(N) from real decoding, N the
  draft tokens a step; ``c(N) = t_step(N) / t_AR``, ``S(N) = tau(N) / c(N)``.
- `end_to_end(system, ar, prompts, max_new, trials)`: paired, order-alternating (ABBA) runs of two engines
  on each prompt; per pair ``r = t_AR / t_system``, the speedup ``exp(mean log r)`` with a 95% t-interval
  (`paired_speedup`), tokens/s of each, whether the outputs were identical, the system's tau.
- `system_and_stock_models(dep, opts, device)`: the target loaded with the system's model options and
  with the deployment's stock ones (one model when they agree).

Only measures: nothing here changes what it measures. Progress goes to stderr.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from specpilot import output
from specpilot.engine.api import MODEL_OPTIONS, Engine, apply_model_options
from specpilot.engine.options import EngineOptions
from specpilot.engine.weights import load_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine: Engine, prompt: list[int], max_new: int):
    """``(result, seconds)`` of one generation, the device synchronised before and after."""
    sync(engine.device)
    t = time.perf_counter()
    r = engine.generate(prompt, max_new)
    sync(engine.device)
    return r, time.perf_counter() - t


def sweep(model, tok, opts: EngineOptions, ns: list[int], prompts, max_new) -> dict:
    """tau(N), t_step(N), c(N), S(N) from real decoding of the prompts (N = draft tokens per step)."""

    def run_all(o: EngineOptions):
        e = Engine(model, tok, o)
        warm_up(e, prompts, max_new)
        taus, steps, times = [], 0, 0.0
        for p in prompts:
            r = e.generate(p, max_new)
            steps += r.steps
            times += sum(r.draft_s) + sum(r.verify_s)
            taus.extend(r.accepted_per_step)
        return sum(taus) / max(1, len(taus)), times / max(1, steps)

    _, t_ar = run_all(opts.replace(drafter="none"))
    rows = []
    for n in ns:
        tau, t_step = run_all(opts.replace(block_size=n))
        c = t_step / t_ar
        rows.append({"n": n, "tau": tau, "t_step_ms": 1e3 * t_step, "c": c, "S": tau / c})
    return {"t_ar_ms": 1e3 * t_ar, "rows": rows}


def warm_up(engine: Engine, prompts, max_new) -> None:
    """First calls at a new shape pay one-off costs; under CUDA graphs every prompt is run once, so
    each (block size, attention length) graph is captured before timing starts."""
    for p in prompts if engine.graphs else prompts[:1]:
        engine.generate(p, max_new)


def paired_speedup(log_ratios: Sequence[float]) -> dict:
    """``{"pairs", "speedup", "ci95"}`` from paired ``log(baseline time / system time)`` (or of system /
    baseline throughput): the geometric mean and its two-sided 95% Student t-interval (infinite with one
    pair)."""
    from scipy import stats

    n = len(log_ratios)
    mean = statistics.fmean(log_ratios)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(log_ratios) / math.sqrt(n) if n > 1 else float("inf")
    return {"pairs": n, "speedup": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)]}


def end_to_end(sys_engine: Engine, ar_engine: Engine, prompts, max_new, trials: int) -> dict:
    """Paired, order-alternating runs of AR and the system on each prompt."""
    from rich.progress import Progress

    from specpilot.harness.loadgen import frozen_heap

    logs, same, committed = [], 0, []
    tok = {"ar": 0, "sys": 0}
    secs = {"ar": 0.0, "sys": 0.0}

    with Progress(transient=True, console=output.console(stderr=True)) as progress, frozen_heap():
        task = progress.add_task("end to end (AR, system)", total=trials * len(prompts))
        for t in range(trials):
            for i, p in enumerate(prompts):
                order = ("ar", "sys") if (i + t) % 2 == 0 else ("sys", "ar")
                res = {}
                for who in order:
                    res[who] = timed(ar_engine if who == "ar" else sys_engine, p, max_new)
                    tok[who] += len(res[who][0].tokens)
                    secs[who] += res[who][1]
                logs.append(math.log(res["ar"][1] / res["sys"][1]))
                same += res["ar"][0].tokens == res["sys"][0].tokens
                committed += res["sys"][0].accepted_per_step
                progress.advance(task)
    return {
        **paired_speedup(logs),
        "ar_tok_s": tok["ar"] / secs["ar"], "sys_tok_s": tok["sys"] / secs["sys"],
        "identical_outputs": same / len(logs),
        "tau": sum(committed) / max(1, len(committed)),  # the system's tokens per step, every request
    }


def system_and_stock_models(dep, opts: EngineOptions, device, data_dir=None):
    """(system model, stock model, tokenizer): the target with ``opts``' model options and with the
    deployment's stock ones (`MODEL_OPTIONS`); one model when they agree. AR is measured on the
    stock model, so model options count towards the speedup."""
    stock = dep.options()
    model, tok = load_model(dep.target, dtype=opts.dtype, device=device, data_dir=data_dir)
    stock_model = apply_model_options(model, stock)
    if all(getattr(opts, k) == getattr(stock, k) for k in MODEL_OPTIONS):
        return stock_model, stock_model, tok
    fresh = load_model(dep.target, dtype=opts.dtype, device=device, data_dir=data_dir)[0]
    return apply_model_options(fresh, opts), stock_model, tok

