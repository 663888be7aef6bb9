"""The parallel drafter: its proposals, its weights file, and the training helpers."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.engine.drafters.ngram import SuffixIndex
from specpilot.engine.drafters.parallel import (
    DEFAULT_WEIGHTS,
    ParallelConfig,
    ParallelDrafter,
    ParallelDrafterNet,
    copy_span,
    load_parallel_drafter,
    save_drafter,
)
from specpilot.errors import UserError
from specpilot.harness.distill import generate_batch, make_examples, to_draft_ids
from specpilot.harness.fit import evaluate
from tests.engine.conftest import make_engine


def random_drafter(model, k: int = 4, vocab: int = 64, seed: int = 0, lookup: bool = False,
                   copy_min_match: int = 0) -> ParallelDrafter:
    torch.manual_seed(seed)
    cfg = ParallelConfig(target=model.cfg.name, dim=model.cfg.dim, width=32, k=k, draft_vocab=vocab, lookup=lookup,
                         copy_min_match=copy_min_match)
    net = ParallelDrafterNet(cfg, torch.randperm(model.cfg.vocab_size)[:vocab], model.embed.weight.detach())
    for p in net.parameters():  # make the (identity-initialised) blocks do something
        torch.nn.init.normal_(p, std=0.5)
    return ParallelDrafter(net)


def test_proposals_chain_and_beam(tiny):
    model, _ = tiny
    d = random_drafter(model)
    h = torch.randn(model.cfg.dim)
    chain = d.propose([1, 2, 3], h, 3, 1)
    assert len(chain) == 1 and len(chain[0].tokens) == 3
    assert set(chain[0].tokens) <= set(d.net.vocab_ids.tolist())
    s = chain[0].scores
    assert 1.0 >= s[0] >= s[1] >= s[2] > 0.0
    beams = d.propose([7], h, 4, 6)  # a context shorter than n_context is padded
    assert len(beams) == 6 and len({c.tokens for c in beams}) == 6
    assert beams[0].tokens == tuple(d.propose([7], h, 4, 1)[0].tokens)  # best beam == greedy chain
    assert [c.scores[-1] for c in beams] == sorted((c.scores[-1] for c in beams), reverse=True)
    assert d.propose([1], None, 4, 1) == [] and d.propose([1], h, 0, 1) == []
    assert len(d.propose([1], h, 9, 1)[0].tokens) == 4  # never more than the drafter's k


def test_copy_path_proposes_what_followed_the_suffix_even_outside_the_vocabulary(tiny):
    model, _ = tiny
    d = random_drafter(model, vocab=16, lookup=True)
    outside = [t for t in range(model.cfg.vocab_size) if t not in set(d.net.vocab_ids.tolist())]
    a, b, x, y, z, w = outside[:6]
    context = [a, b, x, y, z, w, 3, a, b]  # the suffix (a, b) occurred before, followed by x y z w
    h = torch.randn(model.cfg.dim)
    assert d.propose(context, h, 4, 1)[0].tokens != (x, y, z, w)  # random weights do not copy
    with torch.no_grad():
        d.net.copy_bias.fill_(1e3)  # the copy column now wins wherever there is a lookup token
    d.reset()
    assert d.propose(context, h, 4, 1)[0].tokens == (x, y, z, w)
    beams = d.propose(context, h, 4, 5)
    assert beams[0].tokens == (x, y, z, w) and len({c.tokens for c in beams}) == 5
    # The continuation is cut at the context's end (x a b): copy where the lookup has tokens, the
    # draft vocabulary after.
    short = d.propose([a, b, x, a, b], h, 4, 1)[0].tokens
    assert short[:3] == (x, a, b) and short[3] in set(d.net.vocab_ids.tolist())


def test_a_long_enough_match_is_proposed_as_a_whole_span(tiny):
    model, _ = tiny
    d = random_drafter(model, vocab=16, lookup=True, copy_min_match=3)
    outside = [t for t in range(model.cfg.vocab_size) if t not in set(d.net.vocab_ids.tolist())]
    a, b, c, x, y, z = outside[:6]
    h = torch.randn(model.cfg.dim)
    # (b, c) matched two deep: below copy_min_match, the net's own picks (random: not the copy)
    assert d.propose([a, b, c, x, y, z, 5, b, c], h, 4, 1)[0].tokens != (x, y, z, 5)
    # (a, b, c) matched three deep: the continuation whole, cut at the context's end, then the net
    d.reset()
    assert d.propose([a, b, c, x, y, a, b, c], h, 4, 1)[0].tokens == (x, y, a, b)
    chain = d.propose([a, b, c, a, b, c], h, 4, 1)[0].tokens
    assert chain[:3] == (a, b, c) and chain[3] in set(d.net.vocab_ids.tolist())
    beams = d.propose([a, b, c, x, y, z, 5, a, b, c], h, 4, 3)
    assert beams[0].tokens == (x, y, z, 5) and len(beams) == 3  # trees: the span first
    # A block asked longer than the net's k: a whole copied span runs on to that length...
    d.reset()
    long = [a, b, c, x, y, z, 5, 6, 7, 8, 9, a, b, c]
    assert d.propose(long, h, 8, 1)[0].tokens == (x, y, z, 5, 6, 7, 8, 9)
    assert d.propose(long, h, 4, 1)[0].tokens == (x, y, z, 5)
    # ... and after the net's own picks, copying goes on where their tail recurs in the context.
    d.reset()
    picks = d.propose([1, 2, 3], h, 4, 1)[0].tokens
    d.reset()
    context = [*picks[1:], 11, 12, 13, 14, 1, 2, 3]  # the picks' last 3 tokens occurred, then 11..14
    assert d.propose(context, h, 4, 1)[0].tokens == picks
    assert d.propose(context, h, 7, 1)[0].tokens == (*picks, 11, 12, 13)
    ids = copy_span(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[7, 8, -1], [7, 8, 9]]),
                    torch.tensor([3, 2]), 3)
    assert ids.tolist() == [[7, 8, 3], [1, 2, 3]]


def test_batched_heads_equal_the_heads_one_by_one(tiny):
    """The forward runs the k heads as one bmm; each head module applied to its position (what
    training's state dict holds) is the reference."""
    model, _ = tiny
    d = random_drafter(model, vocab=16, lookup=True)
    net = d.net
    h, ctx = torch.randn(3, model.cfg.dim), torch.randint(0, 256, (3, 3))
    look, match = torch.tensor([[5, -1, 7, 9]] * 3), torch.tensor([2, 0, 4])
    heads_out = []  # what the output projection receives: the heads' result
    hook = net.out.register_forward_pre_hook(lambda mod, inp: heads_out.append(inp[0]))
    with torch.no_grad():
        got = net(h, ctx, look, match, d.heads)
        trunk = net.trunk(_trunk_input(net, h, ctx, look, match))
        want = torch.stack([head(trunk[:, i]) for i, head in enumerate(net.heads)], dim=1)
        assert torch.equal(got, net(h, ctx, look, match))  # stacked once == stacked per call
    hook.remove()
    assert (want - trunk).abs().max() > 0.1  # the heads do change their input
    torch.testing.assert_close(heads_out[0], want, rtol=1e-5, atol=1e-5)


def _trunk_input(net, hidden, ctx, look, match):
    """The trunk's input, written out position by position (the unbatched formulation)."""
    parts = [net.in_norms[0](hidden)]
    e = net.embed[ctx]
    parts += [net.in_norms[1 + i](e[:, -1 - i]) for i in range(net.cfg.n_context)]
    a = net.inp(torch.cat(parts, dim=-1))[:, None, :] + net.pos
    has = look >= 0
    look_e = net.embed[look.clamp(min=0)]
    a = a + torch.where(has[..., None], net.look_in(net.look_norm(look_e)), net.look_none)
    return a + net.match[match][:, None, :]


def _chain_reference(d: ParallelDrafter, context: list[int], h: torch.Tensor, k: int) -> tuple[int, ...]:
    """A chain proposal written out from the net's outputs (each position's most probable token, the
    lookup's tokens where the match is deep enough), before any span runs on past the net's k."""
    found, m = SuffixIndex(d.cfg.lookup_max, d.cfg.lookup_min, d.cfg.lookup_periodic).lookup(context, d.cfg.k)
    look = torch.tensor([[*found, *[-1] * (d.cfg.k - len(found))]], device=h.device)
    ctx = context[-d.cfg.n_context:]
    ctx = torch.tensor([[ctx[0]] * (d.cfg.n_context - len(ctx)) + ctx], device=h.device)
    with torch.no_grad():
        logp, ids = d.net.candidates(d.net(h[None], ctx, look, torch.tensor([m], device=h.device)), look)
    picks = ids[0].gather(-1, logp[0].argmax(-1)[:, None])[:, 0].tolist()
    if 0 < d.cfg.copy_min_match <= m:
        picks = [t if t >= 0 else p for t, p in zip(look[0].tolist(), picks, strict=True)]
    return tuple(picks[:k])


def _chain_proposals_match_the_reference(model, device: str, graph: bool) -> ParallelDrafter:
    rng = random.Random(5)
    d = random_drafter(model, vocab=32, lookup=True, copy_min_match=3)
    d = ParallelDrafter(d.net.to(device), graph=graph)
    hits = 0
    for _ in range(40):
        context = [rng.randrange(8) for _ in range(rng.randrange(3, 40))]  # small alphabet: lookups hit
        h = torch.randn(model.cfg.dim, device=device)
        for k in (2, 4):
            d.reset()
            got = d.propose(context, h, k, 1)[0].tokens
            assert got == _chain_reference(d, context, h, k), (context, k)
            hits += d.index.query(1)[1] > 0  # the net saw a lookup row
    assert hits > 20 and d._graph is not None
    return d


def _tree_reference(d: ParallelDrafter, context: list[int], h: torch.Tensor, k: int, n: int) -> list[tuple[int, ...]]:
    """A tree proposal written out from the net's outputs: the beam's n best prefixes over each position's
    ``beam_top`` best tokens (the copied span, when the match is deep enough, ahead of them)."""
    found, m = SuffixIndex(d.cfg.lookup_max, d.cfg.lookup_min, d.cfg.lookup_periodic).lookup(context, max(k, d.cfg.k))
    look = torch.tensor([[*found[: d.cfg.k], *[-1] * (d.cfg.k - len(found[: d.cfg.k]))]], device=h.device)
    ctx = context[-d.cfg.n_context:]
    ctx = torch.tensor([[ctx[0]] * (d.cfg.n_context - len(ctx)) + ctx], device=h.device)
    with torch.no_grad():
        logp, ids = d.net.candidates(d.net(h[None], ctx, look, torch.tensor([m], device=h.device)), look)
    vals, idx = logp[0, :k].topk(d.beam_top, dim=-1)
    vals, toks = vals.tolist(), ids[0, :k].gather(-1, idx).tolist()
    beams = [(0.0, ())]
    for depth in range(k):
        beams = sorted(((s + vals[depth][j], t + (toks[depth][j],)) for s, t in beams for j in range(d.beam_top)),
                       key=lambda b: -b[0])[:n]
    spans = [tuple(found[:k])] if 0 < d.cfg.copy_min_match <= m and found else []
    return [*spans, *(t for _, t in beams)][:n]


def _tree_proposals_match_the_reference(model, device: str, graph: bool) -> None:
    rng = random.Random(6)
    d = random_drafter(model, vocab=32, lookup=True, copy_min_match=3)
    d = ParallelDrafter(d.net.to(device), graph=graph)
    for _ in range(30):
        context = [rng.randrange(8) for _ in range(rng.randrange(3, 40))]
        h = torch.randn(model.cfg.dim, device=device)
        for k, n in ((2, 3), (4, 8)):
            d.reset()
            got = [c.tokens for c in d.propose(context, h, k, n)]
            assert got == _tree_reference(d, context, h, k, n), (context, k, n)


def test_tree_proposal_is_the_beam_over_the_nets_top_tokens_on_cpu(tiny):
    """Trees read each position's best tokens from the same static computation as chains (captured as a
    CUDA graph there): the beam over them is what the net's outputs give."""
    _tree_proposals_match_the_reference(tiny[0], "cpu", graph=True)


def test_chain_proposal_equals_the_nets_picks_on_cpu(tiny):
    model, _ = tiny
    d = _chain_proposals_match_the_reference(model, "cpu", graph=True)
    assert d._graph.graph is None  # nothing to capture off CUDA: the same computation, eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_chain_proposal_equals_the_nets_picks_on_cuda():
    from specpilot.engine.weights import load_model

    model, tok = load_model("tiny", dtype="fp32", device="cuda")
    static = _chain_proposals_match_the_reference(model, "cuda", graph=True)
    assert static._graph.graph is not None  # captured, and replayed for every proposal above
    _tree_proposals_match_the_reference(model, "cuda", graph=True)
    from specpilot.engine.api import Engine
    from specpilot.engine.options import EngineOptions

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    ar = Engine(model, tok, EngineOptions(drafter="none", dtype="fp32", cuda_graphs=True))
    sp = Engine(model, tok, EngineOptions(drafter="ngram", block_size=6, dtype="fp32", cuda_graphs=True))
    sp.drafter = static
    assert [sp.generate(p, 40).tokens for p in prompts] == [ar.generate(p, 40).tokens for p in prompts]


def _rows_propose_as_one_by_one(model, device: str, graph: bool) -> None:
    """`propose_rows` (one batched pass for the forked drafters of a batch's rows) gives each row the chain
    and the tree its drafter proposes alone, whatever k it then asks for, and a context other than the
    batched one runs alone again."""
    rng = random.Random(7)
    net = random_drafter(model, vocab=32, lookup=True, copy_min_match=3).net.to(device)
    alone = ParallelDrafter(net, graph=graph)
    first = ParallelDrafter(net, graph=graph)
    rows = [first, *(first.fork() for _ in range(4))]
    assert all(d.net is net and d.shared is first.shared for d in rows) and len({id(d.index) for d in rows}) == 5
    for step in range(12):
        contexts = [[rng.randrange(8) for _ in range(rng.randrange(3, 40))] for _ in rows]
        hiddens = [torch.randn(model.cfg.dim, device=device) for _ in rows]
        n = 1 if step % 2 else 6
        batched = 3 + step % 3
        ParallelDrafter.propose_rows(rows[:batched], contexts[:batched], hiddens[:batched], 6)
        for d, context, h in zip(rows, contexts, hiddens, strict=True):  # rows past the batch propose alone
            k = rng.choice([2, 4, 6])
            alone.reset()
            want = alone.propose(context, h, k, n)
            got = d.propose(context, h, k, n)
            assert [c.tokens for c in got] == [c.tokens for c in want], (step, k, n)
            assert all(c.scores == pytest.approx(w.scores, rel=1e-5) for c, w in zip(got, want, strict=True))
            assert d._ready is None  # read once
    if graph and device == "cuda":
        assert first.shared.batch.graph is not None
    with pytest.raises(ValueError, match="share one net"):
        ParallelDrafter.propose_rows([first, alone], contexts[:2], hiddens[:2], 4)


def test_rows_of_a_batch_propose_in_one_pass_as_they_would_alone_on_cpu(tiny):
    _rows_propose_as_one_by_one(tiny[0], "cpu", graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_of_a_batch_propose_in_one_captured_pass_on_cuda():
    from specpilot.engine.weights import load_model

    _rows_propose_as_one_by_one(load_model("tiny", dtype="fp32", device="cuda")[0], "cuda", graph=True)


def test_a_batch_of_parallel_drafters_drafts_in_one_pass_and_stays_lossless(tiny):
    """In the batched decoder the rows' forked parallel drafters propose through one `propose_rows` call a
    step (chains and trees), and every request still gets batch-1 AR's tokens."""
    from specpilot.engine.batch import BatchDecoder, BatchRequest
    from specpilot.engine.decode import DecodeConfig
    from tests.engine.test_lossless import _tiny_prompts

    model, _ = tiny
    prompts = _tiny_prompts(11, n=6)
    max_new = [30, 12, 30, 20, 5, 26]
    reference = [make_engine(tiny, drafter="none").generate(p, n).tokens for p, n in zip(prompts, max_new, strict=True)]
    calls = []
    propose_rows = ParallelDrafter.propose_rows

    class Counting(ParallelDrafter):
        @staticmethod
        def propose_rows(drafters, contexts, hiddens, k):
            calls.append(len(drafters))
            propose_rows(drafters, contexts, hiddens, k)

    for tree in (False, True):
        calls.clear()
        first = random_drafter(model, vocab=64, lookup=True, copy_min_match=2)
        first = Counting(first.net)
        drafters = [first, *(first.fork() for _ in range(2))]
        dec = BatchDecoder(model, drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3, max_len=256,
                           stop_ids=model.cfg.stop_ids)
        result = dec.run([BatchRequest(str(i), p, n, arrival_step=i) for i, (p, n) in
                          enumerate(zip(prompts, max_new, strict=True))])
        assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference, tree
        assert calls and max(calls) == 3  # full steps drafted all three rows in one pass


def _device_drafts_run(model_tok, device: str, block: int, device_drafts: bool, filled: list[int],
                       compile_drafts: bool = False) -> list[list[int]]:
    """Six requests over three rows through the batched graph path (captured on CUDA) with forked random
    parallel drafters; returns each request's tokens and records each step's device-drafted rows."""
    from specpilot.engine.batch import BatchDecoder, BatchPolicy, BatchRequest
    from specpilot.engine.decode import DecodeConfig
    from specpilot.engine.graphs import GraphRunner
    from tests.engine.test_lossless import _tiny_prompts

    model = model_tok[0]
    prompts = _tiny_prompts(11, n=6)
    max_new = [30, 12, 30, 20, 5, 26]

    class Recording(GraphRunner):
        def run_rows(self, blocks, idle=None, drafts=None):
            if drafts is not None:
                filled.append(len(drafts[0]))
                assert drafts[1].dtype == torch.int64 and drafts[1].shape == (len(drafts[0]), block)
            return super().run_rows(blocks, idle, drafts)

    first = ParallelDrafter(random_drafter(model, vocab=64, lookup=True, copy_min_match=2).net.to(device), graph=True)
    drafters = [first, *(first.fork() for _ in range(2))]
    dec = BatchDecoder(model, drafters, DecodeConfig(block_size=block), rows=3, max_len=256,
                       stop_ids=model.cfg.stop_ids,
                       policy=BatchPolicy(device_drafts=device_drafts, compile_drafts=compile_drafts),
                       static_steps=lambda cache: Recording(model, cache, bucket=64, capture=device == "cuda"))
    result = dec.run([BatchRequest(str(i), p, n, arrival_step=i) for i, (p, n) in
                      enumerate(zip(prompts, max_new, strict=True))])
    assert sum(sum(g.verified) - len(g.verified) for g in result.generations.values()) > 0  # drafts were verified
    assert sum(s.committed for s in result.steps) > len(result.steps)  # ... and accepted
    return [result.generations[str(i)].tokens for i in range(len(prompts))]


def test_device_drafts_are_verified_in_place_and_stay_lossless(tiny):
    """``batch_device_drafts`` (graph path run without capture): the net's chains go from the proposal to the
    verify step's token buffer on the device, rows whose lookup is copied whole draft on the host, and every
    request gets batch-1 AR's tokens."""
    from tests.engine.test_lossless import _tiny_prompts

    prompts = _tiny_prompts(11, n=6)
    max_new = [30, 12, 30, 20, 5, 26]
    reference = [make_engine(tiny, drafter="none").generate(p, n).tokens for p, n in zip(prompts, max_new, strict=True)]
    for block in (4, 6):
        filled: list[int] = []
        assert _device_drafts_run(tiny, "cpu", block, True, filled) == reference, block
        assert filled and max(filled) == 3  # full steps took every row's chain from the device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_drafts_on_cuda_verify_what_the_host_path_verifies():
    """Captured, on a GPU: at block = the net's k the device path drafts the very chains the host path
    drafts, so the two give the same tokens bit for bit, and batch-1 AR's up to near-ties; compiled
    (``batch_compile_drafts``), its drafts go through torch.compile and the tokens stay the same."""
    from specpilot.engine.weights import load_model
    from tests.engine.conftest import agree_up_to_near_ties
    from tests.engine.test_lossless import _tiny_prompts

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_model("tiny", dtype="fp32", device="cuda")
    prompts = _tiny_prompts(11, n=6)
    max_new = [30, 12, 30, 20, 5, 26]
    reference = [make_engine((model, tok), drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    filled: list[int] = []
    on_device = _device_drafts_run((model, tok), "cuda", 4, True, filled)
    assert filled and _device_drafts_run((model, tok), "cuda", 4, False, []) == on_device
    agree_up_to_near_ties(model, prompts, on_device, reference, "device drafts")
    compiled: list[int] = []
    assert _device_drafts_run((model, tok), "cuda", 6, True, compiled, compile_drafts=True) == \
        _device_drafts_run((model, tok), "cuda", 6, True, [])
    assert compiled and max(compiled) == 3


def test_copy_column_probability_moves_onto_the_vocabulary_entry(tiny):
    model, _ = tiny
    d = random_drafter(model, vocab=16, lookup=True)
    net, inside = d.net, d.net.vocab_ids[3].item()
    look = torch.tensor([[inside, -1, 7, inside]])
    with torch.no_grad():
        logits = net(torch.randn(1, model.cfg.dim), torch.tensor([[1, 2, 3]]), look, torch.tensor([4]))
    assert logits.shape == (1, 4, 17) and logits[0, 1, -1] == -float("inf")
    logp, ids = net.candidates(logits, look)
    probs, raw = logp.exp(), torch.softmax(logits.float(), -1)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 4))
    assert ids[0, :, -1].tolist() == look[0].tolist() and ids[0, 0, 3] == inside
    assert probs[0, 0, 3] == pytest.approx((raw[0, 0, 3] + raw[0, 0, -1]).item()) and probs[0, 0, -1] == 0
    in_vocab = 7 in net.vocab_ids.tolist()
    assert (probs[0, 2, -1] == 0) == in_vocab


def test_save_load_round_trip_and_target_check(tiny, tmp_path, smollm2):
    model, _ = tiny
    d = random_drafter(model)
    path = tmp_path / "d.pt"
    save_drafter(path, d.net, {"training_data_sha256": "x" * 64, "figures": {}})
    loaded = load_parallel_drafter(model, path)
    h = torch.randn(model.cfg.dim)
    # fp16 storage: same proposals as the fp32 original on this input.
    assert loaded.propose([1, 2, 3], h, 4, 1)[0].tokens == d.propose([1, 2, 3], h, 4, 1)[0].tokens
    with pytest.raises(ValueError, match="trained for 'tiny'"):
        load_parallel_drafter(smollm2[0], path)
    with pytest.raises(FileNotFoundError, match="no parallel drafter weights for target 'tiny'"):
        load_parallel_drafter(model)


def test_shipped_weights_are_small_and_documented(smollm2):
    path = DEFAULT_WEIGHTS["smollm2-135m"]
    assert path.stat().st_size <= 10_000_000
    blob = torch.load(path, weights_only=True)
    meta = blob["meta"]
    assert len(meta["training_data_sha256"]) == 64
    assert {"heldout", "measured_tau", "generated_tokens"} <= set(meta["figures"])
    d = load_parallel_drafter(smollm2[0])
    assert d.cfg.target == "smollm2-135m" and d.cfg.draft_vocab == len(blob["vocab_ids"])
    assert d.cfg.lookup and not meta["args"]["dev_prompts"]  # the copy path; trained on no request


def test_generate_batch_equals_engine_ar_and_examples_line_up(tiny):
    """Left-padded lockstep generation (the training data) == batch-1 AR decoding, row by row."""
    model, _ = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 9, 5)]
    b = generate_batch(model, prompts, 12, model.cfg.stop_ids)
    ar = make_engine(tiny, drafter="none")
    for i, p in enumerate(prompts):
        ref = ar.generate(p, 12).tokens
        assert b["tokens"][i, : len(ref)].tolist() == ref
    ex = make_examples([b], n_context=3, k=4)
    n0 = int(b["alive"][0].sum())
    row0 = b["tokens"][0].tolist()
    # Example g of row 0: context ends at token g; targets are the next 4 tokens (-1 past the end).
    g = 2
    assert ex["ctx"][g].tolist() == row0[g - 2: g + 1]
    assert ex["targets"][g].tolist() == [row0[g + j] if g + j < n0 else -1 for j in range(1, 5)]
    assert ex["ctx"][0].tolist() == prompts[0][-2:] + row0[:1]
    assert torch.equal(ex["hidden"][0], b["hidden"][0, 0])
    ids = to_draft_ids(torch.tensor([[5, -1, 7]]), torch.tensor([7, 9]), 320)
    assert ids.tolist() == [[-100, -100, 0]]
    # The copy path's features: what SuffixIndex answers at each root, as the drafter asks it.
    ex = make_examples([b], n_context=3, k=4, index=SuffixIndex())
    rows = [(i, g) for i in range(len(prompts)) for g in range(int(b["alive"][i].sum()))]
    assert len(rows) == len(ex["look"]) == len(ex["match"])
    for (i, g), look, match in zip(rows, ex["look"].tolist(), ex["match"].tolist(), strict=True):
        found, m = SuffixIndex().lookup(prompts[i] + b["tokens"][i, : g + 1].tolist(), 4)
        assert (look, match) == ([*found, *[-1] * (4 - len(found))], m)
    ex["y"] = to_draft_ids(ex["targets"], torch.arange(320), 320)
    figures = evaluate(random_drafter(model, vocab=320, lookup=True).net.eval(), ex)
    assert len(figures["acc_per_pos"]) == 4 and 1.0 <= figures["tau_chain_est"] <= 5.0


@pytest.mark.parametrize("seed", range(4))
def test_tiny_parallel_drafter_is_lossless(tiny, seed):
    model, _ = tiny
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    ref = [make_engine(tiny, drafter="none").generate(p, 48).tokens for p in prompts]
    for verify, block, nodes in (("chain", 4, 16), ("chain", 10, 16), ("tree", 4, 12), ("tree", 7, 30)):
        e = make_engine(tiny, drafter="ngram", verify=verify, block_size=block, tree_nodes=nodes)
        # Draft vocabulary = every token, so drafts are sometimes right.
        e.drafter = random_drafter(model, vocab=320, seed=seed)
        assert [e.generate(p, 48).tokens for p in prompts] == ref
        e.drafter = random_drafter(model, vocab=64, seed=seed, lookup=True)  # copies, sometimes right
        assert [e.generate(p, 48).tokens for p in prompts] == ref
        e.drafter = random_drafter(model, vocab=64, seed=seed, lookup=True, copy_min_match=2)  # whole spans
        assert [e.generate(p, 48).tokens for p in prompts] == ref


def test_training_data_resumes_from_its_directory(tmp_path):
    """--data keeps each generated batch; a later run loads them (and generates only the rest),
    and a run with other prompts is refused rather than mixing data."""
    from specpilot.app.cmd_drafter import main as train_main

    data, out = tmp_path / "data", tmp_path / "tiny_parallel.pt"
    base = ["--deployment", "tiny-cpu", "--prompts", "12", "--docstrings", "4", "--batch", "8", "--new-tokens", "10",
            "--draft-vocab", "64", "--eval-requests", "0", "--train-batch", "32", "--data", str(data)]
    assert train_main([*base, "--minutes", "0.3", "--gen-share", "1.0", "--generate-only"]) == 0
    shards = sorted(data.glob("batch-*.pt"))
    assert shards and not out.exists()
    before = {p: p.stat().st_mtime_ns for p in shards}
    assert train_main([*base, "--minutes", "0.2", "--gen-share", "0", "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in shards} == before  # loaded, not generated again
    blob = torch.load(out, weights_only=True)
    assert blob["meta"]["figures"]["generated_tokens"] > 0 and blob["config"]["lookup"]
    with pytest.raises(UserError, match="other prompts"):
        train_main([*base, "--seed", "1", "--minutes", "0.2", "--gen-share", "0", "--out", str(out)])


def test_docstring_variants_are_humaneval_shaped():
    from specpilot.harness.corpus import docstring_variants

    prompt = 'import os\n\n\ndef join(self, path, *rest, sep="/"):\n    """Join paths."""\n'
    plain, shaped, fenced, tested = docstring_variants(prompt, random.Random(0))
    assert plain == prompt
    assert shaped.startswith('import os\n\n\ndef join(path, *rest, sep="/"):\n    """Join paths.\n    >>> join(')
    assert shaped.endswith('\n    """\n') and shaped.count('"""') == 2
    assert fenced == shaped + "```\n\n" and tested.startswith(shaped) and tested.endswith(":\n")
    assert docstring_variants("def broken(:\n    x\n", random.Random(0)) == ["def broken(:\n    x\n"]


def test_everyday_chat_prompts_leave_out_what_the_shipped_requests_ask():
    """The drafter's chat prompts share no four-word run and no subject with a request it is measured on:
    a near-copy (the same subject asked another way) would be measured on what the drafter memorised."""
    import re

    from specpilot.harness.corpus import general_chat_prompts
    from specpilot.harness.requests import REQUEST_SETS

    everything = general_chat_prompts(random.Random(0), 10**6)
    assert any("photosynthesis" in p for p in everything) and any("ten-year-old" in p for p in everything)
    # a request that asks about a subject and with a phrase the templates have: both go
    clean = general_chat_prompts(random.Random(0), 10**6, ["Explain photosynthesis to a ten-year-old, briefly."])
    assert clean and not any("photosynthesis" in p or "ten-year-old" in p for p in clean)
    assert len(clean) < len(everything) and set(clean) < set(everything)

    shipped = [r.text for load in REQUEST_SETS.values() for r in load()]
    prompts = general_chat_prompts(random.Random(0), 10**6, shipped)
    assert len(prompts) == len(set(prompts)) > 5000
    words = lambda t: re.findall(r"[a-z]+", t.lower())  # noqa: E731
    grams = {tuple(w[i: i + 4]) for x in shipped for w in [words(x)] for i in range(len(w) - 3)}
    assert not any(tuple(w[i: i + 4]) in grams for p in prompts for w in [words(p)] for i in range(len(w) - 3))
    for subject in ("photosynthesis", "inflation", "factorial", "palindrome", "haiku", "duplicates"):
        assert any(subject in x.lower() for x in shipped) and not any(subject in p.lower() for p in prompts)
    assert general_chat_prompts(random.Random(0), 50, shipped) == general_chat_prompts(random.Random(0), 50, shipped)


@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("longest,shortest", [(4, 2), (6, 1), (3, 3)])
def test_suffix_lookup_of_many_rows_answers_what_the_suffix_index_answers(periodic, longest, shortest):
    """`suffix_lookup_rows` (tensor ops over a [rows, slots] history) against `SuffixIndex.lookup`, row by row,
    on random contexts over small alphabets (many repeats, loops, no match at all), of every length, for
    several ranges of match lengths."""
    from specpilot.engine.drafters.ngram import SuffixIndex
    from specpilot.engine.drafters.parallel import suffix_lookup_rows

    rng = random.Random(3)
    k, L = 8, 64
    contexts = [[rng.randrange(alphabet) for _ in range(rng.randrange(1, L + 1))]
                for alphabet in (2, 3, 5, 50) for _ in range(40)]
    contexts += [[7], [7, 7], [1, 2, 1, 2, 1], [4, 5, 6, 4, 5, 6, 4], list(range(30))]
    history = torch.full((len(contexts), L), 999, dtype=torch.int64)
    for r, c in enumerate(contexts):
        history[r, : len(c)] = torch.tensor(c)
    lengths = torch.tensor([len(c) for c in contexts])
    tokens, match = suffix_lookup_rows(history, lengths, k, longest, shortest, periodic)
    hits = 0
    for r, c in enumerate(contexts):
        want, m = SuffixIndex(longest, shortest, periodic).lookup(c, k)
        got = [t for t in tokens[r].tolist() if t >= 0]
        assert (tuple(got), int(match[r])) == (want, m), (r, c)
        hits += m > 0
    assert 0 < hits < len(contexts)


def test_chains_from_the_token_history_are_what_the_host_proposes(tiny):
    """`chains_from_history` (lookups, net inputs, net and chain on the device): a row copied whole gets the
    span `propose` returns; any other row gets `propose`'s k net picks, then the lookup's tokens past k
    (token 0 where there are none)."""
    from specpilot.engine.drafters.ngram import SuffixIndex

    model, _ = tiny
    first = random_drafter(model, vocab=64, lookup=True, copy_min_match=3)
    drafters = [first, first.fork(), first.fork(), first.fork()]
    g = torch.Generator().manual_seed(2)
    hiddens = [torch.randn(model.cfg.dim, generator=g) for _ in drafters]
    contexts = [list(range(40, 60)), [7, 8, 9, 10, 11] * 3, list(range(90, 75, -1)), [3, 4, 5, 6, 1, 3, 4, 5]]
    history = torch.zeros(6, 32, dtype=torch.int64)
    rows = [4, 0, 5, 2]  # cache rows, not in order
    for r, c in zip(rows, contexts, strict=True):
        history[r, : len(c)] = torch.tensor(c)
    chains = ParallelDrafter.chains_from_history(drafters, history, rows, [len(c) for c in contexts], hiddens, 6)
    assert chains.shape == (4, 6)
    copied = 0
    for j, (c, h) in enumerate(zip(contexts, hiddens, strict=True)):
        alone = ParallelDrafter(first.net)
        (cand,) = alone.propose(c, h, 4, 1)
        found, m = SuffixIndex(4, 2, False).lookup(c, 6)
        if first.copies_whole(m):
            copied += 1
            assert chains[j].tolist() == [*found, 0, 0, 0, 0, 0, 0][:6]  # the whole span, past the net's k; 0: none
        else:
            assert tuple(chains[j, :4].tolist()) == cand.tokens
            assert chains[j, 4:].tolist() == [*found[4:6], 0, 0][:2]
    assert 0 < copied < len(contexts)  # both kinds of row
