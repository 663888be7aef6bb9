"""One patch, from proposal to verdict: the controller's main job.

For each ``PatchProposed``: policy → ``PatchRefused``; else apply + sandboxed default check
(`checks.default_check`) → ``PatchTested``; stock-versus-stock noise once per deployment and device
(`noise`) → ``TimingMeasured(kind="noise")``; paired ABBA timing (`timing.paired`), stopped at the first
look whose evidence is clear (`sequential.look`, at most ``trials``) → ``TimingMeasured``; if the candidate's outputs differ from the incumbent's, token forcing (`force`: the
forcer service over the bus, or this process for `specpilot time`); then ``VerdictIssued`` with every
statistic (`stats.decide`). A promotion is first profiled (``ProfileMeasured``, so the round's cost
model plans the next wave from the new best's step costs and replays), then its ``VerdictIssued``,
``BestAdvanced`` and ``MemoryEntryProposed`` (`memory_entry`: the whole delta from stock, the promoted
system's file hashes, the deployment's facts as requirements) are published together, all recorded or
none. A patch whose decision is already in the ledger is not evaluated again (redelivery); every event
of a patch's decision has an id derived from the patch (``verdict-<patch>``, ``tested-<patch>``, ...), so
a decision made twice (memory could not say it was made) is recorded once: the stream or the ledger drops
the second. Decisions are pure (`specpilot.policy`, `stats`, `sequential`); this module does
the I/O, through the `context.Service` it is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specpilot import policy, schema
from specpilot.services.controller import hardware, phases, sequential, stats, timing
from specpilot.services.controller.checks import default_check
from specpilot.services.controller.state import noise_key
from specpilot.services.controller.systems import SYSTEM_DIRS
from specpilot.services.controller.workers import System

if TYPE_CHECKING:
    from specpilot.services.controller.context import Service
    from specpilot.services.controller.evaluate import Evaluator

FORCING_TIMEOUT_S = 1800.0
# Until the master's cost model states the ceiling of a deployment: no change to a batch-1 decode step
# can make it 20x faster than the incumbent; a measurement saying so is broken.
SANITY_CEILING = 20.0
log = logging.getLogger("controller")


async def evaluate_patch(ctl: Service, patch: schema.PatchProposed) -> None:
    """Decide one patch; every step is an event emitted through ``ctl``."""
    if await ctl.already_decided(patch.patch_id):
        log.info("patch %s already has a verdict; skipping the redelivery", patch.patch_id)
        return
    if refusal := policy.refused(patch):
        await ctl.emit(schema.stamp(refusal, event_id=f"refused-{patch.patch_id}"), patch)
        return
    ev, dep = await ctl.registered(patch)
    best = ctl.best_system(ev, dep)
    noise = await measure_noise(ctl, ev, best, patch)

    fields, candidate = await asyncio.to_thread(default_check, ev, patch, best,
                                                ctl.state.base_options(dep, patch.base_commit))
    await ctl.emit(schema.PatchTested(event_id=f"tested-{patch.patch_id}", patch_id=patch.patch_id, **fields), patch)
    if candidate is None:
        await ctl.emit(schema.VerdictIssued(event_id=verdict_id(patch.patch_id), patch_id=patch.patch_id,
                                            decision="reject", reason=fields["detail"], noise=noise), patch)
        return

    interleave = ev.interleave
    reference_tokens = ev.reference(best)
    # the noise run's own count (a ledger's older figure may have another; a reused one has the design's)
    noise_trials = ctl.state.noise_trials.get(noise_key(ev.deployment, ctl.device)) or ev.noise_trials
    stock_noise = sequential.Reference.from_noise(noise, noise_trials)
    cap = sequential.cap_for(stock_noise, ev.trials)  # the most trials this noise needs for a 5% gain
    looked: list[sequential.Look] = []

    def clear(res: timing.TrialResult) -> bool:
        """The sequential rule: after each pair of trials, stop once the evidence is clear."""
        if len(res.order) not in sequential.looks(cap):
            return False
        looked.append(sequential.look(res.incumbent_s, res.candidate_s, res.order, stock_noise, cap,
                                      res.candidate_outputs == reference_tokens))
        return looked[-1].action != "continue"

    # the interleaved timing's (estimate, noise of its bar, event, look), when a GPU win is confirmed run by run
    first: tuple[stats.GainEstimate, float, schema.TimingMeasured, sequential.Look | None] | None = None
    for attempt in itertools.count():
        t0 = time.monotonic()
        # The first timing is sequential; a timing again run by run (below) runs its full count.
        trial = await asyncio.to_thread(timing.paired, ev, best, candidate, cap if attempt == 0 else None,
                                        interleave, clear if attempt == 0 else None)
        measured = await ctl.emit(schema.TimingMeasured(
            event_id=f"timing-{patch.patch_id}-{attempt}", patch_id=patch.patch_id, kind="candidate", device=ctl.device, incumbent_commit=best.commit,
            candidate_commit=candidate.commit, noise=noise, requests=ev.n_requests, interleaved=interleave,
            wall_s=time.monotonic() - t0, **trial.event_fields()), patch)
        if trial.problem:
            break
        basis = looked[-1] if attempt == 0 and looked and looked[-1].k == len(trial.order) else None
        if basis is not None:
            estimate, verdict_noise = basis.estimate, basis.noise
        else:
            estimate = stats.paired_gain(trial.incumbent_s, trial.candidate_s, order=trial.order)
            verdict_noise = stock_noise.per_trial_sd / math.sqrt(estimate.n)
        # The candidate may slow the other system (work it leaves queued on the device while
        # stopped, caches it evicts): interleaving would credit that to it. Whole runs, each in
        # a worker that exits before the other starts, cannot (stats.retime_reason).
        why = stats.retime_reason(interleave, trial.carryover, estimate, verdict_noise,
                                  gpu=ev.device.startswith("cuda"))
        if not why:
            break
        log.warning("patch %s: %s; timing again run by run", patch.patch_id, why)
        # A suspect carry-over discredits the interleaved timing; a GPU win only asks for confirmation.
        first = (None if trial.carryover is not None and trial.carryover.suspect
                 else (estimate, verdict_noise, measured, basis))
        interleave = False
    if trial.problem:
        await ctl.emit(schema.VerdictIssued(event_id=verdict_id(patch.patch_id), patch_id=patch.patch_id,
                                            decision="reject", reason=trial.problem, noise=noise,
                                            timing_event_id=measured.event_id), patch)
        return

    identical = trial.candidate_outputs == reference_tokens
    evidence, confirmation = [measured.event_id], ""
    if first is not None:  # an interleaved GPU win, timed again run by run: does that uphold it?
        upheld, confirmation = stats.confirms(first[0], estimate, stats.promotion_bar(first[1], identical))
        if upheld:
            (estimate, verdict_noise, measured, basis), evidence = first, [first[2].event_id, measured.event_id]
    if not measured.interleaved and ev.interleave:  # the verdict rests on a design whose noise is unmeasured
        verdict_noise = stats.confirmation_noise(verdict_noise, estimate)
    forcing_passed, forcing_error = None, ""
    if not identical:
        forcing_passed, forcing_error = await force(ctl, ev, patch, candidate, trial.candidate_outputs)
    decision = stats.decide(estimate, verdict_noise, outputs_identical=identical, forcing_passed=forcing_passed,
                            ceiling=ctl.state.ceiling.get(dep, SANITY_CEILING), forcing_error=forcing_error)
    if basis is not None:
        decision = dataclasses.replace(decision, reason=f"{decision.reason}; {basis.why()}")
    if confirmation:
        decision = dataclasses.replace(decision, reason=f"{decision.reason}; run by run: {confirmation}")
    if decision.decision == "promote":
        # The round's cost model reads the latest profile, so after a promotion the old one's costs
        # and replays no longer describe the best (a stale profile misjudged the parallel drafter:
        # docs/FIGURES.md, "Lab notes moved from code"). Emitted before the verdict, so the master's
        # next plan, made after it, cannot miss it.
        label = await asyncio.to_thread(hardware.device_label, ev.device)
        await ctl.emit(await asyncio.to_thread(phases.profile, ev, candidate, label), measured)
    verdict = schema.VerdictIssued(event_id=verdict_id(patch.patch_id), patch_id=patch.patch_id,
                                   timing_event_id=measured.event_id, **decision.verdict_fields())
    if decision.decision != "promote":
        await ctl.emit(verdict, patch)
        return
    # The verdict and its consequences are recorded together or not at all (one atomic publish): a crash
    # between them can no longer leave a promotion decided but never advanced. The branch follows the
    # ledger's state (`best_system` re-points it), so it moves only once they are recorded.
    minted = schema.mint(schema.CONTROLLER, verdict.event_id)
    advanced = schema.BestAdvanced(event_id=f"best-{patch.patch_id}", causation_id=minted, commit=candidate.commit,
                                   previous_commit=best.commit, patch_id=patch.patch_id, options=candidate.options,
                                   gain=estimate.gain)
    entry = memory_entry(ev, patch, candidate, identical,
                         [patch.event_id, *evidence, minted, schema.mint(schema.CONTROLLER, advanced.event_id)])
    await ctl.emit_together([verdict, advanced, schema.stamp(
        entry, event_id=f"entry-{patch.patch_id}", causation_id=schema.mint(schema.CONTROLLER, advanced.event_id))],
        patch)
    ctl.best_system(ev, dep)  # the branch best/<dep> follows the recorded best


def verdict_id(patch_id: str) -> str:
    """A patch's verdict has one id (minted by the controller: `schema.mint`), whoever decides it and however
    often: a second decision of the same patch (a redelivery memory could not yet call decided) is dropped
    by the stream's dedupe or the ledger's primary key, so a patch is decided exactly once."""
    return f"verdict-{patch_id}"


async def measure_noise(ctl: Service, ev: Evaluator, best: System, cause: schema.Event) -> float:
    """Stock-versus-stock noise of the gain estimate, measured once per deployment and device; a fresh
    figure this machine measured for the same design in another data directory is reused (and the
    reuse recorded: ``TimingMeasured.reused_from``)."""
    key = noise_key(ev.deployment, ctl.device)
    if key not in ctl.state.noise and (cached := await asyncio.to_thread(ev.noise_cached)) is not None:
        log.info("noise of %s reused from %s (measured %s)", key, cached.get("data"),
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(cached["measured_at"])))
        await ctl.emit(schema.TimingMeasured(
            kind="noise", device=ctl.device, incumbent_commit=best.commit, candidate_commit=best.commit,
            noise=cached["noise"], requests=ev.n_requests, interleaved=ev.interleave,
            reused_from=f"{cached.get('data')}: {cached.get('event_id')}"), cause)
    if key not in ctl.state.noise:
        t0 = time.monotonic()
        trial = await asyncio.to_thread(timing.paired, ev, best, best, ev.noise_trials)
        wall_s = time.monotonic() - t0
        if trial.problem:
            raise RuntimeError(f"noise measurement failed: {trial.problem}")
        value = stats.noise_from_stock_runs([(trial.incumbent_s, trial.candidate_s)], orders=[trial.order]).noise
        measured = await ctl.emit(schema.TimingMeasured(
            kind="noise", device=ctl.device, incumbent_commit=best.commit, candidate_commit=best.commit, noise=value,
            requests=ev.n_requests, interleaved=ev.interleave, wall_s=wall_s, **trial.event_fields()), cause)
        await asyncio.to_thread(ev.remember_noise, value, measured.event_id)
    return ctl.state.noise[key]


async def force(ctl: Service, ev: Evaluator, patch: schema.PatchProposed, candidate: System,
                outputs: list[list[int]]) -> tuple[bool, str]:
    """Whether the candidate's outputs pass token forcing against the target, and why forcing could not
    run ('' when it ran: a forcer error, no report within the timeout), which is not a failed verdict.

    The timing's outputs are forced first; a pass whose rate rule had less than 90% power to catch a
    system one point worse than stock (the report's ``tokens_for_power``) is forced again with the
    candidate's outputs on that many more distinct dev tokens (`Evaluator.more_dev_prompts`)."""
    prompts = ev.prompts()
    report = await _force_once(ctl, ev, patch, candidate, f"force-{patch.patch_id}", prompts, outputs)
    if report is None or not report.passed:
        return False, _forcing_error(report)
    have = sum(map(len, outputs))
    need = int(report.stats.get("tokens_for_power", 0))
    if need <= have:
        return True, ""
    extra = await asyncio.to_thread(ev.more_dev_prompts, need - have)
    if not extra:
        return True, ""
    more, _ = await asyncio.to_thread(ev.workers.run, candidate, extra)
    log.info("patch %s: forcing again on %d more dev requests (%d tokens forced had %.0f%% power)",
             patch.patch_id, len(extra), have, 100 * float(report.stats.get("power", 0.0)))
    report = await _force_once(ctl, ev, patch, candidate, f"force-{patch.patch_id}-powered", prompts + extra,
                               outputs + more)
    if report is None or not report.passed:
        return False, _forcing_error(report)
    return True, ""


def _forcing_error(report: schema.ForcingReported | None) -> str:
    """Why forcing could not run at all ('' for a report of a forcing that ran and failed)."""
    if report is None:
        return f"no forcing report within {FORCING_TIMEOUT_S:.0f} s (is the forcer service running?)"
    return str(report.stats.get("error", ""))


async def _force_once(ctl: Service, ev: Evaluator, patch: schema.PatchProposed, candidate: System,
                      request_id: str, prompts: list[list[int]], outputs: list[list[int]],
                      ) -> schema.ForcingReported | None:
    outputs_json = [{"prompt_ids": p, "tokens": t} for p, t in zip(prompts, outputs, strict=True)]
    if ev.serves():  # a server's stock differs from the fp32 reference: its own outputs are the baseline
        stock, _ = await asyncio.to_thread(ev.workers.run, ev.stock_system(), prompts)
        for out, tokens in zip(outputs_json, stock, strict=True):
            out["stock_tokens"] = tokens
    if ctl.bus is None:
        from specpilot.harness.forcing import force_outputs

        fields = await asyncio.to_thread(force_outputs, ev.deployment, outputs_json, ev.data)
        report = schema.ForcingReported(request_id=request_id, patch_id=patch.patch_id, source="forcer", **fields)
        ctl.events.append(report)
        return report
    reply = ctl.await_forcing(request_id)
    await ctl.emit(schema.ForcingRequested(
        request_id=request_id, patch_id=patch.patch_id, system_commit=candidate.commit, outputs=outputs_json), patch)
    try:
        return await asyncio.wait_for(reply, FORCING_TIMEOUT_S)
    except TimeoutError:
        ctl.forcing.pop(request_id, None)
        return None


def memory_entry(ev: Evaluator, patch: schema.PatchProposed, candidate: System, identical: bool,
                 evidence: list[str]) -> schema.MemoryEntryProposed:
    """What a promotion teaches: the whole delta from stock to the promoted system, and where it holds."""
    import tempfile

    from specpilot.engine.options import requirement_tables
    from specpilot.entries import requirements_for, tree_hashes

    stock = ev.systems.git("rev-parse", "stock")
    with tempfile.TemporaryDirectory(prefix="sp-entry-") as tmp:
        files = tree_hashes(ev.systems.checkout(candidate.commit, Path(tmp) / "source"))
        stock_files = tree_hashes(ev.systems.checkout(stock, Path(tmp) / "stock"))
    return schema.MemoryEntryProposed(
        entry_id=f"entry-{patch.patch_id}", title=patch.notes[:120] or f"promoted {patch.patch_id}",
        delta=ev.systems.git("diff", stock, candidate.commit, "--", *SYSTEM_DIRS) + "\n"
        if candidate.commit != stock else "",
        options=candidate.options,
        requirements=requirements_for(candidate.options, ev.dep.facts(),
                                      code_delta=candidate.commit != stock and bool(ev.systems.diff(stock, candidate.commit)),
                                      outputs_identical=identical, **requirement_tables()),
        contract="greedy tokens identical to the incumbent's" if identical
        else "passes token forcing against stock (rate and event rules)",
        evidence=evidence, source_commit=candidate.commit, source_files=files, stock_files=stock_files,
        machine=hardware.machine(ev.device, ev.threads, str(candidate.options.get("dtype") or ev.dep.dtype)))
