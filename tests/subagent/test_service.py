"""The subagent's handling of one direction, against an in-memory bus and ledger (no NATS)."""

from __future__ import annotations

import asyncio
import re

from services.subagent.main import Settings, Subagent, patch_event_id
from specpilot import bus, schema
from tests.subagent import scripts

DEMO_INT = scripts.option_diff("    demo_int: int = 0  # added by a promotion")


class FakeBus:
    """Answers the subagent's SQL from a list of events; records publishes (stamped as the real bus does)."""

    user = "subagent"

    def __init__(self, ledger: list[schema.Event]):
        self.ledger = ledger
        self.log: list[tuple[str, object]] = []

    stamp = bus.Bus.stamp

    async def request(self, subject: str, payload: dict, timeout: float = 30.0) -> dict:
        q = payload["query"]
        if "'best.advanced'" in q:
            dep = re.search(r"= '([^']*)' ORDER", q).group(1)
            rows = [[schema.encode(e).decode()] for e in self.ledger
                    if isinstance(e, schema.BestAdvanced) and e.deployment == dep]
        elif "$.patch_id" in q:
            pid = re.search(r"\$\.patch_id'\) = '([^']*)'", q).group(1)
            rows = [[schema.encode(e).decode()] for e in self.ledger
                    if isinstance(e, schema.PatchProposed) and e.patch_id == pid][:1]
        elif "$.direction_id" in q:
            did = re.search(r"\$\.direction_id'\) = '([^']*)'", q).group(1)
            rows = [[sum(isinstance(e, schema.PatchProposed) and e.direction_id == did for e in self.ledger)]]
        else:
            raise AssertionError(q)
        return {"columns": [], "rows": rows}

    async def publish(self, event, cause=None, deadline_s: float = 60.0):
        stamped = self.stamp(event, cause)
        self.log.append(("publish", [stamped]))
        return stamped, 0

    async def publish_many(self, events, cause=None, deadline_s: float = 60.0):
        stamped = [self.stamp(e, cause) for e in events]
        self.log.append(("publish", stamped))
        return stamped


class FakeDelivery:
    def __init__(self, log: list, num_delivered: int = 1):
        self.log, self.num_delivered = log, num_delivered

    async def ack(self) -> None:
        self.log.append(("ack", None))

    async def in_progress(self) -> None:
        self.log.append(("in_progress", None))


LEDGER = [
    schema.PatchProposed(direction_id="d0", patch_id="d0-p0", diff=DEMO_INT, options={"demo_int": 1},
                         deployment="tiny-cpu", source="subagent"),
    schema.BestAdvanced(commit="c1", patch_id="d0-p0", options={"demo_int": 1}, deployment="tiny-cpu",
                        source="controller"),
    schema.BestAdvanced(commit="other", patch_id="x", deployment="smollm2-cpu", source="controller"),
]


def _handle(ledger, direction, tmp_path, env=None, num_delivered=1):
    b = FakeBus(ledger)
    delivery = FakeDelivery(b.log, num_delivered)
    agent = Subagent(b, Settings(work_dir=tmp_path / "work"), env={} if env is None else env)
    asyncio.run(agent.handle(direction, delivery))
    return b.log


def test_sweep_direction_publishes_patches_then_acks(tmp_path):
    d = schema.DirectionPlanned(direction_id="d1", title="sweep demo_int", provider="sweep", deployment="tiny-cpu",
                                round_id="r1", source="master",
                                hints={"option": "demo_int", "values": [2, 3, -1], "base": {"block_size": 6}})
    log = _handle(LEDGER, d, tmp_path)
    assert [k for k, _ in log] == ["publish", "ack"]
    patches = log[0][1]
    assert [p.patch_id for p in patches] == ["d1-p0", "d1-p1"]
    assert [p.options for p in patches] == [{"block_size": 6, "demo_int": 2}, {"block_size": 6, "demo_int": 3}]
    for i, p in enumerate(patches):
        assert p.event_id == patch_event_id(d.event_id, i) and p.event_id[:13] == d.event_id[:13]
        assert (p.deployment, p.round_id, p.source) == ("tiny-cpu", "r1", "subagent")
        assert p.causation_id == p.correlation_id == d.event_id
        assert p.base_commit == "c1" and p.provider == "sweep" and p.diff == "" and p.direction_id == "d1"
    assert not list((tmp_path / "work").iterdir())  # the workspace is removed


def test_memory_direction_on_stock_has_empty_base_commit(tmp_path):
    entry = {"entry_id": "m1", "delta": scripts.option_diff(), "options": {"demo_flag": True}}
    d = schema.DirectionPlanned(direction_id="d2", title="reuse m1", provider="memory", deployment="smollm2-h200",
                                memory_entry_id="m1", hints={"entry": entry})
    (publish, patches), ack = _handle(LEDGER, d, tmp_path)
    (p,) = patches
    assert p.base_commit == "" and p.options == {"demo_flag": True} and "+" + scripts.DEMO_FIELD in p.diff
    assert ack[0] == "ack"


def test_provider_failure_is_reported_then_acked(tmp_path):
    for provider, why in (("anthropic", "ANTHROPIC_API_KEY"), ("gemini", "gemini"), ("sweep", "option")):
        d = schema.DirectionPlanned(direction_id="d3", title="t", provider=provider, deployment="tiny-cpu")
        log = _handle(LEDGER, d, tmp_path)
        assert [kind for kind, _ in log] == ["publish", "ack"]
        (failed,) = log[0][1]
        assert isinstance(failed, schema.DirectionFailed) and failed.direction_id == "d3"
        assert why in failed.reason and failed.causation_id == d.event_id


def test_redelivered_direction_with_patches_is_not_redone(tmp_path):
    d = schema.DirectionPlanned(direction_id="d0", title="t", provider="sweep", deployment="tiny-cpu",
                                hints={"option": "block_size", "values": [2]})
    assert _handle(LEDGER, d, tmp_path, num_delivered=2) == [("ack", None)]
    # other master events are acked and ignored
    assert _handle(LEDGER, schema.RoundStarted(), tmp_path) == [("ack", None)]
