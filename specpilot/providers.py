"""Which provider turns a direction into a patch: the provider string on each ``DirectionPlanned``.

Syntax (the master writes it; the subagent parses it with ``parse_provider``):

- ``sweep``: offline, one patch per value of one option (``hints = {"option", "values", "base"}``).
- ``memory``: offline, apply an accepted memory entry (``hints = {"entry": {"entry_id", "delta", "options"}}``).
- ``anthropic`` or ``anthropic:MODEL``: the Anthropic Messages API with tool use. Key from
  ``ANTHROPIC_API_KEY``; base URL from ``ANTHROPIC_BASE_URL`` when set (the SDK reads it).
- ``openai`` or ``openai:MODEL``: the OpenAI Chat Completions API with tool calls. Key from
  ``OPENAI_API_KEY``; base URL from ``OPENAI_BASE_URL`` when set (the SDK reads it).
- ``openai-compatible:BASE_URL`` or ``openai-compatible:BASE_URL|MODEL``: any server speaking the Chat
  Completions API, e.g. ``openai-compatible:http://gpu-box:8000/v1|Qwen/Qwen3-Coder``. Everything after
  the first colon up to the last ``|`` is the base URL (it contains colons; it never contains ``|``).
  Key from ``OPENAI_COMPATIBLE_API_KEY``, else the literal ``none`` (local servers often need no key).
  ``OPENAI_API_KEY`` is deliberately *not* used here: it would send an OpenAI key to whatever host the
  provider string names.

A missing key raises ``MissingKey`` (a ``UserError``) whose message names the variable. Default models
are the constants below, written once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from specpilot.errors import UserError

SWEEP, MEMORY, ANTHROPIC, OPENAI, OPENAI_COMPATIBLE = "sweep", "memory", "anthropic", "openai", "openai-compatible"
OFFLINE = (SWEEP, MEMORY)
LLM = (ANTHROPIC, OPENAI, OPENAI_COMPATIBLE)

DEFAULT_ANTHROPIC_MODEL = "claude-sonnet-5-5"
DEFAULT_OPENAI_MODEL = "gpt-5.5"
DEFAULT_COMPATIBLE_MODEL = "default"  # what many single-model servers accept; name the model to be sure

KEY_ENV = {ANTHROPIC: "ANTHROPIC_API_KEY", OPENAI: "OPENAI_API_KEY", OPENAI_COMPATIBLE: "OPENAI_COMPATIBLE_API_KEY"}
COMPATIBLE_NO_KEY = "none"


class ProviderError(UserError):
    pass


class MissingKey(ProviderError):
    pass


@dataclass(frozen=True)
class ProviderSpec:
    kind: str
    model: str = ""
    base_url: str | None = None  # None: the SDK's default (or its *_BASE_URL environment variable)

    def __str__(self) -> str:
        if self.kind in OFFLINE:
            return self.kind
        if self.kind == OPENAI_COMPATIBLE:
            return f"{self.kind}:{self.base_url}|{self.model}"
        return f"{self.kind}:{self.model}"


def parse_provider(text: str) -> ProviderSpec:
    """A provider string (see the module docstring) as a ``ProviderSpec``; ``ProviderError`` when malformed."""
    text = (text or "").strip()
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    rest = rest.strip()
    if kind in OFFLINE:
        if rest:
            raise ProviderError(f"provider {text!r}: {kind} takes no argument")
        return ProviderSpec(kind)
    if kind in (ANTHROPIC, OPENAI):
        default = DEFAULT_ANTHROPIC_MODEL if kind == ANTHROPIC else DEFAULT_OPENAI_MODEL
        return ProviderSpec(kind, model=rest or default)
    if kind == OPENAI_COMPATIBLE:
        url, bar, model = rest.rpartition("|") if "|" in rest else (rest, "", "")
        url, model = url.strip(), model.strip()
        if not url.startswith(("http://", "https://")):
            raise ProviderError(f"provider {text!r}: write openai-compatible:BASE_URL[|MODEL] with an http(s) URL, "
                                "e.g. openai-compatible:http://localhost:8000/v1|my-model")
        if bar and not model:
            raise ProviderError(f"provider {text!r}: empty model after '|'")
        return ProviderSpec(kind, model=model or DEFAULT_COMPATIBLE_MODEL, base_url=url)
    known = ", ".join([SWEEP, MEMORY, f"{ANTHROPIC}[:MODEL]", f"{OPENAI}[:MODEL]", f"{OPENAI_COMPATIBLE}:BASE_URL[|MODEL]"])
    raise ProviderError(f"unknown provider {text!r}; known: {known}")


def api_key(spec: ProviderSpec, env: Mapping[str, str] | None = None) -> str:
    """The API key of an LLM provider from the environment; ``MissingKey`` names the variable to set."""
    env = os.environ if env is None else env
    var = KEY_ENV[spec.kind]
    key = (env.get(var) or "").strip()
    if key:
        return key
    if spec.kind == OPENAI_COMPATIBLE:
        return COMPATIBLE_NO_KEY
    raise MissingKey(f"provider {spec.kind} needs an API key: set the environment variable {var} for the subagent "
                     "service")
