"""Greedy decoding, plain and speculative, as a ladder of small functions.

    prefill -> [draft -> verify -> commit]* -> Generation

- `prefill` runs the prompt and returns the first output token (the target's argmax after it).
- `draft` asks the drafter for candidates and lays them out as a chain or a best-first tree.
- `verify` runs root + drafts in one target forward under the tree mask, accepts the longest path
  that matches the target's argmax (greedy acceptance), and compacts the cache to that path. With a
  `specpilot.engine.graphs.GraphRunner` the forward is a CUDA graph replay of the graph-safe form of the same
  computation; acceptance and compaction stay eager.
- `generate` loops until ``max_new_tokens`` tokens or a stop token (which is emitted, then stops).

With no drafter every step verifies the root alone: that *is* autoregressive decoding, through the
same code. Each accepted token equals the target's argmax at its parent, so at temperature 0 every
configuration emits the AR tokens (exactly, up to floating-point differences between a T-token
and a 1-token forward; fp32 on CPU shows none on the tests' prompts).

This module knows nothing about text, files or options parsing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.engine.drafters import Drafter
from specpilot.engine.model import KVCache, Transformer, greedy_ids
from specpilot.engine.tree import DraftTree

if TYPE_CHECKING:
    from specpilot.engine.graphs import GraphRunner


@dataclass
class Generation:
    tokens: list[int]  # the output (prompt excluded), stop token included when one ended it
    committed: list[int] = field(default_factory=list)  # tokens committed by each step (bonus included)
    draft_s: list[float] = field(default_factory=list)  # host time in the drafter + tree building, per step
    verify_s: list[float] = field(default_factory=list)  # target forward + acceptance + cache compaction
    verified: list[int] = field(default_factory=list)  # tokens in each step's target forward (root included)
    prefill_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        return sum(self.committed) / max(1, len(self.committed))


@dataclass(frozen=True)
class DecodeConfig:
    """What `generate` needs from the engine options (kept separate so decode never parses options)."""

    block_size: int = 4
    tree: bool = False
    tree_nodes: int = 16


@torch.no_grad()
def prefill(model: Transformer, cache: KVCache, prompt: list[int]) -> tuple[int, Tensor]:
    """Run the prompt into slots 0..len-1; return the first output token and the last hidden state."""
    tokens = torch.tensor([prompt], dtype=torch.int64, device=model.device)
    positions = torch.arange(len(prompt), device=model.device)
    logits, hidden = model(tokens, positions, cache, 0, last_only=True)
    return int(greedy_ids(logits[0, -1])), hidden[0, -1]


def draft(drafter: Drafter | None, context: list[int], last_hidden: Tensor, k: int,
          cfg: DecodeConfig, max_nodes: int) -> DraftTree:
    """The tree to verify next: root = context[-1], then up to k draft tokens deep."""
    root = context[-1]
    if drafter is None or k <= 0 or max_nodes <= 0:
        return DraftTree.chain(root, [])
    if cfg.tree:
        cands = drafter.propose(context, last_hidden, k, cfg.tree_nodes)
        return DraftTree.best_first(root, cands, max_nodes=min(cfg.tree_nodes, max_nodes), max_depth=k)
    cands = drafter.propose(context, last_hidden, k, 1)
    return DraftTree.chain(root, cands[0].tokens[: min(k, max_nodes)] if cands else [])


@torch.no_grad()
def verify(model: Transformer, cache: KVCache, tree: DraftTree, start: int,
           runner: GraphRunner | None = None) -> tuple[list[int], Tensor]:
    """One target forward over the tree at slots start..; returns (committed tokens, hidden at the last
    accepted node). The root and the accepted drafts end up in slots start..start+len(committed)-1.
    With ``runner`` the forward is its graph replay (when the block fits the cache)."""
    if runner is not None and runner.fits(len(tree), start):
        argmax, hidden = runner.step(tree, start)  # hidden: [T, D], valid until the next step
    else:
        device = model.device
        tokens = torch.tensor([tree.tokens], dtype=torch.int64, device=device)
        # A chain is causal, which SDPA handles without an explicit mask.
        mask = None if tree.is_chain else tree.attention_mask(device)
        logits, hidden = model(tokens, tree.positions(start, device), cache, start, mask)
        argmax = greedy_ids(logits[0]).tolist()  # the one device sync of the step
        hidden = hidden[0]
    path, bonus = tree.accept(argmax)
    cache.compact(start, path)
    return [tree.tokens[i] for i in path[1:]] + [bonus], hidden[path[-1]]


def generate(model: Transformer, cache: KVCache, prompt: list[int], max_new_tokens: int,
             drafter: Drafter | None, cfg: DecodeConfig, stop_ids: tuple[int, ...] = (),
             runner: GraphRunner | None = None) -> Generation:
    """Greedy generation of up to ``max_new_tokens`` tokens after ``prompt``; ``runner`` (over this
    ``cache``) replays the decode steps as CUDA graphs."""
    if runner is not None and runner.cache is not cache:
        raise ValueError("the graph runner was built for another KV cache")
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > cache.max_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"cache ({cache.max_len} slots)")
    if drafter is not None:
        drafter.reset()
    stops = set(stop_ids)
    t0 = time.perf_counter()
    first, hidden = prefill(model, cache, prompt)
    gen = Generation(tokens=[first])
    gen.prefill_s = time.perf_counter() - t0
    context = [*prompt, first]
    start = len(prompt)  # slot (= position) of the root, the last committed token
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in stops:
        t0 = time.perf_counter()
        # Never draft past max_new_tokens (the bonus token is always committed) or past the cache.
        k = min(cfg.block_size, max_new_tokens - len(gen.tokens) - 1)
        tree = draft(drafter, context, hidden, k, cfg, max_nodes=cache.max_len - start - 1)
        t1 = time.perf_counter()
        new, hidden = verify(model, cache, tree, start, runner)
        t2 = time.perf_counter()
        start += len(new)
        n_before = len(gen.tokens)
        for tok in new:  # commit up to and including a stop token
            gen.tokens.append(tok)
            context.append(tok)
            if tok in stops:
                break
        gen.committed.append(len(gen.tokens) - n_before)
        gen.draft_s.append(t1 - t0)
        gen.verify_s.append(t2 - t1)
        gen.verified.append(len(tree))
    del gen.tokens[max_new_tokens:]
    return gen
