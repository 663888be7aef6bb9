"""CUDA graphs for decode steps: capture a block forward once per shape, then replay it.

    runner = GraphRunner(model, cache)              # one per (model, KV cache)
    argmax, hidden = runner.step(tree, start)       # = verify's forward + argmax, as a replay

A decode step runs the block of T tokens of a `DraftTree` (T = 1 for AR; block_size + 1 for a full
chain; up to tree_nodes + 1 for a tree) at cache slots ``start .. start+T-1``. The runner captures
`Transformer.forward_static` + argmax once per ``(T, length)`` -- ``length`` is the number of cache
slots attention reads, ``start + T`` rounded up to a multiple of ``bucket`` (capped at the cache),
so attention costs what the live context costs, in steps of ``bucket`` slots. Graphs are captured
lazily, the first time a shape is needed (one eager warm-up of the same function on a side stream,
then the capture); all of them share one memory pool.

A cache of R rows (continuous batching, `specpilot.engine.batch`) steps every row at once: `run_rows`
takes each busy row's (tree, start), pads every row to the longest tree's T tokens (pad tokens write their
keys past the row's live slots, where nothing reads them before they are overwritten, and see only their
own row), and captures one graph per ``(T, length)`` with ``length`` bucketed on the furthest row. The
attention is one padded call over all rows (`Attention._static_attention`), as ``batch_attention =
"padded"`` computes it eagerly.

Per T there is one static input buffer (int64): tokens [R*T], positions [R*T], starts [R], block masks
[R*T*T] (0/1). A step fills a pinned host copy of it, copies it to the device (one transfer), replays
the graph and reads the argmax ids back (the one sync of the step); a step queued without that read (a
captured prefill, `specpilot.engine.batch`) leaves its upload pending, and the next fill waits for it
(`Staging`).
Outputs live in the graph's static buffers: ``hidden`` is valid until the next step (drafters read it
before that, on the same stream). Prefill and the cache compaction after acceptance stay eager
(`specpilot.engine.decode`).

`GraphRunner(..., capture=False)` runs the same static forward without graphs (any device): the
tests use it to check the graph-safe path on the CPU. `graphs_supported(device)` says whether
capture is possible (CUDA only).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from specpilot.engine.model import KVCache, Transformer, greedy_ids
from specpilot.engine.tree import DraftTree

DEFAULT_BUCKET = 256  # cache slots per attention-length bucket


def graphs_supported(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


Outputs = TypeVar("Outputs")


def capture(compute: Callable[[], Outputs], device: torch.device | str,
            pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """``compute`` run once on a side stream (cuBLAS handles and workspaces, kernel selection, lazy
    allocations: the warm-up the torch.cuda.graphs docs ask for), then captured: (graph, the outputs each
    replay rewrites). ``compute`` runs twice, so it must write nothing the second run does not write again."""
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side), torch.no_grad():
        compute()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph collects garbage before it begins; the collector must not run inside the capture: on an
    # H100 a batched capture after earlier graphs failed 5 of 5 runs (cudaErrorStreamCaptureInvalidated) and
    # passed 4 of 4 with it off (session 36), freeing an older graph mid-capture being the likely cause
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool), torch.no_grad():
            outputs = compute()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs


def block_mask_rows(tree: DraftTree) -> np.ndarray:
    """[T, T] 0/1: row i marks i and its ancestors (what `DraftTree.attention_mask` says)."""
    n = len(tree)
    m = np.zeros((n, n), dtype=np.int64)
    for i, p in enumerate(tree.parents):
        if i:
            m[i] = m[p]
        m[i, i] = 1
    return m


class Staging:
    """An int64 buffer on the device filled from a pinned host copy by one asynchronous copy a fill. The host
    copy is not rewritten while that copy may still wait in the stream (a step queued without a sync after
    it, as a captured prefill is): `writable` waits for the last upload first, which after a step's sync
    has long run. Off CUDA (or with ``pin`` off) the copy is plain and nothing waits."""

    def __init__(self, shape: int | tuple[int, ...], device: torch.device | str, pin: bool | None = None):
        device = torch.device(device)
        pin = device.type == "cuda" if pin is None else pin
        self.buffer = torch.zeros(shape, dtype=torch.int64, device=device)
        self._host = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        self._uploaded = torch.cuda.Event() if pin else None

    def writable(self) -> Tensor:
        """The host copy, once it may be written."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        return self._host

    def upload(self, n: int | None = None) -> None:
        """Queue the copy of the host copy (its first ``n`` entries along the first dimension) to ``buffer``."""
        if n is None:
            self.buffer.copy_(self._host, non_blocking=True)
        else:
            self.buffer[:n].copy_(self._host[:n], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


class _Inputs:
    """The static device buffer of one block size T over R cache rows and its pinned host staging copy."""

    def __init__(self, T: int, rows: int, device: torch.device, max_position: int):
        self.T, self.R = T, rows
        self.max_position = max_position  # the RoPE table's last row: a pad's position never passes it
        # tokens R*T, positions R*T, starts R, masks R*T*T, then (not read by the graph) each row's index
        # into the device drafts `run_rows` puts in place (-1: none)
        self.staging = Staging(rows * (2 * T + 1 + T * T) + rows, device)
        self.device_buf = self.staging.buffer
        self._chain_mask = np.tril(np.ones((T, T), dtype=np.int64))

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens [R, T], positions, starts, block masks int64) over the device buffer; positions [T],
        start [] and mask [T, T] for one row, else [R, T], [R] and [R, T, T]."""
        T, R, b = self.T, self.R, self.device_buf
        tokens, positions = b[:R * T].view(R, T), b[R * T: 2 * R * T]
        starts, masks = b[2 * R * T: 2 * R * T + R], b[2 * R * T + R: -R]
        if R == 1:
            return tokens, positions, starts[0], masks.view(T, T)
        return tokens, positions.view(R, T), starts, masks.view(R, T, T)

    def load(self, blocks: Mapping[int, tuple[DraftTree, int]], starts: Sequence[int],
             device_rows: Mapping[int, int] | None = None) -> None:
        """Row r runs ``blocks[r]`` = (tree, start); a row without a block (or the places past its tree)
        runs pad tokens (token 0, seeing only the row's earlier slots and itself) at ``starts[r]``..
        ``device_rows[r] = j``: row r's drafts are row j of drafts on the device (`fill`)."""
        T, R, h = self.T, self.R, self.staging.writable().numpy()
        tokens, positions = h[:R * T].reshape(R, T), h[R * T: 2 * R * T].reshape(R, T)
        row_starts, masks = h[2 * R * T: 2 * R * T + R], h[2 * R * T + R: -R].reshape(R, T, T)
        fill = h[-R:]
        fill[:] = -1
        for r, j in (device_rows or {}).items():
            fill[r] = j
        row_starts[:] = starts
        if len(blocks) < R or any(len(tree) < T for tree, _ in blocks.values()):
            tokens[:] = 0
            # a pad's position is never read back (its output is dropped, its key overwritten), but it
            # indexes the RoPE table, which a cache row rounded up past the model's context outruns
            positions[:] = np.minimum(np.asarray(starts)[:, None] + np.arange(T), self.max_position)
            masks[:] = np.eye(T, dtype=np.int64)
        for r, (tree, start) in blocks.items():
            n = len(tree)
            tokens[r, :n] = tree.tokens
            positions[r, :n] = tree.depths
            positions[r, :n] += start
            masks[r, :n, :n] = self._chain_mask[:n, :n] if tree.is_chain else block_mask_rows(tree)
        self.staging.upload()

    def fill(self, drafts: Tensor) -> None:
        """Put row j of ``drafts`` [n, w] (device token ids) at places 1.. of the rows `load` named for it,
        on the device (no sync): their blocks are chains of the root and those drafts. Places past a row's
        own chain are pads whatever token they hold."""
        T, R, b = self.T, self.R, self.device_buf
        w = min(drafts.shape[1], T - 1)
        if w < 1:
            return
        tokens, index = b[:R * T].view(R, T), b[-R:]
        picked = drafts[index.clamp(min=0), :w]  # [R, w]; rows without drafts read row 0 and keep their own
        tokens[:, 1:1 + w] = torch.where(index[:, None] >= 0, picked, tokens[:, 1:1 + w])


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph | None, argmax: Tensor, hidden: Tensor):
        self.graph, self.argmax, self.hidden = graph, argmax, hidden


class GraphRunner:
    """Decode-step forwards of one model over one KV cache, as CUDA graph replays."""

    def __init__(self, model: Transformer, cache: KVCache, bucket: int = DEFAULT_BUCKET, capture: bool = True):
        if capture and not graphs_supported(model.device):
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        self.model, self.cache, self.bucket, self.capture = model, cache, bucket, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._inputs: dict[int, _Inputs] = {}
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self.captures = 0  # graphs captured so far (a warm-up pass can check nothing new is captured)

    def length(self, T: int, start: int) -> int:
        """Cache slots attention reads for a block of T tokens at ``start``."""
        need = start + T
        return min(-(-need // self.bucket) * self.bucket, self.cache.max_len)

    def fits(self, T: int, start: int) -> bool:
        return start + T <= self.cache.max_len

    def run(self, tree: DraftTree, start: int) -> tuple[Tensor, Tensor]:
        """Queue one step of a one-row cache; returns (argmax [T] int64, hidden [T, D]) on the device,
        valid until the next call."""
        argmax, hidden, _ = self.run_rows({0: (tree, start)})
        return argmax, hidden

    def run_rows(self, blocks: Mapping[int, tuple[DraftTree, int]], idle: Mapping[int, int] | None = None,
                 drafts: tuple[Mapping[int, int], Tensor] | None = None) -> tuple[Tensor, Tensor, int]:
        """Queue one step over every cache row: row r verifies ``blocks[r]`` = (tree, start); the others
        (and a shorter tree's places up to the longest, T) run pad tokens whose keys land past the row's
        live slots (at ``idle[r]``.., slot 0.. by default), where nothing reads them before they are
        overwritten. ``drafts`` = (rows, tokens): row r's chain takes its draft tokens from row ``rows[r]``
        of ``tokens`` [n, w] on the device (its block's own tokens past the root are placeholders), so the
        drafts never pass through the host before the step. Returns (argmax [R*T], hidden [R*T, D], T): row
        r's i-th token is at r*T + i."""
        R, idle = self.cache.k.shape[1], idle or {}
        T = max(len(tree) for tree, _ in blocks.values())
        starts = [blocks[r][1] if r in blocks else idle.get(r, 0) for r in range(R)]
        if not all(self.fits(T, s) for s in starts):
            raise ValueError(f"a block of {T} tokens at slots {max(starts)}.. does not fit the cache ({self.cache.max_len})")
        inputs = self._inputs.get(T)
        if inputs is None:
            inputs = self._inputs[T] = _Inputs(T, R, self.model.device, self.model.cfg.max_seq_len - 1)
        inputs.load(blocks, starts, drafts[0] if drafts else None)
        if drafts:
            inputs.fill(drafts[1])
        length = self.length(T, max(starts))
        if not self.capture:
            return (*self._forward(inputs, length), T)
        captured = self._graphs.get((T, length))
        if captured is None:
            captured = self._graphs[(T, length)] = self._capture(inputs, length)
        captured.graph.replay()
        return captured.argmax, captured.hidden, T

    def step(self, tree: DraftTree, start: int) -> tuple[list[int], Tensor]:
        """`run` then the argmax ids on the host (the step's one sync)."""
        argmax, hidden = self.run(tree, start)
        return argmax.tolist(), hidden

    @torch.no_grad()
    def _forward(self, inputs: _Inputs, length: int) -> tuple[Tensor, Tensor]:
        tokens, positions, start, mask = inputs.views()
        logits, hidden = self.model.forward_static(tokens, positions, start, mask != 0, self.cache, length)
        return greedy_ids(logits.flatten(0, 1)), hidden.flatten(0, 1)

    def _capture(self, inputs: _Inputs, length: int) -> _Captured:
        # The warm-up computes this very step: it writes the same K/V to the same slots as the replay
        # that follows, so it changes nothing.
        graph, (argmax, hidden) = capture(lambda: self._forward(inputs, length), self.model.device, self.pool)
        self.captures += 1
        return _Captured(graph, argmax, hidden)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(T, length) of every captured graph."""
        return sorted(self._graphs)
