"""The controller's view of one deployment: its systems, workers, requests and references.

A *system* is a commit of the systems repository plus engine option settings. The `Evaluator` holds
what every job on one deployment shares: the systems repository (`systems.Systems`), the running
systems (`workers.Workers`, ``self.workers``), the timing design's settings, the secret split seed, the
dev and sealed prompts (encoded with stock's tokenizer) and each system's reference tokens. The jobs
live beside it, one module each, as functions of an evaluator: the default check and the completeness
rule (`checks`), paired timing (`timing`), the profile of phase 0 and the sealed final of phase 4
(`phases`); the service's handling of one patch is `verdict`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.paths import REPO_ROOT, machine_cache_dir
from specpilot.sandbox import Limits, add_secrets
from specpilot.services.controller import stats
from specpilot.services.controller.systems import Systems
from specpilot.services.controller.workers import System, Workers

__all__ = ["Evaluator", "System"]
# A noise figure of this machine is reused by other data directories for a week: a machine that changed
# (CPU, cores, kernel, GPU) has another fingerprint, so what ages it is load patterns, not hardware.
NOISE_FRESH_S = 7 * 24 * 3600.0


def _noise_path(design: dict) -> Path:
    key = hashlib.sha256(json.dumps(design, sort_keys=True).encode()).hexdigest()[:20]
    return machine_cache_dir() / "noise" / f"{key}.json"


@dataclass
class Evaluator:
    data: Path
    deployment: str
    device: str = "cpu"
    n_requests: int = 4
    max_new_tokens: int = 64
    trials: int = stats.DEFAULT_TRIALS  # the most trials a verdict's sequential timing runs
    noise_trials: int | None = None  # trials of the stock-versus-stock noise run (None: ``trials``)
    threads: int | None = None
    limits: Limits = field(default_factory=Limits)
    python: str = sys.executable
    # One device: both systems' fresh workers alive in each trial and every request answered by both
    # back to back (the idle one paused), instead of one whole run after the other (`timing.paired`).
    # None: on for one device (it cut stock-vs-stock noise on CPU and H200: docs/FIGURES.md, "Lab
    # notes moved from code"). A stopped process's queued GPU kernels still run, so every
    # interleaved timing is checked for carry-over (`stats.carryover`).
    interleave: bool | None = None
    # Pin each timing device's workers to one core beside it (`sandbox.timing_cpus`). None: on for
    # GPUs, off for CPUs (a CPU worker's torch threads are the thing timed; 1 thread by default).
    pin_cpus: bool | None = None
    # Start each worker from a copy of its system's filled compile cache (`workers.Workers`): Triton's
    # kernels on GPUs, C++ extensions (linear_backend = "stream") on CPUs. None: on.
    compile_cache: bool | None = None
    seed_file: Path | None = None  # the controller bundle's split seed (None: one of this data directory's)
    # Start each interleaved trial's fresh workers while the trial before it is timed (`timing.Prestarted`),
    # so a worker's start-up (3-5 s on a CPU) leaves the critical path. Off unless asked: on a 2-core VM it cut
    # a trial from 32 to 23 s but raised the per-trial SD from 3.5% to 6.1%, three times the trials for the
    # same power (docs/lab/2026-12-07-session-44.md); a GPU's warm-up would run on the timed device.
    prestart: bool = False

    def __post_init__(self) -> None:
        # "cuda:0,cuda:1": two devices; trials then run both systems at once and swap (`timing.paired`).
        self.devices = tuple(d.strip() for d in self.device.split(",") if d.strip())
        self.noise_trials = self.noise_trials or self.trials
        self.device = self.devices[0]
        # two devices run both systems at once: nothing to interleave
        self.interleave = len(self.devices) == 1 and self.interleave is not False
        gpu = self.device.startswith("cuda")
        self.pin_cpus = gpu if self.pin_cpus is None else self.pin_cpus
        self.compile_cache = self.compile_cache is not False
        self.prestart = self.interleave and self.prestart
        self.root = Path(self.data) / "controller"
        self.root.mkdir(parents=True, exist_ok=True)
        self.systems = Systems(self.root / "systems")
        self._references: dict[str, list[list[int]]] = {}
        self._prompts: dict[str, list[list[int]]] = {}
        self._stop_ids: set[int] | None = None
        self._prepared: str | None = None  # the stock commit the model cache was last converted for (`prepare`)
        # parsed once (it imports torch: a deployment checks its target's config); the workers get its name
        from specpilot.harness.deployment import load_deployment

        self.dep = load_deployment(self.deployment)
        dep = self.dep
        self._serves = bool(dep.server)
        self._ar_options = dep.ar_options()
        self.workers = Workers(data=Path(self.data), root=self.root, systems=self.systems,
                               deployment=self.deployment, devices=self.devices, max_new_tokens=self.max_new_tokens,
                               limits=self.limits, threads=self.threads, python=self.python,
                               pin_cpus=self.pin_cpus, compile_cache=self.compile_cache,
                               visible=tuple(dep.external_paths()), env=dep.sandbox_env(),
                               concurrency=dep.concurrency if dep.mode == "batched" else 1)

    # --- set-up ----------------------------------------------------------------------------------

    def serves(self) -> bool:
        """Whether the system under test is an external server (`specpilot.harness.server`)."""
        return self._serves

    def ar_system(self, system: System) -> System:
        """``system``'s AR twin: the same code and options, decoding without speculation."""
        return System(system.commit, {**system.options, **self._ar_options})

    def stock_system(self) -> System:
        """The deployment's stock system: the stock commit with no option changed."""
        return System(self.systems.git("rev-parse", "stock"), {})

    @property
    def models(self) -> Path:
        return Path(self.data) / "models"

    def split_seed(self) -> int:
        """The secret seed of the dev/sealed split; it lives where no sandbox can read it: the
        controller's bundle (``seed_file``, `specpilot.bundles`), else (``specpilot time``, no bundle)
        a file this evaluator makes in its own folder. It is a secret `sandbox.scrub` removes from worker text."""
        if self.seed_file is not None:
            seed = int(Path(self.seed_file).read_text())
        else:
            path = self.root / "split_seed"
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(str(secrets.randbits(62)))
            seed = int(path.read_text())
        add_secrets([str(seed)])
        return seed

    def prepare(self) -> str:
        """Stock committed, model cache converted; returns the stock commit. The controller prepares
        before every job: the conversion runs again only when stock changed (`Systems.restock`), since
        for the same stock it finds its cache and does nothing but cost a process with torch and the
        model loaded (~4 s on 2 cores, once per patch)."""
        stock = self.systems.ensure_stock()
        if self._prepared != stock:
            code = ("import sys; from pathlib import Path; from specpilot.harness.deployment import load_engine; "
                    "load_engine(sys.argv[1], device='cpu', data_dir=Path(sys.argv[2]))")
            subprocess.run([self.python, "-c", code, self.deployment, str(self.data)], cwd=REPO_ROOT, check=True,
                           capture_output=True, timeout=900)
            self._prepared = stock
        return stock

    def prompts(self, split: str = "dev") -> list[list[int]]:
        """Prompt ids of the timing requests (encoded by the controller with stock's tokenizer)."""
        if split not in self._prompts:
            self._prompts[split] = self._encoded(split, 0, self.n_requests if split == "dev" else None)
        return self._prompts[split]

    def _encoded(self, split: str, start: int, stop: int | None) -> list[list[int]]:
        """Prompt ids of requests ``start:stop`` of a split under the controller's secret seed."""
        import msgspec

        from specpilot.engine.weights import load_tokenizer
        from specpilot.harness.requests import encode_requests, load_requests

        dep = msgspec.structs.replace(self.dep, split_seed=self.split_seed())
        return encode_requests(load_requests(dep, split)[start:stop], load_tokenizer(dep.target, data_dir=self.data))

    # --- timing noise shared by the data directories of this machine ----------------------------------

    def noise_design(self) -> dict:
        """What a stock-versus-stock noise figure depends on: the machine, the deployment and the timing
        design (`noise_cached` keys the machine cache on it)."""
        from specpilot import __version__
        from specpilot.services.controller.hardware import fingerprint

        return {"machine": fingerprint(self.device), "device": ",".join(self.devices), "threads": self.threads,
                "deployment": self.deployment,
                "deployment_sha256": hashlib.sha256(Path(self.dep.path).read_bytes()).hexdigest()[:16],
                "requests": self.n_requests, "trials": self.noise_trials, "max_new_tokens": self.max_new_tokens,
                "interleave": self.interleave, "specpilot": __version__,
                "analysis": "crossover"}  # noise of the crossover fit (`stats`, "Position"), not the plain one

    def noise_cached(self, max_age_s: float = NOISE_FRESH_S) -> dict | None:
        """A noise figure this machine measured for the same design within ``max_age_s`` (any data
        directory), or None: ``{"noise", "measured_at", "event_id", "data"}``."""
        path = _noise_path(self.noise_design())
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        fresh = time.time() - float(found.get("measured_at", 0)) <= max_age_s
        return found if fresh and isinstance(found.get("noise"), float) else None

    def remember_noise(self, noise: float, event_id: str) -> None:
        design = self.noise_design()
        path = _noise_path(design)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"noise": noise, "measured_at": time.time(), "event_id": event_id,
                                   "data": str(self.data), "design": design}))
        tmp.rename(path)

    def more_dev_prompts(self, tokens: int) -> list[list[int]]:
        """Dev prompts after the timing requests, enough for about ``tokens`` output tokens (forcing
        with power: `verdict.force`); as many as the dev split holds."""
        return self._encoded("dev", self.n_requests, self.n_requests + -(-tokens // self.max_new_tokens))

    def reference(self, system: System) -> list[list[int]]:
        if system.key() not in self._references:
            self._references[system.key()] = self.workers.run(system, self.prompts())[0]
        return self._references[system.key()]

    def stop_ids(self) -> set[int]:
        """The target's own stop tokens (trusted stock code)."""
        if self._stop_ids is None:
            from specpilot.engine.model import get_config

            self._stop_ids = set(get_config(self.dep.target).stop_ids)
        return self._stop_ids
