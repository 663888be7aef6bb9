"""Paired-timing statistics and the promotion rule, on synthetic timings with realistic noise.

The timing model (`bench.timing_model.simulate`, shared with the sequential verdict's tests and bench):
each trial times incumbent and candidate on the same 8 requests in the order `abba_order` gives. A
request's time is its base time x lognormal noise (2-5%), and with a small probability an outlier
(x1.2-2). Both runs of a trial share a trial-level load factor (3%, what pairing cancels); the
machine drifts slowly across the experiment (a random walk per run slot, what ABBA ordering cancels
to first order). The controller's noise comes from one
stock-versus-stock run of the same design per experiment, as it would be measured per deployment.
Every RNG is seeded, so the rates below are exact numbers, not flaky ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.timing_model import simulate
from specpilot import schema
from specpilot.services.controller import stats

N_EXPERIMENTS = 1000


def promotion_rate(seed: int, gain: float, req_sigma: float, outputs_identical: bool = True,
                   forcing_passed: bool | None = None, n_trials: int = stats.DEFAULT_TRIALS,
                   crossover: bool = True, **model) -> float:
    """Share of N_EXPERIMENTS experiments promoted, each with its own stock-vs-stock noise run, analysed
    as the controller does (the trials' order given: the crossover fit) or, with ``crossover=False``,
    without the order (the plain paired t)."""
    rng = np.random.default_rng(seed)
    stock_a, stock_b = simulate(rng, N_EXPERIMENTS, n_trials, 0.0, req_sigma, **model)
    inc, cand = simulate(rng, N_EXPERIMENTS, n_trials, gain, req_sigma, **model)
    order = (model.get("order") or stats.abba_order(n_trials)) if crossover else None
    promoted = 0
    for i in range(N_EXPERIMENTS):
        noise = stats.noise_from_stock_runs([(stock_a[i], stock_b[i])], orders=[order])
        d = stats.decide(stats.paired_gain(inc[i], cand[i], order=order), noise, outputs_identical, forcing_passed,
                         ceiling=2.0)
        promoted += d.promoted
    return promoted / N_EXPERIMENTS


# --- the rates the controller is specified by -------------------------------------------------


@pytest.mark.parametrize("req_sigma", [0.02, 0.05])
def test_stock_versus_stock_false_promotions_at_most_1_percent(req_sigma):
    assert promotion_rate(1, 0.0, req_sigma) <= 0.01


def test_false_promotions_stay_rare_with_heavy_outliers_and_drift():
    assert promotion_rate(2, 0.0, 0.05, outlier_p=0.03, drift_sd=0.01) <= 0.01


@pytest.mark.parametrize("req_sigma", [0.02, 0.05])
def test_true_5_percent_gain_promoted_at_default_trials(req_sigma):
    assert promotion_rate(3, math.log(1.05), req_sigma) >= 0.90


@pytest.mark.parametrize("req_sigma", [0.02, 0.05])
def test_true_half_percent_gain_not_promoted(req_sigma):
    assert promotion_rate(4, math.log(1.005), req_sigma) <= 0.05


@pytest.mark.parametrize("req_sigma", [0.02, 0.05])
def test_a_position_effect_promotes_no_stock_copy(req_sigma):
    """Running first costs 2% (as measured on the 2-core machine), at a round's 6 trials and with drift."""
    assert promotion_rate(5, 0.0, req_sigma, n_trials=6, position=0.02) <= 0.01
    assert promotion_rate(5, 0.0, req_sigma, n_trials=8, position=0.02, linear_drift=0.05) <= 0.01


def test_the_crossover_fit_promotes_a_true_gain_the_plain_t_often_misses():
    fitted = promotion_rate(6, math.log(1.05), 0.02, n_trials=6, position=0.02)
    plain = promotion_rate(6, math.log(1.05), 0.02, n_trials=6, position=0.02, crossover=False)
    assert fitted >= plain + 0.3 and fitted >= 2 * plain, (fitted, plain)  # measured: 0.71 against 0.29


def test_the_crossover_fit_keeps_the_mean_and_removes_the_position():
    order = stats.abba_order(8)
    inc = [1.06 if o == "AB" else 1.02 for o in order]  # whoever goes first is ~4% slower
    cand = [1.00 if o == "AB" else 1.04 for o in order]
    inc = [x * (1 + 0.001 * i) for i, x in enumerate(inc)]  # a little noise on top
    plain, fitted = stats.paired_gain(inc, cand), stats.paired_gain(inc, cand, order=order)
    assert fitted.gain == pytest.approx(plain.gain) and fitted.std_err < plain.std_err / 5
    assert fitted.position == pytest.approx(0.04, abs=0.005)
    # no order, too few trials or one order only: the plain paired t
    for order_ in (None, ["AB", "BA"], ["AB"] * 8):
        got = stats.paired_gain(inc[: len(order_ or inc)], cand[: len(order_ or inc)], order=order_)
        want = stats.paired_gain(inc[: len(order_ or inc)], cand[: len(order_ or inc)])
        assert got.std_err == pytest.approx(want.std_err) and got.position == 0.0
    noise_fit = stats.noise_from_stock_runs([(inc, cand)], orders=[order])
    assert noise_fit.per_trial_sd < stats.noise_from_stock_runs([(inc, cand)]).per_trial_sd / 5


def test_changed_outputs_need_3_percent_and_a_forcing_verdict():
    # A true 2.5% gain clears the 1% + 2*noise bar with little noise, but never the 3% bar.
    quiet = dict(outlier_p=0.0, drift_sd=0.001, trial_sd=0.01)
    assert promotion_rate(5, math.log(1.025), 0.01, **quiet) >= 0.90
    assert promotion_rate(5, math.log(1.025), 0.01, outputs_identical=False, forcing_passed=True, **quiet) == 0.0
    # A true 5% gain with changed outputs: promoted only when forcing passed.
    assert promotion_rate(6, math.log(1.05), 0.01, outputs_identical=False, forcing_passed=True, **quiet) >= 0.90
    assert promotion_rate(6, math.log(1.05), 0.01, outputs_identical=False, forcing_passed=None, **quiet) == 0.0
    assert promotion_rate(6, math.log(1.05), 0.01, outputs_identical=False, forcing_passed=False, **quiet) == 0.0


def test_abba_cancels_linear_drift_that_fixed_order_does_not():
    rng = np.random.default_rng(7)
    kw = dict(outlier_p=0.0, drift_sd=0.0, linear_drift=0.10)  # the machine slows 10% over the run
    a, b = simulate(rng, 200, 32, 0.0, 0.02, **kw)
    abba = np.mean([stats.paired_gain(a[i], b[i]).gain for i in range(200)])
    a, b = simulate(rng, 200, 32, 0.0, 0.02, order=["AB"] * 32, **kw)
    fixed = np.mean([stats.paired_gain(a[i], b[i]).gain for i in range(200)])
    assert abs(abba) < 0.001
    assert fixed < -0.0012  # B always runs second, on a slower machine: a spurious loss


# --- the pieces -----------------------------------------------------------------------------


def test_abba_order():
    assert stats.abba_order(8) == ["AB", "BA", "BA", "AB", "AB", "BA", "BA", "AB"]
    assert stats.abba_order(0) == []
    assert stats.DEFAULT_TRIALS % 4 == 0
    with pytest.raises(ValueError):
        stats.abba_order(-1)


def test_paired_gain_is_mean_log_ratio_with_t_bounds():
    from scipy import stats as sps

    inc = [1.10, 1.05, 1.12, 1.08, 1.07]
    cand = [1.00, 1.01, 1.02, 0.99, 1.00]
    est = stats.paired_gain(inc, cand)
    lr = np.log(np.array(inc) / np.array(cand))
    se = lr.std(ddof=1) / math.sqrt(5)
    assert est.gain == pytest.approx(lr.mean())
    assert est.std_err == pytest.approx(se)
    assert est.lower_bound == pytest.approx(lr.mean() - sps.t.ppf(0.95, 4) * se)
    assert est.upper_bound == pytest.approx(lr.mean() + sps.t.ppf(0.95, 4) * se)
    assert est.n == 5 and est.per_trial_log_r == pytest.approx(tuple(lr))
    assert est.speedup == pytest.approx(math.exp(lr.mean()))


@pytest.mark.parametrize("inc,cand", [([1.0], [1.0]), ([1.0, 2.0], [1.0]), ([1.0, 0.0], [1.0, 1.0]),
                                      ([1.0, float("nan")], [1.0, 1.0]), ([-1.0, 1.0], [1.0, 1.0])])
def test_paired_gain_refuses_bad_timings(inc, cand):
    with pytest.raises(ValueError):
        stats.paired_gain(inc, cand)


def test_noise_within_and_between_runs():
    rng = np.random.default_rng(8)
    runs = []
    for offset in (0.02, -0.02):  # two runs whose gains disagree far more than their spread says
        a = rng.uniform(1.0, 1.1, 16)
        runs.append((a, a / np.exp(offset + rng.normal(0, 0.001, 16))))
    one = stats.noise_from_stock_runs(runs[:1])
    assert one.between == 0.0 and one.noise == one.within
    assert one.within == pytest.approx(one.per_trial_sd / 4)
    two = stats.noise_from_stock_runs(runs)
    assert two.between == pytest.approx(0.02, rel=0.05) and two.noise == two.between > two.within
    assert two.n_runs == 2 and two.n_trials == 16
    # Stated for a bigger experiment, the within-run term shrinks with sqrt(n).
    assert stats.noise_from_stock_runs(runs[:1], n_trials=64).within == pytest.approx(one.within / 2)
    with pytest.raises(ValueError):
        stats.noise_from_stock_runs([])
    with pytest.raises(ValueError):
        stats.noise_from_stock_runs([(a[:4], a[:4]), (a[:8], a[:8])])


def _estimate(gain: float, se: float = 0.002, n: int = 32) -> stats.GainEstimate:
    half = 1.7 * se
    return stats.GainEstimate(gain=gain, lower_bound=gain - half, upper_bound=gain + half, std_err=se, n=n,
                              per_trial_log_r=())


def test_bar_is_1_percent_plus_twice_noise_or_3_percent_for_changed_outputs():
    assert stats.promotion_bar(0.004, True) == pytest.approx(math.log(1.01) + 0.008)
    assert stats.promotion_bar(0.004, False) == pytest.approx(math.log(1.03))
    assert stats.promotion_bar(0.02, False) == pytest.approx(math.log(1.01) + 0.04)  # noise raises it past 3%
    d = stats.decide(_estimate(0.025), 0.004, outputs_identical=True)
    assert d.promoted and d.rule == "promoted" and d.bar == pytest.approx(math.log(1.01) + 0.008)
    d = stats.decide(_estimate(0.025), 0.004, outputs_identical=False, forcing_passed=True)
    assert not d.promoted and d.rule == "below_bar" and d.bar == pytest.approx(math.log(1.03))


def test_forcing_rules():
    good = _estimate(0.10)
    assert stats.decide(good, 0.004, outputs_identical=False, forcing_passed=True).promoted
    assert stats.decide(good, 0.004, outputs_identical=False).rule == "forcing_missing"
    assert stats.decide(good, 0.004, outputs_identical=False, forcing_passed=False).rule == "forcing_failed"
    assert stats.decide(good, 0.004, outputs_identical=True, forcing_passed=False).rule == "forcing_failed"
    assert stats.decide(good, 0.004, outputs_identical=True).promoted  # identical outputs need no forcing
    # forcing that could not run is its own rule, naming the cause (not a failed verdict)
    broken = stats.decide(good, 0.004, outputs_identical=False, forcing_passed=False,
                          forcing_error="FileNotFoundError: /data/models/x.gguf")
    assert broken.rule == "forcing_error" and "x.gguf" in broken.reason and not broken.promoted


def test_speedup_beyond_the_ceiling_is_a_measurement_fault():
    d = stats.decide(_estimate(math.log(2.5)), 0.004, outputs_identical=True, ceiling=2.0)
    assert d.decision == "reject" and d.rule == "ceiling" and "measurement fault" in d.reason
    assert stats.decide(_estimate(math.log(1.9)), 0.004, outputs_identical=True, ceiling=2.0).promoted
    assert stats.decide(_estimate(math.log(2.5)), 0.004, outputs_identical=True, ceiling=0.0).promoted  # unknown


def test_unusable_estimates_are_rejected():
    assert stats.decide(_estimate(float("nan")), 0.004, True).rule == "bad_estimate"
    assert stats.decide(_estimate(0.1), float("inf"), True).rule == "bad_estimate"
    assert stats.decide(_estimate(0.1, n=1), 0.004, True).rule == "bad_estimate"


def test_decision_fills_a_verdict_event():
    rng = np.random.default_rng(9)
    a, b = simulate(rng, 1, stats.DEFAULT_TRIALS, math.log(1.2), 0.02)
    stock_a, stock_b = simulate(rng, 1, stats.DEFAULT_TRIALS, 0.0, 0.02)
    noise = stats.noise_from_stock_runs([(stock_a[0], stock_b[0])])
    d = stats.decide(stats.paired_gain(a[0], b[0]), noise, outputs_identical=True, ceiling=3.0)
    assert d.promoted
    v = schema.VerdictIssued(patch_id="p1", **d.verdict_fields())
    back = schema.decode(schema.encode(v))
    assert back.decision == "promote" and back.gain == pytest.approx(d.gain) and back.bar == d.bar
    assert back.n_trials == stats.DEFAULT_TRIALS and back.ceiling == 3.0 and back.noise == d.noise
    assert set(d.as_dict()) >= {"gain", "lower_bound", "upper_bound", "std_err", "bar", "noise", "speedup"}


# --- carry-over between interleaved runs ------------------------------------------------------------

def _interleaved(rng: np.random.Generator, n_trials: int, n_req: int, slowdown: float, req_sigma: float = 0.05,
                 trial_sd: float = 0.1, outlier_p: float = 0.05) -> list[tuple[str, list[float], list[float]]]:
    """Request times of interleaved trials; the candidate slows the incumbent's requests that follow it by
    ``slowdown`` (request 0 always follows the candidate's warm-up)."""
    base = rng.uniform(0.05, 0.2, n_req)
    trials = []
    for order in stats.abba_order(n_trials):
        shared = math.exp(rng.normal(0.0, trial_sd))

        def noisy(i, shared=shared):
            return base[i] * shared * math.exp(rng.normal(0.0, req_sigma)) * (1.3 if rng.random() < outlier_p else 1.0)

        a = [noisy(i) * ((1 + slowdown) if i == 0 or stats.first_in_request(order, i) == "B" else 1.0)
             for i in range(n_req)]
        trials.append((order, a, [noisy(i) for i in range(n_req)]))
    return trials


def test_first_in_request_alternates_within_a_trial():
    assert [stats.first_in_request("AB", i) for i in range(4)] == ["A", "B", "A", "B"]
    assert [stats.first_in_request("BA", i) for i in range(4)] == ["B", "A", "B", "A"]


def test_carryover_rarely_flags_honest_systems_and_catches_one_that_slows_the_next():
    rng = np.random.default_rng(7)
    honest = [stats.carryover(_interleaved(rng, 6, 4, 0.0)) for _ in range(N_EXPERIMENTS)]
    assert sum(c.suspect for c in honest) / N_EXPERIMENTS <= 0.005
    assert abs(np.mean([c.effect for c in honest])) < 0.003
    hack = [stats.carryover(_interleaved(rng, 6, 4, 0.5)) for _ in range(N_EXPERIMENTS)]
    assert sum(c.suspect for c in hack) / N_EXPERIMENTS >= 0.95
    # the effect is the gain the slowdown fakes: half the incumbent's requests, log(1.5) each
    assert np.mean([c.effect for c in hack]) == pytest.approx(math.log(1.5) / 2, rel=0.1)


def test_carryover_needs_both_positions_and_several_requests():
    rng = np.random.default_rng(0)
    assert stats.carryover(_interleaved(rng, 1, 4, 0.0)) is None  # one trial: each request in one position
    assert stats.carryover(_interleaved(rng, 4, 1, 0.0)) is None  # one request
    assert stats.carryover([]) is None


def test_retime_reason_confirms_gpu_promotions_and_suspect_carryover_run_by_run():
    winning = stats.paired_gain([1.0] * 8, [0.5 + 0.01 * i for i in range(8)])  # ~1.8x, tight
    flat = stats.paired_gain([1.0, 1.01, 0.99, 1.0], [1.0, 0.99, 1.01, 1.0])
    noise = 0.01
    suspect = stats.Carryover(effect=0.2, lower_bound=0.1, p_value=1e-6, n_requests=8)
    honest = stats.Carryover(effect=0.0, lower_bound=-0.05, p_value=0.5, n_requests=8)
    # a GPU timing a candidate would win: again with each worker alone (a paused worker's queued
    # GPU work slows every request of the other alike, which the carry-over test cannot see)
    assert "GPU" in stats.retime_reason(True, honest, winning, noise, gpu=True)
    assert stats.retime_reason(True, honest, winning, noise, gpu=False) == ""  # a stopped CPU process does nothing
    assert stats.retime_reason(True, honest, flat, noise, gpu=True) == ""  # would not promote: stands
    assert "carry-over" in stats.retime_reason(True, suspect, flat, noise, gpu=False)
    for gpu in (False, True):  # a run-by-run timing is the confirmation: never again
        assert stats.retime_reason(False, None, winning, noise, gpu=gpu) == ""


def test_a_confirmation_is_held_to_its_own_standard_error_when_that_is_larger():
    noisy = stats.paired_gain([1.0, 1.3, 0.8, 1.2, 0.9, 1.25], [0.9, 1.0, 0.85, 0.95, 0.8, 1.1])
    assert stats.confirmation_noise(0.005, noisy) == noisy.std_err > 0.005
    assert stats.confirmation_noise(0.5, noisy) == 0.5


def test_untimed_work_is_bounded_against_the_incumbents():
    """A worker's start-up and warm-up are not timed: a patch that answers ahead of time there (or
    precomputes anything) is refused; loading a drafter or packing weights fits the bound."""
    assert stats.untimed_excess([4.0, 5.0], [9.0, 12.0]) == ""  # a drafter's weights, packed linears
    why = stats.untimed_excess([4.0, 5.0], [300.0, 310.0])  # the dev answers generated at start-up
    assert "start-up work" in why and "limit 39.0 s" in why
    assert stats.untimed_excess([], [300.0]) == ""  # nothing measured (a run-by-run confirmation)


# --- the run-by-run confirmation of a GPU win ---------------------------------------------------------

def test_signed_rank_bounds_invert_scipys_exact_wilcoxon_test():
    """The bounds are the Walsh averages where scipy's exact one-sided signed-rank test turns."""
    from scipy import stats as sps

    rng = np.random.default_rng(11)
    assert [stats._signed_rank_critical(n, 0.05) for n in range(3, 12)] == [-1, -1, 0, 2, 3, 5, 8, 10, 13]
    for n in (5, 6, 8, 12):
        x = rng.normal(0.1, 0.1, n)
        est, low, high = stats.signed_rank_bounds(x)
        for d, rejected in ((low - 1e-9, True), (low + 1e-9, False)):  # H0: gain <= d, against > d
            p = sps.wilcoxon(x - d, alternative="greater", method="exact").pvalue
            assert bool(p <= 0.05) == rejected, (n, d, p)
        for d, rejected in ((high + 1e-9, True), (high - 1e-9, False)):
            p = sps.wilcoxon(x - d, alternative="less", method="exact").pvalue
            assert bool(p <= 0.05) == rejected, (n, d, p)
        assert low < est < high
    est, low, high = stats.signed_rank_bounds([0.1, 0.2, 0.3, 0.4])  # 4 trials cannot reach 95%
    assert est == pytest.approx(0.25) and low == -math.inf and high == math.inf


def _alone(rng: np.random.Generator, gain: float, n: int = 6, slow_p: float = 1 / 12) -> stats.GainEstimate:
    """A run-by-run timing: every trial two fresh processes, each at its own level (a few percent, and
    now and then one 1.3-1.5x slower on every request: 2 of 12 on 2026-12-05's H100)."""
    def level() -> float:
        return math.exp(rng.normal(0.0, 0.03)) * (rng.uniform(1.3, 1.5) if rng.random() < slow_p else 1.0)
    return stats.paired_gain([level() for _ in range(n)], [level() * math.exp(-gain) for _ in range(n)],
                             order=stats.abba_order(n))


def _interleaved_estimate(rng: np.random.Generator, gain: float, n: int = 6) -> stats.GainEstimate:
    log_r = rng.normal(gain, 0.029, n)  # the interleaved per-trial spread of the same H100 round
    return stats.paired_gain([1.0] * n, list(np.exp(-log_r)), order=stats.abba_order(n))


def _confirm_rate(seed: int, alone_gain: float, neighbour_slowdown: float, n: int = 2000) -> float:
    rng, bar = np.random.default_rng(seed), stats.promotion_bar(0.022, outputs_identical=True)
    return sum(stats.confirms(_interleaved_estimate(rng, alone_gain + neighbour_slowdown), _alone(rng, alone_gain),
                              bar)[0] for _ in range(n)) / n


def test_a_confirmation_upholds_real_gpu_wins_and_not_a_neighbours_slowdown():
    """Judged on its own (the bar at its own standard error) a 6-trial run-by-run confirmation promotes a
    real 15% win ~40% of the time; asked only whether the candidate is faster alone and consistent with
    the interleaved timing, ~70%. A candidate whose whole interleaved gain is the slowdown it leaves for
    the other system (queued GPU work) is upheld ~1% of the time; with no gain alone the exact test
    bounds that by 5%."""
    assert _confirm_rate(5, 0.15, 0.0) >= 0.6
    assert _confirm_rate(6, 0.0, 0.15) <= 0.03
    assert _confirm_rate(7, 0.0, 0.5) <= 0.01
    # 2026-12-05, H100, drafter = parallel over the graphed n-gram stock: interleaved +21.6% (6 trials),
    # run by run the per-trial gains below (one slow process a side); the old rule said lower bound -0.0%.
    interleaved = stats.paired_gain([0.883, 0.64, 0.73, 0.75, 0.906, 0.742], [0.71, 0.537, 0.599, 0.592, 0.776, 0.613],
                                    order=stats.abba_order(6))
    alone = stats.paired_gain([0.685, 0.716, 0.685, 0.937, 0.711, 0.682], [0.586, 0.58, 0.603, 0.59, 0.75, 0.628],
                              order=stats.abba_order(6))
    assert alone.lower_bound < 0.0 < alone.gain
    upheld, why = stats.confirms(interleaved, alone, stats.promotion_bar(0.022, outputs_identical=True))
    assert upheld, why
    fake = stats.paired_gain([1.0, 1.02, 0.97, 1.01, 0.99, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], order=stats.abba_order(6))
    upheld, why = stats.confirms(interleaved, fake, stats.promotion_bar(0.022, outputs_identical=True))
    assert not upheld and "not clearly faster alone" in why
