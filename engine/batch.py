"""Continuous batching with speculative decoding: many greedy requests in flight, one forward a step.

    batch = BatchDecoder(model, drafters, cfg, rows=8, max_len=2048, stop_ids=model.cfg.stop_ids)
    done = batch.run([BatchRequest("a", prompt_a, 128), BatchRequest("b", prompt_b, 64, arrival_step=3)])

    batch.submit(BatchRequest("c", prompt_c, 32))       # online, as a server's clients do
    while batch.busy:
        batch.step()
        for request_id, generation in batch.finished(): ...

Each request lives in its own row of one KV cache ([layers, rows, kv_heads, max_len, head_dim]) with its
own length. A step:

1. **Join.** Requests that have arrived take free rows, in arrival order (a request that finds no free
   row waits: the queue never drops one). Stock admits each new request's whole prompt at once, before the
   step: the prompts joining at one step run together in one ragged forward (at most `PREFILL_TOKENS`
   tokens a forward; a longer prompt runs alone), as a serving engine batches its prefills. Under decode
   graphs (``static_steps``) each prompt instead replays a captured prefill of its own: the prompt as a
   causal chain padded to a `PREFILL_BUCKET` multiple on a one-row scratch cache, whose K/V is then
   copied into the joining row. An eager forward is launch-bound on a GPU (17 ms for one SmolLM2 prompt on
   an H100, 2026-12-06), and a prompt's K/V bits then depend on the prompt alone, not on which requests
   joined beside it (bf16 GEMMs differ by shape). A captured prefill is only queued: the host drafts the
   step's other rows while the GPU runs it, and its first token is read with the step's verify (the one
   sync a step), so a row that joins beside decoding rows decodes from the next step on (when no row is
   decoding, each prefill is read at once and the rows decode in this step). With
   ``BatchPolicy.prefill_chunk`` the prompts of joining rows instead ride in the step's forward, at most
   that many prompt tokens a step over all of them (first come, first served), beside the other rows'
   drafts; a row drafts once its whole prompt has run and given its first token.
2. **Draft.** Every active row's drafter proposes from its own context (`decode.draft`: a chain, or a
   best-first tree), never past the request's ``max_new_tokens``; how many draft tokens each row may
   verify is the `BatchPolicy`'s (stock: ``block_size``, or ``tree_nodes`` for a tree, for every row).
3. **Verify.** One target forward over every active row's root and drafts (`Transformer.forward_ragged`:
   the rows' tokens packed back to back, linears once over all of them, attention per row over exactly
   that row's live slots).
4. **Accept.** Per row, the longest path that matches the target's argmax (`DraftTree.accept`), its
   cache row compacted to that path; a request ends at ``max_new_tokens`` or a stop token, and its row
   is free for the next step, as is the row of a request `cancel`ed mid-generation (its client left).

Batch invariance: with row-independent linears (``linear_backend = "stream"``; PyTorch's default CPU
GEMM may sum a row in another order when the block has more rows) and attention computed per row, a
request's logits do not depend on its batch-mates or on when it arrived, so in fp32 on a CPU its tokens
equal batch-1 `decode.generate`'s bit for bit (tested). Every accepted token is the target's argmax at
its parent, so speculation stays lossless here as in batch 1.

This module knows nothing about options parsing, text or timing harnesses. A request's `BatchGeneration`
records its tokens, committed and verified tokens a step, the steps on which it joined and finished, and
the clock (``time.perf_counter``) when it was submitted, got its first token and finished; a step's
`StepRecord` the rows in flight and the seconds of its prefills, drafting and forward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specpilot.engine.decode import DecodeConfig, Generation, draft
from specpilot.engine.drafters import Drafter
from specpilot.engine.graphs import GraphRunner, Staging
from specpilot.engine.model import KVCache, Transformer, greedy_ids
from specpilot.engine.tree import DraftTree

PREFILL_TOKENS = 8192  # prompt tokens one stock prefill forward runs at most (its activations stay small)
PREFILL_BUCKET = 64  # a graphed prompt is padded to a multiple of this many tokens (one graph a bucket)


def _prefill_groups(joining: list[tuple[int, BatchRequest, float]]) -> list[list[tuple[int, BatchRequest, float]]]:
    """The joining (slot, request, submitted_at) in arrival order, cut into forwards of at most
    `PREFILL_TOKENS` prompt tokens (a longer prompt alone)."""
    groups: list[list[tuple[int, BatchRequest, float]]] = []
    tokens = 0
    for item in joining:
        n = len(item[1].prompt)
        if not groups or tokens + n > PREFILL_TOKENS:
            groups.append([])
            tokens = 0
        groups[-1].append(item)
        tokens += n
    return groups


@dataclass(frozen=True)
class BatchRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0  # the step before which it arrives (0: at the start)


@dataclass(frozen=True)
class BatchPolicy:
    """What each row drafts in a step. The defaults are stock: every request drafts ``block_size`` tokens
    (or a tree of ``tree_nodes``). Both mechanisms only choose how many draft tokens a row verifies; the
    target still accepts only its own argmax, so neither can change a token.

    - ``node_budget`` > 0: the step's draft tokens over the whole batch, shared by expected acceptance
      (`allocate_drafts`: the next token goes to the row whose next draft is likeliest to be accepted,
      each row's recent acceptance rate ``a`` giving its j-th draft token the chance ``a ** j``).
    - ``adaptive_block``: each row drafts ``1 +`` its recent mean of accepted drafts a step, at most
      ``block_size`` (a row whose drafts keep missing verifies one draft a step, not ``block_size``).
    Both read the last ``window`` steps of the row.
    - ``max_spec_rows`` > 0: a step with more decoding rows than this drafts nothing (every row verifies its
      root alone: batched AR under full load), and speculation resumes as the batch thins. At many rows a
      draft token costs nearly what a row's own token does (c(N, B) grows with B), so speculating then
      loses throughput; serving engines switch it off by batch size for this reason (vLLM's
      ``speculative_disable_by_batch_size``). Like the others it only chooses what is verified.

    - ``prefill_chunk`` > 0: prompts are admitted in segments inside the steps' forwards, at most this
      many prompt tokens a step (stock, 0: each prompt as one forward of its own before the step). This
      one changes how a prompt's keys are computed (attention over several shorter query blocks), so its
      bits may differ from a whole-prompt prefill's: forcing, not construction, says it is lossless.
    - ``padded_attention``: a step's attention as one call over every cache row (`model.PaddedRows`), not
      one call a row: fewer launches and host work a step, but the sum over keys runs over the longest
      row's slots, so its bits may differ too (forcing decides).
    - ``device_drafts``: with decode graphs and parallel drafters drafting chains, the whole proposal runs
      on the GPU from a device copy of every row's context (`ParallelDrafter.chains_from_history`: the
      lookups, the net, the chain) and the verify step reads the chains in place (`GraphRunner.run_rows`'s
      ``drafts``): one device sync a step instead of two, nothing drafted a row on the host. A row's chain
      is ``block_size`` long (the net's k picks, then the lookup's tokens past k; token 0 where there are
      none), not the host path's copied continuation. It only chooses what is drafted: the target still
      accepts its own argmax. ``compile_drafts``: that proposal through torch.compile before its capture,
      built over every cache row so that it compiles once (fewer, fused kernels; drafts only)."""

    node_budget: int = 0
    adaptive_block: bool = False
    window: int = 8
    prefill_chunk: int = 0
    padded_attention: bool = False
    max_spec_rows: int = 0
    device_drafts: bool = False
    compile_drafts: bool = False

    def __post_init__(self) -> None:
        if self.node_budget < 0 or self.window < 1 or self.prefill_chunk < 0 or self.max_spec_rows < 0:
            raise ValueError(f"need node_budget >= 0, window >= 1, prefill_chunk >= 0 and max_spec_rows >= 0, got "
                             f"{self.node_budget}, {self.window}, {self.prefill_chunk}, {self.max_spec_rows}")


def acceptance_rate(accepted: Sequence[int], drafted: Sequence[int]) -> float:
    """A row's recent share of draft tokens accepted, with one accepted of two as the prior (a new row)."""
    return (sum(accepted) + 1) / (sum(drafted) + 2)


def allocate_drafts(rates: Sequence[float], caps: Sequence[int], budget: int) -> list[int]:
    """Draft tokens a row, ``budget`` in all, each at most its cap: greedily to the row whose next token
    has the highest chance ``rate ** (given + 1)`` of being accepted (ties: the earlier row)."""
    given = [0] * len(rates)
    for _ in range(min(budget, sum(caps))):
        best = max((r for r in range(len(rates)) if given[r] < caps[r]), key=lambda r: rates[r] ** (given[r] + 1))
        given[best] += 1
    return given


@dataclass
class BatchGeneration(Generation):
    """A request's `Generation`, with when it joined and finished (step numbers of its `BatchDecoder`)."""

    joined_step: int = -1
    finished_step: int = -1
    submitted_at: float = 0.0  # time.perf_counter() when it was submitted
    first_token_at: float = 0.0  # ... when its prefill gave the first token
    finished_at: float = 0.0  # ... when its last token was committed


@dataclass
class StepRecord:
    rows: int  # active rows in the step's forward
    verified: int  # the rows' tokens in the forward (roots and drafts)
    committed: int  # tokens the step committed over all rows
    forward_s: float
    prefills: int = 0  # requests admitted into rows at this step (stock: their prompts run before it)
    prompt_tokens: int = 0  # prompt tokens run inside this step's forward (segmented admission)
    prefill_s: float = 0.0  # seconds of the joining prompts' forwards before the step (stock admission)
    draft_s: float = 0.0  # seconds the rows' drafters took this step


@dataclass
class _Row:
    request: BatchRequest
    gen: BatchGeneration
    context: list[int]
    start: int  # cache slot of the root (the last committed token); while prefilling, of the next prompt token
    hidden: torch.Tensor | None  # the target's hidden state at the token before the root (None: prefilling)
    drafter: Drafter | None
    slot: int  # its cache row
    tree: DraftTree | None = None
    accepted: deque[int] = field(default_factory=deque)  # accepted draft tokens of its recent steps (bounded)
    drafted: deque[int] = field(default_factory=deque)  # draft tokens of its recent steps (bounded)
    prefill_s: float = 0.0  # forward seconds of its prompt segments so far (segmented admission)
    # a queued captured prefill: (its first token [1], the hidden state before it [D]) on the device, unread
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    on_device: int = 0  # context tokens copied into the decoder's device history (``device_drafts``)

    @property
    def prefilling(self) -> bool:
        return self.hidden is None


@dataclass
class BatchResult:
    generations: dict[str, BatchGeneration]
    steps: list[StepRecord] = field(default_factory=list)


class BatchDecoder:
    """Greedy continuous batching over ``rows`` cache rows of ``max_len`` slots; ``drafters[i]`` serves
    row i (a drafter keeps per-request state, so rows do not share one; None: AR)."""

    def __init__(self, model: Transformer, drafters: Sequence[Drafter | None], cfg: DecodeConfig, rows: int,
                 max_len: int, stop_ids: tuple[int, ...] = (), policy: BatchPolicy | None = None,
                 static_steps: Callable[[KVCache], GraphRunner] | None = None):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        if len(drafters) != rows:
            raise ValueError(f"one drafter (or None) a row: {rows} rows, {len(drafters)} drafters")
        self.model, self.cfg, self.drafters, self.stops = model, cfg, list(drafters), set(stop_ids)
        self.policy = policy or BatchPolicy()
        self.cache = model.new_cache(max_len, batch=rows)
        # decode steps (no prompt segment) as one static forward over every row, replayed as a CUDA graph
        self.runner = static_steps(self.cache) if static_steps else None
        # prompts as static chains on a one-row scratch cache whose K/V is then copied into the joining row
        self.prefill_runner = static_steps(model.new_cache(max_len, batch=1)) if static_steps else None
        # each row's context on the device, for drafters that draft from it (``device_drafts``); built lazily
        self.history: torch.Tensor | None = None
        self._history_upload: Staging | None = None  # (row, place, token) triples of `_upload_history`
        self.waiting: deque[tuple[BatchRequest, float]] = deque()  # submitted, not yet in a row (FIFO)
        self.active: dict[int, _Row] = {}  # cache row -> the request in it
        self.steps = 0  # forwards run so far (the clock of arrival_step, joined_step, finished_step)
        self._finished: list[tuple[str, BatchGeneration]] = []
        self._ids: set[str] = set()  # ids waiting or in flight

    @property
    def rows(self) -> int:
        return self.cache.k.shape[1]

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or in flight."""
        return bool(self.waiting or self.active)

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

    def submit(self, request: BatchRequest) -> None:
        """Queue ``request``; it takes a free row at the next `step` (requests beyond the rows wait, in
        order). A bad request is refused here (`ValueError`), before any work."""
        self._check(request)
        if request.request_id in self._ids:
            raise ValueError(f"request ids must be unique: {request.request_id!r} is already waiting or in flight")
        self._ids.add(request.request_id)
        self.waiting.append((request, time.perf_counter()))

    def cancel(self, request_id: str) -> bool:
        """Drop a request (its client went away): out of the queue, or its row freed for the next step;
        the others are untouched. False when it is neither waiting nor in flight."""
        for i, (request, _) in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[i]
                self._ids.discard(request_id)
                return True
        for slot, row in self.active.items():
            if row.request.request_id == request_id:
                del self.active[slot]
                self._ids.discard(request_id)
                return True
        return False

    @property
    def tokens_in_flight(self) -> int:
        """Output tokens committed so far by the requests still in a row (a load's steady-state count)."""
        return sum(len(row.gen.tokens) for row in self.active.values())

    def finished(self) -> list[tuple[str, BatchGeneration]]:
        """The requests finished since the last call, in the order they finished."""
        out, self._finished = self._finished, []
        return out

    @torch.no_grad()
    def step(self) -> StepRecord | None:
        """Join waiting requests into free rows (their prompts run), then one forward over every row in
        flight; None when no row was in flight after the joins."""
        joining: list[tuple[int, BatchRequest, float]] = []
        prefills = 0
        free = [i for i in range(self.rows) if i not in self.active]
        while self.waiting and free:
            request, at = self.waiting.popleft()
            slot = free.pop(0)
            prefills += 1
            if self.policy.prefill_chunk:  # its prompt runs inside the coming steps' forwards
                self.active[slot] = self._new_row(slot, request, at)
            else:
                joining.append((slot, request, at))
        t0 = time.perf_counter()
        eager = []
        # captured prefills beside decoding rows are queued and read after the step's verify; with no row
        # decoding there is nothing to overlap, and each is read at once (its first token as early as can be)
        overlap = any(not row.prefilling for row in self.active.values())
        for slot, request, at in joining:
            if (row := self._prefill_graphed(slot, request, at)) is not None:
                self.active[slot] = row
                if not overlap:
                    self._read_prefills()
            else:
                eager.append((slot, request, at))
        for group in ([[j] for j in eager] if self.prefill_runner is not None else _prefill_groups(eager)):
            for row in self._prefill(group):
                if self._done(row):
                    self._finish(row)
                else:
                    self.active[row.slot] = row
        prefill_s = time.perf_counter() - t0 if joining else 0.0
        if not self.active:
            return None
        record = self._step(self.active, prefills)
        record.prefill_s = prefill_s
        self._read_prefills()  # after the verify's sync: the queued prefills have run
        for slot in [s for s, row in self.active.items() if self._done(row)]:
            self._finish(self.active.pop(slot))
        self.steps += 1
        return record

    @torch.no_grad()
    def _prefill(self, joining: list[tuple[int, BatchRequest, float]]) -> list[_Row]:
        """The joining requests' whole prompts in one ragged forward (each its own cache row from slot 0,
        causal); each row commits its first token."""
        device = self.model.device
        prompts = [r.prompt for _, r, _ in joining]
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(len(p), device=device) for p in prompts])
        t0 = time.perf_counter()
        logits, hidden = self.model.forward_ragged(tokens, positions, self.cache, [0] * len(prompts),
                                                   [len(p) for p in prompts], [slot for slot, _, _ in joining],
                                                   [None] * len(prompts), last_only=True)
        first = greedy_ids(logits).tolist()  # the forward's one device sync
        seconds = time.perf_counter() - t0
        rows, end = [], 0
        for (slot, request, at), prompt, token in zip(joining, prompts, first, strict=True):
            end += len(prompt)
            row = self._new_row(slot, request, at)
            row.prefill_s = seconds
            self._first_token(row, token, hidden[end - 1])
            rows.append(row)
        return rows

    def _prefill_graphed(self, slot: int, request: BatchRequest, submitted_at: float) -> _Row | None:
        """Queue one prompt as a causal chain padded to a `PREFILL_BUCKET` multiple on the scratch cache (a
        captured step; the pads come after the prompt, so nothing of the prompt sees them), its n slots of
        K/V then copied into the joining cache row; nothing is read back (`_read_prefills` does). None when
        there are no decode graphs or the bucket does not fit the cache."""
        if self.prefill_runner is None:
            return None
        prompt, n = request.prompt, len(request.prompt)
        T = -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
        if not self.prefill_runner.fits(T, 0):
            return None
        t0 = time.perf_counter()
        chain = DraftTree.chain(prompt[0], list(prompt[1:]) + [0] * (T - n))
        argmax, hidden = self.prefill_runner.run(chain, 0)
        scratch = self.prefill_runner.cache
        self.cache.k[:, slot, :, :n] = scratch.k[:, 0, :, :n]
        self.cache.v[:, slot, :, :n] = scratch.v[:, 0, :, :n]
        row = self._new_row(slot, request, submitted_at)
        # copies: the graph's outputs are overwritten by its next replay (another prompt of this step)
        row.pending = (argmax[n - 1: n].clone(), hidden[n - 1].clone())
        row.start = n  # its live slots: a decode step's pads for this row land past them
        row.prefill_s = time.perf_counter() - t0
        return row

    def _read_prefills(self) -> None:
        """Commit the first token of every row whose captured prefill was queued (one read for all)."""
        rows = [row for row in self.active.values() if row.pending is not None]
        if not rows:
            return
        firsts = torch.cat([row.pending[0] for row in rows]).tolist()  # a sync, unless a verify's came first
        for row, first in zip(rows, firsts, strict=True):
            hidden, row.pending = row.pending[1], None
            self._first_token(row, first, hidden)

    def _new_row(self, slot: int, r: BatchRequest, submitted_at: float) -> _Row:
        """A row for ``r`` whose prompt has not run yet."""
        drafter = self.drafters[slot]
        if drafter is not None:
            drafter.reset()
        window = self.policy.window
        gen = BatchGeneration(tokens=[], joined_step=self.steps, submitted_at=submitted_at)
        return _Row(r, gen, list(r.prompt), 0, None, drafter, slot, accepted=deque(maxlen=window),
                    drafted=deque(maxlen=window))

    def _first_token(self, row: _Row, first: int, hidden: torch.Tensor) -> None:
        """The prompt has run: commit the target's first token; the row drafts from now on."""
        row.gen.tokens.append(first)
        row.gen.first_token_at = time.perf_counter()
        row.gen.prefill_s = row.prefill_s
        row.context.append(first)
        row.start, row.hidden = len(row.request.prompt), hidden

    def _done(self, row: _Row) -> bool:
        if row.prefilling:
            return False
        return len(row.gen.tokens) >= row.request.max_new_tokens or row.gen.tokens[-1] in self.stops

    def _finish(self, row: _Row) -> None:
        del row.gen.tokens[row.request.max_new_tokens:]
        row.gen.finished_step, row.gen.finished_at = self.steps, time.perf_counter()
        self._ids.discard(row.request.request_id)
        self._finished.append((row.request.request_id, row.gen))

    def run(self, requests: Sequence[BatchRequest]) -> BatchResult:
        """Serve ``requests`` to the end, each submitted before its ``arrival_step``'s forward (when nothing
        is in flight until the next arrival, the step clock jumps to it)."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for r in requests:
            self._check(r)
        pending = deque(sorted(requests, key=lambda r: r.arrival_step))
        result = BatchResult({})
        while pending or self.busy:
            if not self.busy and pending:
                self.steps = max(self.steps, pending[0].arrival_step)
            while pending and pending[0].arrival_step <= self.steps:
                self.submit(pending.popleft())
            if (record := self.step()) is not None:
                result.steps.append(record)
            result.generations.update(self.finished())
        return result

    def draft_sizes(self, rows: Sequence[_Row]) -> list[int]:
        """Draft tokens each row may verify this step (chain length, or tree nodes): `BatchPolicy`."""
        if 0 < self.policy.max_spec_rows < len(rows):
            return [0] * len(rows)
        stock = self.cfg.tree_nodes if self.cfg.tree else self.cfg.block_size
        caps = []
        for row in rows:
            cap = stock
            if self.policy.adaptive_block and row.drafted:
                mean = sum(row.accepted) / len(row.drafted)
                cap = min(stock, 1 + round(mean))
            caps.append(cap)
        if self.policy.node_budget <= 0:
            return caps
        rates = [acceptance_rate(row.accepted, row.drafted) for row in rows]
        return allocate_drafts(rates, caps, self.policy.node_budget)

    def _segments(self, active: dict[int, _Row]) -> dict[int, int]:
        """Prompt tokens each prefilling row runs this step: ``prefill_chunk`` in all, first joined first."""
        left, out = self.policy.prefill_chunk, {}
        for slot in sorted((s for s, row in active.items() if row.prefilling),
                           key=lambda s: (active[s].gen.joined_step, active[s].gen.submitted_at)):
            if left <= 0:
                break
            out[slot] = min(left, len(active[slot].request.prompt) - active[slot].start)
            left -= out[slot]
        return out

    def _propose_together(self, rows: list[_Row]) -> dict[int, float]:
        """Rows whose drafters can propose for many rows at once (a ``propose_rows`` and one ``shared``
        object, as `ParallelDrafter.fork` gives) get their proposals from one batched call before the
        per-row drafting reads them; returns each such row's share of that call's seconds."""
        groups: dict[int, list[_Row]] = {}
        for row in rows:
            if row.hidden is not None and hasattr(row.drafter, "propose_rows"):
                groups.setdefault(id(row.drafter.shared), []).append(row)
        shares: dict[int, float] = {}
        for group in groups.values():
            if len(group) > 1:
                t0 = time.perf_counter()
                type(group[0].drafter).propose_rows([r.drafter for r in group], [r.context for r in group],
                                                    [r.hidden for r in group], self.cfg.block_size)
                shares.update({r.slot: (time.perf_counter() - t0) / len(group) for r in group})
        return shares

    def _draft_on_device(self, active: dict[int, _Row], slots: list[int], ks: dict[int, int],
                         nodes: dict[int, int]) -> tuple[dict[int, int], torch.Tensor] | None:
        """``device_drafts``: queue every drafting row's chain on the device from the rows' token history
        (`ParallelDrafter.chains_from_history`) and give each row a chain of placeholders to verify; returns
        (cache row -> its row of the drafts, the drafts [n, block_size]) for `GraphRunner.run_rows`, or None
        (the host drafts) when the policy is off, there are no decode graphs, the step verifies trees, a
        row's drafter cannot, or the step will not fit the graphs."""
        if not self.policy.device_drafts or self.runner is None or self.cfg.tree:
            return None
        drafting = [s for s in slots if ks[s] > 0 and nodes[s] > 0]
        drafters = [active[s].drafter for s in drafting]
        if not drafting or not all(hasattr(d, "chains_from_history") for d in drafters):
            return None
        T = 1 + max(ks[s] for s in drafting)  # the longest block this step can have
        if not all(self.runner.fits(T, row.start) for row in active.values()):
            return None  # the step runs eagerly: the host drafts
        rows = [active[s] for s in drafting]
        self._upload_history(rows)
        drafts = type(drafters[0]).chains_from_history(drafters, self.history, drafting, [len(row.context) for row in rows],
                                                       [row.hidden for row in rows], self.cfg.block_size,
                                                       compiled=self.policy.compile_drafts)
        for slot in slots:
            row = active[slot]
            n = min(ks[slot], nodes[slot]) if slot in drafting else 0
            row.tree = DraftTree.chain(row.context[-1], [0] * n)  # placeholders: the device fills them in
        return {s: j for j, s in enumerate(drafting)}, drafts

    def _upload_history(self, rows: list[_Row]) -> None:
        """Copy the rows' context tokens that are not on the device yet into ``self.history`` [rows, max_len]
        (one transfer of (row, place, token) triples from a pinned staging copy; no sync)."""
        if self.history is None:
            self.history = torch.zeros(self.rows, self.cache.max_len, dtype=torch.int64, device=self.model.device)
            self._history_upload = Staging(3 * self.rows * self.cache.max_len, self.model.device)
        where: list[int] = []
        places: list[int] = []
        tokens: list[int] = []
        for row in rows:
            new = row.context[row.on_device:]
            where += [row.slot] * len(new)
            places += range(row.on_device, row.on_device + len(new))
            tokens += new
            row.on_device += len(new)
        n = len(tokens)
        if not n:
            return
        staging = self._history_upload
        staging.writable()[: 3 * n] = torch.tensor(where + places + tokens, dtype=torch.int64)
        staging.upload(3 * n)
        triples = staging.buffer
        self.history[triples[:n], triples[n: 2 * n]] = triples[2 * n: 3 * n]

    def _step(self, active: dict[int, _Row], prefills: int) -> StepRecord:
        segments = self._segments(active)
        slots = sorted(s for s in active if not active[s].prefilling)
        sizes = self.draft_sizes([active[s] for s in slots])
        ks = {s: min(self.cfg.block_size if self.cfg.tree else size,
                     active[s].request.max_new_tokens - len(active[s].gen.tokens) - 1)
              for s, size in zip(slots, sizes, strict=True)}
        nodes = {s: min(size, self.cache.max_len - active[s].start - 1) for s, size in zip(slots, sizes, strict=True)}
        t_draft = time.perf_counter()
        on_device = self._draft_on_device(active, slots, ks, nodes) if not segments else None
        if on_device is None:
            together_s = self._propose_together([active[s] for s in slots if ks[s] > 0 and nodes[s] > 0])
            for slot in slots:
                row = active[slot]
                t0 = time.perf_counter()
                row.tree = draft(row.drafter, row.context, row.hidden, ks[slot], self.cfg, max_nodes=nodes[slot])
                row.gen.draft_s.append(time.perf_counter() - t0 + together_s.get(slot, 0.0))
        draft_s = time.perf_counter() - t_draft
        if on_device is not None:
            for slot in slots:
                active[slot].gen.draft_s.append(draft_s / len(slots))
        trees = [active[s].tree for s in slots]
        lengths = [len(tree) for tree in trees]
        # the prompt segments ride after the decoding rows: causal chains whose logits matter only where a
        # prompt ends (the first token)
        pre = sorted(segments)
        ends = [b for b, s in enumerate(pre) if active[s].start + segments[s] == len(active[s].request.prompt)]
        decode_n = sum(lengths)
        t0 = time.perf_counter()
        T = max(lengths, default=0)
        if self.runner is not None and not pre and all(self.runner.fits(T, row.start) for row in active.values()):
            # every row padded to the longest tree: row s's i-th token is at s*T + i of the outputs
            argmax_d, hidden, T = self.runner.run_rows(
                {s: (tree, active[s].start) for s, tree in zip(slots, trees, strict=True)},
                idle={s: row.start for s, row in active.items()}, drafts=on_device)
            offsets = [s * T for s in slots]
            if on_device is None:
                argmax = argmax_d.tolist()  # the step's one device sync
            else:  # the verify's argmax and the drafts it verified, in one read: still the step's one sync
                rows_of, drafts = on_device
                read = torch.cat([argmax_d, drafts.flatten()]).tolist()
                argmax, width = read[: argmax_d.shape[0]], drafts.shape[1]
                for slot, j in rows_of.items():
                    tree = active[slot].tree
                    got = read[argmax_d.shape[0] + j * width: argmax_d.shape[0] + (j + 1) * width]
                    active[slot].tree = DraftTree.chain(tree.tokens[0], got[: len(tree) - 1])
                trees = [active[s].tree for s in slots]
        else:
            device = self.model.device
            seg_tokens = [active[s].request.prompt[active[s].start: active[s].start + segments[s]] for s in pre]
            all_lengths = lengths + [segments[s] for s in pre]
            offsets = [sum(all_lengths[:b]) for b in range(len(all_lengths))]
            tokens = torch.tensor([t for tree in trees for t in tree.tokens] + [t for seg in seg_tokens for t in seg],
                                  dtype=torch.int64, device=device)
            positions = torch.cat([tree.positions(active[s].start, device) for s, tree in zip(slots, trees, strict=True)]
                                  + [torch.arange(active[s].start, active[s].start + segments[s], device=device)
                                     for s in pre])
            masks = [None if tree.is_chain else tree.attention_mask(device) for tree in trees] + [None] * len(pre)
            logit_index = list(range(decode_n)) + [offsets[len(slots) + b] + segments[pre[b]] - 1 for b in ends]
            logits, hidden = self.model.forward_ragged(
                tokens, positions, self.cache, [active[s].start for s in slots + pre], all_lengths, slots + pre,
                masks, logit_index=logit_index if pre else None, padded=self.policy.padded_attention)
            argmax = greedy_ids(logits).tolist()  # the step's one device sync
        forward_s = time.perf_counter() - t0
        committed = 0
        for b, slot in enumerate(pre):
            row = active[slot]
            row.start += segments[slot]
            row.prefill_s += forward_s
            if b in ends:
                at = ends.index(b)
                self._first_token(row, argmax[decode_n + at], hidden[offsets[len(slots) + b] + segments[slot] - 1])
                committed += 1
        for b, slot in enumerate(slots):
            row = active[slot]
            path, bonus = row.tree.accept(argmax[offsets[b]: offsets[b] + lengths[b]])
            self.cache.compact_row(slot, row.start, path)
            new = [row.tree.tokens[i] for i in path[1:]] + [bonus]
            row.hidden = hidden[offsets[b] + path[-1]]
            row.start += len(new)
            before = len(row.gen.tokens)
            for tok in new:  # commit up to and including a stop token
                row.gen.tokens.append(tok)
                row.context.append(tok)
                if tok in self.stops:
                    break
            row.gen.committed.append(len(row.gen.tokens) - before)
            row.gen.verified.append(len(row.tree))
            row.accepted.append(len(path) - 1)
            row.drafted.append(len(row.tree) - 1)
            row.gen.verify_s.append(forward_s)
            committed += len(row.gen.tokens) - before
        return StepRecord(rows=len(slots), verified=sum(lengths), committed=committed, forward_s=forward_s,
                          prefills=prefills, prompt_tokens=sum(segments.values()), draft_s=draft_s)
