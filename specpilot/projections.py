"""Projections: state folded from the event log, pure and deterministic, and what reads are served from.

The memory service folds each recorded event into the live projections and writes them in the same
transaction; its `reads` endpoint (`specpilot.reads.ViewQuery`) answers "is this patch decided",
"what is the best system", "which rounds are open" from them without scanning the log. ``specpilot
replay`` folds the whole log again and compares the two byte for byte.

Each view maps a key to a typed row (`PatchView`, `BestView`, `EntryView`, `RoundView`; ``counts``
maps event tags to counts). ``canonical()`` renders each view as JSON with sorted keys, plus
``version``. A change to what a view holds bumps `VERSION`: a ledger whose live projections are of
another version has them rebuilt from its log when the memory service opens it (`Ledger.__init__`),
and ``replay`` reports such projections as stale, not as tampered with.
"""

from __future__ import annotations

from typing import Any

import msgspec

from specpilot import schema

VERSION = 2
DECIDED = frozenset({"refused", "promote", "reject"})


class PatchView(msgspec.Struct, kw_only=True):
    """A patch as the log has decided it so far."""

    direction_id: str = ""
    deployment: str = ""
    status: str = "proposed"  # proposed | refused | promote | reject
    options: dict[str, Any] = {}
    proposed_by: str = ""  # the PatchProposed event
    tests_passed: bool | None = None
    forcing_passed: bool | None = None
    gain: float | None = None
    lower_bound: float | None = None
    bar: float | None = None
    verdict: str = ""  # the VerdictIssued event

    @property
    def decided(self) -> bool:
        return self.status in DECIDED


class BestView(msgspec.Struct, kw_only=True):
    """A deployment's current best system (its last BestAdvanced)."""

    commit: str
    patch_id: str = ""
    options: dict[str, Any] = {}
    gain: float = 0.0
    event: str = ""  # the BestAdvanced event


class EntryView(msgspec.Struct, kw_only=True):
    status: str = "proposed"  # proposed | accepted | rejected
    title: str = ""


class RoundView(msgspec.Struct, kw_only=True):
    deployment: str = ""
    status: str = "started"  # started | finished
    sealed: str = ""  # the SealedFinalReported event


ROWS: dict[str, type] = {"counts": int, "patches": PatchView, "best": BestView, "memory_entries": EntryView,
                         "rounds": RoundView}


class State:
    """The live projections: event counts, patches and their verdicts, best systems, memory entries, rounds."""

    NAMES = tuple(ROWS)

    def __init__(self) -> None:
        self.views: dict[str, dict[str, Any]] = {n: {} for n in self.NAMES}

    def reset_to(self, canonical: dict[str, str]) -> None:
        """The views as ``canonical()`` wrote them (empty when they are of another version)."""
        if canonical.get("version") != str(VERSION):
            canonical = {}
        self.views = {n: msgspec.json.decode(canonical[n], type=dict[str, ROWS[n]]) if n in canonical else {}
                      for n in self.NAMES}

    def fold(self, e: schema.Event) -> None:
        v = self.views
        v["counts"][e.tag] = v["counts"].get(e.tag, 0) + 1
        patches = v["patches"]
        match e:
            case schema.PatchProposed():
                patches[e.patch_id] = PatchView(direction_id=e.direction_id, deployment=e.deployment,
                                                options=dict(e.options), proposed_by=e.event_id)
            case schema.PatchRefused():
                patches.setdefault(e.patch_id, PatchView()).status = "refused"
            case schema.PatchTested():
                patches.setdefault(e.patch_id, PatchView()).tests_passed = e.passed
            case schema.VerdictIssued():
                p = patches.setdefault(e.patch_id, PatchView())
                p.status, p.gain, p.lower_bound, p.bar, p.verdict = e.decision, e.gain, e.lower_bound, e.bar, e.event_id
            case schema.ForcingReported() if e.patch_id:
                patches.setdefault(e.patch_id, PatchView()).forcing_passed = e.passed
            case schema.BestAdvanced():
                v["best"][e.deployment] = BestView(commit=e.commit, patch_id=e.patch_id, options=dict(e.options),
                                                   gain=e.gain, event=e.event_id)
            case schema.MemoryEntryProposed():
                v["memory_entries"][e.entry_id] = EntryView(title=e.title)
            case schema.MemoryEntryAccepted():
                v["memory_entries"].setdefault(e.entry_id, EntryView()).status = "accepted"
            case schema.MemoryEntryRejected():
                v["memory_entries"].setdefault(e.entry_id, EntryView()).status = "rejected"
            case schema.RoundStarted():
                v["rounds"][e.round_id] = RoundView(deployment=e.deployment)
            case schema.RoundFinished():
                v["rounds"].setdefault(e.round_id, RoundView()).status = "finished"
            case schema.SealedFinalReported():
                v["rounds"].setdefault(e.round_id, RoundView()).sealed = e.event_id
            case _:
                pass

    def canonical(self) -> dict[str, str]:
        rows = {n: msgspec.json.encode(self.views[n], order="sorted").decode() for n in self.NAMES}
        return {**rows, "version": str(VERSION)}

    def view(self, name: str, keys: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """One view, or only its rows of ``keys`` (those that exist)."""
        if name not in self.views:
            raise ValueError(f"no projection named {name!r}; known: {', '.join(self.NAMES)}")
        rows = self.views[name]
        return {k: rows[k] for k in keys if k in rows} if keys else dict(rows)
