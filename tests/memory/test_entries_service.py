"""Memory entries over a real nats-server: the memory service decides each proposed entry once
(accepted only if stock + delta reproduces the source files) and serves the accepted ones whose
requirements hold for the asking deployment."""

import asyncio
import time

from specpilot import schema, subjects
from tests.backbone.helpers import sql
from tests.conftest import connect_as, spawn_service, wait_for_services
from tests.memory.test_entries import _source_system

CPU = {"device_kind": "cpu", "dtype": "fp32", "model_family": "llama", "mode": "batch1"}


def test_entries_are_validated_once_and_served_by_requirements(server, tmp_path):
    delta, files = _source_system(tmp_path / "a", "\n# a mechanism\n")
    other, _ = _source_system(tmp_path / "b", "\n# not what the hashes say\n")
    good = schema.MemoryEntryProposed(entry_id="e-good", title="good", delta=delta, options={"verify": "tree"},
                                      requirements=CPU, source_files=files, deployment="smollm2-cpu")
    bad = schema.MemoryEntryProposed(entry_id="e-bad", delta=other, requirements=CPU, source_files=files,
                                     deployment="smollm2-cpu")
    proc = spawn_service(server, "memory")
    try:
        wait_for_services(server, {"memory"}, timeout=60)

        async def go():
            ctl = await connect_as(server, "controller")
            for e in (good, bad, good):  # the repeat is a redelivery: decided once
                await ctl.publish(e)
            await ctl.close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rows = await sql(server, "SELECT type, json_extract_string(payload, '$.entry_id') FROM events "
                                         "WHERE type IN ('memory.entry.accepted', 'memory.entry.rejected') ORDER BY pos")
                if len(rows) >= 2:
                    break
                await asyncio.sleep(0.3)
            await asyncio.sleep(1.0)
            rows = await sql(server, "SELECT type, json_extract_string(payload, '$.entry_id'), payload FROM events "
                                     "WHERE type IN ('memory.entry.accepted', 'memory.entry.rejected') ORDER BY pos")
            master = await connect_as(server, "master")
            cpu = await master.request(subjects.RPC_ENTRIES, {"facts": CPU})
            gpu = await master.request(subjects.RPC_ENTRIES, {"facts": {**CPU, "device_kind": "cuda"}})
            await master.close()
            return rows, cpu, gpu

        rows, cpu, gpu = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    decisions = {(t, e) for t, e, _ in rows}
    assert decisions == {("memory.entry.accepted", "e-good"), ("memory.entry.rejected", "e-bad")}
    assert len(rows) == 2
    assert "does not reproduce" in next(p for t, _, p in rows if t == "memory.entry.rejected")
    assert [e["entry_id"] for e in cpu["entries"]] == ["e-good"] and cpu["entries"][0]["options"] == {"verify": "tree"}
    assert gpu["entries"] == []
