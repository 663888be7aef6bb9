"""Whole rounds on the tiny deployment over a real nats-server with all five services.

The ledger must tell the whole story (phase 0, ceiling, every direction with its patches, timings
and verdicts, the sealed final, the summary), ``replay`` must rebuild the same state from the log,
and a round whose master and controller are SIGKILLed mid-round must still complete with nothing
lost or duplicated."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from specpilot import ledger, subjects
from specpilot.sandbox import bwrap_available
from specpilot.services.master.main import RPC_ROUND
from specpilot.services.subagent.workspace import build_workspace
from tests.backbone.helpers import sql
from tests.conftest import REPO, connect_as, spawn_service, wait_for_services
from tests.subagent.wire import Call, ScriptedServer, Turn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")]

CONTROLLER_FLAGS = ["--trials", "2", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "120", "--threads", "1"]
ROUND = {"deployment": "tiny-cpu", "rounds": 2, "sealed_requests": 2, "sealed_trials": 2}
SERVICES = ("memory", "forcer", "subagent", "master")


def _start(server, master_env: dict[str, str] | None = None) -> dict:
    procs = {name: spawn_service(server, name, env=master_env if name == "master" else None) for name in SERVICES}
    procs["controller"] = spawn_service(server, "controller", extra=CONTROLLER_FLAGS)
    wait_for_services(server, set(procs), timeout=120)
    return procs


def _stop(procs: dict) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except Exception:
            p.kill()


def _start_round(server, **params) -> str:
    async def go() -> dict:
        b = await connect_as(server, subjects.ADMIN)
        try:
            return await b.request(RPC_ROUND, {**ROUND, **params}, timeout=30)
        finally:
            await b.close()

    return asyncio.run(go())["round_id"]


def _request(server, subject: str, payload: dict) -> dict:
    async def go() -> dict:
        b = await connect_as(server, subjects.ADMIN)
        try:
            return await b.request(subject, payload, timeout=60)
        finally:
            await b.close()

    return asyncio.run(go())


def _events(server, round_id: str) -> list[tuple[str, str, dict]]:
    rows = asyncio.run(sql(server, f"SELECT type, event_id, payload FROM events WHERE round_id = '{round_id}' ORDER BY pos"))
    return [(t, i, json.loads(p)) for t, i, p in rows]


def _wait_for(server, round_id: str, tag: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(t == tag for t, _, _ in _events(server, round_id)):
            return
        time.sleep(1.0)
    raise AssertionError(f"{tag} not in the ledger after {timeout:.0f} s; have {[t for t, _, _ in _events(server, round_id)]}")


def _check_story(events: list[tuple[str, str, dict]]) -> dict:
    types = [t for t, _, _ in events]
    for tag in ("round.started", "hardware.measured", "profile.measured", "ceiling.computed", "direction.planned",
                "patch.proposed", "timing.measured", "verdict.issued", "sealed.final.requested",
                "sealed.final.reported", "round.finished"):
        assert tag in types, f"{tag} missing from the round's story: {types}"
    assert types[0] == "round.started" and types[-1] == "round.finished"
    ids = [i for _, i, _ in events]
    assert len(ids) == len(set(ids)), "an event was recorded twice"
    by = {}
    for t, _, p in events:
        by.setdefault(t, []).append(p)
    ceiling = by["ceiling.computed"][0]
    assert ceiling["ceiling_speedup"] > 0 and set(ceiling["factors"]) == {"tau", "kernel", "overhead"}
    assert ceiling["replay_tau"]
    # every direction's patches got exactly one decision, with raw timing samples behind each verdict
    patches = {p["patch_id"]: p for p in by["patch.proposed"]}
    decided = [p["patch_id"] for p in by.get("verdict.issued", []) + by.get("patch.refused", [])]
    assert sorted(decided) == sorted(patches), "a patch without exactly one decision"
    for d in by["direction.planned"]:
        assert any(p["direction_id"] == d["direction_id"] for p in patches.values()), f"no patch for {d['title']}"
    timings = {p["patch_id"]: p for p in by["timing.measured"] if p["kind"] == "candidate"}
    for v in by["verdict.issued"]:
        if v["timing_event_id"]:
            assert len(timings[v["patch_id"]]["candidate_s"]) == 2
    for adv in by.get("best.advanced", []):  # a promotion teaches memory something
        assert any(e["evidence"][-1] for e in by.get("memory.entry.proposed", [])), adv
    # Every promotion is profiled before its verdict (the next wave's plan reads the latest profile).
    for t, _, p in events:
        if t == "best.advanced":
            verdict = next(i for i, (u, _, q) in enumerate(events)
                           if u == "verdict.issued" and q["patch_id"] == p["patch_id"])
            assert any(u == "profile.measured" and q["system_commit"] == p["commit"] and q["options"] == p["options"]
                       for u, _, q in events[:verdict]), f"no profile of {p['commit']} {p['options']} before its verdict"
    for e in by.get("memory.entry.proposed", []):  # against the stock the controller registered
        assert "engine/options.py" in e["stock_files"] and "engine/options.py" in e["source_files"]
        assert all(p.startswith(("engine/", "kernels/")) for p in e["stock_files"])
    final = by["sealed.final.reported"][0]
    assert {"ar", "stock", "final"} <= set(final["results"]) and final["lossless"] is True
    summary = by["round.finished"][0]["summary"]
    assert summary["headline"]["lossless"] is True and summary["headline"]["stock_over_ar"] > 0
    assert len(summary["candidates"]) == len(patches)
    return by


# An LLM planner (the real Anthropic SDK against the local wire server) plans one sweep a wave.
PLANS = [Turn("", [Call("plan", {"directions": [{"title": "shorter chains", "factor": "tau", "option": "block_size",
                                                 "values": [2]}]})]),
         Turn("", [Call("plan", {"directions": [{"title": "verify trees", "factor": "tau", "option": "verify",
                                                 "values": ["tree"]}]})])]


def test_a_round_tells_its_whole_story_and_replays(server):
    with ScriptedServer(PLANS) as llm:
        procs = _start(server, master_env={"ANTHROPIC_API_KEY": "sk-test", "ANTHROPIC_BASE_URL": llm.url})
        try:
            round_id = _start_round(server, planner="anthropic:claude-test")
            _wait_for(server, round_id, "round.finished", timeout=600)
            by = _check_story(_events(server, round_id))
            system = _request(server, subjects.RPC_SYSTEM, {"deployment": "tiny-cpu"})
        finally:
            _stop(procs)
        sent = llm.bodies("/v1/messages")
    # the planner was told the evidence: the second wave's knows the first wave's verdict
    assert len(sent) == 2 and '"tried": []' in sent[0]["system"] and "shorter chains" in sent[1]["system"]
    assert [(d["title"], d["evidence"]["deployment"]["deployment"]) for d in by["direction.planned"]] == [
        ("shorter chains", "tiny-cpu"), ("verify trees", "tiny-cpu")]
    assert by["direction.planned"][1]["evidence"]["tried"][0]["options"]["block_size"] == 2
    used = by["conversation.used"]
    assert [(u["purpose"], u["turns"], u["ended"]) for u in used] == [("planner", 1, "finished")] * 2
    # the controller hands out its best as code: its diff rebuilds exactly its trees on this host's stock
    last = by["best.advanced"][-1] if by.get("best.advanced") else None
    assert system["commit"] == (last["commit"] if last else "") and system["options"] == (last["options"] if last else {})
    ws = build_workspace(REPO, [("best", system["diff"])] if system["diff"] else [], dest=server.data / "ws",
                         trees=system["trees"])
    assert set(system["trees"]) == {"engine", "kernels"} and ws.is_dir()
    led = ledger.Ledger(server.data, read_only=True)
    try:
        res = ledger.verify(led)
    finally:
        led.close()
    assert res.ok and res.projections_match


@pytest.mark.long  # the same kills run in CI across hosts: tests/backbone/test_separate_hosts.py
def test_a_round_survives_sigkilled_master_and_controller(server):
    procs = _start(server)
    try:
        round_id = _start_round(server)
        _wait_for(server, round_id, "direction.planned", timeout=300)
        for name in ("master", "controller"):
            procs[name].send_signal(signal.SIGKILL)
            procs[name].wait()
        time.sleep(1.0)
        procs["master"] = spawn_service(server, "master")
        procs["controller"] = spawn_service(server, "controller", extra=CONTROLLER_FLAGS)
        wait_for_services(server, {"master", "controller"}, timeout=120)
        _wait_for(server, round_id, "round.finished", timeout=700)
        _check_story(_events(server, round_id))
    finally:
        _stop(procs)
