"""The forcer service: token forcing of a system's outputs through the stock target (I/O only).

Loop: take the next event from the forcer's durable consumer (filtered on controller events).
A ``ForcingRequested`` is forced in a worker thread against the stock engine of
``event.deployment`` (``specpilot.harness.deployment.load_engine(deployment)`` with default options, loaded once per
deployment and kept), while the loop tells the server every ``HEARTBEAT_S`` that the message is in
progress. The ``ForcingReported`` (``cause=event``) is published, **then** the request is acked: a
crash in between redelivers the request, and the report's id is derived from the request's
(`forcing_rules.report_event_id`), so the republished report is absorbed as a duplicate. A request that
cannot be forced (unknown deployment, malformed outputs, no outputs) is answered with
``passed=False`` and a reason, never left unanswered. Other controller events are acked and
ignored. If publishing fails, the request is not acked and comes back.

The rules live in `specpilot.forcing_rules` and the model work in `specpilot.harness.forcing`; tests call those
directly.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from specpilot import bus, forcing_rules, schema, service
from specpilot.harness import forcing

NAME = "forcer"
DESCRIPTION = "Token forcing of a system's outputs through the stock target."
HEARTBEAT_S = 10.0  # well inside the consumer's ack wait (60 s)
log = logging.getLogger(NAME)


class Worker:
    """The synchronous work of one request (stock engines are loaded once per deployment and kept)."""

    def __init__(self, data_dir: Path | None):
        self.data_dir = data_dir

    def answer(self, request: schema.ForcingRequested) -> dict:
        """The ForcingReported fields for one request; every failure becomes a failed verdict."""
        from specpilot.harness.deployment import DEFAULT_DEPLOYMENT

        try:
            return forcing.force_outputs(request.deployment or DEFAULT_DEPLOYMENT, request.outputs, self.data_dir)
        except (ValueError, FileNotFoundError) as exc:  # a bad request: unknown deployment, malformed outputs
            log.warning("cannot force request %s: %s", request.request_id, exc)
            return forcing_rules.failed(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a request we cannot force is answered, not dropped
            log.exception("forcing request %s failed", request.request_id)
            return forcing_rules.failed(f"{type(exc).__name__}: {exc}")


async def handle(b: bus.Bus, worker: Worker, event: schema.Event, delivery: bus.Delivery) -> None:
    if not isinstance(event, schema.ForcingRequested):
        await delivery.ack()
        return
    log.info("forcing request %s (%d outputs, %s)", event.request_id, len(event.outputs), event.deployment)
    work = asyncio.create_task(asyncio.to_thread(worker.answer, event))
    while True:
        done, _ = await asyncio.wait({work}, timeout=HEARTBEAT_S)
        if done:
            break
        await delivery.in_progress()
    fields = work.result()
    reported, _ = await b.publish(forcing_rules.report(event, fields), cause=event)
    await delivery.ack()
    log.info("request %s: %s (%s)", event.request_id, "passed" if fields["passed"] else "rejected",
             reported.event_id)


def make(cfg: service.ServiceConfig):
    worker = Worker(cfg.data)

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async for event, delivery in b.consume(stop, batch=1):
                    await handle(b, worker, event, delivery)
            except (bus.BusError, ConnectionError) as exc:
                log.warning("bus trouble, retrying: %s", exc)
                await asyncio.sleep(0.5)

    return body, {}


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, make, argv=argv)
