"""The forcer's rules on synthetic counts: the paper's seed figures, near-ties, the statistics."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from specpilot import forcing_rules, schema
from specpilot.forcing_rules import Counts

N = 20_000  # output positions per run, roughly a request set's worth


def counts(rate: float, n: int = N, events: int = 0, audited: int | None = None, unexplained: int = 0) -> Counts:
    audited = min(events, forcing_rules.MAX_AUDITED) if audited is None else audited
    return Counts(positions=n, mismatches=round(rate * n), events=events, audited=audited,
                  unexplained_audited=unexplained)


# --- seed figures (docs/DESIGN.md §6) ------------------------------------------------------------------


@pytest.mark.parametrize("system_rate,stock_rate", [(0.0073, 0.0072), (0.0052, 0.0053)])
def test_lossless_systems_pass(system_rate, stock_rate):
    # Lossless: the same mismatch rate as stock; its few events explained as stock's are.
    v = forcing_rules.verdict(counts(system_rate, events=8, unexplained=1), counts(stock_rate, events=9, unexplained=1),
                      delta=0.1)
    assert v.passed, v.reason
    assert v.rate.p_value > 0.5 and v.event.p_value > 0.05


@pytest.mark.parametrize("system_rate,stock_rate,unexplained", [(0.020, 0.0072, 192), (0.024, 0.0053, 191)])
def test_faulty_systems_fail_both_rules(system_rate, stock_rate, unexplained):
    system = counts(system_rate, events=300, audited=200, unexplained=unexplained)
    v = forcing_rules.verdict(system, counts(stock_rate, events=9, unexplained=1), delta=0.1)
    assert not v.passed
    assert not v.rate.passed and v.rate.lower_bound > forcing_rules.RATE_MARGIN
    assert not v.event.passed and v.event.p_value < 1e-20
    assert system.unexplained == round(300 * unexplained / 200)  # the audited share, extrapolated
    assert "rate rule" in v.reason and "event rule" in v.reason


def test_near_ties_pass():
    # More mismatches than stock, all near-ties (no events), an excess well under half a point.
    v = forcing_rules.verdict(counts(0.0095), counts(0.0072), delta=0.1)
    assert v.passed, v.reason
    assert v.rate.difference > 0


def test_excess_of_one_point_fails_the_rate_rule_alone():
    v = forcing_rules.verdict(counts(0.0172), counts(0.0072), delta=0.1)
    assert not v.passed and not v.rate.passed and v.event.passed


def test_unexplained_events_fail_the_event_rule_alone():
    v = forcing_rules.verdict(counts(0.0072, events=12, unexplained=12), counts(0.0072, events=1, unexplained=0), 0.1)
    assert not v.passed and v.rate.passed and not v.event.passed
    assert v.event.system_unexplained == 12 and v.event.stock_unexplained == 0


def test_explained_events_do_not_count():
    v = forcing_rules.verdict(counts(0.0072, events=12, unexplained=0), counts(0.0072), 0.1)
    assert v.passed and v.event.p_value == 1.0


def test_few_events_against_a_clean_stock_need_evidence():
    # Equal sizes, stock has none: p = 0.5**k, so 4 unexplained events pass and 5 fail.
    assert forcing_rules.event_rule(counts(0.02, 256, 4, unexplained=4), counts(0.0, 256)).passed
    assert not forcing_rules.event_rule(counts(0.02, 256, 5, unexplained=5), counts(0.0, 256)).passed


# --- the statistics ---------------------------------------------------------------------------


def test_rate_rule_is_calibrated_at_the_margin():
    """At a true excess of exactly 0.5 points the rule rejects about 5% of systems; at 0, almost none."""
    rng = np.random.default_rng(0)
    n, p0, reps = 5000, 0.007, 150
    at_margin = [not forcing_rules.rate_rule(Counts(n, a), Counts(n, b)).passed
                 for a, b in zip(rng.binomial(n, p0 + 0.005, reps), rng.binomial(n, p0, reps), strict=True)]
    at_zero = [not forcing_rules.rate_rule(Counts(n, a), Counts(n, b)).passed
               for a, b in zip(rng.binomial(n, p0, reps), rng.binomial(n, p0, reps), strict=True)]
    assert np.mean(at_margin) <= 0.10
    assert np.mean(at_zero) == 0.0


@pytest.mark.parametrize("x1,n1,x0,n0", [(0, 256, 0, 256), (5, 256, 0, 256), (40, 2000, 14, 2000),
                                         (400, 20000, 144, 20000), (3, 100, 1, 5000), (2, 150, 0, 150)])
def test_rate_rule_bound_and_p_value_agree(x1, n1, x0, n0):
    r = forcing_rules.rate_rule(Counts(n1, x1), Counts(n0, x0))
    assert (r.p_value < 0.05) == (r.lower_bound > forcing_rules.RATE_MARGIN) == (not r.passed)
    assert r.lower_bound <= r.difference
    assert r.system_ci[0] <= r.system_rate <= r.system_ci[1]


def test_rate_rule_without_positions_passes():
    assert forcing_rules.rate_rule(Counts(0, 0), Counts(100, 1)).passed


def test_calibrate_delta():
    assert forcing_rules.calibrate_delta([]) == forcing_rules.DELTA_FLOOR
    assert forcing_rules.calibrate_delta([0.001, 0.002]) == forcing_rules.DELTA_FLOOR  # fp32-sized flips: the floor
    margins = np.linspace(0.0, 1.0, 101)
    assert forcing_rules.calibrate_delta(margins) == pytest.approx(0.95)
    assert forcing_rules.calibrate_delta(margins, quantile=0.5, floor=0.0) == pytest.approx(0.5)
    assert forcing_rules.is_event(0.21, 0.1) and not forcing_rules.is_event(0.2, 0.1)


def test_counts_validate_and_extrapolate():
    with pytest.raises(ValueError):
        Counts(positions=10, mismatches=11)
    with pytest.raises(ValueError):
        Counts(positions=10, mismatches=2, events=3)
    with pytest.raises(ValueError):
        Counts(positions=10, mismatches=5, events=3, audited=2, unexplained_audited=3)
    assert Counts(1000, 500, events=400, audited=200, unexplained_audited=50).unexplained == 100
    assert Counts(1000, 500, events=40, audited=0).unexplained == 40  # nothing audited: all count
    assert Counts(1000, 500, events=40, audited=40, unexplained_audited=3).unexplained == 3


def test_stats_are_json_ready():
    import json

    v = forcing_rules.verdict(counts(0.02, events=30, unexplained=20), counts(0.007, events=2), 0.1)
    st = json.loads(json.dumps(v.stats()))
    assert st["delta"] == 0.1 and st["event_threshold"] == 0.2
    assert st["system"]["mismatches"] == 400 and st["stock"]["rate"] == pytest.approx(0.007)
    assert {"p_value", "lower_bound", "difference", "system_ci"} <= set(st["rate_rule"])
    assert {"p_value", "system_unexplained", "stock_unexplained"} <= set(st["event_rule"])


# --- inputs and the service's answers -----------------------------------------------------------


def test_parse_outputs():
    out = forcing_rules.parse_outputs([{"prompt_ids": [1, 2], "tokens": [3]},
                               {"prompt_ids": [4], "tokens": [], "stock_tokens": [5, 6]},
                               {"prompt": "hi", "output": "yo", "chat": True}],
                              encode=lambda text, chat: [len(text), int(chat)], vocab_size=10)
    assert out[0] == forcing_rules.Output((1, 2), (3,))
    assert out[1].stock_tokens == (5, 6) and out[1].tokens == ()
    assert out[2] == forcing_rules.Output((2, 1), (2, 0))


@pytest.mark.parametrize("raw,match", [
    ([{"tokens": [1]}], "needs prompt_ids"),
    ([{"prompt_ids": [], "tokens": [1]}], "prompt is empty"),
    ([{"prompt_ids": [1], "tokens": [99]}], "outside"),
    ([{"prompt_ids": [1], "tokens": ["a"]}], "list of integers"),
    ([{"prompt_ids": [1], "tokens": [True]}], "list of integers"),
    ([{"prompt": "x", "output": "y"}], "need a tokenizer"),
    (["nope"], "expected an object"),
])
def test_parse_outputs_refuses(raw, match):
    with pytest.raises(ValueError, match=match):
        forcing_rules.parse_outputs(raw, vocab_size=10)


def test_report_answers_its_request_with_a_stable_id():
    req = schema.ForcingRequested(request_id="r1", patch_id="p1", outputs=[{"prompt_ids": [1], "tokens": [2]}])
    a = forcing_rules.report(req, forcing_rules.failed("boom"))
    b = forcing_rules.report(req, forcing_rules.failed("boom"))
    assert a.event_id == b.event_id != req.event_id  # a redelivered request's report is the same event
    assert uuid.UUID(a.event_id).version == 7
    assert a.event_id[:13] == req.event_id[:13]  # same millisecond: sorts right after its cause
    assert a.request_id == "r1" and a.patch_id == "p1" and not a.passed and "boom" in a.reason
    assert schema.decode(schema.encode(a)) == a


# --- power ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stock_rate,n", [(0.0, 1200), (0.0105, 4000), (0.0105, 10_000)])
def test_the_reported_power_is_the_rate_rules_rejection_rate_one_point_over_stock(stock_rate, n):
    """The normal approximation against the rule itself on simulated counts (400 draws each)."""
    rng = np.random.default_rng(7)
    draws = 400
    rejected = sum(
        not forcing_rules.rate_rule(Counts(n, int(rng.binomial(n, stock_rate + 0.01)), 0, 0, 0),
                                    Counts(n, int(rng.binomial(n, stock_rate)), 0, 0, 0)).passed
        for _ in range(draws))
    assert rejected / draws == pytest.approx(forcing_rules.rate_power(n, n, stock_rate), abs=0.08)


def test_tokens_for_power_reach_the_target_and_grow_with_stocks_own_rate():
    fp32 = forcing_rules.tokens_for_power(0.0)
    bf16 = forcing_rules.tokens_for_power(0.0105)  # SmolLM2 bf16 stock's measured rate
    assert fp32 < bf16
    for rate, n in ((0.0, fp32), (0.0105, bf16)):
        assert forcing_rules.rate_power(n, n, rate) >= 0.9 > forcing_rules.rate_power(n - 1, n - 1, rate)
    # the case: 2.24% against 1.05% on 1,159 tokens was passed with little power
    assert forcing_rules.rate_power(1159, 1159, 0.0105) < 0.5
    assert forcing_rules.rate_power(0, 10, 0.0) == 0.0
