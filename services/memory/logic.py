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
