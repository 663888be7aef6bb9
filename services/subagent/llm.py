"""The subagent's conversation: one direction in, one patch out, through the shared LLM tool loop
(`specpilot.llm.tool_loop`) over a workspace's tools (`workspace.Tools`).

``propose(spec, direction, tools, key)`` states the direction (title, rationale, factor, hints), the
deployment, the evidence the master sent with it (`specpilot.evidence`), what an engine option is and
the rules in the system prompt; the model calls the tools of
``workspace.TOOL_SPECS`` until an accepted ``finish``, which yields a ``Proposal`` (the workspace's diff
against its base, the finish's options and notes). No ``finish`` within ``max_turns`` model calls, a
finish with neither a diff nor options, or an SDK error is a ``ProviderError``.
"""

from __future__ import annotations

import json

from specpilot import evidence, schema
from specpilot.llm import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TURNS, Usage, tool_loop
from specpilot.providers import ProviderError, ProviderSpec
from specpilot.services.subagent.offline import Proposal
from specpilot.services.subagent.workspace import Tools

NUDGE = ("Use the tools to make the change. When the patch is ready, call finish(options, notes); "
         "if you find nothing worth trying, call finish with empty options and say why in notes.")


def system_prompt(direction: schema.DirectionPlanned, best_options: dict, max_turns: int) -> str:
    hints = json.dumps(direction.hints, sort_keys=True, default=str) if direction.hints else "none"
    dep = direction.deployment or "(default)"
    return f"""You are a SpecPilot subagent. SpecPilot makes a speculative-decoding engine faster without changing \
what it outputs. You turn one direction into one patch.

Deployment: {dep} (its spec is deployments/{dep}.toml; device {direction.device or "as the spec says"})
Direction: {direction.title}
Gap it attacks: {direction.factor or "unspecified"}
Rationale: {direction.rationale or "none given"}
Hints: {hints}
Option settings of the current best system: {json.dumps(best_options, sort_keys=True) if best_options else "stock"}

Evidence (measured on this deployment: the device, the current best's profile per kernel class, its \
replayed tau and chain costs c(N), the cost model's ceiling and factors, the memory entries that apply, and \
every patch tried so far with its verdict, gain, lower bound, bar and reason; do not repeat a rejected \
attempt unless you know why it would now win):
{evidence.render(direction.evidence)}

Your workspace is a copy of the current best system:
- engine/: a compact PyTorch speculative-decoding engine (read engine/README.md first);
- kernels/: Triton kernels, each with a PyTorch reference beside it;
- tests/engine/: the engine's tests (you may run them, never change them);
- deployments/: deployment specs (request sets are off limits).

What an option is: engine/options.py holds EngineOptions, one frozen dataclass whose defaults are stock. \
A new mechanism must be a new field of EngineOptions whose default reproduces stock exactly (same code path, \
same tokens bit for bit); the mechanism runs only when the options you pass to finish turn it on. You may also \
just choose values of existing options.

Rules:
1. Change only files under engine/ and kernels/. Diffs touching tests, deployments, services or anything \
else are refused.
2. With default options the patched engine must emit exactly the current best's tokens.
3. With your options the outputs must remain the target model's own greedy choices: speed from skipping \
work that changes tokens, truncating answers, or remembering answers between requests is rejected.
4. The controller applies your patch in a sandbox, tests it, and times it against the current best in \
paired trials; only a measured speed-up is promoted. Keep the patch small and correct.

Tools: list_files(path), read_file(path), apply_diff(diff) (a unified diff with a/ and b/ prefixes; diffs \
accumulate), run_tests(pattern, path) (pytest -k over tests/engine), quick_time(options) and profile(options) \
(advice from two public dev requests, never a verdict), finish(options, notes). Read before you edit, run the \
relevant tests after, and call finish within {max_turns} turns."""


def task_message(direction: schema.DirectionPlanned) -> str:
    return f"Direction {direction.direction_id}: {direction.title}. Start by reading the code it concerns."


def propose(spec: ProviderSpec, direction: schema.DirectionPlanned, tools: Tools, key: str,
            best_options: dict | None = None, max_turns: int = DEFAULT_MAX_TURNS,
            max_tokens: int = DEFAULT_MAX_TOKENS, usage: Usage | None = None, max_wall_s: float | None = None,
            max_total_tokens: int | None = None) -> Proposal:
    """Run the tool loop of ``spec`` until ``finish`` or a budget is spent; the patch as a ``Proposal``.
    ``usage`` (filled as the conversation goes, also when it fails) is the caller's to report."""
    system = system_prompt(direction, best_options or {}, max_turns)
    usage = usage if usage is not None else Usage()
    tool_loop(spec, key, system, task_message(direction), tools, usage, max_turns, max_tokens, nudge=NUDGE,
              max_wall_s=max_wall_s, max_total_tokens=max_total_tokens)
    done = tools.finished
    if done is None:
        limit = f"within {max_turns} turns" if usage.ended == "turns" else f"before its {usage.ended} budget ran out"
        raise ProviderError(f"{spec}: no finish {limit} ({usage.summary()})")
    diff = tools.ws.diff()
    if not diff.strip() and not done.options:
        raise ProviderError(f"{spec}: finished without a change ({done.notes.strip()[:500] or 'no notes'})")
    notes = f"{done.notes.strip()}\n[{spec}: {usage.summary()}; tools: {' '.join(usage.tools)}]".strip()
    return Proposal(diff=diff, options=done.options, notes=notes)
