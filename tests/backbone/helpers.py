"""Helpers for backbone tests: publishing, querying the ledger through the memory service."""

from __future__ import annotations

import asyncio
import time

from specpilot import bus, natsd, schema, subjects
from tests.conftest import connect_as


async def publish_all(b: bus.Bus, events: list[schema.Event], in_flight: int = 200) -> list[str]:
    """Publish with many in flight; returns the stamped event ids."""
    ids: list[str] = []
    for i in range(0, len(events), in_flight):
        done = await asyncio.gather(*(b.publish(e) for e in events[i:i + in_flight]))
        ids.extend(e.event_id for e, _ in done)
    return ids


def directions(n: int, prefix: str = "d") -> list[schema.Event]:
    return [schema.DirectionPlanned(direction_id=f"{prefix}-{i}", title=f"direction {i}") for i in range(n)]


async def sql(srv: natsd.LocalServer, query: str, timeout: float = 30) -> list[list]:
    b = await connect_as(srv, subjects.ADMIN)
    try:
        return (await b.request(subjects.RPC_SQL, {"query": query}, timeout=timeout))["rows"]
    finally:
        await b.close()


async def wait_for_rows(srv: natsd.LocalServer, query: str, expect: int, timeout: float = 60) -> int:
    """Poll ``query`` (a single count) until it reaches ``expect``; returns the last value."""
    deadline = time.monotonic() + timeout
    value = -1
    while time.monotonic() < deadline:
        try:
            value = (await sql(srv, query, timeout=5))[0][0]
        except bus.BusError:
            value = -1  # memory is (re)starting
        if value >= expect:
            return value
        await asyncio.sleep(0.2)
    return value
