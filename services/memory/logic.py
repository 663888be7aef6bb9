"""The recorder's decisions, pure: what to record, what to dead-letter, what to retry.

Given the messages of one fetch, ``classify`` returns a ``Plan``:
- authorised events are recorded as themselves;
- an event whose type its subject's source may not publish, or whose id that source did not mint
  (`bus.authorised`), is recorded as a ``SecurityViolation`` instead (deterministic id, so a redelivery
  is absorbed like any duplicate);
- bytes that do not decode are retried until ``bus.DECODE_ATTEMPTS`` deliveries, then dead-lettered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from specpilot import schema, subjects
from specpilot.bus import Delivery, authorised, retries_exhausted
from specpilot.ledger import DeadLetter, Incoming


@dataclass
class Plan:
    record: list[Incoming] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    retry: list[Delivery] = field(default_factory=list)  # nak: not decodable yet, deliveries left
    finished: list[Delivery] = field(default_factory=list)  # ack after commit
    dead_deliveries: list[Delivery] = field(default_factory=list)  # term after commit


def violation(d: Delivery, event: schema.Event, why: str) -> schema.SecurityViolation:
    return schema.SecurityViolation(
        event_id=f"{schema.MEMORY}:security-violation-{d.seq}", ts_ns=event.ts_ns, source=schema.MEMORY,
        round_id=event.round_id, deployment=event.deployment, causation_id=event.event_id,
        subject=d.subject, claimed_type=event.tag, claimed_source=subjects.source_of(d.subject) or "",
        reason=why, seq=d.seq, payload_sha256=hashlib.sha256(d.data).hexdigest(),
    )


def classify(deliveries: list[Delivery], legacy_ids: bool = False) -> Plan:
    """``legacy_ids``: accept ids that name no minter (a stream from before ids carried their source)."""
    plan = Plan()
    for d in deliveries:
        try:
            event = schema.decode(d.data)
        except schema.DecodeError as exc:
            if retries_exhausted(d):
                plan.dead.append(DeadLetter(d.subject, d.seq, d.data, str(exc), d.num_delivered))
                plan.dead_deliveries.append(d)
            else:
                plan.retry.append(d)
            continue
        if why := authorised(d.subject, event, legacy_ids):
            v = violation(d, event, why)
            plan.record.append(Incoming(subjects.event_subject(schema.MEMORY, v.tag), d.seq, v, schema.encode(v)))
        else:
            plan.record.append(Incoming(d.subject, d.seq, event, d.data))
        plan.finished.append(d)
    return plan


@dataclass
class StreamCheck:
    """The ledger against the stream, message by message (`check_stream`)."""

    messages: int = 0  # in the stream
    recorded: int = 0  # of them recorded under their own sequence (as themselves or as a SecurityViolation)
    dead: int = 0  # of them dead-lettered (never decoded)
    missing: list[int] = field(default_factory=list)  # stream sequences the ledger holds nowhere: lost
    repeated: list[str] = field(default_factory=list)  # event ids the stream holds more than once
    strays: list[int] = field(default_factory=list)  # ledger sequences the stream does not hold

    @property
    def ok(self) -> bool:
        return not (self.missing or self.repeated or self.strays)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "messages": self.messages, "recorded": self.recorded, "dead": self.dead,
                "missing": self.missing[:50], "repeated": self.repeated[:50], "strays": self.strays[:50]}


def check_stream(messages, recorded: dict[int, str], dead: set[int]) -> StreamCheck:
    """Whether every stream message ``(seq, subject, raw)`` was recorded exactly once: under its own
    sequence in ``recorded`` (ledger ``seq -> event_id``) or in ``dead`` (dead-letter sequences). A message
    whose event id the ledger holds under another sequence is the same event published twice (the ledger
    kept one; the stream's dedupe window had passed); one recorded nowhere is lost."""
    out, ids, seen = StreamCheck(), set(recorded.values()), set()
    for seq, _subject, raw in messages:
        out.messages += 1
        seen.add(seq)
        if seq in recorded:
            out.recorded += 1
        elif seq in dead:
            out.dead += 1
        else:
            try:
                event_id = schema.decode(raw).event_id
            except schema.DecodeError:
                event_id = ""
            (out.repeated.append(event_id) if event_id in ids else out.missing.append(seq))
    out.strays = sorted(set(recorded) - seen)
    return out
