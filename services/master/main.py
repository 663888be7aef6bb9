"""The master service: runs rounds. Phase 0 asks for measurements and computes the ceiling, then
waves of directions go to the subagents, and at the end the sealed final is asked of the controller.

A round is driven from the ledger (typed reads, `specpilot.reads`, over memory's ``events`` endpoint),
never from memory of its own: each step first looks for its event in the ledger and only emits it when it is missing,
under a fixed event id (``<round>-<step>``), so a master restarted mid-round resumes where the
ledger says it stopped and a re-sent event is dropped as a duplicate (``Nats-Msg-Id``) or absorbed
by the ledger's primary key. Steps:

1. ``RoundStarted`` → the controller measures the device and profiles the best system
   (``HardwareMeasured``, ``ProfileMeasured``; again, before its verdict, for every promotion, so each
   plan reads the best system's profile).
2. ``CeilingComputed`` from `costmodel` (replayed tree tau, floors, factors; a PNG of the factors).
3. For each wave: `planner.plan` → ``DirectionPlanned`` (``directions`` of them,
   `planner.directions_per_wave`: 2 on a CPU, one per device on GPUs), worked on at once by the
   subagents; wait until each direction's patches have verdicts (or a timeout). The controller times
   what arrives one candidate at a time, each against the latest best with its delta merged onto it
   (`specpilot.services.controller.systems.Systems.integrate`): a patch planned on a base that another
   promotion of the wave has since advanced is timed as the integration of both, and recorded so
   (``PatchTested.integrated_onto``).
4. ``SealedFinalRequested`` → the controller's ``SealedFinalReported``; then ``RoundFinished`` with
   the summary the CLI prints.

Endpoint ``sp.rpc.master.round`` starts (or resumes) a round: ``{deployment, planner, coder, rounds,
sealed_requests, sealed_trials, minutes}`` → ``{round_id, resumed}``. Unfinished rounds resume at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

from specpilot import bus, evidence, handshake, schema, service, subjects
from specpilot.llm import Usage
from specpilot.reads import Reads
from specpilot.services.master import costmodel, planner, plots, timeline

NAME = "master"
DESCRIPTION = "Plans directions from the cost model, integrates winners, starts the sealed final."
RPC_ROUND = subjects.rpc(NAME, "round")
POLL_S = 0.5
PHASE0_TIMEOUT_S = 1800.0
DIRECTION_TIMEOUT_S = 3600.0
FINAL_TIMEOUT_S = 3600.0
UNBUDGETED_WAVES = 3  # waves of a round with neither a wave count nor a time budget (an LLM never runs out)
NO_PATCH_TIMEOUT_S = 2400.0  # a direction that produced no patch by then has failed (LLM loops run tests)
log = logging.getLogger(NAME)


def round_defaults() -> dict[str, Any]:
    from specpilot.harness.deployment import DEFAULT_DEPLOYMENT

    return {"deployment": DEFAULT_DEPLOYMENT, "planner": "rules", "coder": "sweep", "rounds": 0,
            "sealed_requests": 4, "sealed_trials": 3, "devices": 1, "directions": 0, "minutes": 0.0}


class Master:
    def __init__(self, b: bus.Bus, data: Path):
        self.bus, self.data = b, Path(data)
        self.reads = Reads.over(b)
        self.tasks: dict[str, asyncio.Task] = {}
        self.wake = asyncio.Event()

    # --- rounds ------------------------------------------------------------------------------------

    async def start_round(self, req: dict) -> dict:
        params = {**round_defaults(), **{k: v for k, v in req.items() if v is not None}}
        unknown = set(params) - set(round_defaults())
        if unknown:
            raise ValueError(f"unknown round parameters: {sorted(unknown)}")
        check_providers(str(params["planner"]), str(params["coder"]))
        # Services of another checkout would plan, patch, time or force against another stock.
        if differ := handshake.mismatches(handshake.identity(), await self.bus.discover()):
            raise ValueError(f"refusing to plan: {'; '.join(differ)}. Install the master's SpecPilot checkout on "
                             "every host and restart those services")
        for started in await self.unfinished():
            if started.deployment == params["deployment"]:
                self._spawn(started)
                return {"round_id": started.round_id, "resumed": True}
        round_id = f"round-{time.strftime('%Y%m%d-%H%M%S')}-{schema.new_event_id()[-6:]}"
        started = schema.RoundStarted(event_id=f"{round_id}-started", round_id=round_id,
                                      deployment=params["deployment"], rounds=int(params["rounds"]),
                                      planner=str(params["planner"]), coder=str(params["coder"]),
                                      devices=[str(i) for i in range(int(params["devices"]))],
                                      directions=int(params["directions"]),
                                      sealed_requests=int(params["sealed_requests"]),
                                      sealed_trials=int(params["sealed_trials"]),
                                      minutes=float(params["minutes"]))
        started, _ = await self.bus.publish(started)
        self._spawn(started)  # type: ignore[arg-type]
        return {"round_id": round_id, "resumed": False}

    async def unfinished(self) -> list[schema.RoundStarted]:
        open_ids = [k for k, row in (await self.reads.view("rounds")).items() if row.status != "finished"]
        return await self.reads.events(schema.RoundStarted, round_id=open_ids) if open_ids else []  # type: ignore[return-value]

    def _spawn(self, started: schema.RoundStarted) -> None:
        if started.round_id not in self.tasks or self.tasks[started.round_id].done():
            self.tasks[started.round_id] = asyncio.create_task(self._drive_logged(started))

    async def _drive_logged(self, started: schema.RoundStarted) -> None:
        try:
            await RoundDriver(self, started).drive()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("round %s failed", started.round_id)

    async def resume_all(self) -> None:
        for started in await self.unfinished():
            log.info("resuming %s", started.round_id)
            self._spawn(started)

    async def run(self, stop: asyncio.Event) -> None:
        """Drain this service's consumer (events wake the round drivers) until stopped."""
        resuming = asyncio.create_task(self.resume_all())  # waits for memory, which may start later
        while not stop.is_set():
            try:
                async for _event, delivery in self.bus.consume(stop, batch=64):
                    self.wake.set()
                    await delivery.ack()
            except (bus.BusError, ConnectionError) as exc:
                log.warning("bus trouble, retrying: %s", exc)
                await asyncio.sleep(0.5)
        resuming.cancel()
        for task in self.tasks.values():
            task.cancel()


class RoundDriver:
    def __init__(self, master: Master, started: schema.RoundStarted):
        self.master, self.started = master, started
        self.reads = master.reads
        self.round_id, self.deployment = started.round_id, started.deployment
        self._spec = None  # the parsed deployment (`spec`)

    def spec(self):
        """The round's deployment, parsed once (it imports torch: a deployment checks its target's config)."""
        if self._spec is None:
            from specpilot.harness.deployment import load_deployment

            self._spec = load_deployment(self.deployment)
        return self._spec

    async def emit(self, event: schema.Event) -> schema.Event:
        stamped = schema.stamp(event, round_id=self.round_id, deployment=self.deployment,
                               causation_id=event.causation_id or self.started.event_id,
                               correlation_id=self.round_id)
        published, _ = await self.master.bus.publish(stamped)
        return published

    async def wait_for(self, kind: type[schema.Event], timeout: float) -> list[schema.Event]:
        """This round's events of class ``kind``, waiting up to ``timeout`` for the first."""
        deadline = time.monotonic() + timeout
        while True:
            found = await self.round_events(kind)
            if found or time.monotonic() > deadline:
                return found
            await self.nap(POLL_S)

    async def round_events(self, *kinds: type[schema.Event]) -> list[schema.Event]:
        return await self.reads.events(*kinds, round_id=self.round_id)

    async def nap(self, seconds: float) -> None:
        """Sleep until a new event arrives on the master's consumer, or ``seconds``."""
        self.master.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.master.wake.wait(), seconds)

    async def drive(self) -> None:
        log.info("round %s on %s: %s waves, coder %s", self.round_id, self.deployment, self.started.rounds or "budgeted",
                 self.started.coder)
        ceiling = await self.phase0()
        # rounds = 0: wave after wave until nothing is left to try or the next candidate would not end
        # before the sealed final must start (`within_budget`); without a budget, UNBUDGETED_WAVES
        waves = self.started.rounds or (0 if self.started.minutes > 0 else UNBUDGETED_WAVES)
        for wave in itertools.count() if waves <= 0 else range(waves):
            if not await self.wave(wave, ceiling):
                break
        final = await self.final()
        await self.finish(ceiling, final)

    # --- phase 0 -------------------------------------------------------------------------------------

    async def phase0(self) -> schema.CeilingComputed | None:
        done = await self.round_events(schema.CeilingComputed)
        if done:
            return done[-1]  # type: ignore[return-value]
        profiles = await self.wait_for(schema.ProfileMeasured, PHASE0_TIMEOUT_S)
        hardware = await self.round_events(schema.HardwareMeasured)
        if not profiles or not hardware or profiles[-1].step_s <= 0:  # type: ignore[attr-defined]
            log.warning("round %s: no usable profile; planning without a ceiling", self.round_id)
            return None
        prof: schema.ProfileMeasured = profiles[-1]  # type: ignore[assignment]
        hw: schema.HardwareMeasured = hardware[-1]  # type: ignore[assignment]
        best, by = costmodel.envelope(replays(prof))
        result = compute_ceiling(prof, hw, best)
        speedup, factors, batched = result.speedup, dict(result.factors), {}
        if prof.rows > 1 and prof.t_ar_rows_s > 0:  # a batched deployment: the ceiling at its rows
            b = compute_batched_ceiling(prof, hw, best)
            batched = dataclasses.asdict(b)
            batched["by_budget"] = {str(k): v for k, v in b.by_budget.items()}
            speedup = b.speedup
            # the best draft length at these rows (today's step costs where measured) sets the tau factor
            n = b.measured_budget or b.budget
            factors["tau"] = max(best.get(n, prof.tau), prof.tau) / prof.tau if prof.tau > 0 else 1.0
            factors["overhead"] = costmodel.batched_overhead(factors["overhead"], prof.t_ar_rows_s, prof.t_one_row_s)
        event = await self.emit(schema.CeilingComputed(
            event_id=f"{self.round_id}-ceiling", ceiling_speedup=speedup,
            factors=factors, floors_s=result.floors_s, latency_floor_s=result.latency_floor_s,
            replay_tau={str(k): v for k, v in best.items()}, replay_by={str(k): v for k, v in by.items()},
            batched=batched, causation_id=prof.event_id))
        result = dataclasses.replace(result, speedup=speedup, factors=factors)
        with contextlib.suppress(Exception):  # a chart is a nicety; the event is the record
            plots.factor_chart(result.factors, result.speedup, self.master.data / "rounds" / self.round_id / "factors.png")
        return event  # type: ignore[return-value]

    # --- waves ---------------------------------------------------------------------------------------

    async def wave(self, wave: int, ceiling: schema.CeilingComputed | None) -> bool:
        """Plan (or find) this wave's directions and wait for their verdicts; False when nothing is left."""
        prefix = f"{self.round_id}-w{wave}-"
        directions = [d for d in await self.round_events(schema.DirectionPlanned)
                      if d.direction_id.startswith(prefix)]
        if not directions:
            planned, told = await self.plan(ceiling, usage_id=f"{prefix}planner")
            planned = await self.within_budget(planned)
            if not planned:
                log.info("round %s: nothing left to try (or no time) after %d waves", self.round_id, wave)
                return False
            for i, d in enumerate(planned):
                directions.append(await self.emit(schema.DirectionPlanned(
                    event_id=f"{prefix}d{i}", direction_id=f"{prefix}d{i}", title=d.title, rationale=d.rationale,
                    factor=d.factor, provider=d.provider, device=str(i % max(1, len(self.started.devices))),
                    memory_entry_id=d.memory_entry_id,
                    hints={**d.hints, "expected_patches": d.expected_patches}, evidence=told)))
        for d in directions:
            await self.wait_direction(d)  # type: ignore[arg-type]
        return True

    async def within_budget(self, planned: list[planner.Direction]) -> list[planner.Direction]:
        """``planned`` cut to what fits the round's ``minutes`` before the sealed final, judged by the
        earlier timings on this deployment; with none yet, one candidate per timing device, so that the
        first timings size the next wave (a whole first wave of four 8-trial candidates overran a
        26-minute round by 5 minutes, 2026-12-05)."""
        if self.started.minutes <= 0 or not planned:
            return planned
        rows = await self.reads.events(schema.TimingMeasured, deployment=self.deployment)
        samples = [planner.TimingSample(t.wall_s, len(t.incumbent_s), t.requests) for t in rows[-8:]]  # type: ignore[attr-defined]
        estimates = planner.budget_estimates(samples, self.started.sealed_requests, self.started.sealed_trials)
        if estimates is None:
            return planner.fit_slots(planned, max(1, len(self.started.devices)))
        candidate_s, sealed_s = estimates
        remaining_s = self.started.minutes * 60 - (time.time() - self.started.ts_ns / 1e9) - sealed_s
        fitted = planner.fit_to_budget(planned, remaining_s, candidate_s)
        if fitted != planned:
            log.info("round %s: %.0f s left before the sealed final (~%.0f s), ~%.0f s a candidate: %s",
                     self.round_id, remaining_s, sealed_s, candidate_s,
                     "no time for another wave" if not fitted else "fewer candidates")
        return fitted

    async def plan(self, ceiling: schema.CeilingComputed | None, usage_id: str = "",
                   ) -> tuple[list[planner.Direction], dict]:
        """The wave's directions: the LLM planner's (its conversation reported as a `schema.ConversationUsed`
        under ``usage_id``) or, without one or when it fails, the rules'; and the evidence both planners
        and the subagents are told (`specpilot.evidence.bundle`), from the same reads of the ledger."""
        deployment = self.spec()
        facts = deployment.facts()
        # The options the planner sweeps and checks: EngineOptions' fields, or a server's [server.options]
        options = deployment.options_class()
        best = await self.reads.events(schema.BestAdvanced, deployment=self.deployment)
        best_options = dict(best[-1].options) if best else {}  # type: ignore[attr-defined]
        history = await self.reads.events(schema.DirectionPlanned, schema.PatchProposed, schema.PatchRefused,
                                          schema.VerdictIssued, deployment=self.deployment, brief=True)
        failed = await self.reads.events(schema.DirectionFailed, deployment=self.deployment)
        past = planner.history_from([*history, *failed], self.round_id)
        try:
            reply = await self.master.bus.request(subjects.RPC_ENTRIES, {"facts": facts}, timeout=30)
            entries = reply.get("entries", [])
        except bus.BusError:
            entries = []
        # An entry this deployment's own promotion taught is in its best system already: re-applying it
        # wastes a wave (docs/FIGURES.md, "Lab notes moved from code").
        past = dataclasses.replace(past, applied_entries=past.applied_entries
                                   | planner.entries_in_lineage(entries, {b.event_id for b in best}))
        known = set(options.__dataclass_fields__)
        hardware = await self.round_events(schema.HardwareMeasured)
        here = dict(hardware[-1].machine) if hardware else {}  # type: ignore[attr-defined]
        entries = [{**e, "same_machine": planner.same_machine_kind(e.get("machine"), here)}
                   for e in planner.applicable_entries(entries, known, server=bool(deployment.server))]
        predict = None
        profiles = [p for p in await self.round_events(schema.ProfileMeasured) if p.step_s > 0]  # type: ignore[attr-defined]
        told = evidence.bundle(facts=facts, best_options=best_options, attempts=evidence.attempts(history),
                               hardware=hardware[-1] if hardware else None,  # type: ignore[arg-type]
                               profile=profiles[-1] if profiles else None, ceiling=ceiling,  # type: ignore[arg-type]
                               entries=entries)
        # the step model predicts our engine's options at one row: not a server's, nor a batched step
        if profiles and not deployment.server and deployment.mode == "batch1":
            model = step_model(profiles[-1])  # type: ignore[arg-type]
            stock = deployment.stock_options().to_dict()

            def predict(option: str, value: Any, base: dict) -> float | None:
                return costmodel.predicted_gain(model, option, value, base, stock)
        devices = planner.directions_per_wave(self.started.directions, facts.get("device_kind", "cpu"),
                                              len(self.started.devices))
        if self.started.planner not in ("", "rules"):
            from specpilot.errors import UserError
            from specpilot.services.master.llm_planner import plan_with_llm

            # The evidence holds the deployment, best options, device, profile, ceiling, entries and attempts.
            context = {"stock_options": options().to_dict(), "swept": sorted(f"{o}={v}" for o, v in past.tried_options),
                       "evidence": told}
            usage = Usage()
            try:
                return await asyncio.to_thread(plan_with_llm, self.started.planner, context, known, best_options,
                                               self.started.coder, devices, None, usage), told
            except UserError as exc:  # provider errors and missing keys: plan by the rules instead
                log.warning("round %s: LLM planner %s failed (%s); planning by the rules", self.round_id,
                            self.started.planner, exc)
            finally:
                if usage.turns:
                    await self.emit(usage.event("planner", self.started.planner,
                                                **({"event_id": usage_id} if usage_id else {})))
        return planner.plan(factors=dict(ceiling.factors) if ceiling else {}, facts=facts, best_options=best_options,
                            known_options=known, entries=entries,
                            history=past,
                            # a code patch changes our engine, not a server: servers are tuned by their options
                            coder="sweep" if deployment.server else self.started.coder, devices=devices,
                            predict=predict, options=options,
                            stock_options={} if deployment.server else deployment.stock_options().changed()), told

    async def wait_direction(self, direction: schema.DirectionPlanned) -> None:
        did = direction.direction_id
        t0 = time.monotonic()
        while True:
            ids = sorted({p.patch_id for p in await self.reads.events(schema.PatchProposed, direction_id=did)})  # type: ignore[attr-defined]
            decided = {k for k, row in (await self.reads.patches(*ids)).items() if row.decided}
            elapsed = time.monotonic() - t0
            if ids and len(decided) >= len(ids):  # a subagent stores a direction's patches in one atomic batch
                return
            if not ids and await self.reads.count(schema.DirectionFailed, direction_id=did):
                log.warning("direction %s failed in the subagent (see the ledger)", direction.direction_id)
                return
            if not ids and elapsed > NO_PATCH_TIMEOUT_S:
                log.warning("direction %s produced no patch in %.0f s", direction.direction_id, elapsed)
                return
            if elapsed > DIRECTION_TIMEOUT_S:
                log.warning("direction %s: verdicts still missing after %.0f s", direction.direction_id, elapsed)
                return
            await self.nap(POLL_S * 4)

    # --- phase 4 -------------------------------------------------------------------------------------

    async def final(self) -> schema.SealedFinalReported | None:
        if not await self.round_events(schema.SealedFinalRequested):
            await self.emit(schema.SealedFinalRequested(event_id=f"{self.round_id}-final", requests=self.started.sealed_requests,
                                                        trials=self.started.sealed_trials))
        reported = await self.wait_for(schema.SealedFinalReported, FINAL_TIMEOUT_S)
        return reported[-1] if reported else None  # type: ignore[return-value]

    async def finish(self, ceiling: schema.CeilingComputed | None, final: schema.SealedFinalReported | None) -> None:
        if await self.round_events(schema.RoundFinished):
            return
        # one read of what the summary and the timeline need (brief: a proposal's diff as its skeleton)
        marks = await self.reads.events(
            schema.RoundStarted, schema.CeilingComputed, schema.TimingMeasured, schema.PatchProposed,
            schema.PatchTested, schema.ForcingRequested, schema.ForcingReported, schema.VerdictIssued,
            schema.PatchRefused, schema.SealedFinalRequested, schema.SealedFinalReported,
            round_id=self.round_id, brief=True)

        def of(kind: type[schema.Event]) -> list:
            return [e for e in marks if isinstance(e, kind)]

        summary = summarise(final, ceiling, of(schema.VerdictIssued), of(schema.PatchRefused),
                            {p.patch_id: p for p in of(schema.PatchProposed)}, of(schema.PatchTested))
        summary["timeline"] = timeline.timeline(marks, until_ns=time.time_ns())  # where the round's time went
        await self.emit(schema.RoundFinished(event_id=f"{self.round_id}-finished", summary=summary))
        log.info("round %s finished: %s", self.round_id, json.dumps(summary.get("headline", {})))


# --- pure helpers ------------------------------------------------------------------------------------

def check_providers(planner_name: str, coder: str) -> None:
    """Refuse a round whose planner or coder string does not parse (keys are checked where they are used:
    the coder's on the subagent's host)."""
    from specpilot.providers import OFFLINE, parse_provider

    if planner_name not in ("", "rules") and parse_provider(planner_name).kind in OFFLINE:
        raise ValueError(f"planner {planner_name!r}: use 'rules' or an LLM provider (anthropic, openai, openai-compatible:URL)")
    parse_provider(coder)


def replay(prof: schema.ProfileMeasured, chain: bool = False) -> dict[int, float]:
    """Replayed tau per node budget, pooled over the profiled requests (steps weighted): the best tree
    in hindsight, or (``chain``) the drafter's first candidate cut to the budget."""
    return costmodel.pooled_replay(prof.chain_depths if chain else prof.replay_depths)


def replays(prof: schema.ProfileMeasured) -> dict[str, dict[int, float]]:
    """Every replay the profile holds, by mechanism: the system's own drafter as a tree (best in hindsight)
    and as a chain, and each other drafter (or setting) the worker replayed as a chain (other drafters also
    as trees)."""
    own = str(prof.options.get("drafter", "")) or "own drafter"
    out = {f"{own} tree": replay(prof)}
    if prof.chain_depths:
        out[f"{own} chain"] = replay(prof, chain=True)
    for name, d in prof.drafters.items():
        if d.get("chain_depths"):
            out[f"{name} chain"] = costmodel.pooled_replay(d["chain_depths"])
        if d.get("depths"):
            out[f"{name} tree"] = costmodel.pooled_replay(d["depths"])
    return out


def step_model(prof: schema.ProfileMeasured) -> costmodel.StepModel:
    drafters = {name: (costmodel.pooled_replay(d["chain_depths"]), float(d.get("draft_s", 0.0)))
                for name, d in prof.drafters.items() if d.get("chain_depths")}
    trees = {name: costmodel.pooled_replay(d["depths"]) for name, d in prof.drafters.items() if d.get("depths")}
    return costmodel.StepModel(t_ar_s=prof.t_ar_s, step_s=prof.step_s, n_tokens=max(1, prof.n_tokens), tau=prof.tau,
                               verified_tokens=prof.verified_tokens,
                               replay=replay(prof), chain_replay=replay(prof, chain=True) if prof.chain_depths else {},
                               drafters=drafters, drafter_trees=trees, chain_cost=dict(prof.chain_cost),
                               profiled=dict(prof.options))


def _step_inputs(prof: schema.ProfileMeasured, hw: schema.HardwareMeasured) -> dict[str, Any]:
    """What both ceilings read of a profile and the device: shape, peaks, bytes a weight (the head's too),
    bytes an activation and the context."""
    bytes_per = costmodel.WEIGHT_BYTES.get(prof.dtype, 4.0)
    return {"shape": costmodel.Shape(**prof.shape), "hw": costmodel.Hardware(hw.bandwidth_bytes_s, hw.flops_s),
            "weight_bytes": bytes_per, "act_bytes": 2.0 if prof.dtype == "bf16" else 4.0, "context": prof.context,
            "head_bytes": costmodel.head_bytes_per_weight(prof.device, bytes_per)}


def compute_ceiling(prof: schema.ProfileMeasured, hw: schema.HardwareMeasured,
                    replay_tau: dict[int, float]) -> costmodel.Ceiling:
    """The ceiling of ``prof`` on ``hw``; ``replay_tau``: the best replay per node budget
    (`costmodel.envelope` of `replays`)."""
    return costmodel.ceiling(**_step_inputs(prof, hw), t_ar_s=prof.t_ar_s, step_s=prof.step_s, tau=prof.tau,
                             n_tokens=max(1, prof.n_tokens), profile_s=dict(prof.classes_s), replay=replay_tau,
                             launches=dict(prof.launches), launch_s=hw.launch_s, kernel_floor_s=hw.kernel_floor_s)


def compute_batched_ceiling(prof: schema.ProfileMeasured, hw: schema.HardwareMeasured,
                            replay_tau: dict[int, float]) -> costmodel.BatchedCeiling:
    """The ceiling of ``prof``'s batched deployment at its rows (`costmodel.batched_ceiling`)."""
    return costmodel.batched_ceiling(**_step_inputs(prof, hw), rows=prof.rows, t_ar_rows_s=prof.t_ar_rows_s,
                                     replay=replay_tau,
                                     measured_c={int(k): v for k, v in prof.batch_cost.items()})


def sandbox_of(tested: list) -> str:
    """How the round's agent code ran, from its ``PatchTested`` records: "proved" (bubblewrap, proved at the
    controller's start), the development override by name when any candidate ran without a sandbox, or ""
    (nothing was tested)."""
    records = [dict(t.sandbox) for t in tested if getattr(t, "sandbox", None)]
    if unsafe := next((r for r in records if not r.get("proved")), None):
        return f"NONE: {unsafe.get('override') or 'not proved'} (development only: agent code ran unisolated)"
    return "proved (bubblewrap: no network, data directory and bundle hidden)" if records else ""


def summarise(final: schema.SealedFinalReported | None, ceiling: schema.CeilingComputed | None,
              verdicts: list, refused: list, proposals: dict, tested: list = ()) -> dict[str, Any]:
    results = dict(final.results) if final else {}
    headline: dict[str, Any] = {}
    if "final" in results and "stock" in results:
        headline = {
            "stock_over_ar": results["stock"].get("over_ar"), "final_over_ar": results["final"].get("over_ar"),
            "final_over_stock": results["final"].get("over_stock"),
            "final_over_stock_ci95": results["final"].get("over_stock_ci95"),
            "lossless": bool(final.lossless) if final else False,
        }
        peer = results.get("peer")
        if isinstance(peer, dict) and "speedup" in peer:
            headline["peer_over_its_ar"] = peer["speedup"]
            headline["peer_tok_s"] = peer["prompt_lookup_tok_s"]
            headline["final_tok_s"] = results["final"].get("tok_s")
            headline["final_faster_than_peer"] = bool(results["final"].get("tok_s", 0) > peer["prompt_lookup_tok_s"])
    candidates = []
    for v in verdicts:
        p = proposals.get(v.patch_id)
        candidates.append({"patch_id": v.patch_id, "provider": p.provider if p else "", "options": dict(p.options) if p else {},
                           "decision": v.decision, "gain": v.gain, "lower_bound": v.lower_bound, "bar": v.bar,
                           "n_trials": v.n_trials, "reason": v.reason})
    for r in refused:
        candidates.append({"patch_id": r.patch_id, "decision": "refused", "reason": r.reason})
    return {"headline": headline, "sealed": results, "candidates": candidates,
            "ceiling": {"speedup": ceiling.ceiling_speedup, "factors": dict(ceiling.factors)} if ceiling else {},
            "final_commit": final.final_commit if final else "", "sandbox": sandbox_of(list(tested))}


def make(cfg: service.ServiceConfig):
    holder: dict[str, Master] = {}

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        master = holder.setdefault("m", Master(b, cfg.data))
        master.bus = b
        master.reads = Reads.over(b)
        await master.run(stop)

    async def round_endpoint(req: dict) -> dict:
        if "m" not in holder:
            raise RuntimeError("the master is still starting; try again")
        return await holder["m"].start_round(req)

    return body, {RPC_ROUND: round_endpoint}


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, make, argv=argv)
