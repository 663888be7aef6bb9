"""The event bus over NATS JetStream. The only module that imports ``nats``.

Contract:
- ``connect`` joins over TLS with a bundle's certificate (`specpilot.bundles`: the certificate is the
  identity); it retries a dead server with backoff, then raises ``BusError`` with what to do, and
  fails at once on a refused certificate or a server of another installation.
- ``Bus.publish`` sends an event on ``sp.ev.<own service>.<tag>``, its id minted by this service
  (``<service>:...``, `schema.mint`), with ``Nats-Msg-Id`` a keyed hash of the id (`Bus.msg_id`: the key
  derives from this service's bundle, so no other service can take an id first and make this one's event
  a duplicate), and retries (same id, so the server drops duplicates) until JetStream acknowledges it or
  the deadline passes. A returned publish is durable (the server fsyncs before acking).
- ``provision`` (admin only) creates the stream and the durable pull consumers; services only bind.
- ``Bus.fetch`` returns ``Delivery`` objects; the caller acks after its work is durable.
- ``Bus.consume`` yields decoded events whose type the subject's source may publish. A message that
  cannot be decoded is redelivered with a delay up to ``DECODE_ATTEMPTS`` times and then terminated
  on that consumer; the memory service keeps it as a dead letter (the stream keeps it too).
  Neither stalls the other messages.
- ``serve`` registers a NATS micro service (discovery, ping, stats) with request/reply endpoints;
  ``discover`` lists the services that answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import api
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from specpilot import schema, subjects
from specpilot.bundles import Bundle
from specpilot.errors import UserError

T = TypeVar("T")

# asyncio warns "returning true from eof_received() has no effect when using ssl" at every TLS close of a
# nats-py connection: harmless, and it would bury real warnings.
logging.getLogger("asyncio").addFilter(lambda record: not str(record.msg).startswith("returning true from eof_received"))
log = logging.getLogger("specpilot.bus")

DECODE_ATTEMPTS = 3  # deliveries of an undecodable message before it is dead-lettered
DECODE_RETRY_DELAY_S = 0.2
# How long a fetched message may stay unacknowledged before redelivery. The recorder commits a batch
# in milliseconds, so a crashed recorder's batch comes back quickly; slow workers send in_progress().
ACK_WAIT_S = {"memory": 5.0}
DEFAULT_ACK_WAIT_S = 60.0
DUPLICATE_WINDOW_S = 600.0
ATOMIC_BATCH = 1000  # the server's default limit on messages per atomic batch
ERR_BATCH_DUPLICATE_ID = 10201  # "atomic publish batch contains duplicate message id"


# Publish failures that a retry with the same message id can heal (the server dedupes it).
RETRIABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
             nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
             nats.errors.OutboundBufferLimitError)


class BusError(UserError):
    pass


class ServiceError(BusError):
    """The service answered with an error (its request was bad): retrying the same request will not help."""


@dataclass
class Delivery:
    """One message fetched from a durable consumer."""

    subject: str
    data: bytes
    seq: int
    num_delivered: int
    _msg: object

    # A lost ack only causes a redelivery, so a broken connection is reported as ``BusError`` for
    # the caller's retry loop rather than as one of nats-py's own exceptions.
    async def ack(self) -> None:
        with _as_bus_error("ack"):
            await self._msg.ack()  # type: ignore[attr-defined]

    async def nak(self, delay: float | None = None) -> None:
        with _as_bus_error("nak"):
            await self._msg.nak(delay=delay)  # type: ignore[attr-defined]

    async def term(self) -> None:
        with _as_bus_error("term"):
            await self._msg.term()  # type: ignore[attr-defined]

    async def in_progress(self) -> None:
        with _as_bus_error("in_progress"):
            await self._msg.in_progress()  # type: ignore[attr-defined]


@contextlib.contextmanager
def _as_bus_error(what: str):
    try:
        yield
    except nats.errors.Error as exc:
        raise BusError(f"{what} failed: {exc!r}") from exc


class _Puller:
    """A raw pull from one durable consumer into this connection's private inbox."""

    def __init__(self, nc: Client, service: str, inbox: str):
        self.nc, self.next_subject, self.inbox = nc, subjects.js_next(service), inbox
        self.buffer: deque = deque()
        self.arrived = asyncio.Event()

    @classmethod
    async def start(cls, nc: Client, service: str) -> _Puller:
        puller = cls(nc, service, nc.new_inbox())
        await nc.subscribe(puller.inbox, cb=puller._on_msg, pending_msgs_limit=1_000_000,
                           pending_bytes_limit=1 << 30)
        return puller

    async def _on_msg(self, msg) -> None:
        self.buffer.append(msg)
        self.arrived.set()

    async def pull(self, request: dict, want: int, timeout: float) -> list[Delivery]:
        """Send one pull request and collect its messages until ``want`` or the server's end status."""
        if want <= 0:
            return []
        await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)
        out: list[Delivery] = []
        deadline = time.monotonic() + timeout
        while len(out) < want:
            while self.buffer:
                msg = self.buffer.popleft()
                status = msg.headers.get("Status") if msg.headers else None
                if status and not msg.data:
                    if status == "100":  # idle heartbeat
                        continue
                    return out  # 404 no messages, 408 request expired, 409 ...: this pull is over
                out.append(_delivery(msg))
                if len(out) >= want:
                    return out
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return out
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=left)
            except TimeoutError:
                return out
        return out


def _delivery(msg) -> Delivery:
    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending> (v1), or the
    # v2 form with domain and account hash first; nats-py's Msg.metadata parses both, slowly.
    tokens = msg.reply.split(".")
    if len(tokens) == 9:
        delivered, seq = int(tokens[4]), int(tokens[5])
    else:
        md = msg.metadata
        delivered, seq = md.num_delivered, md.sequence.stream
    return Delivery(subject=msg.subject, data=msg.data, seq=seq, num_delivered=delivered, _msg=msg)


def retries_exhausted(d: Delivery) -> bool:
    """An undecodable message is given up (dead-lettered) at its ``DECODE_ATTEMPTS``-th delivery."""
    return d.num_delivered >= DECODE_ATTEMPTS


def authorised(subject: str, event: schema.Event, legacy_ids: bool = False) -> str | None:
    """Why ``event`` on ``subject`` is not authorised, or None when it is. Its id must be minted by the
    subject's source, the publisher NATS authenticated (``<source>:...``: `schema.mint`), so no service can
    record an event under another's id; ``legacy_ids``: an id naming no minter passes too (a stream recorded
    before ids carried their source, rebuilt: `services.memory.main.rebuild`)."""
    source = subjects.source_of(subject)
    if source is None:
        return f"subject {subject!r} is not an event subject"
    if event.source and event.source != source:
        return f"envelope source {event.source!r} differs from subject source {source!r}"
    if source not in type(event).sources:
        return f"{source} may not publish {event.tag}"
    minter = schema.minted_by(event.event_id)
    if minter != source and not (legacy_ids and minter is None):
        return f"event id {event.event_id!r} is not minted by its publisher {source!r}"
    return None


class Bus:
    def __init__(self, nc: Client, user: str, errors: list[str] | None = None, msg_key: bytes = b""):
        self.nc = nc
        self.user = user
        # the key of this publisher's stream message ids (`msg_id`): from its bundle's private key
        self._msg_key = msg_key or hashlib.sha256(f"specpilot msg-id\0{user}".encode()).digest()
        self.js = nc.jetstream()
        self.errors = errors if errors is not None else []  # asynchronous server errors (e.g. permissions)
        self._subs: dict[str, object] = {}

    # --- publishing ------------------------------------------------------------------------------

    def msg_id(self, event_id: str) -> str:
        """The stream's deduplication id of ``event_id`` (``Nats-Msg-Id``): a keyed hash only this publisher can
        compute, the same at every retry and restart (so a re-sent event is dropped), never one another
        service could take first to make this one's events look like duplicates."""
        return hmac.new(self._msg_key, event_id.encode(), hashlib.sha256).hexdigest()[:40]

    def stamp(self, event: schema.Event, cause: schema.Event | None = None) -> schema.Event:
        """Set the envelope's source (this user), its id as this user mints it (`schema.mint`) and, given a
        cause, its causation and correlation."""
        extra: dict[str, str] = {"source": self.user, "event_id": schema.mint(self.user, event.event_id)}
        if cause is not None:
            if not event.causation_id:  # an event of a batch may name an earlier one of it as its cause
                extra["causation_id"] = cause.event_id
            if not event.correlation_id:
                extra["correlation_id"] = cause.correlation_id or cause.event_id
            for name in ("round_id", "deployment"):
                if not getattr(event, name):
                    extra[name] = getattr(cause, name)
        return schema.stamp(event, **extra)

    async def publish(self, event: schema.Event, cause: schema.Event | None = None,
                      deadline_s: float = 60.0) -> tuple[schema.Event, int]:
        """Publish durably; returns the stamped event and its stream sequence."""
        event = self.stamp(event, cause)
        subject = subjects.event_subject(self.user, event.tag)
        seq = await self.publish_raw(subject, schema.encode(event), self.msg_id(event.event_id), deadline_s)
        return event, seq

    async def publish_raw(self, subject: str, data: bytes, msg_id: str, deadline_s: float = 60.0) -> int:
        """Publish bytes with a message id, retrying across broker restarts until acknowledged."""
        deadline = time.monotonic() + deadline_s
        delay = 0.05
        while True:
            try:
                ack = await self.js.publish(subject, data, timeout=2.0, headers={"Nats-Msg-Id": msg_id})
                return ack.seq
            except nats.js.errors.APIError as exc:
                # A permissions or stream error will not heal by retrying.
                raise BusError(f"publish to {subject} refused: {exc}") from exc
            except RETRIABLE as exc:
                if time.monotonic() > deadline:
                    raise BusError(f"publish to {subject} not acknowledged within {deadline_s:.0f} s: {exc!r}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def publish_many(self, events: list[schema.Event], cause: schema.Event | None = None,
                           deadline_s: float = 60.0) -> list[schema.Event]:
        """Publish many events durably in JetStream atomic batches (one fsync per batch, not per event).

        Each batch of up to ``ATOMIC_BATCH`` events is stored whole or not at all. A retried batch that
        the server already stored is refused as containing duplicate message ids, which means done.
        """
        stamped = [self.stamp(e, cause) for e in events]
        for i in range(0, len(stamped), ATOMIC_BATCH):
            await self._publish_atomic(stamped[i:i + ATOMIC_BATCH], deadline_s)
        return stamped

    async def publish_together(self, events: list[schema.Event], cause: schema.Event | None = None,
                               deadline_s: float = 60.0) -> tuple[list[schema.Event], bool]:
        """Publish up to ``ATOMIC_BATCH`` events as one atomic batch: all are stored or none (a decision and
        its consequences). Returns the stamped events and whether the server stored them now (False: it held
        them already, from an earlier publish of the same ids: the earlier one is what stands)."""
        if len(events) > ATOMIC_BATCH:
            raise ValueError(f"at most {ATOMIC_BATCH} events are published together")
        stamped = [self.stamp(e, cause) for e in events]
        return stamped, await self._publish_atomic(stamped, deadline_s)

    async def _publish_atomic(self, events: list[schema.Event], deadline_s: float) -> bool:
        deadline = time.monotonic() + deadline_s
        delay = 0.05
        while True:
            batch_id = schema.new_event_id()  # a fresh batch per attempt; the message ids stay the same
            try:
                for n, e in enumerate(events, start=1):
                    headers = {api.Header.BATCH_ID: batch_id, api.Header.BATCH_SEQUENCE: str(n),
                               api.Header.MSG_ID: self.msg_id(e.event_id)}
                    subject, data = subjects.event_subject(self.user, e.tag), schema.encode(e)
                    if n < len(events):
                        await self.nc.publish(subject, data, headers=headers)
                        continue
                    headers[api.Header.BATCH_COMMIT] = "1"
                    reply = json.loads((await self.nc.request(subject, data, headers=headers, timeout=5.0)).data)
                    error = reply.get("error")
                    if not error:
                        return True
                    if error.get("err_code") == ERR_BATCH_DUPLICATE_ID:
                        return False
                    raise BusError(f"atomic publish of {len(events)} events refused: {error.get('description')}")
            except RETRIABLE as exc:
                if time.monotonic() > deadline:
                    raise BusError(f"atomic publish not acknowledged within {deadline_s:.0f} s: {exc!r}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # --- consuming -------------------------------------------------------------------------------

    async def fetch(self, batch: int = 1000, timeout: float = 1.0, service: str | None = None) -> list[Delivery]:
        """Up to ``batch`` messages from a durable consumer (default: this user's); [] on timeout.

        Takes what is available at once (a ``no_wait`` pull); when nothing is, long-polls for one
        message up to ``timeout`` and then takes what followed it. (nats-py's own ``fetch`` spends
        most of a busy recorder's time in per-message timers, hence this raw pull.)
        """
        try:
            puller = await self._puller(service or self.user)
            got = await puller.pull({"batch": batch, "no_wait": True}, batch, timeout=5.0)
            if not got:
                got = await puller.pull({"batch": 1, "expires": int(timeout * 1e9)}, 1, timeout=timeout + 1.0)
                if got:
                    got += await puller.pull({"batch": batch - 1, "no_wait": True}, batch - 1, timeout=5.0)
            return got
        except nats.errors.Error as exc:  # disconnected, reconnecting, closed: the caller retries
            raise BusError(f"fetch from {service or self.user}'s consumer failed: {exc!r}") from exc

    async def _puller(self, service: str) -> _Puller:
        if service not in self._subs:
            self._subs[service] = await _Puller.start(self.nc, service)
        return self._subs[service]  # type: ignore[return-value]

    async def consume(self, stop: asyncio.Event | None = None, batch: int = 16,
                      ) -> AsyncIterator[tuple[schema.Event, Delivery]]:
        """Decoded, authorised events from this service's consumer. The caller acks each one."""
        while stop is None or not stop.is_set():
            try:
                deliveries = await self.fetch(batch=batch, timeout=1.0)
            except BusError as exc:  # disconnected or reconnecting: nats-py reconnects by itself
                log.warning("fetch failed, retrying: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for d in deliveries:
                try:
                    event = schema.decode(d.data)
                except schema.DecodeError as exc:
                    await self.reject_undecodable(d, exc)
                    continue
                if why := authorised(d.subject, event):
                    log.warning("ignoring seq %d: %s", d.seq, why)
                    await d.term()
                    continue
                yield event, d

    async def reject_undecodable(self, d: Delivery, exc: Exception) -> bool:
        """Retry a bad message a bounded number of times; True once it is given up (terminated)."""
        if not retries_exhausted(d):
            await d.nak(delay=DECODE_RETRY_DELAY_S)
            return False
        log.error("giving up on seq %d on %s after %d deliveries: %s", d.seq, d.subject, d.num_delivered, exc)
        await d.term()
        return True

    # --- request / reply and micro services -----------------------------------------------------

    async def request(self, subject: str, payload: dict, timeout: float = 30.0) -> dict:
        try:
            msg = await self.nc.request(subject, json.dumps(payload).encode(), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise BusError(f"no service answers on {subject}: is it running? (`specpilot status`)") from None
        except nats.errors.TimeoutError:
            raise BusError(f"{subject} did not answer within {timeout:.0f} s") from None
        reply = json.loads(msg.data or b"{}")
        if msg.headers and msg.headers.get("Nats-Service-Error"):
            raise ServiceError(msg.headers["Nats-Service-Error"])
        return reply

    async def serve(self, name: str, version: str, description: str,
                    endpoints: dict[str, Callable[[dict], Awaitable[dict]]],
                    metadata: dict[str, str] | None = None) -> object:
        """Register a micro service; each endpoint takes and returns JSON objects. ``metadata`` is in
        every discovery reply (the version handshake)."""
        svc = await add_service(self.nc, ServiceConfig(name=name, version=version, description=description,
                                                       metadata=metadata or {}))
        for subject, handler in endpoints.items():
            await svc.add_endpoint(EndpointConfig(name=subject.rsplit(".", 1)[-1], subject=subject,
                                                  handler=_json_handler(handler)))
        return svc

    async def discover(self, timeout: float = 0.75) -> list[dict]:
        """Every micro service that answers ``$SRV.INFO`` within ``timeout``."""
        inbox = self.nc.new_inbox()
        found: list[dict] = []
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(subjects.MICRO_DISCOVERY, b"", reply=inbox)
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            with contextlib.suppress(ValueError):
                found.append(json.loads(msg.data))
        await sub.unsubscribe()
        return sorted(found, key=lambda s: (s.get("name", ""), s.get("id", "")))

    async def try_request(self, subject: str, data: bytes = b"", timeout: float = 1.0) -> bytes | None:
        """A raw request; None when nothing answers in time (e.g. the server refused it)."""
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return None
        return msg.data

    def refused(self, subject: str) -> bool:
        """Whether the server has reported a permissions violation naming ``subject``."""
        quoted = f'"{subject}"'.lower()  # nats-py lower-cases the server's message
        return any("permissions violation" in e.lower() and quoted in e.lower() for e in self.errors)

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until the server has seen everything sent so far (acks included)."""
        with _as_bus_error("flush"):
            await self.nc.flush(timeout=timeout)

    async def subscribe_raw(self, subject: str) -> None:
        """A bare core subscription (permission probes); the server reports refusals asynchronously."""
        await self.nc.subscribe(subject)
        await self.nc.flush()

    async def publish_core(self, subject: str, data: bytes = b"") -> None:
        """A bare core publish, no JetStream ack (permission probes)."""
        await self.nc.publish(subject, data)
        await self.nc.flush()

    async def close(self) -> None:
        # Every publish has been acknowledged before it returned, so flushing acks and closing is
        # enough; drain() would wait out its 30 s timeout on an idle pull subscription.
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)
        with contextlib.suppress(Exception):
            await self.nc.close()


def _json_handler(handler: Callable[[dict], Awaitable[dict]]):
    async def run(req) -> None:
        try:
            payload = json.loads(req.data or b"{}")
            if not isinstance(payload, dict):
                raise ValueError("request body must be a JSON object")
            reply = await handler(payload)
        except Exception as exc:  # every failure goes back to the caller as a service error
            await req.respond_error("400", str(exc) or type(exc).__name__)
            return
        await req.respond(json.dumps(reply, default=str).encode())

    return run


async def bounded(work: Awaitable[T], timeout: float) -> T:
    """``work``'s result if it ends within ``timeout`` seconds, else ``TimeoutError`` once its task has ended.

    Unlike ``asyncio.wait_for``, a cancellation the work swallows is sent again until the task ends: on
    Python 3.11 ``wait_for`` drops a cancellation that meets an inner future's completion, and nats-py's
    initial connect (reconnects unlimited) then loops on while ``wait_for`` waits for it for ever (a
    refused-certificate connect hung CI for 600 s). Work that ends anyway with a result returns it; work
    that outlives 20 cancellations (10 s) is left behind, still cancelled, and ``TimeoutError`` raised."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task}, timeout=timeout)
        for _ in range(20):
            if task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
    except asyncio.CancelledError:  # our caller gave up: the work goes with it
        task.cancel()
        raise
    if not task.done() or task.cancelled():
        raise TimeoutError(f"gave up after {timeout:.1f} s")
    return task.result()


async def connect(url: str | None, bundle: Bundle | Path | str, name: str = "",
                  connect_timeout_s: float = 20.0) -> Bus:
    """Connect over TLS as the owner of ``bundle`` (a folder or a loaded `Bundle`); ``url`` None: the
    bundle's own server URL. Retries with backoff while nothing answers, then says what to do; a
    refused certificate or an untrusted server fails at once."""
    if not isinstance(bundle, Bundle):
        bundle = Bundle.load(bundle)
    url = url or bundle.nats
    if not url:
        raise BusError(f"no server URL: pass --nats URL or give the bundle {bundle.path} a \"nats\" URL")
    ctx = bundle.context()
    deadline = time.monotonic() + connect_timeout_s
    delay = 0.1
    last: Exception | None = None
    errors: list[str] = []
    refusals: list[ssl.SSLError] = []  # certificate failures; nats-py retries them itself and reports them here

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))
        del errors[:-100]
        if _certificate_failure(exc):
            refusals.append(exc)
        log.debug("nats: %r", exc)

    while time.monotonic() < deadline:
        try:
            # nats-py keeps retrying an initial connect forever when reconnects are unlimited,
            # so each attempt gets its own deadline.
            nc = await bounded(nats.connect(
                url, tls=ctx, name=name or bundle.name, inbox_prefix=subjects.inbox_prefix(bundle.name),
                connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.25, allow_reconnect=True,
                error_cb=on_error,
            ), timeout=max(0.5, min(5.0, deadline - time.monotonic())))
            return Bus(nc, bundle.name, errors, msg_key=_msg_key(bundle))
        except ssl.SSLError as exc:  # a handshake cut short (a server starting or dying) is worth a retry
            if _certificate_failure(exc):
                refusals.append(exc)
            last = exc
        except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
            last = exc
        except nats.errors.Error as exc:
            if "authorization" in str(exc).lower():
                raise BusError(f"NATS at {url} refused {bundle.name!r}: its certificate maps to no user there "
                               "(a bundle of another installation?)") from exc
            last = exc
        if refusals:
            raise _tls_refusal(url, bundle, refusals[-1])
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
    raise BusError(f"no NATS server answers at {url} ({last!r}); start one with `specpilot up`, "
                   "or pass --nats URL --bundle DIR for a running server")


def _msg_key(bundle: Bundle) -> bytes:
    """The key of a publisher's stream message ids: derived from its bundle's private key, which no other
    service holds (its own bundle only: docs/DESIGN.md §2)."""
    try:
        secret = bundle.key.read_bytes()
    except OSError:
        secret = b""
    return hashlib.sha256(b"specpilot msg-id\0" + bundle.name.encode() + b"\0" + secret).digest()


def _certificate_failure(exc: BaseException) -> bool:
    """A TLS failure no retry mends: the server's certificate is not trusted, or the server refused
    ours (a TLS alert about a certificate)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and "ALERT" in str(exc.reason or exc).upper()


def _tls_refusal(url: str, bundle: Bundle, exc: ssl.SSLError) -> BusError:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return BusError(f"the server at {url} is not certified by this bundle's CA ({exc.verify_message}): it "
                        f"belongs to another installation, or {bundle.ca} is not this server's")
    return BusError(f"the server at {url} refused the TLS handshake of {bundle.name!r} ({exc.reason or exc}): is "
                    "its certificate from this server's CA?")


async def provision(admin: Bus) -> None:
    """Create the event stream and every service's durable pull consumer (idempotent, admin only)."""
    stream = api.StreamConfig(
        name=subjects.STREAM, subjects=[subjects.EVENTS_ALL], storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS, duplicate_window=DUPLICATE_WINDOW_S, allow_atomic=True,
    )
    try:
        info = await admin.js.stream_info(subjects.STREAM)
        if not info.config.allow_atomic:
            await admin.js.update_stream(stream)
    except nats.js.errors.NotFoundError:
        await admin.js.add_stream(stream)
    for service, filters in subjects.CONSUMER_FILTERS.items():
        cfg = api.ConsumerConfig(
            durable_name=subjects.consumer_name(service), ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL, ack_wait=ACK_WAIT_S.get(service, DEFAULT_ACK_WAIT_S), max_ack_pending=20_000,
            filter_subjects=filters if len(filters) > 1 else None,
            filter_subject=filters[0] if len(filters) == 1 else None,
        )
        try:
            await admin.js.consumer_info(subjects.STREAM, cfg.durable_name)
        except nats.js.errors.NotFoundError:
            await admin.js.add_consumer(subjects.STREAM, cfg)


async def raw_stream_messages(admin: Bus, start_seq: int = 1) -> AsyncIterator[tuple[int, str, bytes]]:
    """Every message in the stream from ``start_seq`` (admin only; used to rebuild a ledger)."""
    info = await admin.js.stream_info(subjects.STREAM)
    for seq in range(max(start_seq, info.state.first_seq), info.state.last_seq + 1):
        try:
            msg = await admin.js.get_msg(subjects.STREAM, seq)
        except nats.js.errors.NotFoundError:
            continue
        yield seq, msg.subject, msg.data or b""
