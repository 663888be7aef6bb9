"""Where a round's time went (`services.master.timeline`), from a round's events and their clocks."""

from __future__ import annotations

import pytest

from specpilot import schema
from specpilot.services.master.timeline import timeline

S = 1_000_000_000  # ns a second


def _round() -> list[schema.Event]:
    t = 1_000 * S

    def at(s: float) -> int:
        return t + int(s * S)

    return [
        schema.RoundStarted(ts_ns=at(0)),
        schema.CeilingComputed(ts_ns=at(60), ceiling_speedup=3.0),
        schema.PatchProposed(ts_ns=at(70), direction_id="d", patch_id="p1", diff=""),
        schema.TimingMeasured(ts_ns=at(200), kind="noise", wall_s=120.0),
        schema.PatchTested(ts_ns=at(210), patch_id="p1", passed=True),
        schema.TimingMeasured(ts_ns=at(260), patch_id="p1", wall_s=50.0, incumbent_s=[5.0, 5.0],
                              candidate_s=[4.0, 4.0], incumbent_untimed_s=[4.0, 4.0], candidate_untimed_s=[6.0, 6.0]),
        schema.ForcingRequested(ts_ns=at(261), request_id="f", patch_id="p1"),
        schema.ForcingReported(ts_ns=at(281), request_id="f", patch_id="p1", passed=True),
        schema.VerdictIssued(ts_ns=at(285), patch_id="p1", decision="reject", n_trials=2),
        schema.PatchProposed(ts_ns=at(280), direction_id="d", patch_id="p2", diff=""),
        schema.PatchRefused(ts_ns=at(286), patch_id="p2", rule="paths", reason="outside the allowed paths"),
        schema.SealedFinalRequested(ts_ns=at(300)),
        schema.SealedFinalReported(ts_ns=at(450)),
    ]


def test_a_rounds_time_is_split_by_phase_and_candidate_and_adds_up():
    tl = timeline(_round(), until_ns=1_000 * S + 460 * S)
    rows = {r["what"]: r for r in tl["rows"]}
    assert tl["total_s"] == pytest.approx(460)
    assert rows["phase 0"]["s"] == pytest.approx(60) and rows["noise"]["s"] == pytest.approx(120)
    p1 = rows["candidate p1"]
    # taken up after the noise run (t=200) and decided at 285
    assert p1["s"] == pytest.approx(85) and p1["checks"] == pytest.approx(10)
    assert p1["start_up"] == pytest.approx(20) and p1["measured"] == pytest.approx(18)
    assert p1["timing_other"] == pytest.approx(12) and p1["forcing"] == pytest.approx(20)
    assert p1["checks"] + 50 + p1["forcing"] + p1["other"] == pytest.approx(p1["s"])
    assert p1["trials"] == 2 and p1["decision"] == "reject"
    assert rows["candidate p2"]["decision"] == "refused" and rows["candidate p2"]["s"] == pytest.approx(1)
    assert rows["sealed final"]["s"] == pytest.approx(150)
    assert tl["idle_s"] == pytest.approx(460 - sum(r["s"] for r in tl["rows"]))
    assert tl["idle_s"] >= 0


def test_no_events_no_timeline():
    assert timeline([]) == {}
