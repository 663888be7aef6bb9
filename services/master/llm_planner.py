"""An LLM as the master's planner (``--planner anthropic[:MODEL] | openai[:MODEL] | openai-compatible:URL``).

The model sees what the rules planner sees — the cost model's factors and ceiling, the profile by
kernel class, the replayed tree tau, the engine's options with their stock values, what was already
tried, accepted memory entries — plus the wave's evidence (`specpilot.evidence.bundle`: every attempt on
the deployment with its verdict, gain, bound and reason), and answers with one call of the ``plan`` tool: a list of
directions, each either an option sweep (``option`` + ``values``, run by the ``sweep`` subagent) or an
open task for the coder (only when the coder is an LLM). Directions naming an unknown option or
factor, and directions the evidence shows rejected from the same base without a ``new_evidence`` saying
what is new, are refused back to the model, which may correct them within ``MAX_TURNS``. The conversation
runs through `specpilot.llm.tool_loop` (the one module that imports the SDKs); providers
and keys are `specpilot.providers`'. On any failure the caller falls back to the rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from specpilot import evidence
from specpilot.llm import ToolResult, Usage, tool_loop
from specpilot.providers import OFFLINE, ProviderError, api_key, parse_provider
from specpilot.services.master.costmodel import FACTORS
from specpilot.services.master.planner import Direction

MAX_TURNS = 4
MAX_WALL_S = 600.0
PLAN_TOOL = {
    "name": "plan",
    "description": "Submit the next wave of directions (at most the number of free devices).",
    "input_schema": {
        "type": "object",
        "properties": {"directions": {"type": "array", "items": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "factor": {"type": "string", "enum": list(FACTORS)},
                "rationale": {"type": "string"},
                "option": {"type": "string", "description": "an engine option to sweep (omit for an open task)"},
                "values": {"type": "array", "description": "values of that option to time"},
                "new_evidence": {"type": "string", "description": "required to try again what the evidence shows "
                                 "rejected from the same base: what is new since (a changed best, a new measurement)"},
            },
            "required": ["title", "factor"],
        }}},
        "required": ["directions"],
    },
}


class PlanBox:
    """The planner's one tool: ``plan(directions)``, validated into `Direction`s."""

    specs = [PLAN_TOOL]

    def __init__(self, known_options: set[str], best_options: dict[str, Any], coder: str, devices: int,
                 attempts: list[dict[str, Any]] = ()):
        """``attempts``: what was tried on the deployment (`specpilot.evidence.attempts`)."""
        self.known, self.best, self.coder, self.devices = known_options, best_options, coder, devices
        self.attempts = list(attempts)
        self.finished: list[Direction] | None = None

    def _again(self, d: dict[str, Any]) -> str:
        """Why ``d`` repeats a refuted direction without naming new evidence ('' when it does not)."""
        if str(d.get("new_evidence") or "").strip():
            return ""
        option = d.get("option")
        if option:
            old = [v for v in d.get("values") or [] if evidence.refuted(self.attempts, option, v, self.best)]
            return f"{option} = {', '.join(map(repr, old))} was already rejected from this base" if old else ""
        title = str(d.get("title", "")).strip().casefold()
        if any(a["decision"] in ("reject", "refused") and str(a["direction"]).strip().casefold() == title
               for a in self.attempts):
            return f"{d['title']!r} was already tried and rejected"
        return ""

    def call(self, name: str, args: dict | None) -> ToolResult:
        if name != "plan":
            return ToolResult(f"there is no tool {name!r}; call plan(directions)", error=True)
        items = (args or {}).get("directions")
        if not isinstance(items, list) or not items:
            return ToolResult("directions must be a non-empty list", error=True)
        out, problems = [], []
        for i, d in enumerate(items[: self.devices]):
            if not isinstance(d, dict) or not isinstance(d.get("title"), str):
                problems.append(f"direction {i}: needs a title")
                continue
            factor = d.get("factor", "")
            if factor not in FACTORS:
                problems.append(f"direction {i}: factor must be one of {list(FACTORS)}")
                continue
            if again := self._again(d):
                problems.append(f"direction {i}: {again} (see tried in the evidence); plan something else, or "
                                "say in new_evidence what is new since")
                continue
            option = d.get("option")
            note = {"new_evidence": str(d["new_evidence"])} if d.get("new_evidence") else {}
            if option:
                values = d.get("values")
                if option not in self.known or not isinstance(values, list) or not values:
                    problems.append(f"direction {i}: option must be one of {sorted(self.known)} with a list of values")
                    continue
                out.append(Direction(title=d["title"], factor=factor, provider="sweep", rationale=d.get("rationale", ""),
                                     hints={"option": option, "values": values, "base": dict(self.best), **note}))
            elif self.coder in OFFLINE:
                problems.append(f"direction {i}: the coder ({self.coder}) only runs option sweeps: give option and values")
            else:
                out.append(Direction(title=d["title"], factor=factor, provider=self.coder,
                                     rationale=d.get("rationale", ""), hints={"best_options": dict(self.best), **note}))
        if problems:
            return ToolResult("; ".join(problems), error=True)
        self.finished = out
        return ToolResult(f"planned {len(out)} direction(s)")


def system_prompt(context: dict[str, Any], devices: int, coder: str) -> str:
    return f"""You plan the next wave of a SpecPilot round. SpecPilot makes a speculative-decoding engine \
faster without changing its outputs: each direction you plan becomes a patch (an option sweep, or code \
written by the coder `{coder}`), which a controller times against the current best in paired trials.

The cost model splits the gap to the speed ceiling into three factors (each >= 1; the largest is where \
the time goes): tau (tokens per step the drafter leaves on the table, from exact replay), kernel (kernel \
time over byte/FLOP floors), overhead (step time over kernel time).

What is known (JSON):
{json.dumps(context, indent=1, sort_keys=True, default=str)}

Plan at most {devices} direction(s) with one call of plan(directions). Prefer directions whose values were \
not tried and that attack the largest factor in this regime (device, dtype). A direction the evidence shows \
rejected from the same base is refused unless new_evidence says what is new since."""


def plan_with_llm(planner: str, context: dict[str, Any], known_options: set[str], best_options: dict[str, Any],
                  coder: str, devices: int, env: Mapping[str, str] | None = None,
                  usage: Usage | None = None) -> list[Direction]:
    """The model's directions; ProviderError (or MissingKey) when it gives none. ``usage`` (filled also
    when it fails) is the caller's to report."""
    spec = parse_provider(planner)
    if spec.kind in OFFLINE:
        raise ProviderError(f"{planner} is not an LLM; planners are 'rules' or an LLM provider")
    key = api_key(spec, env)
    box = PlanBox(known_options, best_options, coder, devices, (context.get("evidence") or {}).get("tried", []))
    usage = usage if usage is not None else Usage()
    tool_loop(spec, key, system_prompt(context, devices, coder), "Plan the next wave.", box, usage, MAX_TURNS,
              max_wall_s=MAX_WALL_S)
    if box.finished is None:
        raise ProviderError(f"{spec}: no valid plan within {MAX_TURNS} turns ({usage.summary()})")
    return box.finished
