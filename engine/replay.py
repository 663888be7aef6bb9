"""What the cost model needs from a system, measured inside that system's own process.

- `matched_depths`: walking a request's greedy output, how deep the drafter's candidates at each
  position match what the target actually emitted next (the deepest matching node of the trie of
  its candidates). `services.master.costmodel.replay_tau` turns these into the tokens per step of
  the best tree at any node budget ("exact replay").
- `measure`: one request through the engine with the kernel-class profile of `engine.bench`, and
  the matched depths of its output twice: over all the drafter's candidates (``depths``: the best
  tree in hindsight) and over its first candidate only (``chain_depths``: what a chain verifies),
  and the operator launches per step of each kernel class (`engine.bench.launches`).

The timing worker serves `measure` (``engine.worker``); nothing here decides anything.
"""

from __future__ import annotations

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


@torch.no_grad()
def matched_depths(engine: Engine, prompt: list[int], output: list[int], depth: int = 16, nodes: int = 64) -> list[int]:
    """``depths[p]``: the match at output position p (p = 0, the prefill's token, is always 0)."""
    from engine.drafters import make_drafter

    drafter = make_drafter(engine.options, engine.model)
    if drafter is None or len(output) < 2:
        return [0] * len(output)
    drafter.reset()
    hidden = None
    if engine.options.drafter == "parallel":  # it reads the target's hidden state before the root
        seq = [*prompt, *output]
        cache = engine._cache_for(len(seq) + 1)
        ids = torch.tensor([seq], dtype=torch.int64, device=engine.device)
        _, hidden = engine.model(ids, torch.arange(len(seq), device=engine.device), cache, 0)
        hidden = hidden[0]
    depths = [0]
    for p in range(1, len(output)):
        context = [*prompt, *output[:p]]
        last_hidden = hidden[len(context) - 2] if hidden is not None else None
        cands = drafter.propose(context, last_hidden, depth, nodes)
        depths.append(matched_depth([c.tokens for c in cands], output[p:]))
    return depths


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
        "context": len(prompt) + len(result.tokens) // 2,
    }
