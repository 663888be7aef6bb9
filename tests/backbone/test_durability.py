"""Crash tests over a real nats-server: the recorder SIGKILLed ≥20 times while 10,000 events are
published, the ack-before-commit variant losing events under the same harness, and a broker crash."""

import asyncio
import os
import random
import signal
import subprocess
import time

import pytest

from specpilot import ledger, schema, subjects
from specpilot.services.memory import main as memory_main
from tests.backbone.helpers import directions, publish_all, sql, wait_for_rows
from tests.conftest import connect_as, spawn_service, wait_for_services

N_EVENTS = 10_000
N_KILLS = 20


async def _publish_paced(server, n: int, seconds: float) -> list[str]:
    master = await connect_as(server, "master")
    events = directions(n)
    ids: list[str] = []
    chunk = 100
    pause = seconds / (n / chunk)
    for i in range(0, n, chunk):
        ids += await publish_all(master, events[i:i + chunk])
        await asyncio.sleep(pause)
    await master.close()
    return ids


async def _kill_repeatedly(server, module: str, kills: int, rng: random.Random) -> None:
    for _ in range(kills):
        proc = spawn_service(server, "memory", module=module)
        await asyncio.sleep(rng.uniform(0.8, 1.6))  # start-up takes ~0.7 s; then kill mid-batch
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _crash_run(server, module: str, seed: int, settle_s: float = 60) -> tuple[set[str], list]:
    rng = random.Random(seed)

    async def go():
        publisher = asyncio.create_task(_publish_paced(server, N_EVENTS, seconds=N_KILLS * 1.0))
        await _kill_repeatedly(server, module, N_KILLS, rng)
        ids = await publisher
        final = spawn_service(server, "memory", module=module)
        await wait_for_rows(server, "SELECT count(*) FROM events", N_EVENTS, timeout=settle_s)
        await asyncio.sleep(1.0)  # anything still redelivering would show up as a duplicate now
        rows = await sql(server, "SELECT event_id FROM events")
        final.terminate()
        final.wait(timeout=30)
        return set(ids), rows

    return asyncio.run(go())


@pytest.mark.slow
def test_sigkilled_recorder_loses_and_duplicates_nothing(server):
    ids, rows = _crash_run(server, "specpilot.services.memory", seed=1)
    recorded = [r[0] for r in rows]
    assert len(ids) == N_EVENTS
    assert len(recorded) == len(set(recorded)), "duplicated events"
    assert set(recorded) == ids, f"lost {len(ids - set(recorded))} events"
    led = ledger.Ledger(server.data, read_only=True)
    res = ledger.verify(led)
    led.close()
    assert res.ok and res.projections_match and res.rows == N_EVENTS


@pytest.mark.slow
def test_ack_before_commit_loses_events_under_the_same_harness(server):
    ids, rows = _crash_run(server, "tests.backbone.unsafe_memory", seed=1, settle_s=15)
    lost = ids - {r[0] for r in rows}
    assert lost, "the crash harness failed to expose ack-before-commit"


@pytest.mark.slow
def test_broker_crash_during_publishing(server):
    async def go():
        recorder = spawn_service(server, "memory")
        await asyncio.to_thread(wait_for_services, server, {"memory"})
        master = await connect_as(server, "master")
        events = directions(3000)
        ids: list[str] = []

        killed_at = []

        async def crash():
            await asyncio.sleep(0.8)
            server.kill(signal.SIGKILL)
            killed_at.append(time.monotonic())
            await asyncio.sleep(1.0)
            return server.restart()

        crasher = asyncio.create_task(crash())
        for i in range(0, len(events), 50):
            ids += await publish_all(master, events[i:i + 50])
            await asyncio.sleep(0.02)
        published_at = time.monotonic()
        restarted = await crasher
        assert killed_at and killed_at[0] < published_at  # the broker died while events were being published
        await master.close()
        assert await wait_for_rows(restarted, "SELECT count(*) FROM events", len(events), timeout=60) == len(events)
        await asyncio.sleep(1.0)
        rows = await sql(restarted, "SELECT event_id FROM events")
        recorder.terminate()
        recorder.wait(timeout=30)
        restarted.stop()
        return ids, [r[0] for r in rows]

    ids, recorded = asyncio.run(go())
    assert len(recorded) == len(set(recorded)) == len(ids)
    assert set(recorded) == set(ids)


def _fill(disk) -> None:
    """Write one file until ``disk`` has no byte left."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError:
            pass


async def _recording_state(server) -> str:
    b = await connect_as(server, "master")
    try:
        found = [s for s in await b.discover() if s.get("name") == "memory"]
        return (found[0].get("metadata") or {}).get("recording", "") if found else "not answering"
    finally:
        await b.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs: the ledger's disk, to fill. Mounting needs root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_pauses_recording_and_space_resumes_it_losing_nothing(server, small_disk):
    """The ledger on a disk that fills: the recorder neither crashes nor drops a batch; it says it is paused
    (discovery, `specpilot status`), the events wait in the stream, and when space returns every one is
    recorded once, by the same process, with the hash chain whole."""
    memory = spawn_service(server, "memory", extra=["--data", str(small_disk)])
    try:
        wait_for_services(server, {"memory"})

        async def go():
            first = await publish_all(await connect_as(server, "master"), directions(20, "before"))
            assert await wait_for_rows(server, "SELECT count(*) FROM events", 20) == 20
            _fill(small_disk)
            master = await connect_as(server, "master")
            later = [schema.DirectionPlanned(direction_id=f"full-{i}", title="x" * 4000) for i in range(400)]
            ids = await publish_all(master, later)  # the stream takes them: its store is on another disk
            await master.close()
            deadline = time.monotonic() + 30
            while not (state := await _recording_state(server)).startswith("paused") and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert state.startswith("paused: disk full"), state
            await asyncio.sleep(3 * memory_main.FULL_RETRY_S)
            assert memory.poll() is None, "the recorder crashed on a full disk"
            assert (await sql(server, "SELECT count(*) FROM events"))[0][0] < 420  # reads still answer
            (small_disk / "filler").unlink()
            assert await wait_for_rows(server, "SELECT count(*) FROM events", 420, timeout=60) == 420
            recorded = {r[0] for r in await sql(server, "SELECT event_id FROM events")}
            assert recorded == set(first) | set(ids)
            assert await _recording_state(server) == "running"
            b = await connect_as(server, "admin")
            assert (await b.request(subjects.RPC_REPLAY, {}, timeout=60))["ok"]
            await b.close()

        asyncio.run(go())
        assert memory.poll() is None  # one process throughout: no crash loop
        log = (server.data / "memory.log").read_text()
        assert "recording paused: the disk of" in log and "recording resumed after" in log
    finally:
        memory.terminate()
        memory.wait(timeout=20)
