"""LLM providers: a tool loop over a workspace, through the Anthropic or OpenAI SDK. The only module
that imports ``anthropic`` or ``openai``.

Contract: ``tool_loop(spec, key, system, task, toolbox, usage, max_turns)`` drives one conversation over
any toolbox (``specs``: name/description/input_schema dicts; ``call(name, args)`` → ``ToolResult``;
``finished``: set when the conversation is done); the master's LLM planner uses it with its own
``plan`` tool. ``propose(spec, direction, tools, key)`` is the subagent's conversation. The system prompt states
the direction (title, rationale, factor, hints), the deployment, what an engine option is and the
rules; the model calls the tools of ``workspace.TOOL_SPECS`` (executed by ``workspace.Tools``) until an
accepted ``finish``, which yields a ``Proposal`` (the workspace's diff against its base, the finish's
options and notes). No ``finish`` within ``max_turns`` model calls, a finish with neither a diff nor
options, or an SDK error (after the SDK's own retries) is a ``ProviderError``.

- Anthropic: ``client.messages.create(model, max_tokens, system, tools, messages)``; every ``tool_use``
  block of a reply is answered by a ``tool_result`` block with its ``tool_use_id`` in the next user turn.
- OpenAI and OpenAI-compatible servers: ``client.chat.completions.create(model, messages, tools)``; every
  ``tool_calls`` entry is answered by a ``{"role": "tool", "tool_call_id": ...}`` message.
A reply without tool calls gets one user nudge to use the tools or finish (it costs a turn).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import anthropic
import openai

from services.subagent.offline import Proposal
from services.subagent.providers import ANTHROPIC, ProviderError, ProviderSpec
from services.subagent.workspace import TOOL_SPECS, Tools
from specpilot import schema

log = logging.getLogger("subagent")

DEFAULT_MAX_TURNS = 30
DEFAULT_MAX_TOKENS = 8192
REQUEST_TIMEOUT_S = 600.0
NUDGE = ("Use the tools to make the change. When the patch is ready, call finish(options, notes); "
         "if you find nothing worth trying, call finish with empty options and say why in notes.")


@dataclass
class Usage:
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tools: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.turns} turns, {self.input_tokens} input / {self.output_tokens} output tokens"


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
accumulate), run_tests(pattern, path) (pytest -k over tests/engine), finish(options, notes). Read before you \
edit, run the relevant tests after, and call finish within {max_turns} turns."""


def task_message(direction: schema.DirectionPlanned) -> str:
    return f"Direction {direction.direction_id}: {direction.title}. Start by reading the code it concerns."


def propose(spec: ProviderSpec, direction: schema.DirectionPlanned, tools: Tools, key: str,
            best_options: dict | None = None, max_turns: int = DEFAULT_MAX_TURNS,
            max_tokens: int = DEFAULT_MAX_TOKENS) -> Proposal:
    """Run the tool loop of ``spec`` until ``finish``; the patch as a ``Proposal``."""
    system = system_prompt(direction, best_options or {}, max_turns)
    usage = Usage()
    tool_loop(spec, key, system, task_message(direction), tools, usage, max_turns, max_tokens)
    done = tools.finished
    if done is None:
        raise ProviderError(f"{spec}: no finish within {max_turns} turns ({usage.summary()})")
    diff = tools.ws.diff()
    if not diff.strip() and not done.options:
        raise ProviderError(f"{spec}: finished without a change ({done.notes.strip()[:500] or 'no notes'})")
    notes = f"{done.notes.strip()}\n[{spec}: {usage.summary()}; tools: {' '.join(usage.tools)}]".strip()
    return Proposal(diff=diff, options=done.options, notes=notes)


def tool_loop(spec: ProviderSpec, key: str, system: str, task: str, toolbox, usage: Usage,
              max_turns: int = DEFAULT_MAX_TURNS, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    """Converse until ``toolbox.finished`` is set or ``max_turns`` model calls; SDK errors → ProviderError."""
    try:
        if spec.kind == ANTHROPIC:
            _anthropic_loop(spec, key, system, task, toolbox, usage, max_turns, max_tokens)
        else:
            _openai_loop(spec, key, system, task, toolbox, usage, max_turns)
    except (anthropic.APIError, openai.APIError) as exc:
        raise ProviderError(f"{spec}: {type(exc).__name__}: {exc}") from exc


# --- Anthropic -----------------------------------------------------------------------------------


def _anthropic_tools(specs: list[dict]) -> list[dict]:
    return [{"name": t["name"], "description": t["description"], "input_schema": t["input_schema"]} for t in specs]


def _anthropic_block(block) -> dict:
    """A reply's content block as the dict sent back in the next request."""
    if block.type == "text":
        return {"type": "text", "text": block.text}
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    return block.model_dump(mode="json", exclude_none=True)  # thinking blocks etc. go back as they came


def _anthropic_loop(spec: ProviderSpec, key: str, system: str, task: str, tools: Tools, usage: Usage,
                    max_turns: int, max_tokens: int) -> None:
    client = anthropic.Anthropic(api_key=key, base_url=spec.base_url, timeout=REQUEST_TIMEOUT_S)
    specs = _anthropic_tools(getattr(tools, "specs", TOOL_SPECS))
    messages: list[dict] = [{"role": "user", "content": task}]
    while usage.turns < max_turns:
        reply = client.messages.create(model=spec.model, max_tokens=max_tokens, system=system, tools=specs,
                                       messages=messages)
        usage.turns += 1
        if reply.usage is not None:
            usage.input_tokens += reply.usage.input_tokens or 0
            usage.output_tokens += reply.usage.output_tokens or 0
        messages.append({"role": "assistant", "content": [_anthropic_block(b) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            log.info("%s turn %d: no tool call (stop_reason %s)", spec, usage.turns, reply.stop_reason)
            messages.append({"role": "user", "content": NUDGE})
            continue
        results = []
        for u in uses:
            res = tools.call(u.name, u.input if isinstance(u.input, dict) else {})
            usage.tools.append(u.name)
            log.info("%s turn %d: %s -> %s", spec, usage.turns, u.name, "error" if res.error else "ok")
            results.append({"type": "tool_result", "tool_use_id": u.id, "content": res.text, "is_error": res.error})
        messages.append({"role": "user", "content": results})
        if tools.finished is not None:
            return


# --- OpenAI and OpenAI-compatible ----------------------------------------------------------------


def _openai_tools(specs: list[dict]) -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in specs]


def _openai_loop(spec: ProviderSpec, key: str, system: str, task: str, tools: Tools, usage: Usage,
                 max_turns: int) -> None:
    client = openai.OpenAI(api_key=key, base_url=spec.base_url, timeout=REQUEST_TIMEOUT_S)
    specs = _openai_tools(getattr(tools, "specs", TOOL_SPECS))
    messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    while usage.turns < max_turns:
        reply = client.chat.completions.create(model=spec.model, messages=messages, tools=specs)
        usage.turns += 1
        if reply.usage is not None:
            usage.input_tokens += reply.usage.prompt_tokens or 0
            usage.output_tokens += reply.usage.completion_tokens or 0
        if not reply.choices:
            raise ProviderError(f"{spec}: a reply without choices")
        msg = reply.choices[0].message
        calls = list(msg.tool_calls or [])
        sent: dict = {"role": "assistant", "content": msg.content}
        if calls:
            sent["tool_calls"] = [_openai_call(c) for c in calls]
        elif msg.content is None:
            sent["content"] = ""
        messages.append(sent)
        if not calls:
            log.info("%s turn %d: no tool call (finish_reason %s)", spec, usage.turns, reply.choices[0].finish_reason)
            messages.append({"role": "user", "content": NUDGE})
            continue
        for c in calls:
            name = getattr(getattr(c, "function", None), "name", "") or ""
            try:
                args = json.loads(c.function.arguments or "{}") if c.type == "function" else None
            except (json.JSONDecodeError, TypeError) as exc:
                args, text = None, f"the arguments are not valid JSON: {exc}"
            else:
                text = "only function tools exist here" if args is None else ""
            if args is not None:
                res = tools.call(name, args if isinstance(args, dict) else {})
                text = res.text if not res.error else f"error: {res.text}"
                log.info("%s turn %d: %s -> %s", spec, usage.turns, name, "error" if res.error else "ok")
            usage.tools.append(name or "?")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": text})
        if tools.finished is not None:
            return


def _openai_call(c) -> dict:
    if c.type == "function":
        return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
    return c.model_dump(mode="json", exclude_none=True)
