"""The subagent service: turns one direction into a patch behind an engine option (I/O only).

Several subagent processes bound to the durable pull consumer ``subagent`` form a queue group: each
works on up to ``concurrency`` ``DirectionPlanned`` at once (`Settings.concurrency`, default 2: a wave
plans 2 directions on a CPU; other master events are acked and ignored) and, for each:

1. builds the current best system of the direction's deployment on this host's stock
   (``workspace.build_workspace``) from the controller's ``system`` RPC: the best's diff from stock,
   checked against the controller's git tree ids of the runtime, so the workspace is the controller's
   best exactly. When no controller answers, from the ledger instead (memory's read endpoints): every
   ``best.advanced`` of that deployment in ledger order, each one's ``patch.proposed`` diff applied in
   turn. ``base_commit`` is the best's commit ("" while stock); the best's options are its ``options``;
2. runs the provider the direction names (``providers.parse_provider``: sweep, memory, anthropic,
   openai, openai-compatible) in a worker thread, telling the server every ``HEARTBEAT_S`` that the
   direction is in progress;
3. publishes one ``PatchProposed`` per proposal with ``cause=direction`` (so ``round_id``,
   ``deployment`` and the correlation carry over), ``patch_id = f"{direction_id}-p{i}"`` and an
   ``event_id`` derived from the direction's, all in one atomic batch, **then** acks the direction.

A provider failure (missing key, SDK error, no ``finish`` within the turn limit, a diff that does not
apply, no valid sweep value) is logged and answered with ``DirectionFailed`` (the master stops
waiting for that direction), then the direction is acked. A redelivered direction whose patches
are already in the ledger is acked without running again. If publishing fails the direction is not
acked and comes back. On a stop signal a direction in progress is abandoned unacked (redelivered to
another subagent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specpilot import bus, canary, providers, schema, service, subjects
from specpilot.errors import UserError
from specpilot.llm import Usage
from specpilot.paths import REPO_ROOT
from specpilot.reads import Reads
from specpilot.services.subagent import offline
from specpilot.services.subagent.offline import Proposal
from specpilot.services.subagent.workspace import DEFAULT_TEST_TIMEOUT_S, Tools, Workspace, build_workspace

NAME = "subagent"
DESCRIPTION = "Turns one direction into one patch behind an engine option."
HEARTBEAT_S = 10.0  # well inside the consumer's ack wait (60 s)
READ_TIMEOUT_S = 30.0
DEFAULT_CONVERSATION_S = 1800.0  # one LLM conversation, turns and tool runs included
log = logging.getLogger(NAME)


@dataclass(frozen=True)
class Best:
    """The current best system of a deployment as the ledger tells it."""

    promotions: list[tuple[str, str]] = field(default_factory=list)  # (patch_id, diff) in ledger order
    commit: str = ""  # the latest BestAdvanced.commit; "" while stock
    options: dict = field(default_factory=dict)
    trees: dict[str, str] = field(default_factory=dict)  # the controller's git tree id per runtime root (or none)


@dataclass(frozen=True)
class Settings:
    source: Path = REPO_ROOT  # where stock's engine/, kernels/, deployments/ and tests/engine/ come from
    default_provider: str = providers.ANTHROPIC  # for a direction whose provider is empty
    max_turns: int = 30
    test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S
    work_dir: Path | None = None  # where workspaces are built (a temporary directory when None)
    # The service's data directory: hidden from every run of agent code; its model cache feeds the
    # quick_time and profile tools (None: no such tools, nothing to hide).
    data: Path | None = None
    max_wall_s: float = DEFAULT_CONVERSATION_S  # one LLM conversation's wall-clock budget
    max_llm_tokens: int | None = None  # one conversation's token budget (input + output; None: no limit)
    concurrency: int = 2  # directions worked on at once by this process


async def current_best(b: bus.Bus, reads: Reads, deployment: str) -> Best:
    """The controller's best system of ``deployment`` (`subjects.RPC_SYSTEM`); the ledger's account of
    it (`best_from_ledger`) when no controller answers."""
    try:
        system = await b.request(subjects.RPC_SYSTEM, {"deployment": deployment}, timeout=READ_TIMEOUT_S)
    except bus.BusError as exc:
        log.warning("no best system from the controller (%s): rebuilding it from the ledger's promotions", exc)
        return await best_from_ledger(reads, deployment)
    diff = str(system.get("diff", ""))
    return Best(promotions=[(f"the controller's best {system.get('commit', '')[:12]}", diff)] if diff else [],
                commit=str(system.get("commit", "")), options=dict(system.get("options") or {}),
                trees=dict(system.get("trees") or {}))


async def best_from_ledger(reads: Reads, deployment: str) -> Best:
    """Promotions of ``deployment`` and the diffs of their patches, from the ledger."""
    promotions: list[tuple[str, str]] = []
    commit, options = "", {}
    for adv in await reads.events(schema.BestAdvanced, deployment=deployment):
        assert isinstance(adv, schema.BestAdvanced)
        patch = next(iter(await reads.events(schema.PatchProposed, patch_id=adv.patch_id)), None)
        if patch is None:
            raise providers.ProviderError(f"cannot rebuild the best of {deployment!r}: promoted patch "
                                          f"{adv.patch_id!r} (commit {adv.commit[:12]}) has no patch.proposed in the ledger")
        assert isinstance(patch, schema.PatchProposed)
        promotions.append((adv.patch_id, patch.diff))
        commit, options = adv.commit, dict(adv.options)
    return Best(promotions=promotions, commit=commit, options=options)


def sweep_validator(deployment: str, ws: Workspace) -> offline.Validator:
    """What checks a sweep's option settings: a server deployment's own ``[server.options]`` (no patch can
    add one: deployments are outside the patchable roots), else the workspace's engine (a promoted patch
    may have added options)."""
    from specpilot.harness.deployment import deployment_or_none

    dep = deployment_or_none(deployment) if deployment else None
    if dep is None or not dep.server:
        return offline.workspace_validator(ws)

    def check(options: dict) -> str | None:
        try:
            dep.check_options(options)
        except ValueError as exc:
            return str(exc)
        return None

    return check


def produce(direction: schema.DirectionPlanned, best: Best, settings: Settings,
            env: Mapping[str, str] | None = None, usage: Usage | None = None) -> list[Proposal]:
    """The proposals of one direction (blocking: runs in a worker thread). Raises ``UserError`` on failure.
    ``usage`` is filled by an LLM provider's conversation (also when it fails)."""
    spec = providers.parse_provider(direction.provider or settings.default_provider)
    key = providers.api_key(spec, env) if spec.kind in providers.LLM else ""  # a missing key fails before any work
    dest = None
    if settings.work_dir is not None:
        Path(settings.work_dir).mkdir(parents=True, exist_ok=True)
        dest = Path(settings.work_dir) / f"{direction.direction_id}-{direction.event_id[-12:]}"
    ws = Workspace(build_workspace(settings.source, best.promotions, dest, trees=best.trees),
                   hide=(settings.data,) if settings.data else ())
    try:
        if spec.kind == providers.SWEEP:
            return offline.sweep(direction.hints, sweep_validator(direction.deployment, ws))
        if spec.kind == providers.MEMORY:
            return [offline.memory(direction.hints, ws)]
        from specpilot.harness.deployment import DEFAULT_DEPLOYMENT
        from specpilot.services.subagent import llm  # the SDKs load only when an LLM provider is used
        from specpilot.services.subagent.advice import Advisor

        advisor = Advisor(direction.deployment or DEFAULT_DEPLOYMENT, settings.data, dict(best.options)) \
            if settings.data is not None else None
        tools = Tools(ws, test_timeout_s=settings.test_timeout_s, advisor=advisor)
        return [llm.propose(spec, direction, tools, key, best_options=best.options, max_turns=settings.max_turns,
                            usage=usage, max_wall_s=settings.max_wall_s, max_total_tokens=settings.max_llm_tokens)]
    finally:
        ws.remove()


def patch_event_id(direction_event_id: str, index: int) -> str:
    """The id of a direction's ``index``-th patch event (`schema.derived_id`): a republished patch is the same
    event (the server's dedupe and the ledger's primary key absorb it); the bus mints it as this service's."""
    return schema.derived_id(direction_event_id, f"patch.proposed:{direction_event_id}:{index}")


def patch_events(direction: schema.DirectionPlanned, proposals: list[Proposal], best: Best,
                 provider: str) -> list[schema.PatchProposed]:
    return [schema.PatchProposed(event_id=patch_event_id(direction.event_id, i), direction_id=direction.direction_id,
                                 patch_id=f"{direction.direction_id}-p{i}", diff=p.diff, options=dict(p.options),
                                 base_commit=best.commit, provider=provider, notes=p.notes)
            for i, p in enumerate(proposals)]


def usage_events(direction: schema.DirectionPlanned, provider: str, usage: Usage) -> list[schema.ConversationUsed]:
    """The direction's `schema.ConversationUsed` (none when no model was called), under a fixed id."""
    if not usage.turns:
        return []
    return [usage.event("coder", provider, event_id=patch_event_id(direction.event_id, -2),
                        direction_id=direction.direction_id)]


def _in_daemon_thread(fn: Callable, *args) -> asyncio.Future:
    """Run ``fn`` in a daemon thread: a stopping service does not wait for a model that is still thinking."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result, exc) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is gone: the service stopped meanwhile
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=target, name="subagent-provider", daemon=True).start()
    return fut


class Subagent:
    def __init__(self, b: bus.Bus, settings: Settings | None = None, env: Mapping[str, str] | None = None):
        self.bus, self.settings = b, settings or Settings()
        self.env = os.environ if env is None else env

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch a direction whenever one of ``concurrency`` slots is free; each is handled in its own task."""
        slots = asyncio.Semaphore(max(1, self.settings.concurrency))
        working: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                await slots.acquire()  # one slot for the next direction fetched
                try:
                    async for event, delivery in self.bus.consume(stop, batch=1):
                        task = asyncio.create_task(self._in_slot(event, delivery, stop, slots))
                        working.add(task)
                        task.add_done_callback(working.discard)
                        await slots.acquire()
                    slots.release()
                except (bus.BusError, ConnectionError) as exc:  # the broker went away; it will come back
                    slots.release()
                    log.warning("bus trouble, retrying: %s", exc)
                    await asyncio.sleep(0.5)
        finally:
            for task in working:
                task.cancel()

    async def _in_slot(self, event: schema.Event, delivery: bus.Delivery, stop: asyncio.Event,
                       slots: asyncio.Semaphore) -> None:
        try:
            await self.handle(event, delivery, stop)
        except (bus.BusError, ConnectionError) as exc:  # unacked: the server redelivers it
            log.warning("direction left unacked after bus trouble: %s", exc)
        except Exception:  # noqa: BLE001 - one direction's bug must not stop the others
            log.exception("direction handling failed; it stays unacked and comes back")
        finally:
            slots.release()

    async def already_proposed(self, direction_id: str) -> bool:
        with contextlib.suppress(bus.BusError):
            reads = Reads.over(self.bus, timeout=10, retry=False)
            return await reads.count(schema.PatchProposed, direction_id=direction_id) > 0
        return False

    async def handle(self, event: schema.Event, delivery: bus.Delivery, stop: asyncio.Event | None = None) -> None:
        if not isinstance(event, schema.DirectionPlanned):
            await delivery.ack()
            return
        d = event
        if delivery.num_delivered > 1 and await self.already_proposed(d.direction_id):
            log.info("direction %s already has its patches; acking the redelivery", d.direction_id)
            await delivery.ack()
            return
        provider = d.provider or self.settings.default_provider
        log.info("direction %s (%s, %s): %s", d.direction_id, provider, d.deployment, d.title)
        usage = Usage()
        try:
            best = await current_best(self.bus, Reads.over(self.bus, timeout=READ_TIMEOUT_S, retry=False), d.deployment)
            work = _in_daemon_thread(produce, d, best, self.settings, self.env, usage)
            while True:
                done, _ = await asyncio.wait({work}, timeout=HEARTBEAT_S)
                if done:
                    break
                if stop is not None and stop.is_set():
                    log.warning("stopping: direction %s abandoned unacked (it will be redelivered)", d.direction_id)
                    return
                try:
                    await delivery.in_progress()
                except bus.BusError as exc:
                    log.warning("in_progress for %s failed: %s", d.direction_id, exc)
            proposals = work.result()
        except (bus.BusError, ConnectionError):
            raise
        except Exception as exc:  # noqa: BLE001 - a provider failure must not kill the service
            log.error("direction %s: provider failure (%s): %s", d.direction_id, provider, exc,
                      exc_info=not isinstance(exc, UserError))
            failed = schema.DirectionFailed(event_id=patch_event_id(d.event_id, -1), direction_id=d.direction_id,
                                            provider=provider, reason=f"{type(exc).__name__}: {exc}"[:2000])
            await self.bus.publish_many([*usage_events(d, provider, usage), failed], cause=d)
            await delivery.ack()
            return
        patches = patch_events(d, proposals, best, provider)
        await self.bus.publish_many([*usage_events(d, provider, usage), *patches], cause=d)
        await delivery.ack()
        for p in patches:
            log.info("direction %s: %s (%d-byte diff, options %s)", d.direction_id, p.patch_id, len(p.diff), p.options)


def add_args(parser) -> None:
    parser.add_argument("--default-provider", default=providers.ANTHROPIC,
                        help="provider for a direction that names none (see services/subagent/providers.py)")
    parser.add_argument("--max-turns", type=int, default=30, help="model calls before an LLM provider gives up")
    parser.add_argument("--max-wall-s", type=float, default=DEFAULT_CONVERSATION_S,
                        help="seconds one LLM conversation may take before it gives up")
    parser.add_argument("--max-llm-tokens", type=int, default=None,
                        help="tokens (input + output) one LLM conversation may use (default: no limit)")
    parser.add_argument("--test-timeout", type=float, default=DEFAULT_TEST_TIMEOUT_S,
                        help="seconds one run_tests call may take")
    parser.add_argument("--concurrency", type=int, default=Settings.concurrency,
                        help="directions this process works on at once (several processes also share the queue)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where workspaces are built (default: a temp dir)")
    parser.add_argument("--source", type=Path, default=REPO_ROOT,
                        help="the checkout whose engine/, kernels/, deployments/ and tests/engine/ are stock")


def make(cfg: service.ServiceConfig):
    a = cfg.args
    # fail closed: no agent-written test, option check or advice run on a host without a proved sandbox
    canary.require(cfg.data, cfg.bundle.path, what="agent code (tests, option checks, advice runs)")
    settings = Settings(source=a.source, default_provider=a.default_provider, max_turns=a.max_turns,
                        test_timeout_s=a.test_timeout, work_dir=a.work_dir, data=Path(cfg.data),
                        max_wall_s=a.max_wall_s, max_llm_tokens=a.max_llm_tokens, concurrency=a.concurrency)
    providers.parse_provider(settings.default_provider)  # a bad flag fails at start-up

    async def body(b: bus.Bus, stop: asyncio.Event) -> None:
        await Subagent(b, settings).run(stop)

    return body, {}


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, make, argv=argv, add_args=add_args)
