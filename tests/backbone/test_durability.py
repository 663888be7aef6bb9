"""Crash tests over a real nats-server: the recorder SIGKILLed ≥20 times while 10,000 events are
published, the ack-before-commit variant losing events under the same harness, and a broker crash."""

import asyncio
import random
import signal
import time

import pytest

from specpilot import ledger
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
