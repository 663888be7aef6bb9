"""What a job of the controller (`verdict`, `phases`) may ask of the service that runs it.

`Service` is the interface `main.Controller` provides: emit an event (recorded and folded into the
state), or a decision and its consequences together (all recorded or none), ask the ledger whether work is already done, get a deployment's evaluator (registered) and its
best system, and wait for a forcing report. Jobs are typed against it, so they point down to it and
never up to the service module.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from specpilot import bus, schema

if TYPE_CHECKING:
    from specpilot.services.controller.evaluate import Evaluator
    from specpilot.services.controller.state import State
    from specpilot.services.controller.workers import System


class Service(Protocol):
    bus: bus.Bus | None  # None: `specpilot time` (a local log, forcing in this process)
    device: str
    state: State  # the fold of the ledger (`state.fold`)
    events: list[schema.Event]  # every event this process emitted
    forcing: dict[str, asyncio.Future]  # forcing requests awaiting their report

    async def emit(self, event: schema.Event, cause: schema.Event) -> schema.Event: ...

    async def emit_together(self, events: list[schema.Event], cause: schema.Event) -> list[schema.Event]: ...

    async def already_decided(self, patch_id: str) -> bool: ...

    async def already_reported(self, kind: type[schema.Event], round_id: str) -> bool: ...

    async def registered(self, event: schema.Event) -> tuple[Evaluator, str]: ...

    def best_system(self, ev: Evaluator, dep: str) -> System: ...

    def await_forcing(self, request_id: str) -> asyncio.Future: ...
