"""Timing noise is a fact of the machine and the timing design: measured once, reused by every data
directory on the same machine while fresh (the reuse recorded in the ledger), never across designs."""

from __future__ import annotations

import asyncio
import json
import os

from specpilot import schema
from specpilot.services.controller import evaluate
from specpilot.services.controller.main import Controller
from specpilot.services.controller.verdict import measure_noise
from specpilot.services.controller.workers import System


def _noise_events(data) -> list[schema.TimingMeasured]:
    ctl = Controller(data, None, evaluator_kw={"trials": 2, "n_requests": 1, "max_new_tokens": 8, "threads": 1})
    ev = ctl.evaluator("tiny-cpu")
    best = System(ev.prepare(), {})
    value = asyncio.run(measure_noise(ctl, ev, best, schema.RoundStarted(deployment="tiny-cpu")))
    asyncio.run(measure_noise(ctl, ev, best, schema.RoundStarted(deployment="tiny-cpu")))  # once a data directory
    events = [e for e in ctl.events if isinstance(e, schema.TimingMeasured) and e.kind == "noise"]
    assert len(events) == 1 and events[0].noise == value
    return events


def test_noise_is_measured_once_per_machine_and_reused_by_another_data_directory(tmp_path):
    assert os.environ["SPECPILOT_MACHINE_CACHE"]  # this test's own (tests/conftest.py)
    (first,) = _noise_events(tmp_path / "a")
    assert not first.reused_from and first.incumbent_s and first.wall_s > 0  # measured
    (second,) = _noise_events(tmp_path / "b")
    assert second.reused_from == f"{tmp_path / 'a'}: {first.event_id}" and not second.incumbent_s
    assert second.noise == first.noise

    ev = evaluate.Evaluator(tmp_path / "c", "tiny-cpu", trials=2, n_requests=1, max_new_tokens=8, threads=1)
    assert ev.noise_cached() is not None
    assert ev.noise_cached(max_age_s=-1) is None  # stale
    other = evaluate.Evaluator(tmp_path / "c", "tiny-cpu", trials=3, n_requests=1, max_new_tokens=8, threads=1)
    assert other.noise_cached() is None  # another timing design: its own noise
    (kept,) = list((evaluate.machine_cache_dir() / "noise").glob("*.json"))
    assert json.loads(kept.read_text())["design"]["machine"] == ev.noise_design()["machine"]
