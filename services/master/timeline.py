"""Where a round's time went, from its events alone (pure: the events' clocks, no I/O).

`timeline` splits the round's wall time into what ran one after the other on the timing device:

- ``phase 0``: hardware, the stock profile and the ceiling (round start to ``CeilingComputed``);
- ``noise``: the stock-versus-stock timing (its ``wall_s``; 0 when a cached figure was reused);
- each candidate, from the controller taking it up (its proposal, or the controller's previous decision if
  later) to its verdict: ``checks`` (apply and the default check, up to ``PatchTested``), ``start_up``
  (the timed workers' start and warm-up: ``TimingMeasured``'s untimed seconds), ``measured`` (the timed
  requests themselves), ``timing_other`` (the rest of the timings' wall time: pauses, process exits),
  ``forcing`` (``ForcingRequested`` to its last ``ForcingReported``) and ``other`` (the profile of a
  promotion, the verdict's publication);
- ``sealed final``: ``SealedFinalRequested`` to ``SealedFinalReported``;
- ``idle``: the rest (the controller waiting for patches: planning, writing them).
The parts of each candidate add up to its span; the spans and ``idle`` add up to ``total``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specpilot import schema

NS = 1e9


def _at(e: schema.Event) -> float:
    return e.ts_ns / NS


def timeline(events: Sequence[schema.Event], until_ns: int | None = None) -> dict[str, Any]:
    """The round's time, in seconds, by phase and by candidate (module docstring); ``until_ns``: the end
    (default: the last event)."""
    events = sorted(events, key=lambda e: e.ts_ns)
    if not events:
        return {}
    start = next((e for e in events if isinstance(e, schema.RoundStarted)), events[0])
    end = (until_ns or events[-1].ts_ns) / NS
    total = max(0.0, end - _at(start))
    rows: list[dict[str, Any]] = []
    if ceiling := next((e for e in events if isinstance(e, schema.CeilingComputed)), None):
        rows.append({"what": "phase 0", "s": _at(ceiling) - _at(start)})
    noise = [e for e in events if isinstance(e, schema.TimingMeasured) and e.kind == "noise"]
    if noise:
        rows.append({"what": "noise", "s": sum(e.wall_s for e in noise), "reused": any(e.reused_from for e in noise)})

    proposed = {e.patch_id: e for e in events if isinstance(e, schema.PatchProposed)}
    busy_until = _at(ceiling) if ceiling else _at(start)
    for verdict in (e for e in events if isinstance(e, schema.VerdictIssued | schema.PatchRefused)):
        pid = verdict.patch_id
        mine = [e for e in events if getattr(e, "patch_id", None) == pid and e.ts_ns <= verdict.ts_ns]
        begun = max(_at(proposed[pid]) if pid in proposed else busy_until, busy_until)
        for e in noise:  # the noise run measured before this patch's timing is its own row
            if begun <= _at(e) <= _at(verdict):
                begun = _at(e)
        span = max(0.0, _at(verdict) - begun)
        tested = next((e for e in mine if isinstance(e, schema.PatchTested)), None)
        timings = [e for e in mine if isinstance(e, schema.TimingMeasured) and e.kind == "candidate"]
        asked = [e for e in mine if isinstance(e, schema.ForcingRequested)]
        answered = [e for e in events if isinstance(e, schema.ForcingReported) and e.patch_id == pid
                    and e.ts_ns <= verdict.ts_ns]
        start_up = sum(sum(t.incumbent_untimed_s) + sum(t.candidate_untimed_s) for t in timings)
        measured = sum(sum(t.incumbent_s) + sum(t.candidate_s) for t in timings)
        wall = sum(t.wall_s for t in timings)
        row = {"what": f"candidate {pid}", "s": span,
               "checks": max(0.0, _at(tested) - begun) if tested else 0.0,
               "start_up": start_up, "measured": measured, "timing_other": max(0.0, wall - start_up - measured),
               "forcing": max(0.0, _at(answered[-1]) - _at(asked[0])) if asked and answered else 0.0,
               "trials": sum(len(t.incumbent_s) for t in timings),
               "decision": getattr(verdict, "decision", "refused")}
        row["other"] = max(0.0, span - row["checks"] - wall - row["forcing"])
        rows.append(row)
        busy_until = _at(verdict)
    asked_final = next((e for e in events if isinstance(e, schema.SealedFinalRequested)), None)
    reported = next((e for e in events if isinstance(e, schema.SealedFinalReported)), None)
    if asked_final and reported:
        rows.append({"what": "sealed final", "s": _at(reported) - _at(asked_final)})
    return {"total_s": total, "rows": rows, "idle_s": max(0.0, total - sum(r["s"] for r in rows))}
