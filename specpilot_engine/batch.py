"""Continuous batching with speculative decoding: many greedy requests in flight, one forward a step.

    batch = BatchDecoder(model, drafters, cfg, rows=8, max_len=2048, stop_ids=model.cfg.stop_ids)
    done = batch.run([BatchRequest("a", prompt_a, 128), BatchRequest("b", prompt_b, 64, arrival_step=3)])

Each request lives in its own row of one KV cache ([layers, rows, kv_heads, max_len, head_dim]) with its
own length. A step:

1. **Join.** Requests that have arrived take free rows, in arrival order (a request that finds no free
   row waits: the queue never drops one). Stock admits a new request's whole prompt as one forward of its
   own, before the step (`prefill`), as batch-1 decoding does.
2. **Draft.** Every active row's drafter proposes from its own context (`decode.draft`: a chain of up to
   ``block_size`` tokens, or a best-first tree), never past the request's ``max_new_tokens``.
3. **Verify.** One target forward over every active row's root and drafts, padded to the widest row
   (`Transformer.forward_ragged`: linears over the whole block, attention per row over exactly that
   row's live slots).
4. **Accept.** Per row, the longest path that matches the target's argmax (`DraftTree.accept`), its
   cache row compacted to that path; a request ends at ``max_new_tokens`` or a stop token, and its row
   is free for the next step.

Batch invariance: with row-independent linears (``linear_backend = "stream"``; PyTorch's default CPU
GEMM may sum a row in another order when the block has more rows) and attention computed per row, a
request's logits do not depend on its batch-mates or on when it arrived, so in fp32 on a CPU its tokens
equal batch-1 `decode.generate`'s bit for bit (tested). Every accepted token is the target's argmax at
its parent, so speculation stays lossless here as in batch 1.

This module knows nothing about options parsing, text or timing harnesses; `BatchDecoder.run` records
per request its tokens, committed tokens and verified tokens a step, and the step on which it joined
and finished, and per step the batch's rows and the forward's seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpilot_engine.decode import DecodeConfig, Generation, draft
from specpilot_engine.drafters import Drafter
from specpilot_engine.model import Transformer, greedy_ids
from specpilot_engine.tree import DraftTree


@dataclass(frozen=True)
class BatchRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0  # the step before which it arrives (0: at the start)


@dataclass
class BatchGeneration(Generation):
    """A request's `Generation`, with when it joined and finished (step numbers of its `BatchDecoder`)."""

    joined_step: int = -1
    finished_step: int = -1


@dataclass
class StepRecord:
    rows: int  # active rows in the step's forward
    tokens: int  # tokens in the forward, padding included (rows x widest row)
    verified: int  # the rows' own tokens (roots and drafts)
    committed: int  # tokens the step committed over all rows
    forward_s: float
    prefills: int = 0  # requests admitted (their prompts run) before this step


@dataclass
class _Row:
    request: BatchRequest
    gen: BatchGeneration
    context: list[int]
    start: int  # cache slot of the root (the last committed token)
    hidden: torch.Tensor  # the target's hidden state at the token before the root
    drafter: Drafter | None
    tree: DraftTree | None = None


@dataclass
class BatchResult:
    generations: dict[str, BatchGeneration]
    steps: list[StepRecord] = field(default_factory=list)


class BatchDecoder:
    """Greedy continuous batching over ``rows`` cache rows of ``max_len`` slots; ``drafters[i]`` serves
    row i (a drafter keeps per-request state, so rows do not share one; None: AR)."""

    def __init__(self, model: Transformer, drafters: Sequence[Drafter | None], cfg: DecodeConfig, rows: int,
                 max_len: int, stop_ids: tuple[int, ...] = ()):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        if len(drafters) != rows:
            raise ValueError(f"one drafter (or None) a row: {rows} rows, {len(drafters)} drafters")
        self.model, self.cfg, self.drafters, self.stops = model, cfg, list(drafters), set(stop_ids)
        self.cache = model.new_cache(max_len, batch=rows)

    @property
    def rows(self) -> int:
        return self.cache.k.shape[1]

    def _check(self, r: BatchRequest) -> None:
        if not r.prompt:
            raise ValueError(f"request {r.request_id!r}: the prompt is empty")
        if r.max_new_tokens < 1:
            raise ValueError(f"request {r.request_id!r}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        # room for the output plus one step's drafts past it
        room = len(r.prompt) + r.max_new_tokens + max(self.cfg.block_size, self.cfg.tree_nodes if self.cfg.tree else 0)
        if room > self.cache.max_len:
            raise ValueError(f"request {r.request_id!r}: prompt ({len(r.prompt)} tokens) + max_new_tokens "
                             f"({r.max_new_tokens}) + a step's drafts exceed a cache row ({self.cache.max_len} slots)")

    @torch.no_grad()
    def _prefill(self, slot: int, r: BatchRequest, step: int) -> _Row:
        tokens = torch.tensor([r.prompt], dtype=torch.int64, device=self.model.device)
        positions = torch.arange(len(r.prompt), device=self.model.device).unsqueeze(0)
        t0 = time.perf_counter()
        logits, hidden = self.model.forward_ragged(tokens, positions, self.cache, [0], [len(r.prompt)], [slot], [None],
                                                   last_only=True)
        first = int(greedy_ids(logits[0, -1]))
        gen = BatchGeneration(tokens=[first], joined_step=step)
        gen.prefill_s = time.perf_counter() - t0
        drafter = self.drafters[slot]
        if drafter is not None:
            drafter.reset()
        return _Row(r, gen, [*r.prompt, first], len(r.prompt), hidden[0, -1], drafter)

    def _done(self, row: _Row) -> bool:
        return len(row.gen.tokens) >= row.request.max_new_tokens or row.gen.tokens[-1] in self.stops

    @torch.no_grad()
    def run(self, requests: Sequence[BatchRequest]) -> BatchResult:
        """Serve ``requests`` to the end; each arrives before its ``arrival_step``'s forward."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for r in requests:
            self._check(r)
        waiting = sorted(requests, key=lambda r: r.arrival_step)
        active: dict[int, _Row] = {}
        result = BatchResult({})
        step = 0
        while waiting or active:
            prefills = 0
            free = [i for i in range(self.rows) if i not in active]
            while waiting and free and waiting[0].arrival_step <= step:
                slot, r = free.pop(0), waiting.pop(0)
                row = self._prefill(slot, r, step)
                prefills += 1
                if self._done(row):
                    self._finish(row, step, result)
                else:
                    active[slot] = row
            if not active:
                if waiting:  # nothing in flight until the next arrival: time moves on
                    step = max(step + 1, waiting[0].arrival_step)
                continue
            result.steps.append(self._step(active, prefills))
            for slot in [s for s, row in active.items() if self._done(row)]:
                self._finish(active.pop(slot), step, result)
            step += 1
        return result

    def _finish(self, row: _Row, step: int, result: BatchResult) -> None:
        del row.gen.tokens[row.request.max_new_tokens:]
        row.gen.finished_step = step
        result.generations[row.request.request_id] = row.gen

    def _step(self, active: dict[int, _Row], prefills: int) -> StepRecord:
        slots = sorted(active)
        for slot in slots:
            row = active[slot]
            t0 = time.perf_counter()
            k = min(self.cfg.block_size, row.request.max_new_tokens - len(row.gen.tokens) - 1)
            row.tree = draft(row.drafter, row.context, row.hidden, k, self.cfg,
                             max_nodes=self.cache.max_len - row.start - 1)
            row.gen.draft_s.append(time.perf_counter() - t0)
        width = max(len(active[s].tree) for s in slots)
        device = self.model.device
        tokens = torch.zeros((len(slots), width), dtype=torch.int64, device=device)
        positions = torch.zeros((len(slots), width), dtype=torch.int64, device=device)
        masks = []
        for b, slot in enumerate(slots):
            row = active[slot]
            n = len(row.tree)
            tokens[b, :n] = torch.tensor(row.tree.tokens, device=device)
            pos = row.tree.positions(row.start, device)
            positions[b, :n] = pos
            positions[b, n:] = pos[-1]  # pads: any position in range; their outputs are dropped
            masks.append(None if row.tree.is_chain else row.tree.attention_mask(device))
        t0 = time.perf_counter()
        logits, hidden = self.model.forward_ragged(tokens, positions, self.cache, [active[s].start for s in slots],
                                                   [len(active[s].tree) for s in slots], slots, masks)
        argmax = greedy_ids(logits).tolist()  # the step's one device sync
        forward_s = time.perf_counter() - t0
        committed = 0
        for b, slot in enumerate(slots):
            row = active[slot]
            path, bonus = row.tree.accept(argmax[b][: len(row.tree)])
            self.cache.compact_row(slot, row.start, path)
            new = [row.tree.tokens[i] for i in path[1:]] + [bonus]
            row.hidden = hidden[b, path[-1]]
            row.start += len(new)
            before = len(row.gen.tokens)
            for tok in new:  # commit up to and including a stop token
                row.gen.tokens.append(tok)
                row.context.append(tok)
                if tok in self.stops:
                    break
            row.gen.committed.append(len(row.gen.tokens) - before)
            row.gen.verified.append(len(row.tree))
            row.gen.verify_s.append(forward_s)
            committed += len(row.gen.tokens) - before
        return StepRecord(rows=len(slots), tokens=len(slots) * width, verified=sum(len(active[s].tree) for s in slots),
                          committed=committed, forward_s=forward_s, prefills=prefills)
