"""The permissions matrix: every service user against its allowed and denied subjects, on a real
nats-server with the rendered config. Denied operations must be refused by the server and leave the
stream, its consumers and the ledger unchanged."""

import asyncio
import json

from specpilot import schema, subjects
from specpilot.schema import SERVICES
from tests.backbone.helpers import sql, wait_for_rows
from tests.conftest import connect_as, spawn_service, wait_for_services

S = subjects.STREAM
ALLOWED_EVENT = {
    "master": schema.DirectionPlanned(direction_id="d", title="t"),
    "subagent": schema.PatchProposed(direction_id="d", patch_id="p", diff=""),
    "controller": schema.PatchRefused(patch_id="p", rule="r", reason="r"),
    "forcer": schema.ForcingReported(request_id="f", passed=True),
    "memory": schema.MemoryEntryAccepted(entry_id="m"),
}


def evil_consumer(name: str) -> bytes:
    # A push consumer delivering into the controller's prefix would forge controller events.
    return json.dumps({"stream_name": S, "config": {"durable_name": name, "deliver_subject":
                       "sp.ev.controller.verdict.issued", "ack_policy": "none"}}).encode()


def denied_requests(user: str) -> dict[str, bytes]:
    others = [s for s in SERVICES if s != user]
    reqs = {
        f"$JS.API.STREAM.PURGE.{S}": b"",
        f"$JS.API.STREAM.DELETE.{S}": b"",
        f"$JS.API.STREAM.UPDATE.{S}": json.dumps({"name": S, "subjects": ["x.>"]}).encode(),
        "$JS.API.STREAM.CREATE.EVIL": json.dumps({"name": "EVIL", "subjects": ["sp.ev.>"]}).encode(),
        f"$JS.API.STREAM.MSG.DELETE.{S}": json.dumps({"seq": 1}).encode(),
        f"$JS.API.CONSUMER.CREATE.{S}.evil": evil_consumer("evil"),
        f"$JS.API.CONSUMER.DURABLE.CREATE.{S}.evil2": evil_consumer("evil2"),
        f"$JS.API.CONSUMER.DELETE.{S}.{user}": b"",
        f"$JS.API.CONSUMER.DELETE.{S}.memory": b"",
        subjects.RPC_EXPORT: json.dumps({"dir": "/tmp/written-by-a-service"}).encode(),  # the admin's only
    }
    for o in others:
        reqs[f"$JS.API.CONSUMER.MSG.NEXT.{S}.{o}"] = json.dumps({"batch": 1, "no_wait": True}).encode()
        reqs[f"sp.ev.{o}.verdict.issued"] = schema.encode(schema.VerdictIssued(patch_id="x", decision="promote"))
    return reqs


def test_permissions_matrix(server):
    recorder = spawn_service(server, "memory")
    wait_for_services(server, {"memory"})

    async def probe(user: str) -> dict:
        b = await connect_as(server, user)
        result: dict = {"user": user}
        # allowed: publish own events (acked by JetStream), fetch and inspect own consumer, query memory
        _, seq = await b.publish(ALLOWED_EVENT[user])
        result["published_seq"] = seq
        if user != "memory":  # memory's own consumer is busy with the recorder; fetching it would steal
            result["fetch_ok"] = isinstance(await b.fetch(batch=1, timeout=0.5), list)
        info = await b.try_request(subjects.js_consumer_info(user), b"", timeout=2)
        result["own_consumer_info"] = info is not None and b'"error"' not in info
        result["sql_ok"] = (await b.request(subjects.RPC_SQL, {"query": "SELECT 1"}))["rows"] == [[1]]
        # denied: every request below must be refused by the server
        denied = denied_requests(user)
        answers = await asyncio.gather(*(b.try_request(s, d, timeout=1.0) for s, d in denied.items()))
        result["answered"] = [s for s, a in zip(denied, answers, strict=True) if a is not None]
        others = [s for s in SERVICES if s != user]
        for o in others:
            await b.publish_core(f"$JS.ACK.{S}.{o}.1.1.1.1.1.1")
            await b.subscribe_raw(f"{subjects.inbox_prefix(o)}.>")
        await b.subscribe_raw(subjects.EVENTS_ALL)
        await asyncio.sleep(0.5)
        probes = list(denied) + [f"$JS.ACK.{S}.{o}.1.1.1.1.1.1" for o in others] + \
            [f"{subjects.inbox_prefix(o)}.>" for o in others] + [subjects.EVENTS_ALL]
        result["not_refused"] = [s for s in probes if not b.refused(s)]
        await b.close()
        return result

    async def go():
        admin = await connect_as(server, subjects.ADMIN)
        before = await admin.js.stream_info(S)
        results = await asyncio.gather(*(probe(u) for u in SERVICES))
        after = await admin.js.stream_info(S)
        consumers = sorted([c.name for c in await admin.js.consumers_info(S)] if hasattr(admin.js, "consumers_info")
                           else [])
        await wait_for_rows(server, "SELECT count(*) FROM events", len(SERVICES))
        await asyncio.sleep(0.5)
        types = sorted(r[0] for r in await sql(server, "SELECT type FROM events"))
        await admin.close()
        return before, after, results, consumers, types

    before, after, results, consumers, types = asyncio.run(go())
    recorder.terminate()
    recorder.wait(timeout=20)
    for r in results:
        assert r["published_seq"] > 0, r
        assert r.get("fetch_ok", True) and r["own_consumer_info"] and r["sql_ok"], r
        assert r["answered"] == [], f"{r['user']} got answers from denied subjects: {r['answered']}"
        assert r["not_refused"] == [], f"{r['user']} was not refused on: {r['not_refused']}"
    # the stream holds exactly the allowed publishes; its config and consumers are untouched
    assert after.state.messages == before.state.messages + len(SERVICES)
    assert after.config.subjects == before.config.subjects == [subjects.EVENTS_ALL]
    if consumers:
        assert consumers == sorted(subjects.CONSUMER_FILTERS)
    assert types == sorted(e.tag for e in ALLOWED_EVENT.values())
