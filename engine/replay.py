"""What the cost model needs from a system, measured inside that system's own process.

- `matched_depths`: walking a request's greedy output, how deep the drafter's candidates at each
  position match what the target actually emitted next (the deepest matching node of the trie of
  its candidates). `services.master.costmodel.replay_tau` turns these into the tokens per step of
  the best tree at any node budget ("exact replay").
- `measure`: one request through the engine with the kernel-class profile of `engine.bench`, and
  the matched depths of its output twice: over all the drafter's candidates (``depths``: the best
  tree in hindsight) and over its first candidate only (``chain_depths``: what a chain verifies),
  the operator launches per step of each kernel class (`engine.bench.launches`), and the same
  chain replay for every other drafter of the target with its draft time (`alternative_drafters`),
  so the planner can predict a switch of drafter before timing it.

The timing worker serves `measure` (``engine.worker``); nothing here decides anything.
"""

from __future__ import annotations

import time

import torch

from engine.api import Engine


def matched_depth(candidates, truth: list[int]) -> int:
    """Longest prefix of ``truth`` that any candidate's tokens start with."""
    best = 0
    for cand in candidates:
        m = 0
        for a, b in zip(cand, truth, strict=False):
            if a != b:
                break
            m += 1
        best = max(best, m)
    return best


HIDDEN_READERS = ("parallel", "eagle")  # drafters that read the target's hidden state before the root
ALTERNATIVE_DRAFTERS = ("ngram", "parallel", "eagle")  # replayed beside the system's own (`measure`)


@torch.no_grad()
def matched_depths(engine: Engine, prompt: list[int], output: list[int], depth: int = 16, nodes: int = 64,
                   drafter: str | None = None) -> list[int]:
    """``depths[p]``: the match at output position p (p = 0, the prefill's token, is always 0), for the
    engine's drafter or the one named ``drafter`` (with the engine's other options)."""
    proposer, hidden = _replay_drafter(engine, prompt, output, drafter)
    if proposer is None or len(output) < 2:
        return [0] * len(output)
    depths = [0]
    for p in range(1, len(output)):
        context = [*prompt, *output[:p]]
        cands = proposer.propose(context, hidden[len(context) - 2] if hidden is not None else None, depth, nodes)
        depths.append(matched_depth([c.tokens for c in cands], output[p:]))
    return depths


@torch.no_grad()
def draft_seconds(engine: Engine, prompt: list[int], output: list[int], drafter: str, k: int,
                  positions: int = 16) -> float:
    """Mean host seconds of one chain proposal of ``k`` tokens by ``drafter``, over the first positions."""
    proposer, hidden = _replay_drafter(engine, prompt, output, drafter)
    if proposer is None or len(output) < 2:
        return 0.0
    ps = range(1, min(len(output), positions + 1))
    t0 = time.perf_counter()
    for p in ps:
        context = [*prompt, *output[:p]]
        proposer.propose(context, hidden[len(context) - 2] if hidden is not None else None, k, 1)
    return (time.perf_counter() - t0) / len(ps)


def _replay_drafter(engine: Engine, prompt: list[int], output: list[int], name: str | None):
    """(a fresh drafter, the target's hidden states over prompt + output if it reads them)."""
    from engine.drafters import make_drafter

    name = name or engine.options.drafter
    proposer = make_drafter(engine.options.replace(drafter=name), engine.model)
    if proposer is None:
        return None, None
    proposer.reset()
    hidden = None
    if name in HIDDEN_READERS:
        seq = [*prompt, *output]
        cache = engine._cache_for(len(seq) + 1)
        ids = torch.tensor([seq], dtype=torch.int64, device=engine.device)
        _, hidden = engine.model(ids, torch.arange(len(seq), device=engine.device), cache, 0)
        hidden = hidden[0]
    return proposer, hidden


def alternative_drafters(engine: Engine, prompt: list[int], output: list[int], depth: int = 16) -> dict[str, dict]:
    """For every other drafter this target has: its chain's matched depths on the same output and its
    draft time at the engine's block size (what the planner needs to predict switching to it)."""
    out: dict[str, dict] = {}
    for name in ALTERNATIVE_DRAFTERS:
        if name == engine.options.drafter:
            continue
        try:
            out[name] = {"chain_depths": matched_depths(engine, prompt, output, depth, 1, drafter=name),
                         "draft_s": draft_seconds(engine, prompt, output, name, max(1, engine.options.block_size))}
        except (FileNotFoundError, ValueError) as exc:  # no weights for this target, another target's file
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def measure(engine: Engine, prompt: list[int], max_new_tokens: int, depth: int = 16, nodes: int = 64) -> dict:
    """Profile one request and replay its output (see the module docstring)."""
    from engine.bench import launches, profile

    result = engine.generate(prompt, max_new_tokens)
    prof = profile(engine, prompt, max_new_tokens)
    return {
        "tokens": result.tokens, "steps": result.steps,
        "profile_ms": prof,
        "launches": launches(engine, prompt, min(16, max_new_tokens)),
        "depths": matched_depths(engine, prompt, result.tokens, depth, nodes),
        "chain_depths": matched_depths(engine, prompt, result.tokens, depth, 1),
        "drafters": alternative_drafters(engine, prompt, result.tokens, depth),
        "context": len(prompt) + len(result.tokens) // 2,
    }
