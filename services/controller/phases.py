"""Phase 0 (measure the device and profile the best) and phase 4 (the sealed final) of a round.

Phase 0, on ``RoundStarted``: the device is measured (`hardware`) and the current best profiled on the
dev requests (`measure`) → ``HardwareMeasured``, ``ProfileMeasured``. Phase 4, on
``SealedFinalRequested``: the final system, stock and AR answer the sealed requests (`sealed_final`),
the final's outputs are forced in this process (sealed prompts never enter the ledger), transformers'
prompt lookup runs on the same prompts (`peer`) → ``SealedFinalReported``. Both are skipped when the
ledger already holds their report for the round. `measure` and `sealed_final` are functions of an
`evaluate.Evaluator` (they run systems); `round_started`, `profile` and `final` are the service's
handlers, functions of the `context.Service` (they emit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import TYPE_CHECKING

from specpilot import schema
from specpilot.sandbox import WorkerFailed
from specpilot.services.controller import hardware, stats
from specpilot.services.controller.timing import together
from specpilot.services.controller.workers import System
from specpilot.shapes import shape_of

BATCH_COST_DRAFTS = (1, 2, 4, 8, 16)  # draft counts whose batched step cost c(n, rows) a batched profile measures

if TYPE_CHECKING:
    from specpilot.services.controller.context import Service
    from specpilot.services.controller.evaluate import Evaluator

log = logging.getLogger("controller")


# --- what runs (functions of an evaluator) -----------------------------------------------------------

def measure(ev: Evaluator, system: System) -> dict:
    """What the cost model needs of ``system`` on the dev requests (`schema.ProfileMeasured` fields).

    The kernel-class profile and the drafter's matched depths come from the system's own worker
    (planning inputs, not verdicts); the step times come from the controller's clock: the system and
    its AR twin (same code and options, no drafter) answer the same requests."""
    prompts = ev.prompts()
    with ev.workers.worker(system, ev.device,
                           lambda tmp: ev.workers.compile_cache_for(system, prompts, ev.device, tmp)) as worker:
        replies = [worker.request({"measure": {"prompt_ids": p, "max_new_tokens": ev.max_new_tokens}},
                                  timeout=ev.limits.wall_s)[0] for p in prompts]
        batch = {}
        if ev.workers.concurrency > 1:  # a batched deployment: its step costs at its rows
            context = int(sum(len(p) for p in prompts) / len(prompts) + ev.max_new_tokens / 2)
            batch = worker.request({"batch_cost": {"rows": ev.workers.concurrency, "context": context,
                                                   "drafts": list(BATCH_COST_DRAFTS)}}, timeout=ev.limits.wall_s)[0]
    _, system_s = ev.workers.run(system, prompts)
    ar_outputs, ar_s = ev.workers.run(ev.ar_system(system), prompts)
    n = len(prompts)
    steps = sum(int(r["steps"]) for r in replies)
    verified = sum(int(r.get("verified", 0)) for r in replies)
    new_tokens = sum(len(r["tokens"]) for r in replies)
    classes: dict[str, float] = {}
    launches: dict[str, float] = {}
    for r in replies:
        for k, v in r["profile_ms"].items():
            classes[k] = classes.get(k, 0.0) + float(v) / 1e3 / n
        for k, v in r.get("launches", {}).items():
            launches[k] = launches.get(k, 0.0) + float(v) / n
    # The prefill counts as one step on both sides, so the two step times stay comparable.
    return {
        "step_s": sum(system_s) / (steps + n),
        "t_ar_s": sum(ar_s) / sum(len(t) for t in ar_outputs),
        "tau": (new_tokens - n) / max(1, steps),
        "verified_tokens": verified / max(1, steps),
        "classes_s": classes,
        "launches": launches,
        "context": round(sum(int(r["context"]) for r in replies) / n),
        "replay_depths": [[int(d) for d in r["depths"]] for r in replies],
        "chain_depths": [[int(d) for d in r.get("chain_depths", [])] for r in replies],
        "drafters": _alternative_drafters(replies),
        "chain_cost": _mean_chain_cost(replies),
        "rows": ev.workers.concurrency,
        "t_ar_rows_s": float(batch.get("t_ar_s", 0.0)),
        "t_one_row_s": float(batch.get("t_one_row_s", 0.0)),
        "batch_cost": {int(k): round(float(v), 4) for k, v in batch.get("c", {}).items()},
    }


def sealed_final(ev: Evaluator, systems: dict[str, System], n_requests: int = 0, trials: int = 3,
                 ) -> tuple[dict, dict[str, list[list[int]]]]:
    """Every system answers the sealed requests ``trials`` times (order: `sealed_order`).

    With ``interleave`` (one device) every system's fresh worker of a trial is alive at once and each
    request is answered by all of them in turn, the trial's order forward on even requests and
    reversed on odd ones, as in the paired timing (`timing.together`); else whole runs one after
    another. Returns per system its tokens/s and, per other system, the speedup over the one named
    "ar" and over "stock" (geometric mean of per-trial time ratios, two-sided 95% t-interval), plus
    the outputs of the first trial (for forcing)."""
    prompts = ev.prompts("sealed")[: n_requests or None]
    names = list(systems)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list[list[int]]] = {}
    interleave = ev.interleave  # False for two devices (`Evaluator.__post_init__`)
    for t in range(trials):
        order = sealed_order(names, t)
        if interleave:
            runs = together(ev, order, systems, prompts, lambda i, order=order: order if i % 2 == 0 else order[::-1])
        else:
            runs = ((name, *ev.workers.run(systems[name], prompts), None) for name in order)
        for name, outs, secs, failure in runs:
            if failure is not None:
                raise failure
            if name in outputs and outs != outputs[name]:
                raise WorkerFailed(f"{name} changed its tokens between trials")
            outputs[name] = outs
            seconds[name].append(sum(secs))
    results: dict = {"requests": len(prompts), "trials": trials, "max_new_tokens": ev.max_new_tokens,
                     "interleaved": interleave}
    for name in names:
        tokens = sum(len(o) for o in outputs[name])
        row = {"tok_s": tokens * trials / sum(seconds[name]), "seconds": seconds[name],
               "identical_to_stock": outputs[name] == outputs.get("stock")}
        for base in ("ar", "stock"):
            if base in seconds and base != name and trials >= 2:
                est = stats.paired_gain(seconds[base], seconds[name], confidence=0.975)
                row[f"over_{base}"] = math.exp(est.gain)
                row[f"over_{base}_ci95"] = [math.exp(est.lower_bound), math.exp(est.upper_bound)]
        results[name] = row
    return results, outputs


def sealed_order(names: list[str], trial: int) -> list[str]:
    """The order of the systems in one sealed trial: a rotation that moves every second trial, reversed
    on odd trials, so each pair of systems runs in both orders within every two trials (a plain
    rotation of three systems put "stock" before "final" in both of two trials, and a run's position
    in the trial can be worth several percent on a GPU)."""
    k = (trial // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if trial % 2 else order


def _mean_chain_cost(replies: list[dict]) -> dict[int, float]:
    """Per chain length, the mean over requests of the measured c(n) (`specpilot.harness.replay.chain_cost`)."""
    by_n: dict[int, list[float]] = {}
    for r in replies:
        for n, c in r.get("chain_cost", {}).items():
            by_n.setdefault(int(n), []).append(float(c))
    return {n: round(sum(cs) / len(cs), 4) for n, cs in sorted(by_n.items())}


def _alternative_drafters(replies: list[dict]) -> dict[str, dict]:
    """Per other drafter replayed in every reply: its chain depths per request and mean draft seconds, and
    its tree depths per request where every reply has them."""
    per = [r.get("drafters", {}) for r in replies]
    names = set.intersection(*(set(k for k, v in d.items() if "chain_depths" in v) for d in per)) if per else set()
    out = {name: {"chain_depths": [[int(x) for x in d[name]["chain_depths"]] for d in per],
                  "draft_s": sum(float(d[name]["draft_s"]) for d in per) / len(per)} for name in sorted(names)}
    for name in out:
        if all("depths" in d[name] for d in per):
            out[name]["depths"] = [[int(x) for x in d[name]["depths"]] for d in per]
    return out


# --- the service's handlers (functions of the controller) ----------------------------------------

async def round_started(ctl: Service, event: schema.RoundStarted) -> None:
    """Phase 0: measure the device and profile the current best on the dev requests."""
    if await ctl.already_reported(schema.ProfileMeasured, event.round_id):
        return
    ev, dep = await ctl.registered(event)
    best = ctl.best_system(ev, dep)
    dtype = str(best.options.get("dtype") or ev.dep.dtype)
    hw = await asyncio.to_thread(hardware.measure, ev.device, dtype, ev.threads)
    await ctl.emit(schema.HardwareMeasured(**hw, machine=hardware.machine(ev.device, ev.threads, dtype)), event)
    await ctl.emit(await asyncio.to_thread(profile, ev, best, hw["device"]), event)


def profile(ev: Evaluator, system: System, device: str) -> schema.ProfileMeasured:
    """``system`` measured on the dev requests as the cost model reads it (`measure`)."""
    from specpilot.engine.model import get_config
    from specpilot.engine.options import EngineOptions

    deployment = ev.dep
    m = measure(ev, system)
    # A promoted patch may have added options this (stock) EngineOptions does not know; none of them
    # changes what the profile's fields mean, so they are left out here.
    if deployment.server:
        # A server's step is what it reported: the tokens it verified a step (drafts and the root); its
        # weights are in the server's own format (the cost model's bytes a weight).
        n_tokens = max(1, round(m["verified_tokens"]))
        block_size, dtype = n_tokens - 1, deployment.server_spec().weight_dtype or deployment.dtype
    else:
        known = {f.name for f in dataclasses.fields(EngineOptions)}
        opts = deployment.options({k: v for k, v in system.options.items() if k in known})
        n_tokens, block_size, dtype = opts.step_tokens, opts.block_size, str(opts.dtype)
    return schema.ProfileMeasured(
        device=device, system_commit=system.commit, step_s=m["step_s"], classes_s=m["classes_s"], tau=m["tau"],
        block_size=block_size, t_ar_s=m["t_ar_s"], n_tokens=n_tokens,
        verified_tokens=m["verified_tokens"], context=m["context"],
        dtype=dtype, shape=shape_of(get_config(deployment.target)), replay_depths=m["replay_depths"],
        chain_depths=m["chain_depths"], launches=m["launches"], drafters=m["drafters"],
        chain_cost=m.get("chain_cost", {}), options=dict(system.options), rows=m.get("rows", 1),
        t_ar_rows_s=m.get("t_ar_rows_s", 0.0), t_one_row_s=m.get("t_one_row_s", 0.0),
        batch_cost=m.get("batch_cost", {}))


def peer(ev: Evaluator, reference: list[list[int]], n_requests: int) -> dict:
    """transformers' prompt-lookup assisted generation on the same sealed prompts, in this process.

    Stock weights and a published library, so it needs no sandbox; it runs with the workers' thread
    count. Its tokens are compared with AR's; its speedup is over its own greedy generation."""
    import torch

    from specpilot.engine.weights import load_model
    from specpilot.harness.peer import peer as run_peer

    try:
        dep = ev.dep
        opts = dep.options()
        if ev.threads:
            torch.set_num_threads(ev.threads)
        model, _ = load_model(dep.target, dtype=opts.dtype, device=torch.device(ev.device), data_dir=ev.data)
        prompts = ev.prompts("sealed")[: n_requests or None]
        return run_peer(model, dep, opts, prompts, ev.max_new_tokens, reference)
    except Exception as exc:  # the peer is a comparison, never a reason to lose the final
        log.exception("peer run failed")
        return {"error": f"{type(exc).__name__}: {exc}"}


async def final(ctl: Service, event: schema.SealedFinalRequested) -> None:
    """Phase 4: the final system, stock and AR on the sealed requests, and the final's forcing verdict.

    Forcing runs here, not through the forcer service, so sealed prompts never enter the ledger."""
    if await ctl.already_reported(schema.SealedFinalReported, event.round_id):
        return
    from specpilot.harness.forcing import force_outputs

    ev, dep = await ctl.registered(event)
    stock_commit = ev.systems.git("rev-parse", "stock")
    best = ctl.best_system(ev, dep)
    systems = {"final": best, "stock": System(stock_commit, {}), "ar": ev.ar_system(System(stock_commit, {}))}
    results, outputs = await asyncio.to_thread(sealed_final, ev, systems, event.requests, max(2, event.trials))
    identical = outputs["final"] == outputs["ar"]
    forcing: dict = {"passed": True, "reason": "the final emits AR's tokens exactly"}
    if not identical:
        prompts = ev.prompts("sealed")[: event.requests or None]
        forced = [{"prompt_ids": p, "tokens": t} for p, t in zip(prompts, outputs["final"], strict=True)]
        if ev.serves():  # a server's stock differs from the fp32 reference: its own outputs are the baseline
            for out, tokens in zip(forced, outputs["stock"], strict=True):
                out["stock_tokens"] = tokens
        forcing = await asyncio.to_thread(force_outputs, dep, forced, ev.data, owner="controller")
    results["forcing"] = {"passed": bool(forcing["passed"]), "reason": forcing.get("reason", ""),
                          "stats": forcing.get("stats", {}), "identical_to_ar": identical}
    results["final_options"] = best.options
    results["peer"] = await asyncio.to_thread(peer, ev, outputs["ar"], event.requests)
    await ctl.emit(schema.SealedFinalReported(final_commit=best.commit, results=results,
                                              lossless=bool(forcing["passed"])), event)
