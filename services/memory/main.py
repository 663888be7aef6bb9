"""The memory service: the only DuckDB writer.

It records every event exactly once: fetch a batch from its durable consumer, decide (``logic``),
append the batch in one transaction, commit, **then** ack. A crash between commit and ack causes a
redelivery that the primary key absorbs; acking first would lose events. It also serves the
ledger read-only over NATS micro endpoints (``events`` and ``view``: the typed reads of
`specpilot.reads`, the latter from the live projections it folds as it records; ``sql``, ``audit``,
``replay``, ``export``, ``entries``).

Memory entries: every recorded ``MemoryEntryProposed`` without a decision is validated
(``entries.validate``: its stock, from the snapshot store ``DATA/memory/stock`` that the service files
its checkout's runtime into at start-up, + delta must reproduce the source system's files) and answered with
``MemoryEntryAccepted``/``Rejected`` under a fixed event id, so a crash between the check and the
answer repeats the check and the answer is recorded once. ``entries`` serves the accepted entries
whose requirements hold for the facts in the request. ``import`` (admin) takes entries exported from
another data directory (`specpilot memory import`: their stock files already in the store) and
proposes each one not known here as memory's own ``MemoryEntryProposed`` (``origin``, the evidence
events carried inside): it is validated like any other, never trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import msgspec

from specpilot import bus, entries, ledger, projections, reads, schema, service, subjects
from specpilot.services.memory import logic

NAME = "memory"
DESCRIPTION = "Sole ledger writer: records every event once, serves read-only SQL and memory entries."
BATCH = 2000
FULL_RETRY_S = 2.0  # how often a recorder paused on a full disk tries its batch again
log = logging.getLogger(NAME)


def entries_with_status(led: ledger.Ledger, state: projections.State, status: str) -> list[schema.Event]:
    """Proposed memory entries whose status (`projections.EntryView`: proposed, accepted, rejected) is
    ``status``, in recording order."""
    ids = [k for k, row in state.view("memory_entries").items() if row.status == status]
    return led.select(reads.query(schema.MemoryEntryProposed, entry_id=ids)) if ids else []  # type: ignore[return-value]


class Recorder:
    """Fetch → classify → append+commit → ack. ``record`` keeps that order; tests subclass it."""

    def __init__(self, led: ledger.Ledger, b: bus.Bus, projection: projections.State | None = None,
                 store: Path | None = None, announced: dict[str, str] | None = None):
        """``projection``: the live projections, shared with the ``view`` endpoint (read from the ledger
        when not given); ``store``: the stock snapshot store (None: entries are checked against this
        host's checkout, as before snapshots existed); ``announced``: the service's discovery metadata,
        where ``recording`` says whether it records or is paused (`specpilot status`)."""
        self.ledger = led
        self.bus = b
        self.projection = projection if projection is not None else led.projections()
        self.store = store
        self.announced = announced if announced is not None else {}
        self.announced["recording"] = "running"

    async def step(self, timeout: float = 0.5) -> int:
        deliveries = await self.bus.fetch(batch=BATCH, timeout=timeout)
        if deliveries:
            await self.record(deliveries)
            if any(d.subject.endswith(".memory.entry.proposed") for d in deliveries):
                await self.review_entries()
        return len(deliveries)

    async def review_entries(self) -> None:
        """Decide every proposed entry that has no decision in the ledger yet."""
        for entry in entries_with_status(self.ledger, self.projection, "proposed"):
            problem = await asyncio.to_thread(entries.validate, entry.delta, entry.source_files,  # type: ignore[attr-defined]
                                              stock_files=entry.stock_files, store=self.store)  # type: ignore[attr-defined]
            decision_id = f"entry-decision-{entry.entry_id}"  # type: ignore[attr-defined]
            if problem:
                log.warning("memory entry %s rejected: %s", entry.entry_id, problem)  # type: ignore[attr-defined]
                decision: schema.Event = schema.MemoryEntryRejected(event_id=decision_id, entry_id=entry.entry_id,  # type: ignore[attr-defined]
                                                                     reason=problem)
            else:
                decision = schema.MemoryEntryAccepted(event_id=decision_id, entry_id=entry.entry_id)  # type: ignore[attr-defined]
            await self.bus.publish(decision, cause=entry)

    async def record(self, deliveries: list[bus.Delivery]) -> None:
        plan = logic.classify(deliveries)
        await self.commit_when_there_is_room(plan, deliveries)
        await self.acknowledge(plan)

    async def commit_when_there_is_room(self, plan: logic.Plan, deliveries: list[bus.Delivery]) -> None:
        """Commit ``plan``. While the ledger's disk is full, recording pauses instead of crashing: the batch
        is held unacknowledged (the stream is told it is in progress, so nothing is redelivered or lost),
        the pause is logged once and announced (`specpilot status`), and the batch is tried again every
        `FULL_RETRY_S` until space returns; then recording resumes where it stopped."""
        paused_at = None
        while True:
            try:
                self.commit(plan)
            except ledger.LedgerFull as exc:
                if paused_at is None:
                    paused_at = time.monotonic()
                    log.error("recording paused: %s. Free space on that disk: the events wait in the stream and "
                              "recording resumes by itself", exc)
                    self.announced["recording"] = f"paused: disk full since {time.strftime('%H:%M:%S')}"
                for d in deliveries:
                    with contextlib.suppress(bus.BusError):
                        await d.in_progress()
                await asyncio.sleep(FULL_RETRY_S)
                continue
            if paused_at is not None:
                log.warning("recording resumed after %.0f s paused on a full disk", time.monotonic() - paused_at)
                self.announced["recording"] = "running"
            return

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
        if self.store is not None:  # this checkout's runtime is the stock the controller registers next
            added = await asyncio.to_thread(entries.snapshot, self.store)
            log.info("stock snapshot store %s: %d new file(s) from this checkout", self.store, added)
        reviewed = False
        while not stop.is_set():
            if not reviewed:  # entries proposed before a crash are decided now
                with contextlib.suppress(bus.BusError):
                    await self.review_entries()
                    reviewed = True
            try:
                await self.step()
            except (bus.BusError, ConnectionError) as exc:
                log.warning("bus trouble, retrying: %s", exc)
                await asyncio.sleep(0.5)


async def rebuild(led: ledger.Ledger, messages) -> int:
    """Record a whole stream into an empty ledger the way `Recorder` records (classify, then append in
    batches of `BATCH` with the projections), without acks: what ``specpilot replay --rebuild`` runs.
    ``messages`` yields ``(seq, subject, raw bytes)``; returns how many were read."""
    recorder = Recorder(led, None)  # type: ignore[arg-type]  # no bus: nothing to ack
    n, batch = 0, []
    async for seq, subject, raw in messages:
        batch.append(bus.Delivery(subject=subject, data=raw, seq=seq, num_delivered=bus.DECODE_ATTEMPTS, _msg=None))
        if len(batch) >= BATCH:
            recorder.commit(logic.classify(batch, legacy_ids=True))
            n, batch = n + len(batch), []
    if batch:
        recorder.commit(logic.classify(batch, legacy_ids=True))
    return n + len(batch)


def stock_store(data: Path) -> Path:
    """Where the memory service of data directory ``data`` keeps stock snapshots (content-addressed)."""
    return Path(data) / "memory" / "stock"


def imported(entry: dict, evidence: list[dict], origin: str, known: set[str]) -> schema.MemoryEntryProposed | None:
    """The ``MemoryEntryProposed`` memory records for one exported entry (None when its id is known here).
    The id derives from the entry's, so importing twice records it once."""
    try:
        original = msgspec.convert(entry, schema.MemoryEntryProposed)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a memory entry: {exc}") from None
    if original.entry_id in known:
        return None
    return msgspec.structs.replace(original, event_id=f"{schema.MEMORY}:imported-{original.entry_id}", ts_ns=time.time_ns(),
                                   source=schema.MEMORY, round_id="", causation_id="", correlation_id="",
                                   origin=origin or original.origin, imported_evidence=list(evidence))


def endpoints(led: ledger.Ledger, state: projections.State, bus_of=lambda: None) -> dict:
    """The memory service's RPCs; ``state`` is the recorder's live projections; ``bus_of()`` the service's
    bus once it is connected (imports are published on it, so they are recorded like any event)."""
    async def off_the_recorder(read):
        """``read(reader)`` in a worker thread over a cursor of its own: the recorder (this event loop, the
        ledger's connection) never waits on a reader (docs/DESIGN.md §2, "Reads")."""
        def run():
            reader = led.reader()
            try:
                return read(reader)
            finally:
                reader.close()
        return await asyncio.to_thread(run)

    async def sql(req: dict) -> dict:
        return await off_the_recorder(lambda r: r.query_readonly(str(req.get("query", ""))))

    async def audit(req: dict) -> dict:
        return await off_the_recorder(
            lambda r: {"events": [schema.encode(e).decode() for e in r.audit(str(req.get("event_id", "")))]})

    async def replay(req: dict) -> dict:
        return ledger.verify(led).as_dict()

    async def export(req: dict) -> dict:
        return {"files": [str(p) for p in led.export_parquet(Path(str(req["dir"])))]}

    async def events(req: dict) -> dict:
        try:
            q = msgspec.convert(req, reads.EventQuery)
        except msgspec.ValidationError as exc:
            raise ValueError(f"not an event query: {exc}") from None
        return await off_the_recorder(lambda r: reads.reply_for(r, q))

    async def view(req: dict) -> dict:
        try:
            return reads.view_reply(state, msgspec.convert(req, reads.ViewQuery))
        except msgspec.ValidationError as exc:
            raise ValueError(f"not a view query: {exc}") from None

    async def accepted(req: dict) -> dict:
        facts = req.get("facts") or {}
        found = [e for e in entries_with_status(led, state, "accepted")
                 if entries.matches(e.requirements, facts)]  # type: ignore[attr-defined]
        return {"entries": [msgspec.to_builtins(e) for e in found]}

    async def import_entries(req: dict) -> dict:
        b = bus_of()
        if b is None:
            raise ValueError("the memory service is not connected yet; try again")
        known = set(state.view("memory_entries"))
        proposed = [e for item in req.get("entries") or []
                    if (e := imported(item.get("entry") or {}, item.get("evidence") or [], str(req.get("origin", "")),
                                      known)) is not None]
        if proposed:
            await b.publish_many(proposed)
        return {"imported": [e.entry_id for e in proposed],
                "known": [str((item.get("entry") or {}).get("entry_id")) for item in req.get("entries") or []
                          if (item.get("entry") or {}).get("entry_id") in known]}

    return {subjects.RPC_SQL: sql, subjects.RPC_AUDIT: audit, subjects.RPC_REPLAY: replay, subjects.RPC_EXPORT: export,
            subjects.RPC_ENTRIES: accepted, subjects.RPC_EVENTS: events, subjects.RPC_VIEW: view,
            subjects.RPC_IMPORT: import_entries}


def make(cfg: service.ServiceConfig, recorder_cls: type[Recorder] = Recorder):
    led = ledger.Ledger(cfg.data)
    state = led.projections()
    connected: list[bus.Bus] = []

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        connected.append(b)
        await recorder_cls(led, b, state, stock_store(cfg.data), cfg.announced).run(stop)

    return body, endpoints(led, state, lambda: connected[-1] if connected else None)


def main(argv: list[str] | None = None, recorder_cls: type[Recorder] = Recorder) -> None:
    service.main(NAME, DESCRIPTION, lambda cfg: make(cfg, recorder_cls), argv=argv)
