"""The subagent's handling of one direction over a real nats-server and memory service.

Each test publishes a direction as the master would, fetches it from the subagent's own durable
consumer, hands it to `Subagent.handle`, and reads what it published back from the ledger; acks are
read from the consumer's state on the server.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from specpilot import natsd, schema, subjects
from specpilot.services.subagent.main import Settings, Subagent, patch_event_id
from tests.backbone.helpers import sql, wait_for_rows
from tests.conftest import _provision, connect_as, spawn_service, wait_for_services
from tests.subagent import scripts

pytestmark = pytest.mark.timeout(180)

DEMO_INT = scripts.option_diff("    demo_int: int = 0  # added by a promotion")

LEDGER = [  # (publisher, event): a promoted patch on tiny-cpu, and a best on another deployment
    ("subagent", schema.PatchProposed(direction_id="d0", patch_id="d0-p0", diff=DEMO_INT, options={"demo_int": 1},
                                      deployment="tiny-cpu")),
    ("controller", schema.BestAdvanced(commit="c1", patch_id="d0-p0", options={"demo_int": 1}, deployment="tiny-cpu")),
    ("controller", schema.BestAdvanced(commit="other", patch_id="x", deployment="smollm2-cpu")),
]


@pytest.fixture(scope="module")
def ledger_server(tmp_path_factory):
    """One provisioned nats-server with the memory service, holding `LEDGER`, for the whole module."""
    data = tmp_path_factory.mktemp("data")
    srv = natsd.start(data)
    asyncio.run(_provision(srv))
    memory = spawn_service(srv, "memory")
    try:
        wait_for_services(srv, {"memory"}, timeout=60)

        async def seed() -> None:
            for user, event in LEDGER:
                b = await connect_as(srv, user)
                try:
                    await b.publish(event)
                finally:
                    await b.close()

        asyncio.run(seed())
        asyncio.run(wait_for_rows(srv, "SELECT count(*) FROM events", len(LEDGER)))
        yield srv
    finally:
        memory.terminate()
        memory.wait(timeout=30)
        srv.stop()


def _handle(srv, direction: schema.Event, tmp_path, env=None, redeliver: bool = False) -> dict:
    """Publish ``direction`` as the master, let the subagent handle its delivery; returns the consumer's
    state afterwards and the events published in reply (read back from the ledger)."""

    async def go() -> dict:
        master = await connect_as(srv, "master")
        try:
            sent, _ = await master.publish(direction)
        finally:
            await master.close()
        b = await connect_as(srv, "subagent")
        try:
            (delivery,) = await b.fetch(batch=1, timeout=10)
            if redeliver:  # a crash before the ack: the server delivers the direction again
                await delivery.nak()
                (delivery,) = await b.fetch(batch=1, timeout=10)
            agent = Subagent(b, Settings(work_dir=tmp_path / "work"), env={} if env is None else env)
            await agent.handle(schema.decode(delivery.data), delivery)
            await b.flush()
            for _ in range(50):  # the server applies an ack asynchronously: give it a moment
                info = await b.nc.request(subjects.js_consumer_info("subagent"), b"", timeout=5)
                state = json.loads(info.data)
                if state["num_ack_pending"] == 0:
                    break
                await asyncio.sleep(0.1)
        finally:
            await b.close()
        return {"sent": sent, "delivered": delivery.num_delivered, "pending_acks": state["num_ack_pending"],
                "unread": state["num_pending"]}

    return asyncio.run(go())


def _replies(srv, sent: schema.Event) -> list[schema.Event]:
    """The events caused by ``sent``, once the memory service has recorded them."""
    rows = asyncio.run(sql(srv, f"SELECT payload FROM events WHERE causation_id = '{sent.event_id}' ORDER BY pos"))
    return [schema.decode(p.encode()) for (p,) in rows]


def _wait_replies(srv, sent: schema.Event, n: int) -> list[schema.Event]:
    asyncio.run(wait_for_rows(srv, f"SELECT count(*) FROM events WHERE causation_id = '{sent.event_id}'", n))
    return _replies(srv, sent)


def test_sweep_direction_publishes_patches_then_acks(ledger_server, tmp_path):
    d = schema.DirectionPlanned(direction_id="d1", title="sweep demo_int", provider="sweep", deployment="tiny-cpu",
                                round_id="r1", hints={"option": "demo_int", "values": [2, 3, -1], "base": {"block_size": 6}})
    state = _handle(ledger_server, d, tmp_path)
    assert state["pending_acks"] == 0 and state["unread"] == 0
    sent = state["sent"]
    patches = _wait_replies(ledger_server, sent, 2)
    assert [p.patch_id for p in patches] == ["d1-p0", "d1-p1"]  # -1 is not a valid value: skipped
    # validated on the base (block size 6), carrying only its own setting (laid over the best by the controller)
    assert [p.options for p in patches] == [{"demo_int": 2}, {"demo_int": 3}]
    for i, p in enumerate(patches):
        assert p.event_id == schema.mint("subagent", patch_event_id(sent.event_id, i))
        assert p.event_id.partition(":")[2][:13] == sent.event_id.partition(":")[2][:13]
        assert (p.deployment, p.round_id, p.source) == ("tiny-cpu", "r1", "subagent")
        assert p.causation_id == p.correlation_id == sent.event_id
        assert p.base_commit == "c1" and p.provider == "sweep" and p.diff == "" and p.direction_id == "d1"
    assert not list((tmp_path / "work").iterdir())  # the workspace is removed


def test_memory_direction_on_stock_has_empty_base_commit(ledger_server, tmp_path):
    entry = {"entry_id": "m1", "delta": scripts.option_diff(), "options": {"demo_flag": True}}
    d = schema.DirectionPlanned(direction_id="d2", title="reuse m1", provider="memory", deployment="smollm2-h200",
                                memory_entry_id="m1", hints={"entry": entry})
    state = _handle(ledger_server, d, tmp_path)
    assert state["pending_acks"] == 0
    (p,) = _wait_replies(ledger_server, state["sent"], 1)
    assert p.base_commit == "" and p.options == {"demo_flag": True} and "+" + scripts.DEMO_FIELD in p.diff


@pytest.mark.parametrize(("provider", "why"), [("anthropic", "ANTHROPIC_API_KEY"), ("gemini", "gemini"),
                                               ("sweep", "option")])
def test_provider_failure_is_reported_then_acked(ledger_server, tmp_path, provider, why):
    d = schema.DirectionPlanned(direction_id=f"d3-{provider}", title="t", provider=provider, deployment="tiny-cpu")
    state = _handle(ledger_server, d, tmp_path)
    assert state["pending_acks"] == 0
    (failed,) = _wait_replies(ledger_server, state["sent"], 1)
    assert isinstance(failed, schema.DirectionFailed) and failed.direction_id == d.direction_id
    assert why in failed.reason and failed.source == "subagent"


def test_redelivered_direction_with_patches_is_not_redone(ledger_server, tmp_path):
    # d0 already has its patch in the ledger (LEDGER): a redelivery is acked without new patches.
    d = schema.DirectionPlanned(direction_id="d0", title="t", provider="sweep", deployment="tiny-cpu",
                                hints={"option": "block_size", "values": [2]})
    state = _handle(ledger_server, d, tmp_path, redeliver=True)
    assert state["delivered"] == 2 and state["pending_acks"] == 0
    assert _replies(ledger_server, state["sent"]) == []
    # other master events are acked and ignored
    state = _handle(ledger_server, schema.RoundStarted(), tmp_path)
    assert state["pending_acks"] == 0 and _replies(ledger_server, state["sent"]) == []
