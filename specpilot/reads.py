"""Typed reads of the ledger: one query shape per kind of question, schema objects out, no SQL outside the ledger.

Two kinds of question, both answered by the memory service:
- **Events** (`EventQuery` on `subjects.RPC_EVENTS`): their classes (tags taken from the schema classes,
  never spelled by hand), an envelope filter (deployment, round), payload fields equal to a value or
  one of several values (``patch_id``, ``direction_id``, ``kind``, ...), and optionally only the last
  ``last`` of them, those after the first ``offset``, or just their count. Answered from the log
  (`specpilot.ledger.Ledger.select`, the one place that turns a query into SQL).
- **State** (`ViewQuery` on `subjects.RPC_VIEW`): rows of a projection (`specpilot.projections`: a
  patch's status and verdict, a deployment's best system, a memory entry's status, a round's status),
  answered from the live projections the memory service folds as it records, without a scan of the log.

`Reads` is the client every service and command uses: over the bus (``Reads.over(bus)``, retrying while
the memory service restarts), over an open ledger (``Reads.local(ledger)``: the CLI when no service runs),
or over nothing (``Reads.none()``: nothing recorded yet). Its helpers name what services ask the log
(`best`, `decided`, `patches`, ...). It holds no state: every answer comes from the ledger, the one
source of truth.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from specpilot import evidence, projections, schema, subjects

log = logging.getLogger("reads")
FieldValue = str | int | float | bool
RETRY_S = 1.0
MAX_REPLY_BYTES = 768 << 10  # of events a reply carries (a NATS message holds 1 MiB): more go on later pages


class EventQuery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which events (all of them when empty); see the module docstring."""

    types: tuple[str, ...] = ()
    deployment: str | list[str] | None = None  # one value, or one of several
    round_id: str | list[str] | None = None
    fields: dict[str, FieldValue | list[FieldValue]] = {}
    last: int = 0  # only the last N (0: all)
    offset: int = 0  # skip the first N (in recording order)
    count: bool = False  # only how many
    brief: bool = False  # diffs and deltas as their skeleton (`evidence.skeleton`): history without the code


class ViewQuery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Rows of one projection (`projections.ROWS` names them): all of them, or those of ``keys``."""

    view: str
    keys: tuple[str, ...] = ()


def tag_of(kind: type[schema.Event]) -> str:
    """The stable tag of an event class (what the ledger's ``type`` column holds)."""
    return kind.__struct_config__.tag  # type: ignore[return-value]


def query(*kinds: type[schema.Event], deployment: str | list[str] | None = None,
          round_id: str | list[str] | None = None, last: int = 0,
          offset: int = 0, count: bool = False, brief: bool = False,
          **fields: FieldValue | list[FieldValue]) -> EventQuery:
    """An `EventQuery` from event classes and filters (payload fields as keywords)."""
    return EventQuery(types=tuple(tag_of(k) for k in kinds), deployment=deployment, round_id=round_id,
                      fields=fields, last=last, offset=offset, count=count, brief=brief)


Ask = Callable[[str, Any], Awaitable[dict[str, Any]]]  # (RPC subject, query struct) -> reply


class Reads:
    """Typed questions to the ledger, answered by ``ask(subject, query) -> reply dict`` (see `Reads.over`)."""

    def __init__(self, ask: Ask):
        self._ask = ask

    @classmethod
    def over(cls, b, timeout: float = 30.0, retry: bool = True) -> Reads:
        """Reads through the memory service on bus ``b``; with ``retry`` it waits out a memory restart."""
        from specpilot import bus as bus_module

        async def ask(subject: str, q: Any) -> dict[str, Any]:
            while True:
                try:
                    return await b.request(subject, msgspec.to_builtins(q), timeout=timeout)
                except bus_module.BusError as exc:
                    if not retry or isinstance(exc, bus_module.ServiceError):
                        raise
                    log.warning("ledger read failed, retrying: %s", exc)
                    await asyncio.sleep(RETRY_S)

        return cls(ask)

    @classmethod
    def local(cls, ledger) -> Reads:
        """Reads straight from an open `specpilot.ledger.Ledger` (no service)."""

        async def ask(subject: str, q: Any) -> dict[str, Any]:
            return reply_for(ledger, q) if subject == subjects.RPC_EVENTS else view_reply(ledger.projections(), q)

        return cls(ask)

    @classmethod
    def none(cls) -> Reads:
        """Reads of an empty ledger (a process with no ledger at all, e.g. `specpilot time` alone)."""

        async def ask(subject: str, q: Any) -> dict[str, Any]:
            if subject == subjects.RPC_VIEW:
                return view_reply(projections.State(), q)
            return {"count": 0} if q.count else {"events": []}

        return cls(ask)

    # --- the two queries ------------------------------------------------------------------------

    async def events(self, *kinds: type[schema.Event], **filters: Any) -> list[schema.Event]:
        """Every matching event, in recording order, however many pages the answer takes (`reply_for`)."""
        q, out = query(*kinds, **filters), []
        while True:
            reply = await self._ask(subjects.RPC_EVENTS, q)
            out += [schema.decode(e.encode()) for e in reply["events"]]
            if not reply.get("more"):
                return out
            q = msgspec.structs.replace(q, offset=q.offset + len(reply["events"]))

    async def count(self, *kinds: type[schema.Event], **filters: Any) -> int:
        return int((await self._ask(subjects.RPC_EVENTS, query(*kinds, count=True, **filters)))["count"])

    async def last(self, kind: type[schema.Event], **filters: Any) -> schema.Event | None:
        found = await self.events(kind, last=1, **filters)
        return found[-1] if found else None

    async def view(self, name: str, *keys: str) -> dict[str, Any]:
        """Rows of projection ``name`` (all, or those of ``keys`` that exist), typed (`projections.ROWS`)."""
        reply = await self._ask(subjects.RPC_VIEW, ViewQuery(view=name, keys=keys))
        return msgspec.convert(reply["rows"], dict[str, projections.ROWS[name]])

    # --- what services ask ----------------------------------------------------------------------

    async def best(self, deployment: str) -> projections.BestView | None:
        """The deployment's current best system (None: stock, nothing promoted)."""
        return (await self.view("best", deployment)).get(deployment)

    async def patches(self, *patch_ids: str) -> dict[str, projections.PatchView]:
        """The status and verdict of each of ``patch_ids`` that the ledger knows."""
        return await self.view("patches", *patch_ids) if patch_ids else {}

    async def decided(self, patch_id: str) -> bool:
        """Whether the patch already has a verdict or a refusal."""
        row = (await self.patches(patch_id)).get(patch_id)
        return row is not None and row.decided


def reply_for(ledger, q: EventQuery, max_bytes: int = MAX_REPLY_BYTES) -> dict[str, Any]:
    """The reply the memory service sends for ``q`` (shared by its endpoint and `Reads.local`): the events in
    recording order, as many as fit ``max_bytes`` (a NATS message holds 1 MiB), with ``"more": true`` when
    some were left for the next page (`Reads.events` asks again from ``offset`` + what it got)."""
    found = ledger.select(q)
    if q.count:
        return {"count": found}
    page, size = [], 0
    for e in found:
        if q.brief:
            e = _brief(e)
        text = schema.encode(e).decode()
        if page and size + len(text) > max_bytes:
            return {"events": page, "more": True}
        page.append(text)
        size += len(text) + 3
    return {"events": page}


def _brief(event: schema.Event) -> schema.Event:
    """``event`` with its patch text (a ``diff`` or ``delta`` field) reduced to `evidence.skeleton`."""
    cut = {f: evidence.skeleton(v) for f in ("diff", "delta") if isinstance(v := getattr(event, f, None), str) and v}
    return msgspec.structs.replace(event, **cut) if cut else event


def view_reply(state: projections.State, q: ViewQuery) -> dict[str, Any]:
    """The reply the memory service sends for ``q`` from the live projections ``state``."""
    return {"rows": msgspec.to_builtins(state.view(q.view, q.keys))}
