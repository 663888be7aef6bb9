"""Paired timing of two systems of one deployment, on the controller's clock.

`paired` runs interleaved ABBA trials; each trial starts a fresh worker per system (no writable state
survives between trials: `workers.Workers`), sends every timing request and times each reply. With
``interleave`` (one device) both workers of a trial are alive and take turns request by request, the
idle one paused (`together`); with two devices both systems run at once and then swap devices.
Every reply is checked: the incumbent must reproduce its reference, the candidate must give whole
answers (`checks.incomplete`) and the same tokens in every trial (a system that changes its answers
between runs, by caching or detecting warm-ups, is rejected). What a timing means is `stats`' job.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specpilot.sandbox import Worker, WorkerFailed
from specpilot.services.controller import stats
from specpilot.services.controller.checks import incomplete
from specpilot.services.controller.workers import System

if TYPE_CHECKING:
    from specpilot.services.controller.evaluate import Evaluator

# (who, outputs, seconds per request, failure or None) of one run of a system
Run = tuple[str, list[list[int]], list[float], WorkerFailed | None]


@dataclass
class TrialResult:
    incumbent_s: list[float]
    candidate_s: list[float]
    order: list[str]
    load: list[float]
    candidate_outputs: list[list[int]]
    problem: str = ""
    request_s: list[tuple[str, list[float]]] = field(default_factory=list)  # per run: (A or B, seconds a request)
    carryover: stats.Carryover | None = None  # interleaved trials: does one system slow the next?
    # untimed seconds (start-up and warm-up) of each worker of each system, in start order
    incumbent_untimed_s: list[float] = field(default_factory=list)
    candidate_untimed_s: list[float] = field(default_factory=list)

    def per_trial_requests(self) -> list[tuple[str, list[float], list[float]]]:
        """``(order, incumbent request seconds, candidate request seconds)`` per trial of one device."""
        runs: dict[str, list[list[float]]] = {"A": [], "B": []}
        for who, secs in self.request_s:
            runs[who].append(secs)
        return list(zip(self.order, runs["A"], runs["B"], strict=False))  # a failed trial's runs may be missing

    def event_fields(self) -> dict:
        """The `schema.TimingMeasured` fields of this timing (raw samples and the carry-over test)."""
        return {"incumbent_s": self.incumbent_s, "candidate_s": self.candidate_s, "order": self.order,
                "load": self.load, "request_s": [secs for _, secs in self.request_s],
                "carryover": {k: getattr(self.carryover, k) for k in ("effect", "lower_bound", "p_value")}
                if self.carryover else {},
                "incumbent_untimed_s": self.incumbent_untimed_s, "candidate_untimed_s": self.candidate_untimed_s}


def paired(ev: Evaluator, incumbent: System, candidate: System, trials: int | None = None,
           interleave: bool | None = None, stop: Callable[[TrialResult], bool] | None = None) -> TrialResult:
    """Paired trials on ``ev``'s dev requests; stops early with ``problem`` set when a system misbehaves.

    One device: interleaved ABBA, one system at a time; with ``interleave``, ABBA within the trial
    too, request by request (a slowdown of the machine that lasts a few requests then falls on both
    systems). Two devices: each trial runs both systems at once (A on the first device, B on the
    second), then again with the devices swapped; a system's trial time is the sum of its two runs,
    so a faster device favours neither.

    ``stop``, asked after each complete trial, ends the timing early when it says so (a sequential
    verdict: `sequential.look`); ``trials`` (default: the evaluator's) is then the cap.
    ``interleave`` overrides the evaluator's setting for this timing. An interleaved timing carries
    its carry-over test (`stats.carryover`); the caller decides what a suspect one means (the
    controller times again without interleaving)."""
    interleave = (ev.interleave if interleave is None else interleave) and len(ev.devices) < 2
    prompts, reference = ev.prompts(), ev.reference(incumbent)
    res = TrialResult([], [], [], [], [])
    first_candidate: list[list[int]] | None = None
    systems = {"A": incumbent, "B": candidate}
    ev.workers.untimed.clear()  # this timing's workers only (one job at a time)
    orders = stats.abba_order(trials or ev.trials)
    # interleaved on a machine with a spare core: the next trial's workers start while this one is timed
    ahead: dict[int, Prestarted] = {}

    def start_next(i: int) -> Callable[[], None] | None:
        if not (interleave and ev.prestart and i + 1 < len(orders)):
            return None
        return lambda: ahead.setdefault(i + 1, Prestarted(ev, orders[i + 1], systems, prompts))

    try:
        for i, order in enumerate(orders):
            times: dict[str, float] = {"A": 0.0, "B": 0.0}
            runs = _trial_runs(ev, order, systems, prompts, interleave, ahead.get(i), start_next(i))
            for who, outs, secs, failure in runs:
                if failure is not None:
                    res.problem = f"{'incumbent' if who == 'A' else 'candidate'} failed during timing: {failure}"
                    return res
                times[who] += sum(secs)
                res.request_s.append((who, secs))
                if who == "A" and outs != reference:
                    res.problem = "the incumbent did not reproduce its reference tokens (nondeterministic system?)"
                    return res
                if who == "B":
                    if short := incomplete(outs, reference, ev.stop_ids(), ev.max_new_tokens):
                        res.problem = short
                        return res
                    if first_candidate is None:
                        first_candidate = outs
                        res.candidate_outputs = outs
                    elif outs != first_candidate:
                        res.problem = ("the candidate's tokens changed between trials: a system must answer the "
                                       "same request the same way every time")
                        return res
            if (done := ahead.pop(i, None)) is not None:
                done.close()
            res.incumbent_s.append(times["A"])
            res.candidate_s.append(times["B"])
            res.order.append(order if len(ev.devices) < 2 else f"{order[0]}@0{order[1]}@1|{order[0]}@1{order[1]}@0")
            res.load.append(os.getloadavg()[0])
            if stop is not None and stop(res):
                break
    finally:
        for unused in ahead.values():  # started for a trial that will not run (a stop, a failure)
            unused.close()
    if interleave:
        res.carryover = stats.carryover(res.per_trial_requests())
    res.incumbent_untimed_s = [s for key, s in ev.workers.untimed if key == incumbent.key()]
    res.candidate_untimed_s = [s for key, s in ev.workers.untimed if key == candidate.key()]
    if why := stats.untimed_excess(res.incumbent_untimed_s, res.candidate_untimed_s):
        res.problem = why
    return res


class Prestarted:
    """A trial's fresh workers, started and warmed up in a background thread while the trial before it
    is timed (`paired`), each paused once warm: they take no CPU until their own trial resumes them.
    Each is a fresh process of its own system, as a worker started at its trial would be. The thread
    lives as long as its workers: bubblewrap's ``--die-with-parent`` kills a sandbox when the thread that
    started it ends."""

    def __init__(self, ev: Evaluator, order: str, systems: dict[str, System], prompts: list[list[int]]):
        self.workers: dict[str, Worker] = {}
        self.failed: tuple[str, WorkerFailed] | None = None
        self._ready, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ev, order, systems, prompts), daemon=True,
                                        name=f"prestart-{order}")
        self._thread.start()

    def _run(self, ev: Evaluator, order: str, systems: dict[str, System], prompts: list[list[int]]) -> None:
        who = order[0]
        with contextlib.ExitStack() as stack:
            try:
                for who in order:
                    worker = stack.enter_context(ev.workers.warm_worker(systems[who], prompts, ev.device))
                    worker.sandbox.pause()
                    self.workers[who] = worker
            except WorkerFailed as exc:
                self.failed = (who, exc)
            except Exception as exc:  # noqa: BLE001 - any start failure is the trial's failure, reported there
                self.failed = (who, WorkerFailed(f"{type(exc).__name__}: {exc}"))
            finally:
                self._ready.set()
                self._release.wait()  # until `close`: the workers end with this thread

    def take(self) -> dict[str, Worker]:
        """The warm, paused workers by system ("A", "B"); raises the start's `WorkerFailed`."""
        self._ready.wait()
        if self.failed is not None:
            raise self.failed[1]
        return self.workers

    def close(self) -> None:
        self._ready.wait()
        for w in self.workers.values():
            w.sandbox.resume()  # a stopped process would not see its stdin close
        self._release.set()
        self._thread.join()


def _trial_runs(ev: Evaluator, order: str, systems: dict[str, System], prompts: list[list[int]],
                interleave: bool, ready: Prestarted | None = None,
                when_timing: Callable[[], None] | None = None) -> Iterator[Run]:
    """Each run of one trial, in ``order``; interleaved: its workers from ``ready`` when they were started
    ahead, and ``when_timing`` called once they are all warm, before the first timed request."""
    if interleave:
        def request_order(i: int) -> list[str]:  # both systems per request, the order flipped on odd ones
            first = stats.first_in_request(order, i)
            return [first, order.replace(first, "")]

        yield from together(ev, list(order), systems, prompts, request_order, ready, when_timing)
        return
    if len(ev.devices) < 2:
        for who in order:
            try:
                outs, secs = ev.workers.run(systems[who], prompts)
                yield who, outs, secs, None
            except WorkerFailed as exc:
                yield who, [], [], exc
        return
    from concurrent.futures import ThreadPoolExecutor

    d0, d1 = ev.devices[:2]
    for placement in ({order[0]: d0, order[1]: d1}, {order[0]: d1, order[1]: d0}):
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {who: pool.submit(ev.workers.run, systems[who], prompts, dev) for who, dev in placement.items()}
        for who in order:
            try:
                outs, secs = futures[who].result()
                yield who, outs, secs, None
            except WorkerFailed as exc:
                yield who, [], [], exc


def together(ev: Evaluator, names: list[str], systems: dict[str, System], prompts: list[list[int]],
             request_order: Callable[[int], list[str]], ready: Prestarted | None = None,
             when_timing: Callable[[], None] | None = None) -> Iterator[Run]:
    """A run of each of ``names``, their fresh workers alive at once: each started and warmed up alone
    (the others paused), or taken warm from ``ready`` (started ahead: `Prestarted`, closed by its owner),
    then ``when_timing()``, then unit ``i`` (a request, or a batched deployment's load: `Workers.units`)
    answered by each system in ``request_order(i)``; a worker
    not being timed is paused (``Sandbox.pause``), so it takes no CPU while another answers. On a
    failure only the failing system is yielded. Also the sealed final's way of running (`phases`)."""
    workers: dict[str, Worker] = {}
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    secs: dict[str, list[float]] = {n: [] for n in names}
    who = names[0]
    with contextlib.ExitStack() as stack:
        try:
            if ready is not None:
                try:
                    workers.update(ready.take())
                except WorkerFailed:
                    who = ready.failed[0] if ready.failed else who  # the system whose start failed
                    raise
            for who in names:
                if who in workers:
                    continue
                for other in workers.values():
                    other.sandbox.pause()
                workers[who] = stack.enter_context(ev.workers.warm_worker(systems[who], prompts, ev.device))
            if when_timing is not None:
                when_timing()
            for i, unit in enumerate(ev.workers.units(prompts)):
                for who in request_order(i):
                    for other, w in workers.items():
                        (w.sandbox.resume if other == who else w.sandbox.pause)()
                    tokens, t = ev.workers.answer(workers[who], unit)
                    outs[who].extend(tokens)
                    secs[who].append(t)
        except WorkerFailed as exc:
            yield who, [], [], exc
            return
        finally:
            for w in workers.values():
                w.sandbox.resume()  # a stopped process would not see its stdin close
    for n in names:
        yield n, outs[n], secs[n], None
