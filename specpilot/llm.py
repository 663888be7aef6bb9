"""The LLM tool loop, through the Anthropic or OpenAI SDK: the only module that imports ``anthropic`` or
``openai`` (when a conversation runs, not on import). Shared by the services that converse with a model
(the subagent's patch writer, the master's planner); it knows nothing of either.

Contract: ``tool_loop(spec, key, system, task, toolbox, usage, max_turns)`` drives one conversation over
any toolbox (``specs``: name/description/input_schema dicts; ``call(name, args)`` → `ToolResult`;
``finished``: set when the conversation is done). No SDK error escapes: after the SDK's own retries it is a
`ProviderError`.

- Anthropic: ``client.messages.create(model, max_tokens, system, tools, messages)``; every ``tool_use``
  block of a reply is answered by a ``tool_result`` block with its ``tool_use_id`` in the next user turn.
- OpenAI and OpenAI-compatible servers: ``client.chat.completions.create(model, messages, tools)``; every
  ``tool_calls`` entry is answered by a ``{"role": "tool", "tool_call_id": ...}`` message.
A reply without tool calls gets one user nudge (``nudge``) to use the tools or finish (it costs a turn).

Budgets: a conversation ends at ``max_turns`` model calls, ``max_wall_s`` seconds or ``max_total_tokens``
tokens (input plus output), whichever comes first; ``usage`` says what it cost and why it ended
(``finished``, ``turns``, ``wall``, ``tokens`` or ``error``), for the caller's `schema.ConversationUsed`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from specpilot import schema
from specpilot.providers import ANTHROPIC, ProviderError, ProviderSpec

log = logging.getLogger("llm")

DEFAULT_MAX_TURNS = 30
DEFAULT_MAX_TOKENS = 8192
REQUEST_TIMEOUT_S = 600.0
NUDGE = "Use the tools; call the tool that finishes the task when you are done."


@dataclass(frozen=True)
class ToolResult:
    """What one tool call answers: text for the model, and whether it is an error."""

    text: str
    error: bool = False


@dataclass
class Usage:
    """What a conversation cost so far, and (once over) why it ended."""

    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tools: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    ended: str = ""

    def summary(self) -> str:
        return f"{self.turns} turns, {self.input_tokens} input / {self.output_tokens} output tokens, {self.wall_s:.0f} s"

    def event(self, purpose: str, provider: str, **fields) -> schema.ConversationUsed:
        """This conversation as the `schema.ConversationUsed` its service publishes (``fields``: the event
        id, the direction)."""
        return schema.ConversationUsed(purpose=purpose, provider=provider, turns=self.turns,
                                       input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                                       wall_s=round(self.wall_s, 3), ended=self.ended or "error",
                                       tools=list(self.tools), **fields)


@dataclass(frozen=True)
class Budget:
    """Limits of one conversation (None: no limit)."""

    turns: int = DEFAULT_MAX_TURNS
    wall_s: float | None = None
    tokens: int | None = None  # input plus output

    def spent(self, usage: Usage, started: float) -> str:
        """Which limit ``usage`` reached ('' while none is)."""
        usage.wall_s = time.monotonic() - started
        if usage.turns >= self.turns:
            return "turns"
        if self.wall_s is not None and usage.wall_s >= self.wall_s:
            return "wall"
        if self.tokens is not None and usage.input_tokens + usage.output_tokens >= self.tokens:
            return "tokens"
        return ""


def tool_loop(spec: ProviderSpec, key: str, system: str, task: str, toolbox, usage: Usage,
              max_turns: int = DEFAULT_MAX_TURNS, max_tokens: int = DEFAULT_MAX_TOKENS, nudge: str = NUDGE,
              max_wall_s: float | None = None, max_total_tokens: int | None = None) -> None:
    """Converse until ``toolbox.finished`` is set or a budget is spent (``usage.ended`` says which);
    SDK errors → ProviderError."""
    import anthropic  # the SDKs load only when a conversation runs
    import openai

    budget, started = Budget(max_turns, max_wall_s, max_total_tokens), time.monotonic()
    try:
        if spec.kind == ANTHROPIC:
            _anthropic_loop(spec, key, system, task, toolbox, usage, budget, started, max_tokens, nudge)
        else:
            _openai_loop(spec, key, system, task, toolbox, usage, budget, started, nudge)
        usage.ended = "finished" if toolbox.finished is not None else budget.spent(usage, started)
    except (anthropic.APIError, openai.APIError) as exc:
        usage.ended = "error"
        raise ProviderError(f"{spec}: {type(exc).__name__}: {exc}") from exc
    except ProviderError:
        usage.ended = "error"
        raise
    finally:
        usage.wall_s = time.monotonic() - started


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


def _anthropic_loop(spec: ProviderSpec, key: str, system: str, task: str, tools, usage: Usage,
                    budget: Budget, started: float, max_tokens: int, nudge: str) -> None:
    import anthropic

    client = anthropic.Anthropic(api_key=key, base_url=spec.base_url, timeout=REQUEST_TIMEOUT_S)
    specs = _anthropic_tools(tools.specs)
    messages: list[dict] = [{"role": "user", "content": task}]
    while not budget.spent(usage, started):
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
            messages.append({"role": "user", "content": nudge})
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


def _openai_loop(spec: ProviderSpec, key: str, system: str, task: str, tools, usage: Usage,
                 budget: Budget, started: float, nudge: str) -> None:
    import openai

    client = openai.OpenAI(api_key=key, base_url=spec.base_url, timeout=REQUEST_TIMEOUT_S)
    specs = _openai_tools(tools.specs)
    messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    while not budget.spent(usage, started):
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
            messages.append({"role": "user", "content": nudge})
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
