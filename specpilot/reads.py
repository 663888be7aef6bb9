"""Typed reads of the ledger: one query shape and one client, schema objects out, no SQL outside the ledger.

`EventQuery` names which events: their classes (tags taken from the schema classes, never spelled by
hand), an envelope filter (deployment, round), payload fields equal to a value or one of several
values (``patch_id``, ``direction_id``, ``kind``, ...), and optionally only the last ``last`` of them,
those after the first ``offset``, or just their count. The memory service answers it on
`subjects.RPC_EVENTS` from the ledger (`specpilot.ledger.Ledger.select`, the one place that turns it
into SQL).

`Reads` is the client every service and command uses: over the bus (``Reads(bus)``, retrying while the
memory service restarts), over an open ledger (``Reads.local(ledger)``: the CLI when no service runs),
or over nothing (``Reads.none()``: nothing recorded yet). Its helpers name what services ask the log
(`best`, `decided`, ...). It holds no state: every answer comes from the ledger, the one source of truth.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from specpilot import schema, subjects

log = logging.getLogger("reads")
FieldValue = str | int | float | bool
RETRY_S = 1.0


class EventQuery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which events (all of them when empty); see the module docstring."""

    types: tuple[str, ...] = ()
    deployment: str | None = None
    round_id: str | None = None
    fields: dict[str, FieldValue | list[FieldValue]] = {}
    last: int = 0  # only the last N (0: all)
    offset: int = 0  # skip the first N (in recording order)
    count: bool = False  # only how many


def tag_of(kind: type[schema.Event]) -> str:
    """The stable tag of an event class (what the ledger's ``type`` column holds)."""
    return kind.__struct_config__.tag  # type: ignore[return-value]


def query(*kinds: type[schema.Event], deployment: str | None = None, round_id: str | None = None, last: int = 0,
          offset: int = 0, count: bool = False, **fields: FieldValue | list[FieldValue]) -> EventQuery:
    """An `EventQuery` from event classes and filters (payload fields as keywords)."""
    return EventQuery(types=tuple(tag_of(k) for k in kinds), deployment=deployment, round_id=round_id,
                      fields=fields, last=last, offset=offset, count=count)


class Reads:
    """Typed questions to the ledger, answered by ``answer(query) -> reply dict`` (see `Reads.over`)."""

    def __init__(self, answer: Callable[[EventQuery], Awaitable[dict[str, Any]]]):
        self._answer = answer

    @classmethod
    def over(cls, b, timeout: float = 30.0, retry: bool = True) -> Reads:
        """Reads through the memory service on bus ``b``; with ``retry`` it waits out a memory restart."""
        from specpilot import bus as bus_module

        async def answer(q: EventQuery) -> dict[str, Any]:
            while True:
                try:
                    return await b.request(subjects.RPC_EVENTS, msgspec.to_builtins(q), timeout=timeout)
                except bus_module.BusError as exc:
                    if not retry or isinstance(exc, bus_module.ServiceError):
                        raise
                    log.warning("ledger read failed, retrying: %s", exc)
                    await asyncio.sleep(RETRY_S)

        return cls(answer)

    @classmethod
    def local(cls, ledger) -> Reads:
        """Reads straight from an open `specpilot.ledger.Ledger` (no service)."""

        async def answer(q: EventQuery) -> dict[str, Any]:
            return reply_for(ledger, q)

        return cls(answer)

    @classmethod
    def none(cls) -> Reads:
        """Reads of an empty ledger (a process with no ledger at all, e.g. `specpilot time` alone)."""

        async def answer(q: EventQuery) -> dict[str, Any]:
            return {"count": 0} if q.count else {"events": []}

        return cls(answer)

    # --- the one query ------------------------------------------------------------------------

    async def events(self, *kinds: type[schema.Event], **filters: Any) -> list[schema.Event]:
        reply = await self._answer(query(*kinds, **filters))
        return [schema.decode(e.encode()) for e in reply["events"]]

    async def count(self, *kinds: type[schema.Event], **filters: Any) -> int:
        return int((await self._answer(query(*kinds, count=True, **filters)))["count"])

    async def last(self, kind: type[schema.Event], **filters: Any) -> schema.Event | None:
        found = await self.events(kind, last=1, **filters)
        return found[-1] if found else None

    # --- what services ask ----------------------------------------------------------------------

    async def best(self, deployment: str) -> schema.BestAdvanced | None:
        """The deployment's current best system (None: stock, nothing promoted)."""
        return await self.last(schema.BestAdvanced, deployment=deployment)  # type: ignore[return-value]

    async def decided(self, patch_id: str) -> bool:
        """Whether the patch already has a verdict or a refusal."""
        return await self.count(schema.VerdictIssued, schema.PatchRefused, patch_id=patch_id) > 0


def reply_for(ledger, q: EventQuery) -> dict[str, Any]:
    """The reply the memory service sends for ``q`` (shared by its endpoint and `Reads.local`)."""
    found = ledger.select(q)
    if q.count:
        return {"count": found}
    return {"events": [schema.encode(e).decode() for e in found]}
