"""The memory service over a real nats-server: recording, forgery, poison messages, SQL, tampering."""

import asyncio

import pytest

from specpilot import bus, ledger, schema, subjects
from specpilot.app.cli import main as cli
from specpilot.services.memory import logic
from tests.backbone.helpers import directions, publish_all, sql, wait_for_rows
from tests.conftest import connect_as, spawn_service


def test_records_every_event_once_with_chain(server, memory):
    async def go():
        master = await connect_as(server, "master")
        ids = await publish_all(master, directions(300))
        await master.close()
        assert await wait_for_rows(server, "SELECT count(*) FROM events", 300) == 300
        rows = await sql(server, "SELECT event_id, seq, pos FROM events ORDER BY pos")
        assert sorted(r[0] for r in rows) == sorted(ids)
        assert [r[2] for r in rows] == list(range(300))
        res = await (await connect_as(server, "admin")).request(subjects.RPC_REPLAY, {})
        assert res["ok"] and res["projections_match"] and res["rows"] == 300

    asyncio.run(go())


def test_republished_ids_are_absorbed(server, memory):
    async def go():
        admin = await connect_as(server, subjects.ADMIN)
        before = (await admin.js.stream_info(subjects.STREAM)).state.messages
        master = await connect_as(server, "master")
        events = [master.stamp(e) for e in directions(50)]
        for _ in range(2):
            for e in events:
                await master.publish_raw(subjects.event_subject("master", e.tag), schema.encode(e), e.event_id)
        # a different message id with the same event id gets past the server's dedupe: the ledger absorbs it
        await master.publish_raw(subjects.event_subject("master", events[0].tag), schema.encode(events[0]), "other-id")
        await master.close()
        # the server's Nats-Msg-Id window dropped the 50 republished messages: 50 + the other id stored
        assert (await admin.js.stream_info(subjects.STREAM)).state.messages - before == 51
        await admin.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", 50)
        await asyncio.sleep(1.0)
        assert (await sql(server, "SELECT count(*), count(DISTINCT event_id) FROM events"))[0] == [50, 50]

    asyncio.run(go())


def test_forged_verdict_becomes_security_violation(server, memory):
    async def go():
        sub = await connect_as(server, "subagent")
        forged = schema.VerdictIssued(patch_id="p-evil", decision="promote", gain=9.9)
        await sub.publish(forged)  # on its own prefix: the server lets it through, the recorder must not
        # an envelope claiming another source is a violation too
        lying = schema.PatchProposed(direction_id="d", patch_id="p-lie", diff="", source="controller")
        await sub.publish_raw(subjects.event_subject("subagent", lying.tag), schema.encode(lying), lying.event_id)
        good = schema.PatchProposed(direction_id="d", patch_id="p-ok", diff="")
        await sub.publish(good)
        await sub.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", 3)
        types = await sql(server, "SELECT type, source FROM events ORDER BY pos")
        assert types == [["security.violation", "memory"], ["security.violation", "memory"], ["patch.proposed", "subagent"]]
        assert (await sql(server, "SELECT count(*) FROM events WHERE type = 'verdict.issued'"))[0][0] == 0
        detail = await sql(server, "SELECT json_extract_string(payload, '$.claimed_type') FROM events "
                                   "WHERE type = 'security.violation' ORDER BY pos")
        assert detail == [["verdict.issued"], ["patch.proposed"]]

    asyncio.run(go())


def test_an_event_id_belongs_to_its_publisher(server, memory):
    """The master's ids follow fixed patterns a subagent can read (``<round>-finished``): the subagent takes that
    id first, with the message id the stream would have deduplicated on before ids carried their minter, and
    again through its own bus. Both become security violations, and the master's event is recorded."""
    async def go():
        sub = await connect_as(server, "subagent")
        master = await connect_as(server, "master")
        squat = schema.PatchProposed(event_id="master:round-x-finished", direction_id="d", patch_id="p", diff="",
                                     source="subagent")
        await sub.publish_raw(subjects.event_subject("subagent", squat.tag), schema.encode(squat), squat.event_id)
        await sub.publish(squat)  # the id names another minter: kept as it is, and refused by the recorder
        published, _ = await master.publish(schema.RoundFinished(event_id="round-x-finished", round_id="round-x"))
        assert published.event_id == "master:round-x-finished" and master.msg_id(published.event_id) != published.event_id
        assert master.msg_id(published.event_id) != sub.msg_id(published.event_id)  # keyed by each one's bundle
        await sub.close()
        await master.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", 3)
        rows = await sql(server, "SELECT type, event_id, json_extract_string(payload, '$.reason') FROM events "
                                 "ORDER BY pos")
        assert [r[0] for r in rows] == ["security.violation", "security.violation", "round.finished"]
        assert rows[2][1] == "master:round-x-finished"
        assert all("is not minted by its publisher 'subagent'" in r[2] for r in rows[:2])

    asyncio.run(go())


def test_poison_message_is_dead_lettered_and_does_not_stall(server, memory):
    async def go():
        master = await connect_as(server, "master")
        events = directions(40)
        ids = await publish_all(master, events[:20])
        await master.publish_raw("sp.ev.master.direction.planned", b"{this is not json", "poison-1")
        ids += await publish_all(master, events[20:])
        await master.close()
        assert await wait_for_rows(server, "SELECT count(*) FROM events", 40) == 40
        assert await wait_for_rows(server, "SELECT count(*) FROM dead_letters", 1) == 1
        dl = await sql(server, "SELECT subject, deliveries, error FROM dead_letters")
        assert dl[0][0] == "sp.ev.master.direction.planned" and dl[0][1] == bus.DECODE_ATTEMPTS
        assert "not a SpecPilot event" in dl[0][2]
        assert sorted(r[0] for r in await sql(server, "SELECT event_id FROM events")) == sorted(ids)

    asyncio.run(go())


@pytest.mark.parametrize("query", [
    "INSERT INTO events SELECT * FROM events", "UPDATE events SET type = 'x'", "DELETE FROM events",
    "CREATE TABLE t (x INT)", "DROP TABLE events", "ATTACH '/tmp/x.db' AS x", "COPY events TO '/tmp/e.csv'",
    "PRAGMA enable_checkpoint_on_shutdown", "SET threads = 1", "SELECT 1; DELETE FROM events",
    "SELECT * FROM read_csv('/etc/passwd')", "CHECKPOINT", "ALTER TABLE events ADD COLUMN x INT",
    "EXPLAIN ANALYZE DELETE FROM events", "/* a comment */ explain analyse DELETE FROM events",
])
def test_sql_endpoint_refuses_writes(server, memory, query):
    async def go():
        admin = await connect_as(server, subjects.ADMIN)
        with pytest.raises(bus.BusError) as info:
            await admin.request(subjects.RPC_SQL, {"query": query}, timeout=10)
        assert "refused" in str(info.value) or "not allowed" in str(info.value) or "disabled" in str(info.value)
        assert (await admin.request(subjects.RPC_SQL, {"query": "SELECT count(*) FROM events"}))["rows"] == [[0]]
        await admin.close()

    asyncio.run(go())


def test_readonly_queries_cannot_write_even_past_the_statement_filter(tmp_path, monkeypatch):
    """EXPLAIN ANALYZE executes its statement (in DuckDB it deletes), so it is refused; and whatever
    passes the filter runs in a transaction that is rolled back."""
    led = ledger.Ledger(tmp_path)
    led.con.execute("CREATE TABLE scratch AS SELECT * FROM range(3) t(x)")
    for query in ("EXPLAIN ANALYZE DELETE FROM scratch", "-- hidden\nEXPLAIN ANALYZE DELETE FROM scratch",
                  "/* x */ explain analyse delete from scratch"):
        with pytest.raises(ledger.ReadOnlyViolation, match="EXPLAIN ANALYZE runs its statement"):
            led.query_readonly(query)
    assert led.query_readonly("EXPLAIN SELECT * FROM scratch")["rows"]  # plain EXPLAIN still works
    monkeypatch.setattr(ledger, "READ_ONLY_TYPES", ledger.READ_ONLY_TYPES | {"DELETE"})  # a filter hole
    led.query_readonly("DELETE FROM scratch")
    assert led.con.execute("SELECT count(*) FROM scratch").fetchone() == (3,)
    led.close()


def test_sql_reads_work(server, memory):
    async def go():
        master = await connect_as(server, "master")
        await publish_all(master, directions(5))
        await wait_for_rows(server, "SELECT count(*) FROM events", 5)
        rows = await sql(server, "WITH t AS (SELECT type, count(*) AS n FROM events GROUP BY type) SELECT * FROM t")
        assert rows == [["direction.planned", 5]]

    asyncio.run(go())


def _record_then_stop(server, n=20) -> list[list]:
    proc = spawn_service(server, "memory")

    async def go():
        master = await connect_as(server, "master")
        await publish_all(master, directions(n))
        await master.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", n)

    asyncio.run(go())
    proc.terminate()
    proc.wait(timeout=20)
    led = ledger.Ledger(server.data)
    rows = led.con.execute("SELECT pos, seq FROM events ORDER BY pos").fetchall()
    led.close()
    return rows


def _tamper(server, *statements) -> None:
    led = ledger.Ledger(server.data)
    for s in statements:
        led.con.execute(s)
    led.close()


def test_replay_names_first_bad_sequence(server, capsys):
    rows = _record_then_stop(server)
    seq_at = dict(rows)
    data = ["--data", str(server.data), "--nats", "nats://127.0.0.1:1"]  # no memory service: read the file
    assert cli(["replay", *data[:2]]) == 0

    # flip one byte of a stored payload
    _tamper(server, "UPDATE events SET payload = replace(payload, 'direction 5', 'direction 6') WHERE pos = 5")
    assert cli(["replay", *data[:2]]) == 1
    assert f"first bad sequence {seq_at[5]} " in capsys.readouterr().err.replace("\n", " ")
    _tamper(server, "UPDATE events SET payload = replace(payload, 'direction 6', 'direction 5') WHERE pos = 5")
    assert cli(["replay", *data[:2]]) == 0

    # swap two rows
    _tamper(server, "UPDATE events SET pos = -1 WHERE pos = 3", "UPDATE events SET pos = 3 WHERE pos = 7",
            "UPDATE events SET pos = 7 WHERE pos = -1")
    led = ledger.Ledger(server.data, read_only=True)
    res = ledger.verify(led)
    led.close()
    assert not res.ok and res.first_bad_pos == 3 and res.first_bad_seq == seq_at[7]
    _tamper(server, "UPDATE events SET pos = -1 WHERE pos = 3", "UPDATE events SET pos = 3 WHERE pos = 7",
            "UPDATE events SET pos = 7 WHERE pos = -1")

    # delete a row
    _tamper(server, "DELETE FROM events WHERE pos = 11")
    capsys.readouterr()
    assert cli(["replay", *data[:2]]) == 1
    assert f"first bad sequence {seq_at[12]} " in capsys.readouterr().err.replace("\n", " ")


def test_projections_rebuilt_equal_live_and_detect_edits(server):
    _record_then_stop(server)
    led = ledger.Ledger(server.data)
    assert ledger.verify(led).projections_match
    live = led.live_projections()
    assert '"direction.planned":20' in live["counts"]
    led.con.execute("UPDATE projections SET body = replace(body, ':20', ':21') WHERE name = 'counts'")
    res = ledger.verify(led)
    led.close()
    assert res.ok and not res.projections_match and res.projection_diff == "counts"


def test_the_stream_check_finds_lost_repeated_and_stray_messages():
    """`logic.check_stream`, what `specpilot replay --stream` and the chaos bench report: every stream message
    recorded once under its sequence, or dead-lettered; anything else is named."""
    events = [schema.DirectionPlanned(event_id=f"master:d{i}", direction_id=f"d{i}", title="t") for i in range(4)]
    stream = [(i + 1, "x", schema.encode(e)) for i, e in enumerate(events)]
    stream += [(5, "x", b"not json"), (6, "x", schema.encode(events[0]))]  # a dead letter; d0 published again
    recorded = {1: "master:d0", 2: "master:d1", 4: "master:d3", 9: "master:elsewhere"}  # d2 (seq 3) was lost
    got = logic.check_stream(stream, recorded, dead={5})
    assert (got.messages, got.recorded, got.dead) == (6, 3, 1)
    assert (got.missing, got.repeated, got.strays, got.ok) == ([3], ["master:d0"], [9], False)
    whole = logic.check_stream(stream[:2], {1: "master:d0", 2: "master:d1"}, set())
    assert whole.ok and whole.as_dict()["recorded"] == 2
