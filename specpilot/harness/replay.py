"""What the cost model needs from a system, measured inside that system's own process.

- `Replay` (and `matched_depths`): walking a request's greedy output, how deep a drafter's
  candidates at each position match what the target actually emitted next (the deepest matching
  node of the trie of its candidates); one `Replay` serves every drafter of one output.
  `specpilot.services.master.costmodel.replay_tau` turns these into the tokens per step of the best tree at
  any node budget ("exact replay").
- `measure`: one request through the engine with the kernel-class profile of `specpilot.harness.profile`, and
  the matched depths of its output twice: over all the drafter's candidates (``depths``: the best
  tree in hindsight) and over its first candidate only (``chain_depths``: what a chain verifies),
  the operator launches per step of each kernel class (`specpilot.harness.profile.launches`), and the same
  chain replay for every other drafter of the target with its draft time (`alternative_drafters`),
  and for the system's own drafter under other settings (``ALTERNATIVE_SETTINGS``, keyed
  ``option=value``), so the planner can predict a switch of drafter, or of its setting, before
  timing it; and `chain_cost`: the forward of a full chain of ``n`` drafts timed against a
  one-token forward at the same context (c(n) measured, not extrapolated from the steps the
  system's own drafter happened to fill).

The timing worker serves `measure` (``specpilot.harness.worker``); nothing here decides anything.
"""

from __future__ import annotations

import statistics
import time

import torch

from specpilot.engine.api import Engine
from specpilot.engine.tree import matched_depth

HIDDEN_READERS = ("parallel", "eagle")  # drafters that read the target's hidden state before the root
ALTERNATIVE_DRAFTERS = ("ngram", "parallel", "eagle")  # replayed beside the system's own (`measure`)
# ... also as trees: EAGLE's tree replay is left out for its cost (its head runs per node: ~8 s a
# 128-token request on the 2-core CPU, 2026-12-05, for 1.3 tokens a step on SmolLM2).
ALTERNATIVE_TREES = ("ngram", "parallel")
# Settings of a drafter replayed beside the system's own value: (drafter, option) -> values.
ALTERNATIVE_SETTINGS = {("ngram", "ngram_min_match"): (1, 2, 3)}


class Replay:
    """One request's greedy output, replayed for any drafter of the engine's target. The target's
    hidden states over prompt + output (what hidden-state drafters read) are computed once, on first
    use, and each drafter is built once."""

    def __init__(self, engine: Engine, prompt: list[int], output: list[int]):
        self.engine, self.prompt, self.output = engine, prompt, output
        self._hidden: torch.Tensor | None = None
        self._drafters: dict[str, object] = {}

    def drafter(self, name: str):
        """The named drafter, reset; None for "none". ``name`` is a drafter (with the engine's other
        options) or ``option=value``: the engine's own drafter with that option changed."""
        from specpilot.engine.drafters import make_drafter

        if name not in self._drafters:
            opts = self.engine.options
            if "=" in name:
                option, value = name.split("=", 1)
                opts = opts.replace(**{option: type(getattr(opts, option))(value)})
            else:
                opts = opts.replace(drafter=name)
            self._drafters[name] = make_drafter(opts, self.engine.model)
        proposer = self._drafters[name]
        if proposer is not None:
            proposer.reset()
        return proposer

    @torch.no_grad()
    def last_hidden(self, name: str, p: int) -> torch.Tensor | None:
        """What drafter ``name`` is given at output position ``p``: the hidden state before the root."""
        if (self.engine.options.drafter if "=" in name else name) not in HIDDEN_READERS:
            return None
        if self._hidden is None:
            engine, seq = self.engine, [*self.prompt, *self.output]
            cache = engine._cache_for(len(seq) + 1)
            ids = torch.tensor([seq], dtype=torch.int64, device=engine.device)
            self._hidden = engine.model(ids, torch.arange(len(seq), device=engine.device), cache, 0)[1][0]
        return self._hidden[len(self.prompt) + p - 2]

    def proposals(self, name: str, k: int, n: int, positions: int | None = None):
        """(position, candidates) of drafter ``name`` at output positions 1.. (the first ``positions``)."""
        proposer = self.drafter(name)
        if proposer is None:
            return
        for p in range(1, min(len(self.output), (positions or len(self.output)) + 1)):
            yield p, proposer.propose([*self.prompt, *self.output[:p]], self.last_hidden(name, p), k, n)

    @torch.no_grad()
    def depths(self, name: str, depth: int = 16, nodes: int = 64) -> list[int]:
        """``depths[p]``: how deep the drafter's candidates at position p match the output (p = 0, the
        prefill's token, is always 0)."""
        if len(self.output) < 2 or self.drafter(name) is None:
            return [0] * len(self.output)
        return [0] + [matched_depth([c.tokens for c in cands], self.output[p:])
                      for p, cands in self.proposals(name, depth, nodes)]

    @torch.no_grad()
    def draft_seconds(self, name: str, k: int, positions: int = 16) -> float:
        """Mean host seconds of one chain proposal of ``k`` tokens, over the first positions."""
        self.last_hidden(name, 1)  # the target's forward is not the drafter's time
        t0, calls = time.perf_counter(), 0
        for _ in self.proposals(name, k, 1, positions):
            calls += 1
        return (time.perf_counter() - t0) / calls if calls else 0.0

    def alternative_drafters(self, depth: int = 16, nodes: int = 64) -> dict[str, dict]:
        """For every other drafter this target has, and for the engine's drafter under each other value
        of its ``ALTERNATIVE_SETTINGS`` (keyed ``option=value``): the chain's matched depths on the same
        output and the draft time at the engine's block size (what the planner needs to predict the
        switch); for the other drafters of ``ALTERNATIVE_TREES`` also their trees' (best in hindsight over
        ``nodes`` candidates: a drafter whose chain loses may win as a tree)."""
        out: dict[str, dict] = {}
        for name in ALTERNATIVE_DRAFTERS:
            if name == self.engine.options.drafter:
                continue
            try:
                out[name] = {"chain_depths": self.depths(name, depth, 1),
                             "draft_s": self.draft_seconds(name, max(1, self.engine.options.block_size))}
                if name in ALTERNATIVE_TREES:
                    out[name]["depths"] = self.depths(name, depth, nodes)
            except (FileNotFoundError, ValueError) as exc:  # no weights for this target, another target's file
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        opts = self.engine.options
        for (drafter, option), values in ALTERNATIVE_SETTINGS.items():
            if opts.drafter != drafter:
                continue
            for value in values:
                if value != getattr(opts, option):
                    name = f"{option}={value}"
                    out[name] = {"chain_depths": self.depths(name, depth, 1),
                                 "draft_s": self.draft_seconds(name, max(1, opts.block_size))}
        return out


def matched_depths(engine: Engine, prompt: list[int], output: list[int], depth: int = 16, nodes: int = 64,
                   drafter: str | None = None) -> list[int]:
    """`Replay.depths` for the engine's drafter or the one named ``drafter``."""
    return Replay(engine, prompt, output).depths(drafter or engine.options.drafter, depth, nodes)


def alternative_drafters(engine: Engine, prompt: list[int], output: list[int], depth: int = 16) -> dict[str, dict]:
    """`Replay.alternative_drafters` of one output."""
    return Replay(engine, prompt, output).alternative_drafters(depth)


CHAIN_COST_DRAFTS = (2, 4, 8)  # chain lengths `chain_cost` times (and the engine's block size)


@torch.no_grad()
def chain_cost(engine: Engine, prompt: list[int], output: list[int], ns=CHAIN_COST_DRAFTS, reps: int = 3,
               ) -> dict[int, float]:
    """c(n) = t(forward of 1 + n tokens) / t(forward of 1 token) for each ``n``, as one decode step
    runs it (`specpilot.engine.decode.verify`, with the engine's graph runner), at the context of ``prompt``
    plus half of ``output``. The chain is the output's own next tokens, so every draft is accepted
    and the step does its full work. Sizes are interleaved ``reps`` times; medians are compared."""
    from specpilot.engine.decode import prefill, verify
    from specpilot.engine.tree import DraftTree

    ns = sorted({n for n in ns if 0 < n < len(output) - 1})
    if not ns:
        return {}
    # The root is an output token (so the prefill is never empty), with the longest chain after it.
    at = max(1, min(len(output) // 2, len(output) - 1 - ns[-1]))
    context = [*prompt, *output[:at]]
    cache = engine._cache_for(len(context) + ns[-1] + 2)
    runner = engine.graph_runner(cache)
    prefill(engine.model, cache, context[:-1])
    start, root = len(context) - 1, context[-1]
    times: dict[int, list[float]] = {n: [] for n in (0, *ns)}
    for _ in range(reps + 1):  # the first round warms each size up (graph capture, allocations)
        for n in times:
            tree = DraftTree.chain(root, output[at: at + n])
            engine.synchronize()
            t = time.perf_counter()
            verify(engine.model, cache, tree, start, runner)
            engine.synchronize()
            times[n].append(time.perf_counter() - t)
    median = {n: statistics.median(ts[1:]) for n, ts in times.items()}
    return {n: round(median[n] / median[0], 4) for n in ns}


def measure(engine: Engine, prompt: list[int], max_new_tokens: int, depth: int = 16, nodes: int = 64) -> dict:
    """Profile one request and replay its output (see the module docstring)."""
    from specpilot.harness.profile import launches, profile

    result = engine.generate(prompt, max_new_tokens)
    prof = profile(engine, prompt, max_new_tokens)
    replay, own = Replay(engine, prompt, result.tokens), engine.options.drafter
    return {
        "tokens": result.tokens, "steps": result.steps,
        "verified": sum(result.verified_per_step),  # tokens the steps' forwards ran, roots included
        "profile_ms": prof,
        "launches": launches(engine, prompt, min(16, max_new_tokens)),
        "depths": replay.depths(own, depth, nodes),
        "chain_depths": replay.depths(own, depth, 1),
        "drafters": replay.alternative_drafters(depth),
        "context": len(prompt) + len(result.tokens) // 2,
        "chain_cost": chain_cost(engine, prompt, result.tokens,
                                 (*CHAIN_COST_DRAFTS, engine.options.block_size)),
    }
