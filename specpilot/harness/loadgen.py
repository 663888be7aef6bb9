"""Closed-loop load on a batched decoder: ``concurrency`` clients, each sending its next request as soon as
its last one is answered, as a serving benchmark's clients do.

`closed_loop(decoder, prompts, concurrency, max_new_tokens, total)` drives a
`specpilot.engine.batch.BatchDecoder` online (``submit`` / ``step``): the clients take the prompts in turn
(round robin, so every run of the same arguments sends the same requests in the same order), and the
run ends when ``total`` requests are answered. Per request it records the wall-clock latency (submit to
last token), the time to first token (submit to the end of its prefill) and its tokens; overall the
output tokens per second of wall time, and per step the rows in flight and the forward's seconds (the
step cost by batch size). The whole load's tokens/s includes its drain (the last requests finishing
with fewer clients busy, at the pace of the slowest); ``steady_tok_s`` is the rate until the last
request is sent, while all ``concurrency`` clients are busy (none when every request is sent at the
start, ``total <= concurrency``).

Pure measurement over the decoder's public interface: nothing here changes what is decoded, and a
request's tokens are the decoder's (batch-invariant where its linears are).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a load runs: `frozen_heap` serves torch-free workers (server deployments)
    from specpilot.engine.batch import BatchDecoder


@dataclass
class RequestRecord:
    request_id: str
    prompt_index: int
    tokens: list[int]
    latency_s: float
    ttft_s: float
    steps: int
    committed: int


@dataclass
class LoadResult:
    concurrency: int
    wall_s: float
    requests: list[RequestRecord] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    step_forward_s: list[float] = field(default_factory=list)
    step_wall_s: list[float] = field(default_factory=list)  # the whole step: joins, drafting, forward, acceptance
    step_prefill_s: list[float] = field(default_factory=list)  # the joining prompts' forwards before the step
    step_draft_s: list[float] = field(default_factory=list)  # the rows' drafting
    step_committed: list[int] = field(default_factory=list)
    step_verified: list[int] = field(default_factory=list)  # the rows' tokens (roots and drafts) a forward
    max_waiting: int = 0  # most requests queued for a row at once (clients beyond the decoder's rows)
    # the steady window: from the start until the last request is sent, while every client has one in
    # flight (the load at its concurrency, before the drain); its seconds and the output tokens in it
    steady_s: float = 0.0
    steady_tokens: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def summary(self) -> dict:
        """Throughput, latency percentiles, tau and the step cost by rows in flight (seconds a forward)."""
        lat = sorted(r.latency_s for r in self.requests)
        ttft = sorted(r.ttft_s for r in self.requests)
        by_rows: dict[int, list[float]] = defaultdict(list)
        for rows, secs in zip(self.step_rows, self.step_forward_s, strict=True):
            by_rows[rows].append(secs)
        steps = sum(r.steps for r in self.requests)
        return {
            "concurrency": self.concurrency, "requests": len(self.requests), "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3), "tok_s": self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "steady_s": round(self.steady_s, 3),
            "steady_tok_s": self.steady_tokens / self.steady_s if self.steady_s > 0 else 0.0,
            "latency_p50_s": _percentile(lat, 50), "latency_p99_s": _percentile(lat, 99),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tau": sum(r.committed for r in self.requests) / max(1, steps),
            "verified_per_row": sum(self.step_verified) / max(1, sum(self.step_rows)),
            "max_waiting": self.max_waiting,
            "step_s_by_rows": {str(k): round(statistics.median(v), 5) for k, v in sorted(by_rows.items())},
            # the share of the steps' time outside the target's forward (prefills, drafting, acceptance): on
            # a GPU the host work that graphs do not remove
            "host_share": 1 - sum(self.step_forward_s) / sum(self.step_wall_s) if sum(self.step_wall_s) > 0 else 0.0,
            "time_split": self.time_split(),
        }

    def time_split(self) -> dict[str, float]:
        """Where the steps' wall time went, as shares: the joining prompts' forwards (prefill), drafting, the
        decode forward, and the rest (acceptance, bookkeeping)."""
        wall = sum(self.step_wall_s)
        if wall <= 0:
            return {}
        parts = {"prefill": sum(self.step_prefill_s), "draft": sum(self.step_draft_s),
                 "forward": sum(self.step_forward_s)}
        parts["other"] = max(0.0, wall - sum(parts.values()))
        return {k: round(v / wall, 4) for k, v in parts.items()}


def _percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then keep every object alive now out of the collector's passes (`gc.freeze`) until the
    block ends, as serving engines do once started (vLLM freezes after capturing its graphs). A full
    collection otherwise walks the model, its graphs and every loaded module: on an H100 host one bench
    process ran 10 of them, 174 ms each (`bench/gc_probe.py`, 2026-12-06), a pause in a third of its ~1 s
    loads and most of their spread. Objects made inside the block are collected as usual; cycles among the
    frozen ones wait for the block's end. Nested blocks leave the outer one's freeze as it is."""
    if gc.get_freeze_count():  # inside another frozen block (a bench run in a frozen worker)
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def closed_loop(decoder: BatchDecoder, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                total: int) -> LoadResult:
    """``total`` requests from ``concurrency`` closed-loop clients (see the module docstring)."""
    from specpilot.engine.batch import BatchRequest

    if concurrency < 1 or total < 1 or not prompts:
        raise ValueError("closed_loop needs concurrency >= 1, total >= 1 and at least one prompt")
    result = LoadResult(concurrency=concurrency, wall_s=0.0)
    sent = 0
    submitted: dict[str, tuple[int, float]] = {}

    def send() -> None:
        nonlocal sent
        rid = f"q{sent}"
        index = sent % len(prompts)
        submitted[rid] = (index, time.perf_counter())
        decoder.submit(BatchRequest(rid, prompts[index], max_new_tokens))
        sent += 1

    t0 = time.perf_counter()
    for _ in range(min(concurrency, total)):
        send()
    steady = False
    while decoder.busy:
        t_step = time.perf_counter()
        record = decoder.step()
        t_step = time.perf_counter() - t_step
        result.max_waiting = max(result.max_waiting, len(decoder.waiting))  # still without a row after the joins
        if record is not None:
            result.step_rows.append(record.rows)
            result.step_forward_s.append(record.forward_s)
            result.step_wall_s.append(t_step)
            result.step_prefill_s.append(record.prefill_s)
            result.step_draft_s.append(record.draft_s)
            result.step_committed.append(record.committed)
            result.step_verified.append(record.verified)
        for rid, gen in decoder.finished():
            index, at = submitted.pop(rid)
            result.requests.append(RequestRecord(rid, index, list(gen.tokens), gen.finished_at - at,
                                                 gen.first_token_at - at, gen.steps, sum(gen.committed)))
            if sent < total:
                send()
                steady = sent == total  # the last request is out: clients go idle from here on
        if steady:
            result.steady_s = time.perf_counter() - t0
            result.steady_tokens = sum(len(r.tokens) for r in result.requests) + decoder.tokens_in_flight
            steady = False
    result.wall_s = time.perf_counter() - t0
    return result
