"""Every NATS subject, stream and consumer name. No other module spells a subject.

Layout:
- ``sp.ev.<source>.<event tag>``: events, captured by the JetStream stream ``SP_EVENTS``.
  A service may publish only under its own ``sp.ev.<source>.>`` (server-side permissions).
- ``sp.rpc.<service>.<endpoint>``: request/reply endpoints served through NATS micro.
- One durable pull consumer per service on ``SP_EVENTS``, created by the admin set-up step only.
- ``_INBOX_<user>.>``: each user's private reply inbox, so no user can read another's replies.
"""

from __future__ import annotations

from specpilot.schema import CONTROLLER, FORCER, MASTER, MEMORY, SERVICES, SUBAGENT

STREAM = "SP_EVENTS"
EVENTS_ALL = "sp.ev.>"
ADMIN = "admin"


def event_prefix(source: str) -> str:
    return f"sp.ev.{source}"


def event_subject(source: str, tag: str) -> str:
    return f"{event_prefix(source)}.{tag}"


def source_of(subject: str) -> str | None:
    """The publishing service a subject proves (its prefix is guarded by the server)."""
    parts = subject.split(".", 3)
    if len(parts) >= 4 and parts[0] == "sp" and parts[1] == "ev" and parts[2] in SERVICES:
        return parts[2]
    return None


# What each service's durable consumer is filtered on (what it reacts to).
CONSUMER_FILTERS: dict[str, list[str]] = {
    MEMORY: [EVENTS_ALL],
    MASTER: [event_prefix(s) + ".>" for s in (SUBAGENT, CONTROLLER, FORCER, MEMORY)],
    SUBAGENT: [event_prefix(MASTER) + ".>"],
    CONTROLLER: [event_prefix(s) + ".>" for s in (MASTER, SUBAGENT, FORCER)],
    FORCER: [event_prefix(CONTROLLER) + ".>"],
}


def consumer_name(service: str) -> str:
    return service


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def rpc(service: str, endpoint: str) -> str:
    return f"sp.rpc.{service}.{endpoint}"


RPC_SQL = rpc(MEMORY, "sql")
RPC_AUDIT = rpc(MEMORY, "audit")
RPC_REPLAY = rpc(MEMORY, "replay")
RPC_EXPORT = rpc(MEMORY, "export")
RPC_ENTRIES = rpc(MEMORY, "entries")
RPC_EVENTS = rpc(MEMORY, "events")  # typed reads of events (specpilot.reads.EventQuery)
RPC_VIEW = rpc(MEMORY, "view")  # typed reads of projections (specpilot.reads.ViewQuery)
RPC_IMPORT = rpc(MEMORY, "import")  # memory entries from another data directory (admin only)
SERVICE_RPCS = (RPC_SQL, RPC_AUDIT, RPC_REPLAY, RPC_ENTRIES, RPC_EVENTS, RPC_VIEW)  # memory endpoints a service user may call
RPC_SYSTEM = rpc(CONTROLLER, "system")  # the best system of a deployment as code: its diff from stock, its trees
MICRO_DISCOVERY = "$SRV.INFO"
MICRO_ALL = "$SRV.>"

JS_API = "$JS.API"


def js_next(service: str) -> str:
    return f"{JS_API}.CONSUMER.MSG.NEXT.{STREAM}.{consumer_name(service)}"


def js_ack(service: str) -> str:
    return f"$JS.ACK.{STREAM}.{consumer_name(service)}.>"


def js_consumer_info(service: str) -> str:
    return f"{JS_API}.CONSUMER.INFO.{STREAM}.{consumer_name(service)}"


def permissions(service: str) -> dict[str, dict[str, list[str]]]:
    """Server-side permissions of one service user (allow lists; everything else is denied).

    A service may publish its own events, fetch from and ack its own consumer, ask memory for
    read-only queries (`SERVICE_RPCS`: not ``export``, which writes files where it is told; that is
    the admin's), and answer micro discovery; the master may also ask it (the version handshake,
    `specpilot.handshake`), and a subagent the controller's best system (`RPC_SYSTEM`). It may not touch ``$JS.API.STREAM.*`` nor create or delete consumers.
    """
    publish = [
        event_prefix(service) + ".>",
        js_next(service),
        js_ack(service),
        js_consumer_info(service),
        *SERVICE_RPCS,
        *([MICRO_DISCOVERY] if service == MASTER else []),
        *([RPC_SYSTEM] if service == SUBAGENT else []),
    ]
    subscribe = [inbox_prefix(service) + ".>", MICRO_ALL, rpc(service, ">")]
    return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
