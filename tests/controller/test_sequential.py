"""Sequential verdicts (`sequential`): the boundaries, the rule at one look, and the rates the controller is
specified by (issue 54 item 1), simulated through the controller's own `sequential.look`:

- on the timings recorded on this project's CPU machine (docs/results/timing-noise-cpu-2026-12-07.jsonl,
  resampled in ABBA blocks: `bench.timing_model.Recorded`) at the CPU deployment's own [timing] settings:
  false promotion <= 1%, power >= 90% at a true 5% gain, and a clear loser or winner decided in a few trials;
- on the noise model of the statistics tests (`bench.timing_model.simulate`): a stock copy, also a
  noisier one, also under a linear drift, is promoted at most 1% of the time.
Every RNG is seeded, so the rates are exact numbers, not flaky ones.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from bench.sequential_sim import run_case
from bench.timing_model import Recorded, model_draw, read_runs
from specpilot.harness.deployment import load_deployment
from specpilot.services.controller import sequential, stats

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "docs" / "results" / "timing-noise-cpu-2026-12-07.jsonl"
RUNS = 2000


def test_boundaries_match_the_published_obrien_fleming_table():
    # gsDesign's Lan-DeMets O'Brien-Fleming bounds, 5 equally spaced looks, one-sided alpha 0.025
    published = (4.877, 3.357, 2.680, 2.290, 2.031)
    assert sequential.bounds((1, 2, 3, 4, 5), alpha=0.025, spending="obf") == pytest.approx(published, abs=0.003)


def test_one_look_is_the_fixed_test_and_hsd_bounds_fall_to_it():
    assert sequential.bounds((6,)) == pytest.approx((sps.norm.isf(0.05),), abs=1e-6)
    z = sequential.bounds(sequential.looks(16))
    assert sequential.looks(16) == (2, 4, 6, 8, 10, 12, 14, 16) and len(z) == 8
    assert all(a > b for a, b in zip(z, z[1:], strict=False)) and z[-1] > sps.norm.isf(0.05)
    assert sequential.spent([1.0])[0] == pytest.approx(0.05)


def test_the_boundaries_spend_exactly_alpha_on_a_brownian_motion():
    """Monte Carlo of the z statistics at the looks (independent increments): the chance of ever crossing
    is the alpha spent (0.05), and crossing by look k follows the spending function."""
    at = sequential.looks(16)
    z = np.asarray(sequential.bounds(at))
    rng = np.random.default_rng(7)
    steps = rng.normal(size=(400_000, len(at))) * np.sqrt(np.diff((0, *at)))
    zs = np.cumsum(steps, axis=1) / np.sqrt(at)
    crossed = np.cumsum(zs >= z, axis=1) > 0
    by_look = crossed.mean(axis=0)
    assert by_look[-1] == pytest.approx(0.05, abs=0.0015)
    assert by_look == pytest.approx(sequential.spent(np.asarray(at) / at[-1]), abs=0.0015)


def _reference(sd: float = 0.016, dof: int = 6) -> sequential.Reference:
    return sequential.Reference(sd, dof)


def _times(log_r: list[float]) -> tuple[list[float], list[float]]:
    return [1.0] * len(log_r), [math.exp(-x) for x in log_r]


def test_a_clear_loser_stops_at_the_first_look_and_a_winner_is_never_promoted_on_one_pair():
    inc, cand = _times([math.log(0.75) + e for e in (0.01, -0.01)])
    lost = sequential.look(inc, cand, stats.abba_order(2), _reference(), cap=16)
    assert lost.action == "reject" and lost.k == 2 and lost.estimate.upper_bound < lost.bar
    inc, cand = _times([math.log(1.66) + e for e in (0.01, -0.01)])
    assert sequential.look(inc, cand, stats.abba_order(2), _reference(), cap=16).action == "continue"
    inc, cand = _times([math.log(1.66) + e for e in (0.01, -0.01, 0.005, -0.005)])
    won = sequential.look(inc, cand, stats.abba_order(4), _reference(), cap=16)
    assert won.action == "promote" and won.estimate.lower_bound > won.bar and "4 of at most 16" in won.why()


def test_the_cap_decides_and_decide_agrees_with_the_look():
    rng = np.random.default_rng(3)
    log_r = list(0.02 + rng.normal(0.0, 0.016, size=16))
    inc, cand = _times(log_r)
    last = sequential.look(inc, cand, stats.abba_order(16), _reference(), cap=16)
    assert last.action in ("promote", "reject")
    decided = stats.decide(last.estimate, last.noise, outputs_identical=True)
    assert decided.decision == last.action and decided.n_trials == 16
    assert last.noise == pytest.approx(0.016 / 4)
    assert last.bar == pytest.approx(stats.promotion_bar(0.004, True))


def test_a_candidate_noisier_than_stock_is_held_to_its_own_spread():
    # a wild candidate (its own SD 10x stock's) with a fair mean: the pooled SD would let it through
    log_r = [0.08, -0.02, 0.09, -0.01, 0.10, -0.03]
    inc, cand = _times(log_r)
    found = sequential.look(inc, cand, stats.abba_order(6), _reference(sd=0.004, dof=14), cap=16)
    assert found.action != "promote"
    assert found.estimate.std_err > 0.004 / math.sqrt(6)


def test_changed_outputs_are_held_to_the_3_percent_bar():
    inc, cand = _times([0.02] * 4)
    found = sequential.look(inc, cand, stats.abba_order(4), _reference(sd=0.001), cap=16, outputs_identical=False)
    assert found.bar == pytest.approx(stats.CHANGED_OUTPUTS_BAR) and found.action != "promote"


def test_looks_refuse_counts_outside_the_timing():
    inc, cand = _times([0.0])
    with pytest.raises(ValueError):
        sequential.look(inc, cand, ["AB"], _reference(), cap=16)
    with pytest.raises(ValueError):
        sequential.looks(1)


# --- the rates, on recorded timings at the CPU deployment's settings ---------------------------------------


@pytest.fixture(scope="module")
def recorded() -> Recorded:
    return Recorded(read_runs([RECORDED]))


@pytest.fixture(scope="module")
def cpu_timing():
    return load_deployment("smollm2-cpu").timing


def _case(recorded: Recorded, timing, gain: float, scale: float = 1.0, seed: int = 1) -> dict:
    return run_case(recorded.draw, gain, scale, RUNS, timing.trials, timing.noise_trials, timing.trials, seed)


@pytest.mark.slow
def test_recorded_stock_copies_are_promoted_at_most_1_percent(recorded, cpu_timing):
    assert recorded.trials >= 64
    assert _case(recorded, cpu_timing, 0.0, seed=11)["promoted"] <= 0.01
    assert _case(recorded, cpu_timing, 0.0, scale=3.0, seed=12)["promoted"] <= 0.01


@pytest.mark.slow
def test_recorded_5_percent_gains_are_promoted_at_least_90_percent(recorded, cpu_timing):
    assert _case(recorded, cpu_timing, math.log(1.05), seed=13)["promoted"] >= 0.90


@pytest.mark.slow
def test_recorded_clear_losers_and_winners_take_a_few_trials(recorded, cpu_timing):
    lost = _case(recorded, cpu_timing, math.log(0.75), seed=14)
    won = _case(recorded, cpu_timing, math.log(1.66), seed=15)
    assert lost["promoted"] == 0.0 and lost["mean_trials"] <= 2.5
    assert won["promoted"] == 1.0 and won["mean_trials"] <= 4.5


# --- stock copies on the noise model -------------------------------------------------------------------------


def _model_false_promotions(seed: int, scale: float = 1.0, cap: int = 16, noise_trials: int = 8,
                            **model) -> float:
    def draw(rng, n, gain, s):
        return model_draw(rng, n, gain, s, req_sigma=0.02, **model)

    return run_case(draw, 0.0, scale, RUNS, cap, noise_trials, cap, seed)["promoted"]


@pytest.mark.slow
@pytest.mark.parametrize(("scale", "model"), [(1.0, {}), (3.0, {}), (1.0, {"linear_drift": 0.05}),
                                              (1.0, {"position": 0.02})])
def test_model_stock_copies_are_promoted_at_most_1_percent(scale, model):
    assert _model_false_promotions(21, scale, **model) <= 0.01
