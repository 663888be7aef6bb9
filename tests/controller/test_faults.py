"""Faults injected into a decision (issue 53 item 5), over a real nats-server, memory service and controller
process on the tiny deployment: a controller SIGKILLed just before and just after a decision's atomic
publish, the memory service down while the controller decides, and the NATS server gone for 90 s while
a patch is timed. Each ends with the patch decided exactly once, its promotion advanced (a
``BestAdvanced`` and a memory entry with the verdict, never one without the other), nothing timed or
tested twice in the ledger, and the stream equal to the ledger message by message.

The controller here (`tests.controller.faulty_controller`) promotes whatever it decides, so that every
decision has consequences to lose; the fault fires once and a restart of the same command runs clean,
as a supervisor (systemd, compose) would restart it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from specpilot import schema
from specpilot.sandbox import bwrap_available
from tests.backbone.helpers import sql
from tests.conftest import REPO, connect_as, spawn_service, wait_for_services

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")]

FLAGS = ["--trials", "2", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "120", "--threads", "1"]
DECISION_TYPES = ("verdict.issued", "best.advanced", "memory.entry.proposed", "patch.tested")


def _controller(server, marker, fault: str) -> subprocess.Popen:
    return spawn_service(server, "controller", module="tests.controller.faulty_controller",
                         extra=[*FLAGS, "--fault", fault, "--marker", str(marker)])


def _propose(server, patch_id: str) -> None:
    async def go():
        sub = await connect_as(server, "subagent")
        await sub.publish(schema.PatchProposed(direction_id="d", patch_id=patch_id, diff="", deployment="tiny-cpu",
                                               options={"block_size": 5}))
        await sub.close()
    asyncio.run(go())


def _count(server, query: str) -> int:
    try:
        return asyncio.run(sql(server, query, timeout=10))[0][0]
    except Exception:  # noqa: BLE001  memory or the server is down: not there yet
        return -1


def _wait(what: str, done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def _mine(patch_id: str) -> str:
    """SQL: the events of a patch (its memory entry names no patch: its id derives from it)."""
    return (f"(json_extract_string(payload, '$.patch_id') = '{patch_id}' "
            f"OR event_id = 'controller:entry-{patch_id}')")


def _of(patch_id: str, types: tuple[str, ...]) -> str:
    listed = ", ".join(f"'{t}'" for t in types)
    return f"SELECT count(*) FROM events WHERE type IN ({listed}) AND {_mine(patch_id)}"


def _decided_once(server, patch_id: str) -> None:
    """Exactly one verdict, a promotion with its ``BestAdvanced`` and entry, no event of the patch twice, and
    the stream equal to the ledger, message by message (`specpilot replay --stream`)."""
    rows = asyncio.run(sql(server, f"SELECT type, count(*), count(DISTINCT event_id) FROM events WHERE {_mine(patch_id)} "
                                   "GROUP BY type"))
    counts = {t: n for t, n, _ in rows}
    assert all(n == distinct for _, n, distinct in rows), rows
    assert {t: counts.get(t, 0) for t in DECISION_TYPES} == dict.fromkeys(DECISION_TYPES, 1), counts
    timings = asyncio.run(sql(server, "SELECT event_id FROM events WHERE type = 'timing.measured' AND "
                                      f"json_extract_string(payload, '$.patch_id') = '{patch_id}'"))
    assert timings and len(timings) == len({r[0] for r in timings})
    decision = asyncio.run(sql(server, "SELECT json_extract_string(payload, '$.decision') FROM events WHERE "
                                       f"type = 'verdict.issued' AND json_extract_string(payload, '$.patch_id') = "
                                       f"'{patch_id}'"))
    assert decision == [["promote"]]
    res = subprocess.run([sys.executable, "-m", "specpilot.app.cli", "replay", "--stream", "--json", "--data", str(server.data),
                          "--nats", server.url], capture_output=True, text=True, cwd=REPO, timeout=300)
    replay = json.loads(res.stdout)
    assert res.returncode == 0 and replay["ok"] and replay["stream"]["ok"], (replay, res.stderr[-2000:])


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def _said(server, line: str) -> bool:
    return line in (server.data / "controller.log").read_text(errors="replace")


def test_a_controller_killed_before_its_decision_decides_once_after_the_restart(server, tmp_path):
    """SIGKILLed just before the decision's publish: nothing of it is recorded; the restarted controller gets
    the patch again, times it again (the timings' ids are the first run's: recorded once) and decides."""
    marker, fault = tmp_path / "fired", "kill-before-decision"
    procs = [spawn_service(server, "memory"), _controller(server, marker, fault)]
    try:
        wait_for_services(server, {"memory", "controller"}, timeout=120)
        _propose(server, "p-kill")
        _wait("the fault", lambda: procs[1].poll() is not None, timeout=400)
        assert procs[1].returncode == -signal.SIGKILL and marker.read_text() == fault
        assert _count(server, _of("p-kill", ("verdict.issued", "best.advanced", "memory.entry.proposed"))) == 0
        procs[1] = _controller(server, marker, fault)  # the supervisor's restart: runs clean
        _wait("the decision", lambda: _count(server, _of("p-kill", ("memory.entry.proposed",))) >= 1, timeout=400)
        time.sleep(3.0)  # a second decision, if one were made, would be recorded by now
        _decided_once(server, "p-kill")
    finally:
        _stop(*procs)


def test_memory_down_while_the_controller_decides_and_a_kill_after_its_decision(server, tmp_path):
    """Memory is killed once the patch is being timed and stays down while the controller decides; the
    controller is SIGKILLed just after its decision's publish (the verdict, ``BestAdvanced`` and entry are in
    the stream together) and restarts, waiting for the ledger before it decides anything. When memory
    returns, the redelivered patch is found decided and skipped: one decision, its promotion advanced."""
    marker = tmp_path / "fired"
    memory = spawn_service(server, "memory")
    ctl = _controller(server, marker, "kill-after-decision")
    try:
        wait_for_services(server, {"memory", "controller"}, timeout=120)
        _propose(server, "p-memory")
        _wait("a timing", lambda: _count(server, _of("p-memory", ("patch.tested",))) >= 1, timeout=400)
        memory.send_signal(signal.SIGKILL)
        memory.wait()
        _wait("the decision and its kill", lambda: ctl.poll() is not None, timeout=400)
        assert ctl.returncode == -signal.SIGKILL
        ctl = _controller(server, marker, "none")
        time.sleep(5.0)  # the restarted controller waits for the ledger; nothing may be decided meanwhile
        memory = spawn_service(server, "memory")
        _wait("the decision recorded", lambda: _count(server, _of("p-memory", ("best.advanced",))) >= 1, timeout=120)
        _wait("the redelivery skipped", lambda: _said(server, "patch p-memory already has a verdict"), timeout=180)
        time.sleep(3.0)
        _decided_once(server, "p-memory")
    finally:
        _stop(memory, ctl)


def test_a_90_second_nats_outage_mid_timing(server, tmp_path):
    """The NATS server is SIGKILLed while the patch is timed and comes back 90 s later (past the 60 s after
    which the controller's work task used to die): the services reconnect, and the patch is decided once."""
    marker = tmp_path / "fired"
    procs = [spawn_service(server, "memory"), _controller(server, marker, "none")]
    try:
        wait_for_services(server, {"memory", "controller"}, timeout=120)
        _propose(server, "p-outage")
        _wait("a timing", lambda: _count(server, _of("p-outage", ("patch.tested",))) >= 1, timeout=400)
        server.kill(signal.SIGKILL)
        time.sleep(90.0)
        restarted = server.restart()
        server.pid, server.proc = restarted.pid, restarted.proc  # the fixture stops what runs now
        assert restarted.url == server.url
        _wait("the decision", lambda: _count(restarted, _of("p-outage", ("memory.entry.proposed",))) >= 1,
              timeout=400)
        assert all(p.poll() is None for p in procs), "a service died in the outage"
        time.sleep(3.0)
        _decided_once(restarted, "p-outage")
    finally:
        _stop(*procs)
