"""Memory that carries, over real nats-servers and two data directories: an entry accepted in one is
exported with its evidence and the stock it was made against, imported into another whose checkout
never held that stock, validated there again (never trusted) and served only to deployments whose facts
meet its requirements."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

from specpilot import entries, natsd, schema, subjects
from specpilot.app import cli
from specpilot.app.cmd_memory import import_shipped
from specpilot.engine.options import requirement_tables
from specpilot.harness.deployment import load_deployment
from specpilot.paths import REPO_ROOT
from specpilot.services.memory.main import stock_store
from tests.backbone.helpers import sql
from tests.conftest import _provision, connect_as, spawn_service, wait_for_services

ENGINE_README = "engine/README.md"


def _decisions(srv) -> list[list]:
    return asyncio.run(sql(srv, "SELECT type, json_extract_string(payload, '$.entry_id') FROM events "
                                "WHERE type IN ('memory.entry.accepted', 'memory.entry.rejected') ORDER BY pos"))


def _wait_decided(srv, n: int, timeout: float = 60) -> list[list]:
    deadline = time.monotonic() + timeout
    while (rows := _decisions(srv)) and len(rows) < n or not rows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} entry decisions expected, got {rows}")
        time.sleep(0.3)
    return rows


def _an_entry(tmp_path):
    """An entry made against a stock that is *not* this checkout (its engine README differs), with the
    stock's files filed where the exporting memory service keeps snapshots."""
    stock = tmp_path / "their-stock"
    for r in entries.ROOTS:
        shutil.copytree(REPO_ROOT / r, stock / r, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (stock / ENGINE_README).write_text((stock / ENGINE_README).read_text() + "\nTheir stock.\n")
    source = tmp_path / "their-source"
    shutil.copytree(stock, source)
    (source / "engine" / "options.py").write_text(
        (source / "engine" / "options.py").read_text() + "\n# their mechanism\n")
    import subprocess

    delta = subprocess.run(["git", "diff", "--no-index", "--", str(stock), str(source)], capture_output=True, text=True).stdout
    delta = delta.replace(f"a{stock}/", "a/").replace(f"b{source}/", "b/")
    facts = load_deployment("smollm2-cpu").facts()
    entry = schema.MemoryEntryProposed(
        entry_id="e-carried", title="their mechanism", delta=delta, options={"linear_backend": "stream"},
        requirements=entries.requirements_for({"linear_backend": "stream"}, facts, code_delta=True,
                                              outputs_identical=True, **requirement_tables()),
        contract="greedy tokens identical to the incumbent's", evidence=["controller:v-1"], deployment="smollm2-cpu",
        source_files=entries.tree_hashes(source), stock_files=entries.tree_hashes(stock))
    return entry, stock


def test_an_entry_moves_with_its_evidence_and_stock_and_is_checked_again(tmp_path, capsys):
    entry, their_stock = _an_entry(tmp_path)
    a = natsd.start(tmp_path / "a")
    asyncio.run(_provision(a))
    entries.snapshot(stock_store(a.data), entry.stock_files, live=their_stock)  # seen by A's memory
    proc = spawn_service(a, "memory")
    try:
        wait_for_services(a, {"memory"}, timeout=60)

        async def propose():
            ctl = await connect_as(a, "controller")
            await ctl.publish(schema.VerdictIssued(event_id="v-1", patch_id="p-1", decision="promote", reason="+9%"))
            await ctl.publish(entry)
            await ctl.close()

        asyncio.run(propose())
        assert _wait_decided(a, 1) == [["memory.entry.accepted", "e-carried"]]
        out = tmp_path / "export"
        assert cli.main(["memory", "export", str(out), "--data", str(a.data), "--json"]) == 0
        manifest = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        a.stop()
    assert manifest["entries"] == ["e-carried"] and manifest["stock_files_missing"] == []
    line = json.loads((out / "entries.jsonl").read_text())
    assert [e["event_id"] for e in line["evidence"]] == ["controller:v-1"] and line["entry"]["entry_id"] == "e-carried"
    assert (out / "stock" / entry.stock_files[ENGINE_README]).exists()  # their stock, not this checkout's

    b = natsd.start(tmp_path / "b")
    asyncio.run(_provision(b))
    proc = spawn_service(b, "memory")
    try:
        wait_for_services(b, {"memory"}, timeout=60)
        assert cli.main(["memory", "import", str(out), "--data", str(b.data), "--json"]) == 0
        reply = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert reply["imported"] == ["e-carried"] and reply["stock_files_filed"] >= 1
        assert _wait_decided(b, 1) == [["memory.entry.accepted", "e-carried"]]
        assert cli.main(["memory", "import", str(out), "--data", str(b.data), "--json"]) == 0  # idempotent
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["known"] == ["e-carried"]
        # shipped entries go only into a ledger that holds none yet (`specpilot round` on a fresh directory)
        args = cli.build_parser(["memory", "list"]).parse_args(["memory", "list", "--data", str(b.data)])
        assert import_shipped(args, src=out) == []

        async def served():
            master = await connect_as(b, "master")
            try:
                return {name: (await master.request(subjects.RPC_ENTRIES, {"facts": load_deployment(name).facts()}))["entries"]
                        for name in ("tiny-cpu", "smollm2-h200")}
            finally:
                await master.close()

        got = asyncio.run(served())
        recorded = asyncio.run(sql(b, "SELECT json_extract_string(payload, '$.source'), "
                                      "json_extract_string(payload, '$.origin') FROM events WHERE type = 'memory.entry.proposed'"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        b.stop()
    # its requirements (a CPU kernel option, code validated on the CPU) hold for the tiny CPU deployment only
    assert [e["entry_id"] for e in got["tiny-cpu"]] == ["e-carried"] and got["smollm2-h200"] == []
    assert got["tiny-cpu"][0]["imported_evidence"][0]["event_id"] == "controller:v-1"  # as its publisher minted it
    assert recorded == [["memory", str(a.data)]]  # proposed by B's memory, naming where it came from


def test_shipped_entries_are_proposed_into_a_fresh_ledger(tmp_path, capsys):
    entry, their_stock = _an_entry(tmp_path)
    out = tmp_path / "shipped"
    (out / "stock").mkdir(parents=True)
    entries.snapshot(out / "stock", entry.stock_files, live=their_stock)
    (out / "entries.jsonl").write_text(json.dumps({"entry": json.loads(schema.encode(entry)), "evidence": []}) + "\n")
    (out / "manifest.json").write_text(json.dumps({"format": 1, "origin": "a real round"}))
    c = natsd.start(tmp_path / "c")
    asyncio.run(_provision(c))
    proc = spawn_service(c, "memory")
    try:
        wait_for_services(c, {"memory"}, timeout=60)
        args = cli.build_parser(["memory", "list"]).parse_args(["memory", "list", "--data", str(c.data)])
        assert import_shipped(args, src=tmp_path / "nothing-shipped") == []
        assert import_shipped(args, src=out) == ["e-carried"]  # a fresh ledger: proposed, with its stock filed
        assert _wait_decided(c, 1) == [["memory.entry.accepted", "e-carried"]]
        assert import_shipped(args, src=out) == []  # not a fresh ledger any more
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        c.stop()


def test_an_import_that_is_not_an_export_is_refused(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert cli.main(["memory", "import", str(tmp_path / "x"), "--data", str(tmp_path / "d")]) == 2
    assert "not a memory export" in capsys.readouterr().err
