"""The controller's work on one deployment: prepare stock, measure noise, test and time candidates.

A *system* is a commit of the systems repository plus engine option settings. The evaluator:
1. ``prepare``: commits stock, converts the model cache (trusted stock code, outside the sandbox),
   and fixes the secret split seed that decides which requests are sealed.
2. ``test``: applies a patch on the best commit, then in sandboxes: the candidate with the *best's*
   options must emit the best's reference tokens exactly (the default check: new code is off by
   default), and the candidate with its own options must start and answer.
3. ``time``: interleaved ABBA trials; each trial starts a fresh worker per system (no writable state
   survives between trials), sends every timing request, and times each reply on the controller's
   clock (with ``interleave``, both workers of a trial are alive and take turns request by request,
   the idle one stopped). Starting, warming up and stopping the sandboxed workers, and their compile
   caches, are `workers.Workers`' job (``self.workers``).
   Every reply is checked: the incumbent must reproduce its reference, and the candidate must
   give the same tokens in every trial (a system that changes its answers between runs — caching,
   warm-up detection — is rejected).
Outputs, timings and decisions come back as events for the service to publish.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specpilot import schema
from specpilot.paths import REPO_ROOT
from specpilot.services.controller import stats
from specpilot.services.controller.sandbox import Limits, Worker, WorkerFailed
from specpilot.services.controller.systems import Systems
from specpilot.services.controller.workers import System, Workers


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
                if self.carryover else {}}


@dataclass
class Evaluator:
    data: Path
    deployment: str
    device: str = "cpu"
    n_requests: int = 4
    max_new_tokens: int = 64
    trials: int = stats.DEFAULT_TRIALS
    threads: int | None = None
    limits: Limits = field(default_factory=Limits)
    python: str = sys.executable
    # One device: both systems' fresh workers alive in each trial and every request answered by both
    # back to back (the idle one paused), instead of one whole run after the other (see `time`).
    # None: on for one device (it cut stock-vs-stock noise on CPU and H200: docs/FIGURES.md, "Lab
    # notes moved from code"). A stopped process's queued GPU kernels still run, so every
    # interleaved timing is checked for carry-over (`stats.carryover`).
    interleave: bool | None = None
    # Pin each timing device's workers to one core beside it (`sandbox.timing_cpus`). None: on for
    # GPUs, off for CPUs (a CPU worker's torch threads are the thing timed; 1 thread by default).
    pin_cpus: bool | None = None
    # Start each worker from a copy of its system's filled compile cache (`_compile_cache`): Triton's
    # kernels on GPUs, C++ extensions (linear_backend = "stream") on CPUs. None: on.
    compile_cache: bool | None = None

    def __post_init__(self) -> None:
        # "cuda:0,cuda:1": two devices; trials then run both systems at once and swap (see `time`).
        self.devices = tuple(d.strip() for d in self.device.split(",") if d.strip())
        self.device = self.devices[0]
        # two devices run both systems at once: nothing to interleave
        self.interleave = len(self.devices) == 1 and self.interleave is not False
        gpu = self.device.startswith("cuda")
        self.pin_cpus = gpu if self.pin_cpus is None else self.pin_cpus
        self.compile_cache = self.compile_cache is not False
        self.root = Path(self.data) / "controller"
        self.root.mkdir(parents=True, exist_ok=True)
        self.systems = Systems(self.root / "systems")
        self._references: dict[str, list[list[int]]] = {}
        self._prompts: dict[str, list[list[int]]] = {}
        self.workers = Workers(data=Path(self.data), root=self.root, systems=self.systems,
                               deployment=self.deployment, devices=self.devices, max_new_tokens=self.max_new_tokens,
                               limits=self.limits, threads=self.threads, python=self.python,
                               pin_cpus=self.pin_cpus, compile_cache=self.compile_cache)

    # --- set-up ----------------------------------------------------------------------------------

    @property
    def models(self) -> Path:
        return Path(self.data) / "models"

    def split_seed(self) -> int:
        """The secret seed of the dev/sealed split; it lives where no sandbox can read it."""
        path = self.root / "split_seed"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(str(secrets.randbits(62)))
        return int(path.read_text())

    def prepare(self) -> str:
        """Stock committed, model cache converted; returns the stock commit."""
        stock = self.systems.ensure_stock()
        code = ("import sys; from pathlib import Path; from specpilot.harness.deployment import load_engine; "
                "load_engine(sys.argv[1], device='cpu', data_dir=Path(sys.argv[2]))")
        subprocess.run([self.python, "-c", code, self.deployment, str(self.data)], cwd=REPO_ROOT, check=True,
                       capture_output=True, timeout=900)
        return stock

    def prompts(self, split: str = "dev") -> list[list[int]]:
        """Prompt ids of the timing requests (encoded by the controller with stock's tokenizer)."""
        if split not in self._prompts:
            from dataclasses import replace

            from specpilot.harness.deployment import load_deployment
            from specpilot.harness.requests import encode_requests, load_requests
            from specpilot_engine.weights import load_tokenizer

            dep = replace(load_deployment(self.deployment), split_seed=self.split_seed())
            reqs = load_requests(dep, split)[: self.n_requests if split == "dev" else None]
            self._prompts[split] = encode_requests(reqs, load_tokenizer(dep.target, data_dir=self.data))
        return self._prompts[split]

    def reference(self, system: System) -> list[list[int]]:
        if system.key() not in self._references:
            self._references[system.key()] = self.workers.run(system, self.prompts())[0]
        return self._references[system.key()]

    # --- a patch ---------------------------------------------------------------------------------

    def test(self, patch: schema.PatchProposed, best: System) -> tuple[dict, System | None]:
        """Apply and check a patch; returns the PatchTested fields and the candidate (None if it failed)."""
        from specpilot.services.controller.systems import PatchDoesNotApply

        try:
            commit = self.systems.apply(best.commit, patch.diff, f"candidate {patch.patch_id}: {patch.direction_id}")
        except PatchDoesNotApply as exc:
            return {"passed": False, "detail": str(exc)}, None
        candidate = System(commit, {**best.options, **patch.options})
        try:
            defaults, _ = self.workers.run(System(commit, best.options), self.prompts())
        except WorkerFailed as exc:
            return {"passed": False, "detail": f"candidate with default options failed: {exc}",
                    "sandbox": self.workers.last_sandbox}, None
        info = self.workers.last_sandbox  # the default check's sandbox (reference() may start another)
        identical = defaults == self.reference(best)
        if not identical:
            return {"passed": False, "default_outputs_identical": False, "sandbox": info,
                    "detail": "with default options the candidate's tokens differ from the incumbent's: "
                              "new behaviour must be off unless its option is set"}, None
        try:
            self.workers.run(candidate, self.prompts()[:1])
        except WorkerFailed as exc:
            return {"passed": False, "default_outputs_identical": True, "sandbox": info,
                    "detail": f"candidate with its options failed: {exc}"}, None
        return {"passed": True, "default_outputs_identical": True, "sandbox": info,
                "detail": "default check passed; candidate runs with its options"}, candidate

    def incomplete(self, outputs: list[list[int]], reference: list[list[int]]) -> str:
        """Why some output is not a whole answer ('' if all are): an answer runs to ``max_new_tokens`` or
        ends on a stop token. Returning less (lazily, truncated) would be less work, not more speed."""
        from specpilot.harness.deployment import load_deployment
        from specpilot_engine.model import get_config

        # The target's own stop tokens (trusted stock code), plus any a reference itself ended on: a
        # candidate whose outputs differ may stop early on a token no reference happened to end with.
        stops = set(get_config(load_deployment(self.deployment).target).stop_ids)
        stops |= {r[-1] for r in reference if r and len(r) < self.max_new_tokens}
        for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
            if len(out) != self.max_new_tokens and not (out and out[-1] in stops) and out != ref:
                return (f"output {i} is incomplete: {len(out)} tokens, not {self.max_new_tokens} and no stop token "
                        "at the end")
        return ""

    def time(self, incumbent: System, candidate: System, trials: int | None = None,
             interleave: bool | None = None) -> TrialResult:
        """Paired trials; stops early with ``problem`` set when a system misbehaves.

        One device: interleaved ABBA, one system at a time; with ``interleave``, ABBA within the
        trial too, request by request (a slowdown of the machine that lasts a few requests then
        falls on both systems). Two devices: each trial runs both systems at once (A on the first
        device, B on the second), then again with the devices swapped; a system's trial time is the
        sum of its two runs, so a faster device favours neither.

        ``interleave`` overrides the evaluator's setting for this timing. An interleaved timing
        carries its carry-over test (`stats.carryover`); the caller decides what a suspect one means
        (the controller times again without interleaving)."""
        interleave = (self.interleave if interleave is None else interleave) and len(self.devices) < 2
        prompts, reference = self.prompts(), self.reference(incumbent)
        res = TrialResult([], [], [], [], [])
        first_candidate: list[list[int]] | None = None
        systems = {"A": incumbent, "B": candidate}
        for order in stats.abba_order(trials or self.trials):
            times: dict[str, float] = {"A": 0.0, "B": 0.0}
            for who, outs, secs, failure in self._trial_runs(order, systems, prompts, interleave):
                if failure is not None:
                    res.problem = f"{'incumbent' if who == 'A' else 'candidate'} failed during timing: {failure}"
                    return res
                times[who] += sum(secs)
                res.request_s.append((who, secs))
                if who == "A" and outs != reference:
                    res.problem = "the incumbent did not reproduce its reference tokens (nondeterministic system?)"
                    return res
                if who == "B":
                    if short := self.incomplete(outs, reference):
                        res.problem = short
                        return res
                    if first_candidate is None:
                        first_candidate = outs
                        res.candidate_outputs = outs
                    elif outs != first_candidate:
                        res.problem = ("the candidate's tokens changed between trials: a system must answer the "
                                       "same request the same way every time")
                        return res
            res.incumbent_s.append(times["A"])
            res.candidate_s.append(times["B"])
            res.order.append(order if len(self.devices) < 2 else f"{order[0]}@0{order[1]}@1|{order[0]}@1{order[1]}@0")
            res.load.append(os.getloadavg()[0])
        if interleave:
            res.carryover = stats.carryover(res.per_trial_requests())
        return res

    def _trial_runs(self, order: str, systems: dict[str, System], prompts: list[list[int]], interleave: bool):
        """(who, outputs, seconds, failure) of each run of one trial, in ``order``."""
        if interleave:
            yield from self._interleaved_runs(order, systems, prompts)
            return
        if len(self.devices) < 2:
            for who in order:
                try:
                    outs, secs = self.workers.run(systems[who], prompts)
                    yield who, outs, secs, None
                except WorkerFailed as exc:
                    yield who, [], [], exc
            return
        from concurrent.futures import ThreadPoolExecutor

        d0, d1 = self.devices[:2]
        for placement in ({order[0]: d0, order[1]: d1}, {order[0]: d1, order[1]: d0}):
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {who: pool.submit(self.workers.run, systems[who], prompts, dev) for who, dev in placement.items()}
            for who in order:
                try:
                    outs, secs = futures[who].result()
                    yield who, outs, secs, None
                except WorkerFailed as exc:
                    yield who, [], [], exc

    def _interleaved_runs(self, order: str, systems: dict[str, System], prompts: list[list[int]]):
        """One trial with both systems' fresh workers alive: request ``i`` is answered by both, in
        ``order`` for even ``i`` and reversed for odd ``i`` (`_together`)."""
        def request_order(i: int) -> list[str]:
            first = stats.first_in_request(order, i)
            return [first, order.replace(first, "")]

        yield from self._together(list(order), systems, prompts, request_order)

    def _together(self, names: list[str], systems: dict[str, System], prompts: list[list[int]], request_order):
        """(name, outputs, seconds, failure) of each of ``names``, their fresh workers alive at once:
        each started and warmed up alone (the others paused), then request ``i`` answered by each
        system in ``request_order(i)``; a worker not being timed is paused (``Sandbox.pause``), so it
        takes no CPU while another answers. On a failure only the failing system is yielded."""
        workers: dict[str, Worker] = {}
        outs: dict[str, list[list[int]]] = {n: [] for n in names}
        secs: dict[str, list[float]] = {n: [] for n in names}
        who = names[0]
        with contextlib.ExitStack() as stack:
            try:
                for who in names:
                    for other in workers.values():
                        other.sandbox.pause()
                    workers[who] = stack.enter_context(self.workers.warm_worker(systems[who], prompts, self.device))
                for i, p in enumerate(prompts):
                    for who in request_order(i):
                        for other, w in workers.items():
                            (w.sandbox.resume if other == who else w.sandbox.pause)()
                        tokens, t = workers[who].generate(p, self.max_new_tokens, timeout=self.limits.wall_s)
                        outs[who].append(tokens)
                        secs[who].append(t)
            except WorkerFailed as exc:
                yield who, [], [], exc
                return
            finally:
                for w in workers.values():
                    w.sandbox.resume()  # a stopped process would not see its stdin close
        for n in names:
            yield n, outs[n], secs[n], None

    # --- phase 0 and phase 4 ---------------------------------------------------------------------

    def measure(self, system: System) -> dict:
        """What the cost model needs of ``system`` on the dev requests (`ProfileMeasured` fields).

        The kernel-class profile and the drafter's matched depths come from the system's own worker
        (planning inputs, not verdicts); the step times come from the controller's clock: the
        system and its AR twin (same code and options, no drafter) answer the same requests."""
        prompts = self.prompts()
        with self.workers.worker(system, self.device,
                          lambda tmp: self.workers.compile_cache_for(system, prompts, self.device, tmp)) as worker:
            replies = [worker.request({"measure": {"prompt_ids": p, "max_new_tokens": self.max_new_tokens}},
                                      timeout=self.limits.wall_s)[0] for p in prompts]
        _, system_s = self.workers.run(system, prompts)
        ar_outputs, ar_s = self.workers.run(System(system.commit, {**system.options, "drafter": "none"}), prompts)
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
        }

    def sealed_final(self, systems: dict[str, System], n_requests: int = 0, trials: int = 3,
                     ) -> tuple[dict, dict[str, list[list[int]]]]:
        """Phase 4: every system answers the sealed requests ``trials`` times (order: `sealed_order`).

        With ``interleave`` (one device) every system's fresh worker of a trial is alive at once and
        each request is answered by all of them in turn, the trial's order forward on even requests
        and reversed on odd ones, as in the paired timing (`_together`); else whole runs one after
        another. Returns per system its tokens/s and, per other system, the speedup over the one
        named "ar" and over "stock" (geometric mean of per-trial time ratios, two-sided 95%
        t-interval), plus the outputs of the first trial (for forcing)."""
        prompts = self.prompts("sealed")[: n_requests or None]
        names = list(systems)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[list[int]]] = {}
        interleave = self.interleave  # False for two devices (`__post_init__`)
        for t in range(trials):
            order = sealed_order(names, t)
            if interleave:
                runs = self._together(order, systems, prompts, lambda i, order=order: order if i % 2 == 0 else order[::-1])
            else:
                runs = ((name, *self.workers.run(systems[name], prompts), None) for name in order)
            for name, outs, secs, failure in runs:
                if failure is not None:
                    raise failure
                if name in outputs and outs != outputs[name]:
                    raise WorkerFailed(f"{name} changed its tokens between trials")
                outputs[name] = outs
                seconds[name].append(sum(secs))
        results: dict = {"requests": len(prompts), "trials": trials, "max_new_tokens": self.max_new_tokens,
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


def _mean_chain_cost(replies: list[dict]) -> dict[int, float]:
    """Per chain length, the mean over requests of the measured c(n) (`specpilot.harness.replay.chain_cost`)."""
    by_n: dict[int, list[float]] = {}
    for r in replies:
        for n, c in r.get("chain_cost", {}).items():
            by_n.setdefault(int(n), []).append(float(c))
    return {n: round(sum(cs) / len(cs), 4) for n, cs in sorted(by_n.items())}


def _alternative_drafters(replies: list[dict]) -> dict[str, dict]:
    """Per other drafter replayed in every reply: its chain depths per request and mean draft seconds."""
    per = [r.get("drafters", {}) for r in replies]
    names = set.intersection(*(set(k for k, v in d.items() if "chain_depths" in v) for d in per)) if per else set()
    return {name: {"chain_depths": [[int(x) for x in d[name]["chain_depths"]] for d in per],
                   "draft_s": sum(float(d[name]["draft_s"]) for d in per) / len(per)} for name in sorted(names)}


def sealed_order(names: list[str], trial: int) -> list[str]:
    """The order of the systems in one sealed trial: a rotation that moves every second trial, reversed
    on odd trials, so each pair of systems runs in both orders within every two trials (a plain
    rotation of three systems put "stock" before "final" in both of two trials, and a run's position
    in the trial can be worth several percent on a GPU)."""
    k = (trial // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if trial % 2 else order
