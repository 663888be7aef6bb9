"""Typed reads (`specpilot.reads`) over a real memory service and over the ledger file: classes in,
schema objects out, filters by envelope and payload fields, last/offset/count; a bad query is one
service error, not a retry loop; service users may call the endpoint, and nothing spells SQL."""

import asyncio

import msgspec
import pytest

from specpilot import bus, evidence, ledger, projections, reads, schema
from specpilot.reads import Reads
from tests.backbone.helpers import publish_all, wait_for_rows
from tests.conftest import connect_as


def _story() -> list[schema.Event]:
    env = {"round_id": "r-1", "deployment": "tiny-cpu"}
    return [
        schema.PatchProposed(**env, direction_id="d-1", patch_id="p-1", diff="", options={"verify": "tree"}),
        schema.PatchProposed(**env, direction_id="d-1", patch_id="p-2", diff="", options={"block_size": 6}),
        schema.PatchProposed(round_id="r-2", deployment="other", direction_id="d-2", patch_id="p-3", diff="", options={}),
        schema.VerdictIssued(**env, patch_id="p-1", decision="promote", gain=0.1),
        schema.BestAdvanced(**env, commit="c1", patch_id="p-1", options={"verify": "tree"}),
        schema.PatchRefused(**env, patch_id="p-2", rule="paths", reason="outside"),
        schema.BestAdvanced(**env, commit="c2", patch_id="p-9", options={"verify": "tree", "block_size": 6}),
    ]


SOURCES = {"subagent": (0, 1, 2), "controller": (3, 4, 5, 6)}


async def _check(r: Reads) -> None:
    assert [e.patch_id for e in await r.events(schema.PatchProposed, direction_id="d-1")] == ["p-1", "p-2"]
    assert [e.patch_id for e in await r.events(schema.PatchProposed, deployment="tiny-cpu")] == ["p-1", "p-2"]
    assert await r.count(schema.PatchProposed) == 3 and await r.count(schema.PatchProposed, round_id="r-2") == 1
    assert await r.decided("p-1") and await r.decided("p-2") and not await r.decided("p-3")
    best = await r.best("tiny-cpu")  # from the projections, typed
    assert isinstance(best, projections.BestView) and best.commit == "c2" and best.options["block_size"] == 6
    assert best.patch_id == "p-9" and await r.best("other") is None
    patches = await r.patches("p-1", "p-2", "p-3", "p-none")
    assert {k: (v.status, v.direction_id) for k, v in patches.items()} == {
        "p-1": ("promote", "d-1"), "p-2": ("refused", "d-1"), "p-3": ("proposed", "d-2")}
    assert patches["p-1"].gain == 0.1 and patches["p-1"].options == {"verify": "tree"}
    assert (await r.view("counts"))["patch.proposed"] == 3 and await r.view("rounds") == {}  # no round.started
    assert [e.round_id for e in await r.events(schema.PatchProposed, round_id=["r-1", "r-2"])] == ["r-1", "r-1", "r-2"]
    both = await r.events(schema.VerdictIssued, schema.PatchRefused, patch_id=["p-1", "p-2", "p-3"])
    assert [type(e) for e in both] == [schema.VerdictIssued, schema.PatchRefused]
    assert [e.tag for e in await r.events(round_id="r-1", offset=4)] == ["patch.refused", "best.advanced"]
    assert [e.commit for e in await r.events(schema.BestAdvanced, last=1)] == ["c2"]
    assert await r.count(schema.PatchProposed, patch_id=[]) == 0


def test_typed_reads_over_the_memory_service_and_the_file(server, memory):
    story = _story()

    async def go():
        for source, idx in SOURCES.items():
            b = await connect_as(server, source)
            await publish_all(b, [story[i] for i in idx])
            await b.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", len(story))
        subagent = await connect_as(server, "subagent")  # a service user may ask (SERVICE_RPCS)
        try:
            await _check(Reads.over(subagent))
            with pytest.raises(bus.ServiceError, match="not a payload field"):
                await Reads.over(subagent, retry=True).count(schema.PatchProposed, **{"x') OR 1=1 --": "y"})
            with pytest.raises(bus.ServiceError, match="not an event query"):
                await subagent.request(reads.subjects.RPC_EVENTS, {"types": "nope", "nonsense": 1})
            with pytest.raises(bus.ServiceError, match="no projection named"):
                await Reads.over(subagent).view("nope")
            with pytest.raises(bus.ServiceError, match="not a view query"):
                await subagent.request(reads.subjects.RPC_VIEW, {"view": "best", "nonsense": 1})
        finally:
            await subagent.close()

    asyncio.run(go())
    memory.terminate()
    memory.wait(timeout=20)
    led = ledger.Ledger(server.data, read_only=True)
    try:
        asyncio.run(_check(Reads.local(led)))
    finally:
        led.close()


def test_no_ledger_reads_as_empty():
    async def go():
        r = Reads.none()
        assert await r.events(schema.BestAdvanced) == [] and await r.best("x") is None and not await r.decided("p")

    asyncio.run(go())


def test_services_spell_no_sql_and_no_event_tag():
    """Reads go through `specpilot.reads`; tags come from the schema classes (the ledger and schema excepted,
    and the `sql` command's own example query in the app's CLI)."""
    import re

    from specpilot.paths import REPO_ROOT

    tags = {t for t in schema.BY_TAG}
    offenders = []
    for path in sorted(p for top in ("specpilot", "services") for p in (REPO_ROOT / top).rglob("*.py")):
        if path.name in ("ledger.py", "schema.py"):
            continue
        text = path.read_text()
        if path.name == "cli.py" and path.parent.name == "app":
            text = text.replace('"SELECT type, count(*) FROM events GROUP BY 1"', "")
        if re.search(r"\bSELECT\b.*\bFROM events\b", text) or "json_extract" in text:
            offenders.append(f"{path.relative_to(REPO_ROOT)}: SQL")
        offenders += [f"{path.relative_to(REPO_ROOT)}: {t!r}" for t in tags if f"'{t}'" in text or f'"{t}"' in text]
    assert offenders == []


def test_projections_of_an_older_version_are_rebuilt_not_reported_as_tampering(tmp_path):
    """A ledger written by SpecPilot 0.1 holds version-1 projections (plain JSON, no version row): read-only
    it verifies as stale (chain intact) and its reads fold the log; the memory service's writable open
    rebuilds them, after which they verify identical."""
    from specpilot import subjects

    led = ledger.Ledger(tmp_path)
    batch = [ledger.Incoming(subjects.event_subject(e.source, e.tag), seq, e, schema.encode(e))
             for seq, e in enumerate(_story(), start=1)]
    led.append(batch, projection=led.projections())
    led.con.execute("DELETE FROM projections")
    led.con.execute("INSERT INTO projections VALUES ('counts', '{\"patch.proposed\":3}'), ('best', '{}')")
    led.close()

    old = ledger.Ledger(tmp_path, read_only=True)
    try:
        res = ledger.verify(old)
        assert res.ok and res.projections_stale and res.projections_match and "version 1" in res.reason
        assert asyncio.run(Reads.local(old).best("tiny-cpu")).commit == "c2"  # folded from the log
    finally:
        old.close()
    ledger.Ledger(tmp_path).close()  # the memory service's open
    new = ledger.Ledger(tmp_path, read_only=True)
    try:
        res = ledger.verify(new)
        assert res.ok and res.projections_match and not res.projections_stale
        assert new.live_projections()["version"] == str(projections.VERSION)
    finally:
        new.close()


@pytest.mark.slow
def test_a_heavy_query_never_stalls_the_recorder(server, memory):
    """A query that would run for minutes, sent through the `sql` RPC every service may call, runs off the
    recording path: events published meanwhile are each recorded within a second, and the query is stopped
    at the server's limit (`ledger.READ_TIMEOUT_S`) with a line that says so."""
    import asyncio
    import time

    from specpilot import subjects
    from tests.backbone.helpers import directions
    from tests.conftest import connect_as

    async def go():
        reader, master = await connect_as(server, "controller"), await connect_as(server, "master")
        heavy = asyncio.create_task(reader.request(
            subjects.RPC_SQL, {"query": "SELECT sum(a.range * b.range) FROM range(200000) a, range(200000) b"},
            timeout=ledger.READ_TIMEOUT_S + 30))
        await asyncio.sleep(1.0)  # the query is running
        delays = []
        for n, e in enumerate(directions(5, prefix="during"), start=1):
            await master.publish(e)
            t0 = time.monotonic()
            while (await reader.request(subjects.RPC_EVENTS, {"types": ["direction.planned"], "count": True}))[
                    "count"] < n:
                await asyncio.sleep(0.05)
            delays.append(time.monotonic() - t0)
        assert not heavy.done(), "the heavy query ended early: it cannot show the recorder ran beside it"
        assert max(delays) < 1.0, delays
        with pytest.raises(bus.BusError, match=r"ran past 20 s and was stopped"):
            await heavy
        await reader.close()
        await master.close()

    asyncio.run(go())


def test_answers_larger_than_a_message_come_in_pages(server, memory):
    """A history read whose events hold more than a NATS message (1 MiB: twelve 100 KB diffs) comes back whole,
    in recording order, over several pages (`reads.reply_for`, `Reads.events`)."""
    async def go():
        sub, reader = await connect_as(server, "subagent"), await connect_as(server, "master")
        big = [schema.PatchProposed(direction_id="d", patch_id=f"p{i:02d}",
                                    diff=f"--- a/engine/f{i}.py\n+++ b/engine/f{i}.py\n@@ -1 +1,2 @@\n-old\n"
                                         + ("+" + "x" * 99 + "\n") * 1000) for i in range(12)]
        await publish_all(sub, big)
        await wait_for_rows(server, "SELECT count(*) FROM events", 12)
        got = await Reads.over(reader).events(schema.PatchProposed)
        assert [e.patch_id for e in got] == [e.patch_id for e in big]
        assert [e.patch_id for e in await Reads.over(reader).events(schema.PatchProposed, last=3)] == ["p09", "p10",
                                                                                                    "p11"]
        # History reads (the master's planner) ask for the skeleton: one page, the same diffstat, no code
        brief = await Reads.over(reader).events(schema.PatchProposed, brief=True)
        assert [evidence.diffstat(e.diff) for e in brief] == [evidence.diffstat(e.diff) for e in big]
        assert evidence.diffstat(brief[0].diff) == "engine/f0.py +1000 -1" and "x" not in brief[0].diff
        one = await reader.request(reads.subjects.RPC_EVENTS, msgspec.to_builtins(reads.query(schema.PatchProposed,
                                                                                             brief=True)))
        assert len(one["events"]) == 12 and not one.get("more")
        await sub.close()
        await reader.close()

    asyncio.run(go())
