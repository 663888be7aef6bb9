"""Running systems: the controller's sandboxed workers, their lifecycle and their compile caches.

`Workers` starts a fresh timing worker (`specpilot.harness.worker`) of a `System` (a commit of the systems
repository plus option settings) in a fresh `specpilot.sandbox.Sandbox`, warms it up untimed
(`warm_up_requests`), hands it out, and closes it (the sandbox killed) on exit; `run` answers prompts on
the controller's clock. What one timed call answers is a *unit* (`units`): one prompt for a batch-1
deployment, a closed-loop load of ``LOAD_PER_CLIENT * concurrency`` prompts at the deployment's
concurrency for a batched one (its throughput is what is timed). Each worker starts from a fresh copy of its system's compile cache, filled once
with requests that know lengths, not tokens (`compile_fill_requests`). `abort` kills every sandbox in
use (the service is stopping). What is checked, timed or decided is the jobs' (`checks`, `timing`,
`phases`, `verdict`); this module only runs systems.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.sandbox import Limits, Sandbox, Worker, WorkerFailed, copy_untrusted
from specpilot.services.controller.pinning import timing_cpus
from specpilot.services.controller.systems import Systems

WARMUP_TOKENS = 8
LOAD_PER_CLIENT = 2  # batched: prompts a closed-loop client sends in one timed load


# Kept compile caches of an older format are left unused: before format 2 a kept cache's files lost their times
# when copied, so ninja rebuilt a C++ extension in every worker started from it (`sandbox.copy_untrusted`).
CACHE_FORMAT = 2


def warm_up_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """A prompt of each timed prompt's length but of other content: prompt ``i``'s is the next prompt's
    tokens reversed, cut or repeated to its length. A candidate that memoised its answers, or the KV of a
    prompt, would otherwise be timed on replays of the warm-up."""
    out = []
    for i, p in enumerate(prompts):
        donor = prompts[(i + 1) % len(prompts)][::-1] or p
        out.append((donor * (len(p) // len(donor) + 1))[: len(p)])
    return out


def warm_up_requests(prompts: list[list[int]], max_new_tokens: int, device: str) -> list[tuple[list[int], int]]:
    """The untimed (prompt, max_new_tokens) requests a fresh worker answers before it is timed
    (`warm_up_prompts`: the same step shapes, and on a GPU the same context buckets, so CUDA graphs are
    captured before the clock runs). On a GPU one per timed request, in full; on a CPU one short one (a
    full pass would double a run)."""
    donors = warm_up_prompts(prompts)
    return [(p, max_new_tokens) for p in donors] if device.startswith("cuda") else [(donors[0], WARMUP_TOKENS)]


# A repeating run of token ids below 256 (every vocabulary here has them), so the n-gram drafter
# finds matches and the fill compiles the drafted block sizes as well as single-token steps.
FILL_PATTERN = (101, 37, 202, 58, 143, 77, 19)


def compile_fill_requests(prompts: list[list[int]], max_new_tokens: int, device: str) -> list[tuple[list[int], int]]:
    """The requests that fill a system's compile cache before its first timed worker: on a GPU one
    per prompt length, of content unrelated to any prompt (``FILL_PATTERN``); on a CPU none.

    Triton compiles a kernel per shape specialisation, so requests of the timed lengths compile what
    timing will use (much of a cold GPU worker's start: docs/FIGURES.md, "Lab notes moved from code").
    The cache is the one state kept between trials, so what fills it must know nothing
    a candidate could memoise: lengths, not tokens. Every timed worker still answers its own warm-up
    first (`warm_up_requests`), which compiles anything the fill missed, untimed. A CPU worker
    compiles while it loads (a C++ extension such as `specpilot.kernels.cpu_gemm`: ~30 s on 2 cores, built
    into the cache's ``torch_extensions``), and nothing per shape: starting it is the whole fill."""
    if not device.startswith("cuda"):
        return []
    lengths = sorted({len(p) for p in prompts})
    return [([FILL_PATTERN[i % len(FILL_PATTERN)] for i in range(n)], max_new_tokens) for n in lengths]


@dataclass(frozen=True)
class System:
    commit: str
    options: dict = field(default_factory=dict)

    def key(self) -> str:
        return f"{self.commit}:{json.dumps(self.options, sort_keys=True)}"


@dataclass
class Workers:
    """Sandboxed workers of one deployment's systems on the controller's devices."""

    data: Path  # the data directory: hidden from every sandbox; its models/ is bound read-only
    root: Path  # the controller's folder (compile caches under compile-cache/)
    systems: Systems
    deployment: str
    devices: tuple[str, ...] = ("cpu",)
    max_new_tokens: int = 64
    limits: Limits = field(default_factory=Limits)
    threads: int | None = None
    python: str = sys.executable
    pin_cpus: bool = False
    compile_cache: bool = True
    visible: tuple[Path, ...] = ()  # the deployment's files outside the checkout (`Deployment.external_paths`)
    env: dict[str, str] = field(default_factory=dict)  # the deployment's sandbox environment (`sandbox_env`)
    concurrency: int = 1  # batched deployments: closed-loop clients of a timed load (1: batch 1)

    def __post_init__(self) -> None:
        self._cpus: dict[str, tuple[int, ...]] | None = None
        self._starts: dict[str, int] = {}  # workers started per system key (`compile_cache_for`)
        self._kept: dict[str, Path] = {}  # a kept compile cache of each commit, not empty (`compile_cache_for`)
        self._watched: dict[Path, str] = {}  # a first start's empty cache folder -> its system key
        self._built_nothing: dict[str, bool] = {}  # system key -> its first start left its cache empty
        # (system key, untimed seconds: start-up and warm-up) of each warm worker since the current timing
        # began (`timing.paired` clears it), in start order
        self.untimed: list[tuple[str, float]] = []
        self._active: dict[int, Sandbox] = {}  # sandboxes in use, killed by abort()
        self.last_sandbox: dict = {}  # describe() of the latest sandbox, recorded in PatchTested

    def cpus(self, device: str) -> tuple[int, ...] | None:
        """The cores ``device``'s workers are pinned to (None: not pinned)."""
        if not self.pin_cpus:
            return None
        if self._cpus is None:  # once: it asks the GPU's PCI address
            self._cpus = timing_cpus(self.devices)
        return self._cpus.get(device)

    def sandbox(self, commit: str, workdir: Path, device: str | None = None,
                compile_cache: Path | None = None) -> Sandbox:
        src = self.systems.checkout(commit, workdir / "src")
        device = device or self.devices[0]
        sbx = Sandbox(src=src, models=self.data / "models", hide=[self.data], visible=list(self.visible), env=self.env,
                      device=device, limits=self.limits, threads=self.threads, cpus=self.cpus(device),
                      compile_cache=compile_cache)
        self._active[id(sbx)] = sbx
        self.last_sandbox = sbx.describe()
        return sbx

    def abort(self) -> None:
        """Kill every running sandbox (the service is stopping); the work in progress fails fast."""
        for sbx in list(self._active.values()):
            sbx.kill()

    def units(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """``prompts`` cut into what one timed call answers: one prompt each (batch 1), or loads of
        ``LOAD_PER_CLIENT * concurrency`` prompts (batched), in order."""
        size = 1 if self.concurrency == 1 else LOAD_PER_CLIENT * self.concurrency
        return [prompts[i:i + size] for i in range(0, len(prompts), size)]

    def answer(self, worker: Worker, unit: list[list[int]]) -> tuple[list[list[int]], float]:
        """One unit answered: each prompt's tokens, and the controller-clock seconds of the call."""
        if self.concurrency == 1:
            (prompt,) = unit
            tokens, secs = worker.generate(prompt, self.max_new_tokens, timeout=self.limits.wall_s)
            return [tokens], secs
        return worker.serve(unit, self.max_new_tokens, self.concurrency, timeout=self.limits.wall_s)

    def run(self, system: System, prompts: list[list[int]], device: str | None = None,
            ) -> tuple[list[list[int]], list[float]]:
        """One fresh worker of ``system`` answering ``prompts``: tokens a prompt and controller-clock seconds
        a unit (`units`)."""
        with self.warm_worker(system, prompts, device or self.devices[0]) as worker:
            outs, times = [], []
            for unit in self.units(prompts):
                tokens, secs = self.answer(worker, unit)
                outs.extend(tokens)
                times.append(secs)
            return outs, times

    @contextlib.contextmanager
    def worker(self, system: System, device: str, compile_cache=lambda workdir: None):
        """A started worker of ``system`` in a fresh sandbox, closed (and the sandbox killed) on exit.
        ``compile_cache(workdir)`` gives the sandbox's compile cache directory (None: none)."""
        with tempfile.TemporaryDirectory(prefix="sp-sbx-") as tmp:
            cache = compile_cache(Path(tmp))
            try:
                with self.sandbox(system.commit, Path(tmp), device, cache) as sbx:
                    try:
                        worker = Worker(sbx, self.python, self.deployment, system.options, device=device,
                                        ready_timeout_s=self.limits.wall_s)
                        try:
                            yield worker
                        finally:
                            worker.close()
                    finally:
                        self._active.pop(id(sbx), None)
                if cache is not None and (key := self._watched.get(cache)) is not None:  # a whole first start
                    self._built_nothing[key] = not any(cache.iterdir())
            finally:
                self._watched.pop(cache, None)

    @contextlib.contextmanager
    def warm_worker(self, system: System, prompts: list[list[int]], device: str):
        """A fresh worker of ``system`` that has answered the untimed warm-up requests: lazy
        initialisation in a fresh process is not the system's speed. On a GPU that is every request's
        length in full (CUDA graphs are captured per step shape and context bucket on first use, which
        adds noise when timed: docs/FIGURES.md, "Lab notes moved from code"); on a CPU one short
        request (a full pass would double a run)."""
        with self.worker(system, device, lambda tmp: self.compile_cache_for(system, prompts, device, tmp)) as worker:
            warm_ups = warm_up_requests(prompts, self.max_new_tokens, device)
            for p, n in warm_ups:
                warm, secs = worker.generate(p, n, timeout=self.limits.wall_s)
                worker.untimed_s += secs
                if len(warm) > n:
                    raise WorkerFailed(f"asked for {n} tokens, got {len(warm)}")
            if self.concurrency > 1:  # the batched path too: its rows, drafters and kernels
                donors = warm_up_prompts(prompts)[: self.concurrency]
                _, secs = worker.serve(donors, WARMUP_TOKENS, self.concurrency, timeout=self.limits.wall_s)
                worker.untimed_s += secs
            self.untimed.append((system.key(), worker.untimed_s))
            yield worker

    def compile_cache_for(self, system: System, prompts: list[list[int]], device: str, workdir: Path) -> Path | None:
        """A fresh copy (under ``workdir``) of ``system``'s compile cache for one worker, filled first
        at the system's second start (a system started once, like a default check, compiles for
        itself as before: a fill would double its cost); None where ``compile_cache`` is off.

        A first start gets a copy of the kept cache of the same commit under other options where one
        exists (the same code, filled the same way: an AR twin need not rebuild its system's C++
        kernel, ~12 s on 2 cores), else an empty folder of its own, watched: where it stays empty
        and the fill would send no requests (a CPU), the fill could only keep an empty cache, so an
        empty one is kept without starting it (a worker start saved per system).

        The kept cache is only ever written by the fill (`compile_fill_requests`); what a timed worker
        writes goes to its own copy and is gone with its trial. What a sandbox wrote is hostile input: every
        copy is `copy_untrusted` (no link or special file followed, sizes bounded), and a cache passes only
        between systems of one commit (the same code, so the same author)."""
        if not self.compile_cache:
            return None
        key = system.key()
        self._starts[key] = starts = self._starts.get(key, 0) + 1
        kept = self.root / "compile-cache" / hashlib.sha256(f"{CACHE_FORMAT}:{key}".encode()).hexdigest()[:16]
        copy = workdir / "compile-cache"
        sibling = self._kept.get(system.commit)  # a kept cache of this commit under other options, not empty
        if not kept.exists():
            if starts < 2:
                if sibling is not None:
                    copy_untrusted(sibling, copy)
                else:
                    copy.mkdir()
                    self._watched[copy] = key
                return copy
            fills = compile_fill_requests(prompts, self.max_new_tokens, device)
            if fills or not self._built_nothing.get(key):
                self._fill(system, device, fills, kept, sibling)
            else:
                kept.mkdir(parents=True)
        if any(kept.iterdir()):
            self._kept.setdefault(system.commit, kept)
        copy_untrusted(kept, copy)
        return copy

    def _fill(self, system: System, device: str, fills: list[tuple[list[int], int]], kept: Path,
              seed: Path | None) -> None:
        """Fill ``kept`` by a worker of ``system`` answering ``fills``, from a copy of ``seed`` (what the
        commit built already is not built again) or from nothing."""
        with tempfile.TemporaryDirectory(prefix="sp-fill-") as tmp:
            filling = Path(tmp) / "cache"
            if seed is not None:
                copy_untrusted(seed, filling)
            else:
                filling.mkdir()
            with self.worker(system, device, lambda _: filling) as worker:
                for p, n in fills:
                    worker.generate(p, n, timeout=self.limits.wall_s)
            staged = kept.with_suffix(".tmp")
            shutil.rmtree(staged, ignore_errors=True)  # a fill that died half-way
            # what the worker wrote is hostile: links and special files are left out, sizes bounded
            copy_untrusted(filling, staged)
            staged.rename(kept)  # whole or absent, never half-filled
