"""Where the controller's events go, and where its history comes from: one interface, two places.

`BusEmitter` publishes on NATS (the services' way: the memory service records every event in the ledger,
and `history` reads the ledger back through `specpilot.reads`), waiting out a server outage however long
(a decision is never dropped for one); `emit_together` publishes one atomic batch and says whether the
server stored it now or already held those ids (an earlier decision stands). `LocalEmitter` is `specpilot time`'s:
no bus, so it stamps each event itself and appends it to the local log ``DATA/controller/<LOCAL_LOG>``,
and `history` reads that log back. The controller folds `history` into its state at start-up
(`state.fold`) and each emitted event afterwards, whichever emitter it has.
"""

from __future__ import annotations

from pathlib import Path

from specpilot import bus, schema
from specpilot.reads import Reads
from specpilot.services.controller.state import LOCAL_LOG, RESTORED_FROM

SOURCE = "controller"


class BusEmitter:
    def __init__(self, b: bus.Bus):
        self.bus = b
        self.reads = Reads.over(b, retry=False)  # the controller decides itself whether to retry

    async def emit(self, event: schema.Event, cause: schema.Event) -> schema.Event:
        stamped, _ = await self.bus.publish(event, cause=cause, deadline_s=float("inf"))
        return stamped

    async def emit_together(self, events: list[schema.Event], cause: schema.Event) -> tuple[list[schema.Event], bool]:
        return await self.bus.publish_together(events, cause=cause, deadline_s=float("inf"))

    async def history(self) -> list[schema.Event]:
        """The events the state folds, from the ledger: only noise timings, not every candidate's samples
        (the fold keeps one value per kind and key, so the two queries' order does not matter)."""
        others = [k for k in RESTORED_FROM if k is not schema.TimingMeasured]
        return [*await self.reads.events(*others), *await self.reads.events(schema.TimingMeasured, kind="noise")]


class LocalEmitter:
    def __init__(self, data: Path):
        self.log = Path(data) / "controller" / LOCAL_LOG
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.reads = Reads.none()  # no ledger: nothing was decided by the services

    async def emit(self, event: schema.Event, cause: schema.Event) -> schema.Event:
        stamped = schema.stamp(event, source=SOURCE, event_id=schema.mint(SOURCE, event.event_id),
                               causation_id=event.causation_id or cause.event_id, round_id=cause.round_id,
                               deployment=cause.deployment, correlation_id=cause.correlation_id or cause.event_id)
        with self.log.open("a") as f:
            f.write(schema.encode(stamped).decode() + "\n")
        return stamped

    async def emit_together(self, events: list[schema.Event], cause: schema.Event) -> tuple[list[schema.Event], bool]:
        return [await self.emit(e, cause) for e in events], True  # one process, one file: none in between

    async def history(self) -> list[schema.Event]:
        if not self.log.exists():
            return []
        return [schema.decode(line.encode()) for line in self.log.read_text().splitlines() if line.strip()]
