"""Where simulated paired timings come from: a noise model, and recorded timings resampled.

Shared by the controller's statistics tests (tests/controller/test_stats.py, test_sequential.py) and the
sequential-verdict simulation (bench/sequential_sim.py), so both judge the rules on the same timings.

- `simulate`: the model (`model_draw`: one timing of it, as `Recorded.draw` gives one). Each trial times incumbent and candidate on the same ``n_req`` requests in the
  order `stats.abba_order` gives. A request's time is its base time x lognormal noise, and with a small
  probability an outlier (x1.2-2). Both runs of a trial share a trial-level load factor (what pairing
  cancels); the machine drifts slowly across the experiment (a random walk per run slot, what ABBA
  cancels to first order).
- `Recorded`: real timings (`TimingMeasured` events of a ledger, or the JSON lines of
  bench/controller_noise.py) as per-trial log ratios with the run's mean taken out (what is left: the
  machine's noise and what running first costs), resampled in aligned blocks of 4 trials (one ABBA
  cycle, so each block keeps its drift and position pattern), all blocks of one simulated timing from
  one recorded run (a run's own noise level is part of what a timing meets).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.services.controller import stats

BLOCK = 4  # trials: one ABBA cycle


def simulate(rng: np.random.Generator, n_exp: int, n_trials: int, gain: float, req_sigma: float,
             n_req: int = 8, outlier_p: float = 0.005, drift_sd: float = 0.005, trial_sd: float = 0.03,
             linear_drift: float = 0.0, order: list[str] | None = None,
             position: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Trial times (incumbent_s, candidate_s), each [n_exp, n_trials]; the candidate is exp(gain)x faster
    and whichever system runs first in a trial is exp(position)x slower."""
    base = rng.uniform(0.5, 3.0, size=(n_exp, 1, 1, n_req))
    slots = 2 * n_trials
    walk = np.cumsum(rng.normal(0.0, drift_sd, size=(n_exp, slots)), axis=1)
    drift = np.exp(walk + linear_drift * np.arange(slots) / slots)
    shared = np.exp(rng.normal(0.0, trial_sd, size=(n_exp, n_trials, 1)))
    noise = np.exp(rng.normal(0.0, req_sigma, size=(n_exp, n_trials, 2, n_req)))
    outliers = np.where(rng.random(noise.shape) < outlier_p, rng.uniform(1.2, 2.0, noise.shape), 1.0)
    t = (base * noise * outliers).sum(-1) * shared  # [exp, trial, (incumbent, candidate)]
    first_b = np.array([o == "BA" for o in (order or stats.abba_order(n_trials))], dtype=int)
    slot_a = 2 * np.arange(n_trials) + first_b
    slot_b = 2 * np.arange(n_trials) + 1 - first_b
    first = np.exp(position * np.array([1 - first_b, first_b]))  # [(incumbent, candidate), trial]
    return (t[:, :, 0] * drift[:, slot_a] * first[0], t[:, :, 1] * drift[:, slot_b] / math.exp(gain) * first[1])


def model_draw(rng: np.random.Generator, n_trials: int, gain: float = 0.0, scale: float = 1.0,
               req_sigma: float = 0.02, **model) -> tuple[np.ndarray, np.ndarray]:
    """One `simulate`d timing as trial times (incumbent_s, candidate_s), the candidate's noise around the true
    ``gain`` scaled by ``scale`` (a noisier candidate); the same call as `Recorded.draw`."""
    inc, cand = simulate(rng, 1, n_trials, gain, req_sigma, **model)
    inc, cand = inc[0], cand[0]
    lr = np.log(inc / cand) - gain
    return inc, inc / np.exp(gain + scale * lr)


@dataclass(frozen=True)
class RecordedRun:
    source: str
    incumbent_s: tuple[float, ...]
    candidate_s: tuple[float, ...]
    order: tuple[str, ...]


def read_runs(paths: Iterable[Path]) -> list[RecordedRun]:
    """Interleaved ABBA timings of at least one whole block, from ledgers (``*.duckdb``: every
    ``timing.measured`` event) and JSON-lines files (objects with ``incumbent_s``, ``candidate_s`` and
    ``order``; others are skipped)."""
    runs = []
    for path in map(Path, paths):
        if path.suffix == ".duckdb":
            import duckdb

            with duckdb.connect(str(path), read_only=True) as con:
                rows = [json.loads(p) for (p,) in con.execute(
                    "SELECT payload FROM events WHERE type = 'timing.measured' ORDER BY pos").fetchall()]
            found = [(f"{path}:{r.get('event_id', '')}", r) for r in rows if r.get("interleaved")]
        else:
            found = []
            for i, line in enumerate(path.read_text().splitlines()):
                line = line.strip()
                if line.startswith("{"):
                    found.append((f"{path}:{i + 1}", json.loads(line)))
        for name, r in found:
            inc, cand, order = r.get("incumbent_s") or [], r.get("candidate_s") or [], r.get("order") or []
            if len(inc) >= BLOCK and len(inc) == len(cand) == len(order) and list(order) == stats.abba_order(len(inc)):
                runs.append(RecordedRun(name, tuple(inc), tuple(cand), tuple(order)))
    return runs


class Recorded:
    """Recorded runs as aligned blocks of 4 centred per-trial log ratios (module docstring)."""

    def __init__(self, runs: list[RecordedRun]):
        if not runs:
            raise ValueError("no recorded interleaved ABBA timing of 4 or more trials was found")
        self.runs = runs
        self.blocks: list[np.ndarray] = []  # per run: [n_blocks, 4]
        for r in runs:
            lr = stats.log_ratios(r.incumbent_s, r.candidate_s)
            centred = (lr - lr.mean()) * math.sqrt(lr.size / (lr.size - 1))  # an unbiased spread
            whole = lr.size // BLOCK * BLOCK
            self.blocks.append(centred[:whole].reshape(-1, BLOCK))
        self.weights = np.array([b.shape[0] for b in self.blocks], dtype=np.float64)
        self.weights /= self.weights.sum()

    @property
    def trials(self) -> int:
        return sum(b.size for b in self.blocks)

    def per_trial_sd(self) -> float:
        """The pooled SD of the centred log ratios (position included)."""
        return float(np.sqrt(np.mean(np.concatenate([b.ravel() for b in self.blocks]) ** 2)))

    def draw(self, rng: np.random.Generator, n_trials: int, gain: float = 0.0, scale: float = 1.0,
             ) -> tuple[np.ndarray, np.ndarray]:
        """One simulated timing as trial times (incumbent_s, candidate_s): log ratios ``gain + scale x``
        a resampled noise sequence (the incumbent's trial takes 1 s)."""
        blocks = self.blocks[rng.choice(len(self.blocks), p=self.weights)]
        need = -(-n_trials // BLOCK)
        lr = blocks[rng.integers(0, blocks.shape[0], size=need)].ravel()[:n_trials]
        inc = np.ones(n_trials)
        return inc, inc / np.exp(gain + scale * lr)
