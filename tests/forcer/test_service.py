"""The forcer service over a real nats-server: the controller asks, the forcer answers, memory records.

Consumers are per service, so the test reads the forcer's reports back from the ledger (the memory
service runs beside it) rather than from a consumer of its own.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from specpilot import schema
from specpilot.harness.deployment import load_engine
from tests.backbone.helpers import sql, wait_for_rows
from tests.conftest import connect_as, spawn_service, wait_for_services


@pytest.fixture
def services(server):
    procs = [spawn_service(server, "memory"), spawn_service(server, "forcer")]
    try:
        wait_for_services(server, {"memory", "forcer"}, timeout=60)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def tiny_outputs() -> tuple[list[dict], list[dict]]:
    """Stock's own outputs of the tiny deployment, and the same with tokens perturbed."""
    e = load_engine("tiny-cpu")
    good = []
    for text in ("Hello there", "The quick brown fox", "SpecPilot"):
        ids = e.tokenize(text)
        good.append({"prompt_ids": ids, "tokens": e.generate(ids, 24).tokens})
    bad = [{"prompt_ids": o["prompt_ids"],
            "tokens": [(t + 7) % e.cfg.vocab_size if j in (3, 9, 15) else t for j, t in enumerate(o["tokens"])]}
           for o in good]
    return good, bad


@pytest.mark.slow
def test_forcing_requests_are_answered_and_recorded(server, services):
    good, bad = tiny_outputs()

    async def go():
        controller = await connect_as(server, "controller")
        requests = [
            schema.ForcingRequested(request_id="r-good", patch_id="p-good", deployment="tiny-cpu", outputs=good),
            schema.ForcingRequested(request_id="r-bad", patch_id="p-bad", deployment="tiny-cpu", outputs=bad),
            schema.ForcingRequested(request_id="r-unknown", deployment="no-such-deployment", outputs=good),
            schema.ForcingRequested(request_id="r-malformed", deployment="tiny-cpu", outputs=[{"tokens": [1]}]),
        ]
        # Another controller event on the forcer's consumer: acked and ignored.
        await controller.publish(schema.PatchRefused(patch_id="p-x", rule="policy", reason="touches tests"))
        sent = {}
        for r in requests:
            e, _ = await controller.publish(r)
            sent[e.request_id] = e
        await controller.close()

        q = "SELECT count(*) FROM events WHERE type = 'forcing.reported'"
        assert await wait_for_rows(server, q, len(requests), timeout=90) == len(requests)
        rows = await sql(server, "SELECT payload, source, subject, causation_id, correlation_id, deployment "
                                 "FROM events WHERE type = 'forcing.reported'")
        reports = {}
        for payload, source, subject, causation, correlation, deployment in rows:
            rep = schema.decode(payload.encode())
            cause = sent[rep.request_id]
            assert source == "forcer" and subject == "sp.ev.forcer.forcing.reported"
            assert causation == cause.event_id and correlation == cause.event_id
            assert deployment == cause.deployment
            reports[rep.request_id] = rep
        violations = await sql(server, "SELECT count(*) FROM events WHERE type = 'security.violation'")
        return reports, violations[0][0]

    reports, violations = asyncio.run(go())
    assert violations == 0
    ok, rejected = reports["r-good"], reports["r-bad"]
    assert ok.passed and ok.patch_id == "p-good" and ok.stats["system"]["mismatches"] == 0
    assert ok.stats["deployment"] == "tiny-cpu" and ok.audited == []
    assert not rejected.passed and not rejected.stats["event_rule"]["passed"]
    assert {(a["prompt_index"], a["position"]) for a in rejected.audited} >= {(i, j) for i in range(3) for j in (3, 9, 15)}
    assert all(not a["explained"] for a in rejected.audited)
    json.dumps(rejected.stats)  # the stats survived the ledger as plain JSON
    for rid in ("r-unknown", "r-malformed"):
        assert not reports[rid].passed and reports[rid].reason.startswith("forcing failed")


# --- the loop's ordering, without a server ---------------------------------------------------------


class FakeDelivery:
    def __init__(self, log: list[str]):
        self.log = log

    async def ack(self) -> None:
        self.log.append("ack")

    async def in_progress(self) -> None:
        self.log.append("in_progress")


class FakeBus:
    def __init__(self, log: list[str], fail: bool = False):
        self.log, self.fail, self.published = log, fail, []

    async def publish(self, event, cause=None):
        if self.fail:
            raise RuntimeError("broker gone")
        self.log.append("publish")
        self.published.append((event, cause))
        return event, 1


class SlowWorker:
    def answer(self, request):
        import time

        time.sleep(0.35)
        return {"passed": True, "reason": "ok", "stats": {}, "audited": []}


def test_handle_heartbeats_publishes_then_acks(monkeypatch):
    from specpilot.services.forcer import main

    monkeypatch.setattr(main, "HEARTBEAT_S", 0.1)
    log: list[str] = []
    b = FakeBus(log)
    req = schema.ForcingRequested(request_id="r1", patch_id="p1", outputs=[{"prompt_ids": [1], "tokens": [2]}])
    asyncio.run(main.handle(b, SlowWorker(), req, FakeDelivery(log)))
    assert log[-2:] == ["publish", "ack"] and log.count("in_progress") >= 2
    event, cause = b.published[0]
    assert cause is req and event.request_id == "r1" and event.passed

    log.clear()
    asyncio.run(main.handle(b, SlowWorker(), schema.PatchRefused(patch_id="p", rule="r", reason="x"),
                            FakeDelivery(log)))
    assert log == ["ack"]  # other controller events: acked, nothing published

    log.clear()
    with pytest.raises(RuntimeError):
        asyncio.run(main.handle(FakeBus(log, fail=True), SlowWorker(), req, FakeDelivery(log)))
    assert "ack" not in log  # not published, so not acked: the request comes back
