"""Parallel drafter: K draft tokens in one small forward from the target's last hidden state.

Inputs (all from the target, nothing re-run): the final-norm hidden state ``h_t`` that chose the
root token ``x_{t+1}``, and the target's embeddings of the last ``n_context`` committed tokens
(root included). One pass of a small network predicts ``x_{t+2} .. x_{t+1+K}`` at once:

    z   = W_in [norm(h_t); norm(e(x_{t+1})); norm(e(x_t)); ...]       shared trunk
    a_k = Trunk(z + pos_k);  a_k = Head_k(a_k)                          one residual block per position
    logits_k = norm(W_out a_k) . E_d^T + b                               E_d: the target's embedding rows
                                                                         of a small draft vocabulary

The output layer reuses the target's (frozen) embedding rows of the ``draft_vocab`` most frequent
tokens, so drafting stays cheap (a few MB read per step) and the file stays small; only the
trunk, heads and projections are trained (`specpilot drafter train`). Positions are predicted
independently, so a candidate's score is the product of its tokens' probabilities; trees come
from a beam over positions.

With ``lookup`` (a copy path, as in pointer-generator networks) each position also gets the
token that followed the most recent earlier occurrence of the context's suffix
(`specpilot.engine.drafters.ngram.SuffixIndex`: ``l_k``, or none) and the match length ``m``:

    a_k += W_l norm(e(l_k)) + M[m]                        (a learned vector when there is no l_k)
    logits_k = [u_k . E_d^T + b ;  u_k . e(l_k) + c[m]]   one more column: "copy l_k"

so the heads learn when the context repeats itself, and can propose a token outside the draft
vocabulary (an identifier of the prompt) by copying it. The copy column's probability is added
to ``l_k``'s own entry when the draft vocabulary has it. With ``copy_min_match`` a lookup whose
suffix matched at least that deep is proposed as a whole span instead of position by position
(`copy_span`): independent marginals cannot keep a copied span consistent, and on HumanEval the
net's own picks at such matches lost tau (docs/FIGURES.md, "Lab notes moved from code"). When every
position of the block is copied the net is not run at all (its picks would all be replaced).

Blocks longer than the net's ``k`` (``block_size > k``): the net still drafts ``k`` positions; a
chain then runs on only where copying is likely to hold: a whole copied span continues to the
block size, and after the net's own picks the lookup continues where their tail (at least
``copy_min_match`` tokens) recurs in the context (`SuffixIndex.continuation`). So a step verifies
``k`` drafts when the context does not repeat and up to ``block_size`` when it does; on HumanEval
tau grew with the block size (docs/FIGURES.md, "Lab notes moved from code").

A batch's rows draft together: `ParallelDrafter.propose_rows` runs the net once for every row (the
lookups on the host, the answers read back), and `ParallelDrafter.chains_from_history` keeps the
whole chain proposal on the GPU for ``batch_device_drafts``: the lookups over a device copy of each
row's context (`suffix_lookup_rows`, the same answers as `SuffixIndex`), the net and each row's chain
of ``block_size`` drafts in one captured graph, read by the verify step in place. Past ``k`` such a
chain goes on with the lookup's own tokens, not the continuation above (which needs the picks on the
host).

The weights file records the target it was trained for, the draft vocabulary, the hash of its
training data and its figures. A drafter only proposes: acceptance stays exact greedy matching
in `specpilot.engine.tree`, so a poor drafter costs speed, never correctness.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.engine import graphs
from specpilot.engine.drafters.ngram import SuffixIndex
from specpilot.engine.tree import Candidate

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = {"smollm2-135m": WEIGHTS_DIR / "smollm2_parallel.pt"}


@dataclass(frozen=True)
class ParallelConfig:
    target: str  # specpilot.engine.model.CONFIGS name of the target
    dim: int  # target hidden size
    width: int = 576  # drafter hidden size
    k: int = 4  # positions drafted per pass (a copied span may run on to the engine's block size)
    n_context: int = 3  # committed tokens embedded (root included)
    draft_vocab: int = 4096
    lookup: bool = False  # the copy path over the context's earlier occurrences (see the module docstring)
    lookup_min: int = 2  # SuffixIndex match lengths
    lookup_max: int = 4
    lookup_periodic: bool = False  # SuffixIndex(periodic=...): loops continue past the context's end
    copy_min_match: int = 0  # a lookup matched this deep is proposed whole (`copy_span`); 0: never


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * _rms(x)


class _Residual(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = _Norm(width)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        nn.init.zeros_(self.down.weight)  # each block starts as the identity

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


class ParallelDrafterNet(nn.Module):
    def __init__(self, cfg: ParallelConfig, vocab_ids: Tensor, target_embed: Tensor):
        super().__init__()
        self.cfg = cfg
        d, w = cfg.dim, cfg.width
        self.in_norms = nn.ModuleList(_Norm(d) for _ in range(1 + cfg.n_context))
        self.inp = nn.Linear((1 + cfg.n_context) * d, w, bias=False)
        self.pos = nn.Parameter(torch.zeros(cfg.k, w))
        self.trunk = _Residual(w, 2 * w)
        self.heads = nn.ModuleList(_Residual(w, w // 2) for _ in range(cfg.k))
        self.out = nn.Linear(w, d, bias=False)
        self.out_norm = _Norm(d)
        self.bias = nn.Parameter(torch.zeros(cfg.draft_vocab))
        if cfg.lookup:
            self.look_norm = _Norm(d)
            self.look_in = nn.Linear(d, w, bias=False)
            self.look_none = nn.Parameter(torch.zeros(w))
            self.match = nn.Parameter(torch.zeros(cfg.lookup_max + 1, w))  # by match length (0: none)
            self.copy_bias = nn.Parameter(torch.zeros(cfg.lookup_max + 1))
        # Frozen, not saved: they come from the target at load time.
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.register_buffer("embed", target_embed, persistent=False)  # [V, d], the target's
        self.register_buffer("out_embed", target_embed[vocab_ids.long()].clone(), persistent=False)
        to_draft = torch.full((target_embed.shape[0],), -1, dtype=torch.long, device=vocab_ids.device)
        to_draft[vocab_ids.long()] = torch.arange(len(vocab_ids), device=vocab_ids.device)
        self.register_buffer("to_draft", to_draft, persistent=False)  # target id -> draft index, -1: none
        self.vocab_linear: nn.Module | None = None  # u -> u . out_embed^T another way (`use_stream_linears`)

    def use_stream_linears(self) -> None:
        """Every linear of the net, the draft vocabulary's projection included, through the AVX2 kernel
        of `specpilot.kernels.cpu_gemm` (what ``linear_backend = "stream"`` gives the target; CPU only):
        PyTorch's bf16 products of a few rows were the bulk of a chain proposal's time on an AVX2 VM
        (docs/FIGURES.md, "Lab notes moved from code")."""
        from specpilot.engine.packed import StreamLinear, pack_linears

        pack_linears(self, "stream")
        self.vocab_linear = StreamLinear(self.out_embed)

    def head_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """The per-position heads stacked for batched matmuls: norm [k, w], up [k, w, h], down [k, h, w]."""
        heads = self.heads
        return (torch.stack([h.norm.weight for h in heads]),
                torch.stack([h.up.weight for h in heads]).transpose(1, 2),
                torch.stack([h.down.weight for h in heads]).transpose(1, 2))

    def forward(self, hidden: Tensor, ctx_tokens: Tensor, look: Tensor | None = None,
                match: Tensor | None = None, heads: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """hidden [B, d], ctx_tokens [B, n_context] (oldest first, root last) -> logits [B, k, draft_vocab].

        With ``cfg.lookup`` also look [B, k] (the lookup's tokens, -1 where none) and match [B]
        (its match length, 0 for none), and the logits get the copy column: [B, k, draft_vocab + 1].
        ``heads``: `head_weights()` computed once by an inference caller (stacked here otherwise).

        The inputs' norms and the k heads each run as one batched operator (bmm over positions):
        measured faster at batch 1 on a CPU (docs/FIGURES.md, "Lab notes moved from code").
        """
        e = self.embed[ctx_tokens.flip(-1)]  # [B, n_context, d], root first
        x = _rms(torch.cat([hidden[:, None], e], dim=1)) * torch.stack([n.weight for n in self.in_norms])
        a = self.inp(x.flatten(1))[:, None, :] + self.pos  # [B, k, w]
        if self.cfg.lookup:
            has = look >= 0
            look_e = self.embed[look.clamp(min=0)]  # [B, k, d]
            a = a + torch.where(has[..., None], self.look_in(self.look_norm(look_e)), self.look_none)
            a = a + self.match[match][:, None, :]
        a = self.trunk(a)
        norm_w, up, down = self.head_weights() if heads is None else heads
        t = (_rms(a) * norm_w).transpose(0, 1)  # [k, B, w]: head i's block on position i
        a = a + torch.bmm(F.silu(torch.bmm(t, up)), down).transpose(0, 1)
        u = self.out_norm(self.out(a))
        logits = F.linear(u, self.out_embed, self.bias) if self.vocab_linear is None else self.vocab_linear(u) + self.bias
        if not self.cfg.lookup:
            return logits
        copy = (u * look_e).sum(-1) + self.copy_bias[match][:, None]
        return torch.cat([logits, copy.masked_fill(~has, -math.inf)[..., None]], dim=-1)

    def candidates(self, logits: Tensor, look: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(log-probabilities, token ids), both [B, k, C], of every proposable token per position.

        Without the copy path C is the draft vocabulary. With it the copy column's probability is
        moved onto the looked-up token's own entry when the draft vocabulary has it (the column
        then holds probability 0); otherwise the column proposes that token itself.
        """
        B, k = logits.shape[:2]
        ids = self.vocab_ids.expand(B, k, -1)
        if not self.cfg.lookup:
            return torch.log_softmax(logits.float(), dim=-1), ids
        probs = torch.softmax(logits.float(), dim=-1)
        slot = self.to_draft[look.clamp(min=0)].masked_fill(look < 0, -1)  # [B, k]
        known = slot >= 0
        copy = probs[..., -1]
        vocab = probs[..., :-1].scatter_add(-1, slot.clamp(min=0)[..., None], (copy * known)[..., None])
        probs = torch.cat([vocab, (copy * ~known)[..., None]], dim=-1)
        return probs.log(), torch.cat([ids, look[..., None]], dim=-1)


def copy_span(guess: Tensor, look: Tensor, match: Tensor, min_match: int) -> Tensor:
    """``guess`` [B, k] with the lookup's tokens (``look`` [B, k], -1: none) put in where the match
    (``match`` [B]) is at least ``min_match`` deep; unchanged when ``min_match`` is 0."""
    if min_match <= 0:
        return guess
    use = (match[:, None] >= min_match) & (look >= 0)
    return torch.where(use, look, guess)


def suffix_lookup_rows(history: Tensor, lengths: Tensor, k: int, max_match: int, min_match: int,
                       periodic: bool) -> tuple[Tensor, Tensor]:
    """`SuffixIndex.lookup` of many rows at once, in tensor ops (graph-safe: no value reaches the host).

    ``history`` [R, L] holds each row's context in its first ``lengths[r]`` places (whatever after);
    returns (tokens [R, k], -1 where the lookup has none; match [R], 0 for none): for the longest m in
    ``max_match .. min_match`` whose last-m-token suffix occurred earlier (an occurrence starting at
    j <= n - 1 - m, the most recent one), the k tokens that followed it (``periodic``: continued as the
    repeat it is, token i at ``j + m + i % (n - m - j)``), exactly what `SuffixIndex` answers."""
    R, L = history.shape
    device = history.device
    n = lengths.view(R, 1)
    ends = torch.arange(L, device=device)  # e: where an occurrence ends (it starts at e - m + 1)
    # run[r, e]: how many tokens ending at e equal the context's last ones (history[e - t] == history[n - 1 - t]
    # for t < run), up to max_match; -2 pads before the start (no token). All match lengths in one pass: a
    # captured step replays ~25 small kernels, not ~60 (kernel count, not bytes, is its cost at 32 rows)
    last = history.gather(1, (n - 1 - torch.arange(max_match, device=device)).clamp(min=0))  # [R, M]
    back = F.pad(history, (max_match - 1, 0), value=-2).unfold(1, max_match, 1).flip(-1)  # [R, L, M]: history[e - t]
    run = (back == last[:, None, :]).to(torch.int32).cumprod(-1).sum(-1)  # [R, L]
    lens = torch.arange(min_match, max_match + 1, device=device)  # [K] candidate match lengths
    ok = ((run[:, None, :] >= lens[None, :, None]) & (ends <= n - 2)[:, None, :]  # occurrences before the end
          & (ends[None, :] >= lens[:, None] - 1)[None])  # [R, K, L]
    best = torch.where(ok, ends, -1).amax(-1)  # [R, K]: the most recent occurrence's end for each length
    m = torch.where(best >= 0, lens, 0).amax(-1, keepdim=True)  # [R, 1]: the longest length found, 0: none
    end = best.gather(1, (m - min_match).clamp(min=0))
    j = end - m + 1  # that occurrence's start
    places = torch.arange(k, device=device)
    if periodic:
        at = j + m + places % (n - m - j).clamp(min=1)
        got = history.gather(1, at.clamp(0, L - 1))
    else:
        at = j + m + places
        got = torch.where(at < n, history.gather(1, at.clamp(0, L - 1)), -1)
    tokens = torch.where(m > 0, got, -1)
    return tokens, m[:, 0]


def padded_lookup(found: tuple[int, ...], k: int) -> list[int]:
    """A `SuffixIndex` answer as the net's ``look`` row: ``k`` tokens, -1 where it has none."""
    return [*found, *[-1] * (k - len(found))]


class _ProposalGraph:
    """A proposal's tensor work over ``rows`` rows as one static computation: the net, the copy column's
    merge, each position's best token and the copied span (a chain), and each position's ``beam_top`` best
    tokens (what a tree's beam reads). A call copies its inputs into static buffers (one transfer) and reads
    every row's answer back in one tensor (one sync). With ``capture`` (CUDA) the computation is captured
    once as a CUDA graph and replayed (rows a call does not use are padded); eagerly it is ~40 small
    kernels, slower than a whole AR step of SmolLM2 on an H200 (docs/FIGURES.md, "Lab notes moved from
    code"). Without, it runs eagerly over exactly the rows given."""

    def __init__(self, drafter: ParallelDrafter, capture: bool, rows: int = 1):
        net, cfg = drafter.net, drafter.cfg
        self.drafter = drafter  # its cfg is read at each computation (a capture fixes copy_min_match)
        self.top = min(drafter.beam_top, net.out_embed.shape[0] + (1 if cfg.lookup else 0))
        device = net.out_embed.device
        n_ids = cfg.n_context + (cfg.k + 1 if cfg.lookup else 0)  # context, then the lookup's row and match
        self.rows = rows
        self.staging = graphs.Staging((rows, n_ids), device, pin=capture)
        self.ids = self.staging.buffer
        self.hidden = torch.zeros(rows, cfg.dim, dtype=net.out_embed.dtype, device=device)
        self.graph = None
        if capture:
            self.graph, self.out = graphs.capture(lambda: self._compute(rows), device)

    def _compute(self, rows: int) -> Tensor:
        """[rows, 2, k * (1 + top)] float64. Row 0 of a row's answer: the chain's token ids, then each
        position's ``top`` best ids; row 1: the chain's cumulative probabilities, then those ids'
        log-probabilities."""
        cfg, net = self.drafter.cfg, self.drafter.net
        ids = self.ids[:rows]
        ctx = ids[:, : cfg.n_context]
        look = ids[:, cfg.n_context: cfg.n_context + cfg.k] if cfg.lookup else None
        match = ids[:, -1] if cfg.lookup else None
        logp, cand = net.candidates(net(self.hidden[:rows], ctx, look, match, self.drafter.heads), look)
        best, idx = logp.max(dim=-1)  # [rows, k]
        tokens = cand.gather(-1, idx[..., None])[..., 0]
        if look is not None:
            tokens = copy_span(tokens, look, match, cfg.copy_min_match)
        vals, top_idx = logp.topk(self.top, dim=-1)  # [rows, k, top]
        top_ids = cand.gather(-1, top_idx)
        return torch.stack([torch.cat([tokens.double(), top_ids.flatten(1).double()], dim=1),
                            torch.cat([best.cumsum(1).exp().double(), vals.flatten(1).double()], dim=1)], dim=1)

    def launch(self, hidden: Sequence[Tensor], ids: Sequence[list[int]]) -> Tensor:
        """Queue `_compute` for the net's inputs of up to ``rows`` rows; returns their answers on the device
        (no sync), valid until the next call."""
        n = len(ids)
        self.staging.writable()[:n] = torch.tensor(ids, dtype=torch.int64)
        self.staging.upload()
        if n == 1:
            self.hidden[0].copy_(hidden[0].reshape(-1))
        else:
            self.hidden[:n] = torch.stack([h.reshape(-1) for h in hidden])
        if self.graph is None:
            with torch.no_grad():
                return self._compute(n)
        self.graph.replay()
        return self.out[:n]

    def run(self, hidden: Sequence[Tensor], ids: Sequence[list[int]]) -> list[list[list[float]]]:
        """Each row's answer (`_compute`) for the net's inputs of up to ``rows`` rows, on the host."""
        return self.launch(hidden, ids).tolist()

    def chain(self, answer: list[list[float]]) -> tuple[list[int], list[float]]:
        """The k tokens of the chain and their cumulative probabilities, from one row's answer."""
        k = self.drafter.cfg.k
        tokens, scores = answer
        return [int(t) for t in tokens[:k]], scores[:k]

    def tops(self, answer: list[list[float]]) -> tuple[list[list[float]], list[list[int]]]:
        """Per position, the ``top`` best log-probabilities and their token ids, best first."""
        k, top = self.drafter.cfg.k, self.top
        toks, vals = (row[k:] for row in answer)
        return ([vals[d * top:(d + 1) * top] for d in range(k)],
                [[int(t) for t in toks[d * top:(d + 1) * top]] for d in range(k)])


class _DeviceChainGraph:
    """A batch's whole chain proposal on the device (``batch_device_drafts``): each row's lookup over its
    token history (`suffix_lookup_rows`, what `SuffixIndex` answers), the net's inputs built from that
    history, the net, and each row's chain of ``block`` drafts: the looked-up span when the lookup is copied
    whole (`ParallelDrafter.copies_whole`, with at least min(block, k) tokens found), else the net's k picks
    (copy_span applied) followed by the lookup's tokens past k. Places without a token hold token 0 (a draft
    the target will judge like any other). Inputs: ``history`` [R, L] (the caller keeps every row's context
    there), and per call the rows' indices into it, their context lengths and hidden states; with
    ``capture`` (CUDA) the computation is one captured graph over ``rows`` rows; with ``compiled`` it goes
    through torch.compile first (its elementwise chains fused: a captured step of ~110 small kernels spent
    0.41 ms on an H100, 2026-12-06, where its bytes take microseconds)."""

    def __init__(self, drafter: ParallelDrafter, history: Tensor, rows: int, block: int, capture: bool,
                 compiled: bool = False):
        net = drafter.net
        self.drafter, self.history, self.rows, self.block, self.compiled = drafter, history, rows, block, compiled
        device = history.device
        self.staging = graphs.Staging((2, rows), device, pin=capture)
        self.index = self.staging.buffer  # row indices, context lengths
        self.hidden = torch.zeros(rows, drafter.cfg.dim, dtype=net.out_embed.dtype, device=device)
        self.graph = None
        compute = self._compute
        if compiled:
            compute = torch.compile(self._compute, fullgraph=True, dynamic=False)
        self._run = compute
        if capture:
            self.graph, self.out = graphs.capture(lambda: compute(rows), device)

    def _compute(self, rows: int) -> Tensor:
        d = self.drafter
        cfg, net = d.cfg, d.net
        history = self.history.index_select(0, self.index[0, :rows])
        n = self.index[1, :rows]
        ctx = history.gather(1, (n[:, None] - cfg.n_context + torch.arange(cfg.n_context, device=n.device)).clamp(min=0))
        if not cfg.lookup:
            logp, cand = net.candidates(net(self.hidden[:rows], ctx, heads=d.heads))
            _, idx = logp.max(dim=-1)
            picks = cand.gather(-1, idx[..., None])[..., 0]
            return F.pad(picks, (0, max(0, self.block - cfg.k)))[:, : self.block]
        found, match = suffix_lookup_rows(history, n, max(self.block, cfg.k), cfg.lookup_max, cfg.lookup_min,
                                          cfg.lookup_periodic)
        look = found[:, : cfg.k]
        logp, cand = net.candidates(net(self.hidden[:rows], ctx, look, match, d.heads), look)
        _, idx = logp.max(dim=-1)  # as `_ProposalGraph` picks
        picks = copy_span(cand.gather(-1, idx[..., None])[..., 0], look, match, cfg.copy_min_match)
        chain = torch.cat([picks, found[:, cfg.k:]], dim=1)[:, : self.block]
        if cfg.copy_min_match > 0:
            whole = (match >= cfg.copy_min_match) & ((look >= 0).sum(1) >= min(self.block, cfg.k))
            chain = torch.where(whole[:, None], found[:, : self.block], chain)
        return chain.clamp(min=0)

    def launch(self, rows: Sequence[int], lengths: Sequence[int], hidden: Sequence[Tensor]) -> Tensor:
        """Queue the chains of cache rows ``rows`` (contexts of ``lengths`` tokens in the history); returns
        them on the device, [len(rows), block] int64 (no sync), valid until the next call."""
        n = len(rows)
        self.staging.writable()[:, :n] = torch.tensor([list(rows), list(lengths)], dtype=torch.int64)
        self.staging.upload()
        self.hidden[:n] = torch.stack([h.reshape(-1) for h in hidden])
        if self.graph is None:
            with torch.no_grad():
                return self._run(self.rows if self.compiled else n)[:n]
        self.graph.replay()
        return self.out[:n]


class _Shared:
    """What the drafters of a batch's rows share: the net's batched proposal graph (built at the first
    batched call, over the most rows asked for so far)."""

    def __init__(self):
        self.batch: _ProposalGraph | None = None
        self.chains: _DeviceChainGraph | None = None

    def graph(self, drafter: ParallelDrafter, rows: int) -> _ProposalGraph:
        """The batched proposal graph, over at least ``rows`` rows."""
        if self.batch is None or self.batch.rows < rows:
            self.batch = None  # release the old graph first
            self.batch = _ProposalGraph(drafter, capture=drafter._captures, rows=_capacity(rows))
        return self.batch

    def chain_graph(self, drafter: ParallelDrafter, history: Tensor, rows: int, block: int,
                    compiled: bool = False) -> _DeviceChainGraph:
        """The device chain graph over ``history``, for at least ``rows`` rows and chains of ``block``
        (``compiled``: over every row of ``history``, so that torch.compile runs once)."""
        graph = self.chains
        if (graph is None or graph.rows < rows or graph.history is not history or graph.block != block
                or graph.compiled != compiled):
            self.chains = None  # release the old graph first
            capacity = history.shape[0] if compiled else _capacity(rows)
            self.chains = _DeviceChainGraph(drafter, history, capacity, block, capture=drafter._captures,
                                            compiled=compiled)
        return self.chains


def _capacity(rows: int) -> int:
    """Rows a batched graph is built for: ``rows`` rounded up to a power of two, so that a batch filling up
    captures a few graphs, not one a row."""
    return 1 << (rows - 1).bit_length()


class ParallelDrafter:
    """The `specpilot.engine.drafters.Drafter` over a trained `ParallelDrafterNet`. Proposals (chains and
    trees) run their tensor work through a `_ProposalGraph`, captured as a CUDA graph when ``graph`` is
    set and the net is on CUDA. The rows of a batched decoder each have their own drafter (`fork`: the same
    net, their own lookup index); `propose_rows` runs the net once for all of them."""

    def __init__(self, net: ParallelDrafterNet, beam_top: int = 4, graph: bool = False,
                 shared: _Shared | None = None):
        self.net = net.eval()
        self.cfg = net.cfg
        with torch.no_grad():
            self.heads = net.head_weights()  # stacked once: the net is not trained from here on
        self.beam_top = beam_top
        self.index = (SuffixIndex(self.cfg.lookup_max, self.cfg.lookup_min, self.cfg.lookup_periodic)
                      if self.cfg.lookup else None)
        self.graph = graph
        self._graph: _ProposalGraph | None = None  # built at the first proposal (on the net's device)
        self.shared = shared or _Shared()  # drafters with the same `shared` propose for many rows at once
        self._ready: tuple[int, tuple, int, list[list[float]]] | None = None  # propose_rows' answer

    def fork(self) -> ParallelDrafter:
        """A drafter for another row of a batch: the same net (and batched graph), its own lookup index."""
        return ParallelDrafter(self.net, self.beam_top, self.graph, self.shared)

    def reset(self) -> None:
        if self.index is not None:
            self.index.reset()
        self._ready = None

    def copies_whole(self, match: int) -> bool:
        """Whether a lookup that matched ``match`` tokens deep is proposed as a whole span."""
        return 0 < self.cfg.copy_min_match <= match

    @property
    def _captures(self) -> bool:
        """Whether proposals run as captured CUDA graphs (``graph`` set and the net on CUDA)."""
        return self.graph and self.net.out_embed.device.type == "cuda"

    def _inputs(self, context: list[int], last_hidden: Tensor, span_k: int) -> tuple[Tensor, list[int], tuple, int]:
        """(hidden [1, d], the net's id row, the lookup's tokens (up to the span; the net reads the first
        ``cfg.k``), its match)."""
        ctx = context[-self.cfg.n_context:]
        ctx = [ctx[0]] * (self.cfg.n_context - len(ctx)) + ctx
        h = last_hidden.reshape(1, -1).to(self.net.out_embed.dtype)
        found_all, m = self.index.lookup(context, max(span_k, self.cfg.k)) if self.index is not None else ((), 0)
        lookup_row = padded_lookup(found_all[: self.cfg.k], self.cfg.k) + [m] if self.index is not None else []
        return h, ctx + lookup_row, found_all, m

    def _proposals(self) -> _ProposalGraph:
        if self._graph is None:
            self._graph = _ProposalGraph(self, capture=self._captures)
        return self._graph

    @staticmethod
    @torch.no_grad()
    def propose_rows(drafters: Sequence[ParallelDrafter], contexts: Sequence[list[int]],
                     hiddens: Sequence[Tensor], k: int) -> None:
        """Run the net once for many rows whose drafters share one net (`fork`): each drafter's next
        `propose` on that context (any k up to ``k``) reads its row of the answer instead of running the
        net alone. One replay and one sync for all of them on a GPU; the same answers as one row at a time
        (up to the kernels' rounding at another row count)."""
        first = drafters[0]
        shared = first.shared
        if any(d.shared is not shared for d in drafters):
            raise ValueError("propose_rows batches drafters that share one net (ParallelDrafter.fork)")
        inputs = [d._inputs(c, h, k) for d, c, h in zip(drafters, contexts, hiddens, strict=True)]
        answers = shared.graph(first, len(drafters)).run([i[0] for i in inputs], [i[1] for i in inputs])
        for d, c, (_, _, found_all, m), answer in zip(drafters, contexts, inputs, answers, strict=True):
            d._ready = (len(c), found_all, m, answer)

    @staticmethod
    @torch.no_grad()
    def chains_from_history(drafters: Sequence[ParallelDrafter], history: Tensor, rows: Sequence[int],
                            lengths: Sequence[int], hiddens: Sequence[Tensor], block: int,
                            compiled: bool = False) -> Tensor:
        """The chains of a batch's rows, computed on the device from their token ``history`` [R, L] (cache row
        r's context in its first ``lengths`` places): `_DeviceChainGraph`, [len(rows), block] int64, no sync.
        The drafters' own lookup indexes are not used. ``compiled``: the computation through torch.compile,
        over all R rows (one compilation)."""
        first = drafters[0]
        if any(d.shared is not first.shared for d in drafters):
            raise ValueError("chains_from_history batches drafters that share one net (ParallelDrafter.fork)")
        graph = first.shared.chain_graph(first, history, len(rows), block, compiled)
        return graph.launch(rows, lengths, hiddens)

    @torch.no_grad()
    def propose(self, context: list[int], last_hidden: Tensor | None, k: int, n: int) -> list[Candidate]:
        ready, self._ready = self._ready, None
        if last_hidden is None or k <= 0:
            return []
        span_k, k = k, min(k, self.cfg.k)
        if ready is not None and ready[0] == len(context):
            _, found_all, m, answer = ready
        else:
            h, ids, found_all, m = self._inputs(context, last_hidden, span_k)
            answer = None
        found = found_all[: self.cfg.k]
        if self.index is not None and n <= 1 and self.copies_whole(m) and len(found) >= k:
            # A chain whose every position is copied: the net's picks would all be replaced. The
            # span may run on past the net's k, to the asked length.
            span = found_all[:span_k]
            return [Candidate(tuple(span), (1.0,) * len(span))]
        if answer is None:
            graph = self._proposals()
            (answer,) = graph.run([h], [ids])
        else:  # read with the batched graph: a row's own graph is never built (a capture syncs the device)
            graph = self.shared.batch
        if n <= 1:
            tokens, scores = graph.chain(answer)
            tokens, scores = tokens[:k], scores[:k]
            if span_k > k and self.index is not None and self.cfg.copy_min_match > 0:
                # Past the net's block, copy on where the drafted tail recurs in the context.
                extra = self.index.continuation(context[-self.cfg.lookup_max:] + tokens, span_k - k,
                                                self.cfg.copy_min_match)
                tokens, scores = tokens + list(extra), scores + [scores[-1]] * len(extra)
            return [Candidate(tuple(tokens), tuple(scores))]
        # Trees: a long enough match's span is one more candidate, ahead of the beam (scored first).
        spans = ([Candidate(found_all[:span_k], (1.0,) * len(found_all[:span_k]))]
                 if self.index is not None and self.copies_whole(m) and found else [])
        vals, toks = graph.tops(answer)
        top = graph.top
        # Beam over positions (independent marginals): keep the n best prefixes at each depth.
        beams: list[tuple[float, tuple[int, ...], tuple[float, ...]]] = [(0.0, (), ())]
        for d in range(k):
            grown = [(s + vals[d][j], t + (toks[d][j],), c + (s + vals[d][j],))
                     for s, t, c in beams for j in range(top)]
            beams = heapq.nlargest(n, grown, key=lambda b: b[0])
        return [*spans, *(Candidate(t, tuple(math.exp(x) for x in c)) for _, t, c in beams)][:n]


def save_drafter(path: Path, net: ParallelDrafterNet, meta: dict) -> None:
    """Weights in fp16 (the file stays small), the draft vocabulary, the config and ``meta``."""
    state = {k: v.detach().to(torch.float16).cpu() for k, v in net.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": 1, "config": asdict(net.cfg), "vocab_ids": net.vocab_ids.to(torch.int32).cpu(),
                "state": state, "meta": meta}, tmp)
    tmp.replace(path)


def load_net(model, path: Path | str | None, kind: str, default_weights: dict[str, Path], config_cls, build):
    """A drafter net of ``kind`` for ``model`` from ``path`` (or ``default_weights[target]``, or for a
    checkpoint target the file beside it: `checkpoint.drafter_file`).

    ``build(cfg, vocab_ids)`` makes the untrained net from the file's config; its fp16 state is
    loaded and the net cast to the target's device and dtype. Shared by every trained drafter so
    the file format, the target check and the error messages stay one.
    """
    from specpilot.engine.checkpoint import drafter_file

    name = model.cfg.name
    path = Path(path) if path else default_weights.get(name) or drafter_file(name, kind)
    if path is None or not path.is_file():
        flag = "" if kind == "parallel" else f" --kind {kind}"
        raise FileNotFoundError(f"no {kind} drafter weights for target {name!r} (looked for {path}); "
                                f"train them with `specpilot drafter train{flag} --deployment <a deployment of {name}> "
                                f"--out <file>`")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    # Files written before drafters had kinds hold parallel drafters.
    if (found := blob["config"].get("kind", "parallel")) != kind:
        raise ValueError(f"{path} holds a {found!r} drafter, not a {kind!r} one")
    cfg = config_cls(**blob["config"])
    if cfg.target != name or cfg.dim != model.cfg.dim:
        raise ValueError(f"{path} was trained for {cfg.target!r} (dim {cfg.dim}), not {name!r}")
    embed = model.embed.weight.detach()
    net = build(cfg, blob["vocab_ids"].to(embed.device))
    net.load_state_dict({k: v.float() for k, v in blob["state"].items()})
    return net.to(device=embed.device, dtype=embed.dtype)


def load_parallel_drafter(model, path: Path | str | None = None, graph: bool = False,
                          stream_linears: bool = False) -> ParallelDrafter:
    """The parallel drafter for ``model`` (a specpilot.engine.model.Transformer) from ``path`` or the default file;
    ``graph``: chain proposals as one CUDA graph (`_ChainGraph`); ``stream_linears``: the net's linears
    through `specpilot.kernels.cpu_gemm` (`ParallelDrafterNet.use_stream_linears`; ignored off the CPU)."""
    embed = model.embed.weight.detach()
    net = load_net(model, path, "parallel", DEFAULT_WEIGHTS, ParallelConfig,
                   lambda cfg, vocab_ids: ParallelDrafterNet(cfg, vocab_ids, embed))
    if stream_linears and embed.device.type == "cpu":
        net.use_stream_linears()
    return ParallelDrafter(net, graph=graph)
