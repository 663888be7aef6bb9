"""The memory service: the only DuckDB writer.

It records every event exactly once: fetch a batch from its durable consumer, decide (``logic``),
append the batch in one transaction, commit, **then** ack. A crash between commit and ack causes a
redelivery that the primary key absorbs; acking first would lose events. It also serves the
ledger read-only over NATS micro endpoints (``sql``, ``audit``, ``replay``, ``export``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from services.memory import logic
from specpilot import bus, ledger, projections, schema, service, subjects

NAME = "memory"
DESCRIPTION = "Sole ledger writer: records every event once, serves read-only SQL and memory entries."
BATCH = 2000
log = logging.getLogger(NAME)


class Recorder:
    """Fetch → classify → append+commit → ack. ``record`` keeps that order; tests subclass it."""

    def __init__(self, led: ledger.Ledger, b: bus.Bus):
        self.ledger = led
        self.bus = b
        self.projection = projections.State()
        self.projection.reset_to(led.live_projections())

    async def step(self, timeout: float = 0.5) -> int:
        deliveries = await self.bus.fetch(batch=BATCH, timeout=timeout)
        if deliveries:
            await self.record(deliveries)
        return len(deliveries)

    async def record(self, deliveries: list[bus.Delivery]) -> None:
        plan = logic.classify(deliveries)
        self.commit(plan)
        await self.acknowledge(plan)

    def commit(self, plan: logic.Plan) -> None:
        self.ledger.append(plan.record, plan.dead, self.projection)

    async def acknowledge(self, plan: logic.Plan) -> None:
        for d in plan.finished:
            await d.ack()
        for d in plan.dead_deliveries:
            await d.term()
        for d in plan.retry:
            await d.nak(delay=bus.DECODE_RETRY_DELAY_S)
        await self.bus.flush()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except (bus.BusError, ConnectionError) as exc:
                log.warning("bus trouble, retrying: %s", exc)
                await asyncio.sleep(0.5)


def endpoints(led: ledger.Ledger) -> dict:
    async def sql(req: dict) -> dict:
        return led.query_readonly(str(req.get("query", "")))

    async def audit(req: dict) -> dict:
        return {"events": [schema.encode(e).decode() for e in led.audit(str(req.get("event_id", "")))]}

    async def replay(req: dict) -> dict:
        return ledger.verify(led).as_dict()

    async def export(req: dict) -> dict:
        return {"files": [str(p) for p in led.export_parquet(Path(str(req["dir"])))]}

    return {subjects.RPC_SQL: sql, subjects.RPC_AUDIT: audit, subjects.RPC_REPLAY: replay, subjects.RPC_EXPORT: export}


def make(cfg: service.ServiceConfig, recorder_cls: type[Recorder] = Recorder):
    led = ledger.Ledger(cfg.data)

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        await recorder_cls(led, b).run(stop)

    return body, endpoints(led)


def main(argv: list[str] | None = None, recorder_cls: type[Recorder] = Recorder) -> None:
    service.main(NAME, DESCRIPTION, lambda cfg: make(cfg, recorder_cls), argv=argv)
