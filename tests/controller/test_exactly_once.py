"""A patch is decided once, its consequences with it (issue 53 item 5), over a real nats-server and memory
service: a promotion's verdict and ``BestAdvanced`` are one atomic publish, and a second decision of the same
patch (a redelivery that memory could not yet call decided) carries the first's ids, so the stream drops it,
the first stands, and the controller's state is folded again from the ledger."""

from __future__ import annotations

import asyncio

from specpilot import schema
from specpilot.services.controller.main import Controller
from specpilot.services.controller.verdict import verdict_id
from tests.backbone.helpers import sql, wait_for_rows
from tests.conftest import connect_as, spawn_service, wait_for_services


def _decision(patch: schema.PatchProposed, decision: str, commit: str) -> list[schema.Event]:
    verdict = schema.VerdictIssued(event_id=verdict_id(patch.patch_id), patch_id=patch.patch_id, decision=decision)
    if decision != "promote":
        return [verdict]
    return [verdict, schema.BestAdvanced(event_id=f"best-{patch.patch_id}", patch_id=patch.patch_id, commit=commit,
                                         causation_id=schema.mint(schema.CONTROLLER, verdict.event_id))]


def test_a_decision_and_its_consequences_are_recorded_together_and_once(server):
    memory = spawn_service(server, "memory")
    try:
        wait_for_services(server, {"memory"})

        async def go():
            sub, b = await connect_as(server, "subagent"), await connect_as(server, "controller")
            patch, _ = await sub.publish(schema.PatchProposed(direction_id="d", patch_id="p1", diff="",
                                                              deployment="tiny-cpu"))
            ctl = Controller(server.data, b)
            await ctl.restore()
            first = await ctl.emit_together(_decision(patch, "promote", "c1"), patch)
            assert [e.event_id for e in first] == ["controller:verdict-p1", "controller:best-p1"]
            assert first[1].causation_id == first[0].event_id and first[0].causation_id == patch.event_id
            assert ctl.state.best["tiny-cpu"].commit == "c1"
            # decided again, differently (the first decision was not yet readable): the stream holds its ids
            again = await ctl.emit_together(_decision(patch, "promote", "c2"), patch)
            assert [e.event_id for e in again] == [e.event_id for e in first]
            await ctl.emit(_decision(patch, "reject", "")[0], patch)
            await wait_for_rows(server, "SELECT count(*) FROM events", 3)
            await asyncio.sleep(1.0)  # anything late would be recorded by now
            rows = await sql(server, "SELECT type, event_id, json_extract_string(payload, '$.decision'), "
                                     "json_extract_string(payload, '$.commit') FROM events ORDER BY pos")
            assert rows == [["patch.proposed", patch.event_id, None, None],
                            ["verdict.issued", "controller:verdict-p1", "promote", None],
                            ["best.advanced", "controller:best-p1", None, "c1"]]
            assert ctl.state.best["tiny-cpu"].commit == "c1"  # folded again from the ledger: the first stands
            await sub.close()
            await b.close()

        asyncio.run(go())
    finally:
        memory.terminate()
        memory.wait(timeout=20)
