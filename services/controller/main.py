"""The controller service: isolated; checks, applies, tests and times patches; the only service that
can promote, advance the best system, or read the sealed requests.

This module is the service: its state (a fold of the ledger, `state`, rebuilt at start-up), its
emitter (`emit`: the bus, or a local log for `specpilot time`), one `evaluate.Evaluator` per
deployment, and the loop that takes one job at a time, its delivery kept alive with ``in_progress``
while it works. The jobs are their own modules: a ``PatchProposed`` is decided by `verdict`, a
``RoundStarted`` (phase 0) and a ``SealedFinalRequested`` (phase 4) are handled by `phases`. A job
that fails is reported as an event (a rejection, an empty profile, an error final), never lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path

from specpilot import bus, canary, schema, service, subjects
from specpilot.errors import UserError
from specpilot.sandbox import Limits
from specpilot.services.controller import phases, stats, verdict
from specpilot.services.controller.emit import BusEmitter, LocalEmitter
from specpilot.services.controller.evaluate import Evaluator, System
from specpilot.services.controller.state import State, evolve, fold

NAME = "controller"
DESCRIPTION = "Isolated: checks, applies, tests and times patches; the only service that promotes."
log = logging.getLogger(NAME)
# The job of each event the controller works on (one at a time, in arrival order).
JOBS = {schema.PatchProposed: verdict.evaluate_patch, schema.RoundStarted: phases.round_started,
        schema.SealedFinalRequested: phases.final}


class Controller:
    """The controller service; its jobs see it as a `context.Service`."""

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
        self.restored = False  # the `system` RPC answers only from the ledger's state
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

    async def emit_together(self, events: list[schema.Event], cause: schema.Event) -> list[schema.Event]:
        """A decision and its consequences, recorded all or none (one atomic publish). Where the server held
        those ids already (a decision made before a crash, or by a redelivery that memory could not yet say
        was decided), the earlier one stands: the state is folded again from the ledger, not from these."""
        stamped, stored = await self.emitter.emit_together(events, cause)
        self.events.extend(stamped)
        if stored:
            for e in stamped:
                evolve(self.state, e)
        else:
            log.warning("%s: already recorded (an earlier decision stands); state restored from the ledger",
                        ", ".join(e.event_id for e in stamped))
            await self.restore()
        return stamped

    async def restore(self) -> None:
        """Rebuild the state from the emitter's history: the ledger (with a bus) or the local log (without)."""
        self.state = fold(await self.emitter.history())
        self.restored = True
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
            elif type(event) in JOBS:
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
                await self.handle(event)
            except Exception as exc:
                log.exception("%s %s: controller failure", event.tag, event.event_id)
                await self._report_failure(event, exc)
            finally:
                beat.cancel()
            with contextlib.suppress(bus.BusError):  # a lost ack means a redelivery, which the ledger check absorbs
                await delivery.ack()

    async def handle(self, event: schema.Event) -> None:
        """Do the job of one event (`JOBS`)."""
        await JOBS[type(event)](self, event)

    async def _report_failure(self, event: schema.Event, exc: Exception) -> None:
        reason = f"controller failure ({type(exc).__name__}: {exc}); see its log"
        if isinstance(event, schema.PatchProposed):
            await self.emit(schema.VerdictIssued(event_id=verdict.verdict_id(event.patch_id), patch_id=event.patch_id,
                                                 decision="reject", reason=reason), event)
        elif isinstance(event, schema.SealedFinalRequested):
            await self.emit(schema.SealedFinalReported(results={"error": reason}), event)
        else:  # phase 0: the master plans without a profile (it waits for one, then goes on)
            await self.emit(schema.ProfileMeasured(device=self.device, step_s=0.0, classes_s={"error": 0.0}), event)

    async def already_decided(self, patch_id: str) -> bool:
        """Whether the ledger holds a decision on the patch. False when memory cannot answer: the work is done
        again, and since every event of a decision has an id derived from the patch (`verdict.verdict_id`), a
        second decision is dropped as a duplicate: a patch is decided once whatever memory says."""
        with contextlib.suppress(bus.BusError):
            return await self.reads.decided(patch_id)
        return False

    async def already_reported(self, kind: type[schema.Event], round_id: str) -> bool:
        """Whether the ledger holds a ``kind`` report of the round (False when memory cannot answer)."""
        with contextlib.suppress(bus.BusError):
            return await self.reads.count(kind, round_id=round_id) > 0
        return False

    async def registered(self, event: schema.Event) -> tuple[Evaluator, str]:
        """The evaluator and name of the event's deployment, stock prepared and the deployment registered."""
        dep = event.deployment or _default_deployment()
        ev = self.evaluator(dep)
        stock = await asyncio.to_thread(ev.prepare)
        if self.state.registered.get(dep) != stock:  # first seen, or the runtime changed since (`Systems.restock`)
            await self.emit(schema.DeploymentRegistered(deployment=dep, stock_commit=stock,
                                                        spec={"device": self.device}), event)
        return ev, dep

    def await_forcing(self, request_id: str) -> asyncio.Future:
        """A future the loop completes with the ``ForcingReported`` of ``request_id``."""
        self.forcing[request_id] = asyncio.get_running_loop().create_future()
        return self.forcing[request_id]

    def system(self, req: dict) -> dict:
        """The ``system`` RPC: the deployment's best as code, for hosts that build on it (subagents):
        its diff from stock and the git tree id of each runtime root (a host that applies the diff to
        its own stock checks that it gets the same trees); ``commit`` is "" while the best is stock.
        Read-only; before the deployment is registered the best is stock and there is nothing to send."""
        if not self.restored:
            raise RuntimeError("the controller is still reading the ledger; try again")
        dep = str(req.get("deployment") or _default_deployment())
        if dep not in self.state.registered:
            return {"deployment": dep, "commit": "", "options": {}, "diff": "", "trees": {}}
        systems = self.evaluator(dep).systems
        stock = systems.git("rev-parse", "stock")
        best = self.state.best.get(dep)
        commit = systems.resolve(best.commit) if best else stock
        if commit is None:
            raise UserError(f"the ledger's best system of {dep} ({best.commit[:12]}) is not in this controller's "
                            "systems repository")
        return {"deployment": dep, "commit": commit if best else "", "stock": stock,
                "options": self.state.best_options(dep), "diff": systems.diff(stock, commit), "trees": systems.trees(commit)}

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
    parser.add_argument("--trials", type=int, default=stats.DEFAULT_TRIALS,
                        help="the most ABBA trials a verdict's timing runs (it stops as soon as the evidence is clear)")
    parser.add_argument("--noise-trials", type=int, default=None,
                        help="ABBA trials of the stock-versus-stock noise run (default: --trials)")
    parser.add_argument("--requests", type=int, default=4, help="dev requests per trial")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="one device: both workers of a trial alive, each request answered by both in turn "
                             "(default: on for one device, checked for carry-over; off for two)")
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                        help="pin each timing device's workers to one core beside it (default: on for GPUs)")
    parser.add_argument("--prestart", action="store_true",
                        help="start each trial's fresh workers while the trial before it is timed (faster trials; "
                             "on a 2-core machine noisier ones: off by default)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per timing request")
    parser.add_argument("--wall-s", type=float, default=600.0, help="wall-clock limit of one sandboxed step")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per worker (1 keeps timings steady on a shared machine)")


def make(cfg: service.ServiceConfig):
    a = cfg.args
    # fail closed: no candidate runs on a host where the sandbox is not proved (one line, the service exits)
    canary.require(cfg.data, cfg.bundle.path, what="candidates (the controller's timing workers)")
    kw = {"trials": a.trials, "noise_trials": a.noise_trials, "n_requests": a.requests, "max_new_tokens": a.max_new_tokens,
          "limits": Limits(wall_s=a.wall_s), "threads": a.threads, "interleave": a.interleave,
          "pin_cpus": a.pin_cpus, "prestart": a.prestart, "seed_file": cfg.bundle.split_seed}

    holder: dict[str, Controller] = {}

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        holder["c"] = Controller(cfg.data, b, device=a.device, evaluator_kw=kw)
        await holder["c"].run(stop)

    async def system_endpoint(req: dict) -> dict:
        if "c" not in holder:
            raise RuntimeError("the controller is still starting; try again")
        return await asyncio.to_thread(holder["c"].system, req)

    return body, {subjects.RPC_SYSTEM: system_endpoint}


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, make, argv=argv, add_args=add_args)
