"""Projections: state folded from the event log, pure and deterministic.

The memory service folds each recorded event into the live projections and writes them in the same
transaction; ``specpilot replay`` folds the whole log again and compares the two byte for byte.
A projection is a JSON object; ``canonical()`` renders each one with sorted keys.
"""

from __future__ import annotations

import json
from typing import Any

from specpilot import schema


class State:
    """The live projections: event counts, patches and their verdicts, best systems, memory entries."""

    NAMES = ("counts", "patches", "best", "memory_entries", "rounds")

    def __init__(self) -> None:
        self.views: dict[str, dict[str, Any]] = {n: {} for n in self.NAMES}

    def reset_to(self, canonical: dict[str, str]) -> None:
        self.views = {n: json.loads(canonical[n]) if n in canonical else {} for n in self.NAMES}

    def fold(self, e: schema.Event) -> None:
        v = self.views
        v["counts"][e.tag] = v["counts"].get(e.tag, 0) + 1
        match e:
            case schema.PatchProposed():
                v["patches"][e.patch_id] = {"direction_id": e.direction_id, "status": "proposed",
                                            "options": e.options, "proposed_by": e.event_id}
            case schema.PatchRefused():
                v["patches"].setdefault(e.patch_id, {})["status"] = "refused"
            case schema.PatchTested():
                v["patches"].setdefault(e.patch_id, {})["tests_passed"] = e.passed
            case schema.VerdictIssued():
                p = v["patches"].setdefault(e.patch_id, {})
                p.update(status=e.decision, gain=e.gain, lower_bound=e.lower_bound, bar=e.bar,
                         verdict=e.event_id)
            case schema.ForcingReported() if e.patch_id:
                v["patches"].setdefault(e.patch_id, {})["forcing_passed"] = e.passed
            case schema.BestAdvanced():
                v["best"][e.deployment] = {"commit": e.commit, "patch_id": e.patch_id, "event": e.event_id}
            case schema.MemoryEntryProposed():
                v["memory_entries"][e.entry_id] = {"status": "proposed", "title": e.title}
            case schema.MemoryEntryAccepted():
                v["memory_entries"].setdefault(e.entry_id, {})["status"] = "accepted"
            case schema.MemoryEntryRejected():
                v["memory_entries"].setdefault(e.entry_id, {})["status"] = "rejected"
            case schema.RoundStarted():
                v["rounds"][e.round_id] = {"deployment": e.deployment, "status": "started"}
            case schema.RoundFinished():
                v["rounds"].setdefault(e.round_id, {})["status"] = "finished"
            case schema.SealedFinalReported():
                v["rounds"].setdefault(e.round_id, {})["sealed"] = e.event_id
            case _:
                pass

    def canonical(self) -> dict[str, str]:
        return {n: json.dumps(self.views[n], sort_keys=True, separators=(",", ":")) for n in self.NAMES}
