"""The controller service: isolated; checks, applies, tests and times patches; the only service that
can promote, advance the best system, or read the sealed requests.

For each ``PatchProposed`` (one at a time, the delivery kept alive with ``in_progress`` while it
works): policy → ``PatchRefused``; else apply + sandboxed default check → ``PatchTested``; stock
versus stock noise once per deployment and device → ``TimingMeasured(kind="noise")``; paired ABBA
timing → ``TimingMeasured``; if the candidate's outputs differ from the incumbent's,
``ForcingRequested`` and a wait for the forcer's ``ForcingReported``; then ``VerdictIssued`` with every
statistic (a promotion is first profiled: ``ProfileMeasured``, so the round's cost model plans the
next wave from the new best's step costs and replays) and, on promotion, ``BestAdvanced`` and a
``MemoryEntryProposed`` (the whole delta from stock, the promoted system's file hashes, the
deployment's facts as requirements). Decisions are pure (``policy``, ``stats``); this module does
the I/O. A patch whose verdict is already in the ledger is not evaluated again (redelivery).

Rounds: on ``RoundStarted`` (phase 0) it measures the device (``hardware``) and profiles the best
system on the dev split (``Evaluator.measure``) → ``HardwareMeasured``, ``ProfileMeasured``; on
``SealedFinalRequested`` (phase 4) it runs the final system, stock and AR on the sealed split, forces
the final's outputs in this process (sealed prompts never enter the ledger), runs transformers'
prompt lookup on the same prompts, and reports ``SealedFinalReported``. Both are skipped when the
ledger already holds their report for that round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

from specpilot import bus, policy, schema, service
from specpilot.errors import UserError
from specpilot.services.controller import hardware, stats
from specpilot.services.controller.emit import BusEmitter, LocalEmitter
from specpilot.services.controller.evaluate import Evaluator, System
from specpilot.services.controller.sandbox import Limits
from specpilot.services.controller.state import State, evolve, fold, noise_key
from specpilot.shapes import shape_of

NAME = "controller"
DESCRIPTION = "Isolated: checks, applies, tests and times patches; the only service that promotes."
FORCING_TIMEOUT_S = 1800.0
# Until the master's cost model states the ceiling of a deployment: no change to a batch-1 decode step
# can make it 20x faster than the incumbent; a measurement saying so is broken.
SANITY_CEILING = 20.0
log = logging.getLogger(NAME)


class Controller:
    def __init__(self, data: Path, b: bus.Bus | None, device: str = "cpu", evaluator_kw: dict | None = None):
        """With ``b=None`` (``specpilot time``) events go to the local log (`emit.LocalEmitter`) and forcing
        runs in this process instead of going through the forcer service; every emitted event is also kept
        in ``self.events``. The state starts empty: `restore` folds the emitter's history into it."""
        self.data, self.bus, self.device = Path(data), b, device
        self.events: list[schema.Event] = []
        self.evaluator_kw = evaluator_kw or {}
        self.emitter = BusEmitter(b) if b is not None else LocalEmitter(self.data)
        self.reads = self.emitter.reads
        self.state = State()
        self.evaluators: dict[str, Evaluator] = {}
        self.forcing: dict[str, asyncio.Future] = {}

    def evaluator(self, deployment: str) -> Evaluator:
        if deployment not in self.evaluators:
            self.evaluators[deployment] = Evaluator(self.data, deployment, device=self.device, **self.evaluator_kw)
        return self.evaluators[deployment]

    async def emit(self, event: schema.Event, cause: schema.Event) -> schema.Event:
        stamped = await self.emitter.emit(event, cause)
        self.events.append(stamped)
        evolve(self.state, stamped)
        return stamped

    async def restore(self) -> None:
        """Rebuild the state from the emitter's history: the ledger (with a bus) or the local log (without)."""
        self.state = fold(await self.emitter.history())
        log.info("state restored: %d deployment(s) registered, best of %s", len(self.state.registered),
                 sorted(self.state.best) or "none (stock)")

    # --- the loop --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():  # nothing is decided before the state is the ledger's
            try:
                await self.restore()
                break
            except bus.BusError as exc:
                log.warning("cannot read the ledger yet (%s); the memory service must run: retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        work: asyncio.Queue = asyncio.Queue()
        worker = asyncio.create_task(self._work(work))
        try:
            while not stop.is_set():
                try:
                    await self._dispatch(stop, work, worker)
                except (bus.BusError, ConnectionError) as exc:  # the broker went away; it will come back
                    log.warning("bus trouble, retrying: %s", exc)
                    await asyncio.sleep(0.5)
        finally:
            worker.cancel()
            for ev in self.evaluators.values():
                ev.workers.abort()

    async def _dispatch(self, stop: asyncio.Event, work: asyncio.Queue, worker: asyncio.Task) -> None:
        async for event, delivery in self.bus.consume(stop):
            if isinstance(event, schema.ForcingReported):
                fut = self.forcing.pop(event.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(event)
                await delivery.ack()
            elif isinstance(event, schema.CeilingComputed):
                evolve(self.state, event)
                await delivery.ack()
            elif isinstance(event, schema.PatchProposed | schema.RoundStarted | schema.SealedFinalRequested):
                # Held unacked until its work is done; kept alive so it is not redelivered meanwhile.
                await work.put((event, delivery, asyncio.create_task(_keep_alive(delivery))))
            else:
                await delivery.ack()
            if worker.done():
                worker.result()

    async def _work(self, work: asyncio.Queue) -> None:
        while True:
            event, delivery, beat = await work.get()
            try:
                if isinstance(event, schema.PatchProposed):
                    await self.handle_patch(event)
                elif isinstance(event, schema.RoundStarted):
                    await self.handle_round_started(event)
                else:
                    await self.handle_final(event)
            except Exception as exc:
                log.exception("%s %s: controller failure", event.tag, event.event_id)
                await self._report_failure(event, exc)
            finally:
                beat.cancel()
            with contextlib.suppress(bus.BusError):  # a lost ack means a redelivery, which the ledger check absorbs
                await delivery.ack()

    async def _report_failure(self, event: schema.Event, exc: Exception) -> None:
        reason = f"controller failure ({type(exc).__name__}: {exc}); see its log"
        if isinstance(event, schema.PatchProposed):
            await self.emit(schema.VerdictIssued(patch_id=event.patch_id, decision="reject", reason=reason), event)
        elif isinstance(event, schema.SealedFinalRequested):
            await self.emit(schema.SealedFinalReported(results={"error": reason}), event)
        else:  # phase 0: the master plans without a profile (it waits for one, then goes on)
            await self.emit(schema.ProfileMeasured(device=self.device, step_s=0.0, classes_s={"error": 0.0}), event)

    async def already_decided(self, patch_id: str) -> bool:
        """Whether the ledger holds a decision on the patch (False when memory cannot answer: redo the work)."""
        with contextlib.suppress(bus.BusError):
            return await self.reads.decided(patch_id)
        return False

    async def _already_reported(self, kind: type[schema.Event], round_id: str) -> bool:
        with contextlib.suppress(bus.BusError):
            return await self.reads.count(kind, round_id=round_id) > 0
        return False

    async def _register(self, ev: Evaluator, dep: str, cause: schema.Event) -> None:
        stock = await asyncio.to_thread(ev.prepare)
        if dep not in self.state.registered:
            await self.emit(schema.DeploymentRegistered(deployment=dep, stock_commit=stock,
                                                        spec={"device": self.device}), cause)

    def best_system(self, ev: Evaluator, dep: str) -> System:
        """The deployment's best as the ledger says (stock when nothing was promoted); the git branch
        ``best/<dep>`` follows it."""
        best = self.state.best.get(dep)
        commit = ev.systems.resolve(best.commit) if best else ev.systems.git("rev-parse", "stock")
        if commit is None:
            raise UserError(f"the ledger's best system of {dep} ({best.commit[:12]}) is not in the systems repository "
                            f"{ev.systems.root}: was the data directory's controller/systems replaced?")
        if ev.systems.best(dep) != commit:
            log.info("best/%s re-pointed to the ledger's best %s", dep, commit[:12])
            ev.systems.advance(dep, commit)
        return System(commit, self.state.best_options(dep))

    # --- one patch -------------------------------------------------------------------------------

    async def handle_patch(self, patch: schema.PatchProposed) -> None:
        if await self.already_decided(patch.patch_id):
            log.info("patch %s already has a verdict; skipping the redelivery", patch.patch_id)
            return
        if refusal := policy.refused(patch):
            await self.emit(refusal, patch)
            return
        dep = patch.deployment or _default_deployment()
        ev = self.evaluator(dep)
        await self._register(ev, dep, patch)
        best = self.best_system(ev, dep)
        noise = await self.noise(ev, best, patch)

        fields, candidate = await asyncio.to_thread(ev.test, patch, best)
        await self.emit(schema.PatchTested(patch_id=patch.patch_id, **fields), patch)
        if candidate is None:
            await self.emit(schema.VerdictIssued(patch_id=patch.patch_id, decision="reject", reason=fields["detail"],
                                                 noise=noise), patch)
            return

        interleave = ev.interleave
        while True:
            t0 = time.monotonic()
            trial = await asyncio.to_thread(ev.time, best, candidate, None, interleave)
            timing = await self.emit(schema.TimingMeasured(
                patch_id=patch.patch_id, kind="candidate", device=self.device, incumbent_commit=best.commit,
                candidate_commit=candidate.commit, noise=noise, requests=ev.n_requests, interleaved=interleave,
                wall_s=time.monotonic() - t0, **trial.event_fields()), patch)
            if trial.problem:
                break
            estimate = stats.paired_gain(trial.incumbent_s, trial.candidate_s)
            # The candidate may slow the other system (work it leaves queued on the device while
            # stopped, caches it evicts): interleaving would credit that to it. Whole runs, each in
            # a worker that exits before the other starts, cannot (stats.retime_reason).
            why = stats.retime_reason(interleave, trial.carryover, estimate, noise, gpu=ev.device.startswith("cuda"))
            if not why:
                break
            log.warning("patch %s: %s; timing again run by run", patch.patch_id, why)
            interleave = False
        if trial.problem:
            await self.emit(schema.VerdictIssued(patch_id=patch.patch_id, decision="reject", reason=trial.problem,
                                                 noise=noise, timing_event_id=timing.event_id), patch)
            return

        if interleave != ev.interleave:  # a confirmation run by run: a design whose noise is not measured
            noise = stats.confirmation_noise(noise, estimate)
        identical = trial.candidate_outputs == ev.reference(best)
        forcing_passed = None
        if not identical:
            forcing_passed = await self.force(ev, patch, candidate, trial.candidate_outputs)
        ceiling = self.state.ceiling.get(dep, SANITY_CEILING)
        decision = stats.decide(estimate, noise, outputs_identical=identical, forcing_passed=forcing_passed,
                                ceiling=ceiling)
        if decision.decision == "promote":
            # The round's cost model reads the latest profile, so after a promotion the old one's costs
            # and replays no longer describe the best (a stale profile misjudged the parallel drafter:
            # docs/FIGURES.md, "Lab notes moved from code"). Emitted before the verdict, so the master's
            # next plan, made after it, cannot miss it.
            label = await asyncio.to_thread(hardware.device_label, ev.device)
            await self.emit(await asyncio.to_thread(self.profile, ev, dep, candidate, label), timing)
        verdict = await self.emit(schema.VerdictIssued(patch_id=patch.patch_id, timing_event_id=timing.event_id,
                                                       **decision.verdict_fields()), patch)
        if decision.decision == "promote":
            previous = ev.systems.advance(dep, candidate.commit)
            advanced = await self.emit(schema.BestAdvanced(commit=candidate.commit, previous_commit=previous,
                                                           patch_id=patch.patch_id, options=candidate.options,
                                                           gain=estimate.gain), verdict)
            await self.emit(self.memory_entry(ev, patch, candidate, identical,
                                              [patch.event_id, timing.event_id, verdict.event_id, advanced.event_id]),
                            advanced)

    def memory_entry(self, ev: Evaluator, patch: schema.PatchProposed, candidate: System, identical: bool,
                     evidence: list[str]) -> schema.MemoryEntryProposed:
        """What a promotion teaches: the whole delta from stock to the promoted system, and where it holds."""
        import tempfile

        from specpilot.entries import requirements_of, tree_hashes
        from specpilot.harness.deployment import load_deployment

        stock = ev.systems.git("rev-parse", "stock")
        with tempfile.TemporaryDirectory(prefix="sp-entry-") as tmp:
            files = tree_hashes(ev.systems.checkout(candidate.commit, Path(tmp) / "source"))
            stock_files = tree_hashes(ev.systems.checkout(stock, Path(tmp) / "stock"))
        return schema.MemoryEntryProposed(
            entry_id=f"entry-{patch.patch_id}", title=patch.notes[:120] or f"promoted {patch.patch_id}",
            delta=ev.systems.git("diff", stock, candidate.commit, "--", "specpilot_engine", "specpilot_kernels") + "\n"
            if candidate.commit != stock else "",
            options=candidate.options, requirements=requirements_of(load_deployment(ev.deployment).facts()),
            contract="greedy tokens identical to the incumbent's" if identical
            else "passes token forcing against stock (rate and event rules)",
            evidence=evidence, source_commit=candidate.commit, source_files=files, stock_files=stock_files)

    # --- phase 0 and phase 4 -----------------------------------------------------------------------

    async def handle_round_started(self, event: schema.RoundStarted) -> None:
        """Phase 0: measure the device and profile the current best on the dev requests."""
        from specpilot.harness.deployment import load_deployment

        if await self._already_reported(schema.ProfileMeasured, event.round_id):
            return
        dep = event.deployment or _default_deployment()
        ev = self.evaluator(dep)
        await self._register(ev, dep, event)
        deployment = load_deployment(dep)
        best = self.best_system(ev, dep)
        dtype = str(best.options.get("dtype") or deployment.dtype)
        hw = await asyncio.to_thread(hardware.measure, ev.device, dtype, ev.threads)
        await self.emit(schema.HardwareMeasured(**hw), event)
        await self.emit(await asyncio.to_thread(self.profile, ev, dep, best, hw["device"]), event)

    def profile(self, ev: Evaluator, dep: str, system: System, device: str) -> schema.ProfileMeasured:
        """``system`` measured on the dev requests as the cost model reads it (`Evaluator.measure`)."""
        from specpilot.harness.deployment import load_deployment
        from specpilot_engine.model import CONFIGS
        from specpilot_engine.options import EngineOptions

        deployment = load_deployment(dep)
        m = ev.measure(system)
        # A promoted patch may have added options this (stock) EngineOptions does not know; none of them
        # changes what the profile's fields mean, so they are left out here.
        known = {f.name for f in dataclasses.fields(EngineOptions)}
        opts = deployment.options({k: v for k, v in system.options.items() if k in known})
        return schema.ProfileMeasured(
            device=device, system_commit=system.commit, step_s=m["step_s"], classes_s=m["classes_s"], tau=m["tau"],
            block_size=opts.block_size, t_ar_s=m["t_ar_s"], n_tokens=opts.step_tokens,
            verified_tokens=m["verified_tokens"], context=m["context"],
            dtype=opts.dtype, shape=shape_of(CONFIGS[deployment.target]), replay_depths=m["replay_depths"],
            chain_depths=m["chain_depths"], launches=m["launches"], drafters=m["drafters"],
            chain_cost=m.get("chain_cost", {}), options=dict(system.options))

    def peer(self, ev: Evaluator, reference: list[list[int]], n_requests: int) -> dict:
        """transformers' prompt-lookup assisted generation on the same sealed prompts, in this process.

        Stock weights and a published library, so it needs no sandbox; it runs with the workers' thread
        count. Its tokens are compared with AR's; its speedup is over its own greedy generation."""
        import torch

        from specpilot.harness.bench import peer
        from specpilot.harness.deployment import load_deployment
        from specpilot_engine.weights import load_model

        try:
            dep = load_deployment(ev.deployment)
            opts = dep.options()
            if ev.threads:
                torch.set_num_threads(ev.threads)
            model, _ = load_model(dep.target, dtype=opts.dtype, device=torch.device(ev.device), data_dir=self.data)
            prompts = ev.prompts("sealed")[: n_requests or None]
            return peer(model, dep, opts, prompts, ev.max_new_tokens, reference)
        except Exception as exc:  # the peer is a comparison, never a reason to lose the final
            log.exception("peer run failed")
            return {"error": f"{type(exc).__name__}: {exc}"}

    async def handle_final(self, event: schema.SealedFinalRequested) -> None:
        """Phase 4: the final system, stock and AR on the sealed requests, and the final's forcing verdict.

        Forcing runs here, not through the forcer service, so sealed prompts never enter the ledger."""
        if await self._already_reported(schema.SealedFinalReported, event.round_id):
            return
        from specpilot.harness.forcing import force_outputs

        dep = event.deployment or _default_deployment()
        ev = self.evaluator(dep)
        await self._register(ev, dep, event)
        stock_commit = ev.systems.git("rev-parse", "stock")
        final = self.best_system(ev, dep)
        systems = {"final": final, "stock": System(stock_commit, {}), "ar": System(stock_commit, {"drafter": "none"})}
        results, outputs = await asyncio.to_thread(ev.sealed_final, systems, event.requests, max(2, event.trials))
        identical = outputs["final"] == outputs["ar"]
        forcing: dict = {"passed": True, "reason": "the final emits AR's tokens exactly"}
        if not identical:
            prompts = ev.prompts("sealed")[: event.requests or None]
            forcing = await asyncio.to_thread(
                force_outputs, dep, [{"prompt_ids": p, "tokens": t} for p, t in zip(prompts, outputs["final"], strict=True)],
                self.data)
        results["forcing"] = {"passed": bool(forcing["passed"]), "reason": forcing.get("reason", ""),
                              "stats": forcing.get("stats", {}), "identical_to_ar": identical}
        results["final_options"] = final.options
        results["peer"] = await asyncio.to_thread(self.peer, ev, outputs["ar"], event.requests)
        await self.emit(schema.SealedFinalReported(final_commit=final.commit, results=results,
                                                   lossless=bool(forcing["passed"])), event)

    async def noise(self, ev: Evaluator, best: System, cause: schema.Event) -> float:
        """Stock-versus-stock noise of the gain estimate, measured once per deployment and device."""
        key = noise_key(ev.deployment, self.device)
        if key not in self.state.noise:
            t0 = time.monotonic()
            trial = await asyncio.to_thread(ev.time, best, best)
            wall_s = time.monotonic() - t0
            if trial.problem:
                raise RuntimeError(f"noise measurement failed: {trial.problem}")
            value = stats.noise_from_stock_runs([(trial.incumbent_s, trial.candidate_s)]).noise
            await self.emit(schema.TimingMeasured(kind="noise", device=self.device, incumbent_commit=best.commit,
                                                  candidate_commit=best.commit, noise=value, requests=ev.n_requests,
                                                  interleaved=ev.interleave, wall_s=wall_s,
                                                  **trial.event_fields()), cause)
        return self.state.noise[key]

    async def force(self, ev: Evaluator, patch: schema.PatchProposed, candidate: System,
                    outputs: list[list[int]]) -> bool:
        request_id = f"force-{patch.patch_id}"
        outputs_json = [{"prompt_ids": p, "tokens": t} for p, t in zip(ev.prompts(), outputs, strict=True)]
        if self.bus is None:
            from specpilot.harness.forcing import force_outputs

            report = await asyncio.to_thread(force_outputs, ev.deployment, outputs_json, self.data)
            self.events.append(schema.ForcingReported(request_id=request_id, patch_id=patch.patch_id, source="forcer",
                                                      passed=report["passed"], reason=report.get("reason", ""),
                                                      stats=report.get("stats", {})))
            return bool(report["passed"])
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.forcing[request_id] = fut
        await self.emit(schema.ForcingRequested(
            request_id=request_id, patch_id=patch.patch_id, system_commit=candidate.commit, outputs=outputs_json), patch)
        try:
            report: schema.ForcingReported = await asyncio.wait_for(fut, FORCING_TIMEOUT_S)
        except TimeoutError:
            self.forcing.pop(request_id, None)
            return False
        return bool(report.passed)


def _default_deployment() -> str:
    from specpilot.harness.deployment import (
        DEFAULT_DEPLOYMENT,  # imports torch: only when a deployment is needed
    )

    return DEFAULT_DEPLOYMENT


async def _keep_alive(delivery: bus.Delivery, every_s: float = 15.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            await delivery.in_progress()


def add_args(parser) -> None:
    parser.add_argument("--device", default="cpu",
                        help="device the candidates are timed on; two, comma-separated (cuda:0,cuda:1), run both "
                             "systems of a trial at once and then swap devices")
    parser.add_argument("--trials", type=int, default=stats.DEFAULT_TRIALS, help="ABBA trials per verdict")
    parser.add_argument("--requests", type=int, default=4, help="dev requests per trial")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="one device: both workers of a trial alive, each request answered by both in turn "
                             "(default: on for one device, checked for carry-over; off for two)")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                        help="pin each timing device's workers to one core beside it (default: on for GPUs)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per timing request")
    parser.add_argument("--wall-s", type=float, default=600.0, help="wall-clock limit of one sandboxed step")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per worker (1 keeps timings steady on a shared machine)")


def make(cfg: service.ServiceConfig):
    a = cfg.args
    kw = {"trials": a.trials, "n_requests": a.requests, "max_new_tokens": a.max_new_tokens,
          "limits": Limits(wall_s=a.wall_s), "threads": a.threads, "interleave": a.interleave,
          "pin_cpus": a.pin_cpus}

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        await Controller(cfg.data, b, device=a.device, evaluator_kw=kw).run(stop)

    return body, {}


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, make, argv=argv, add_args=add_args)
