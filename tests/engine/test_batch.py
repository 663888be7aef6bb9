"""Continuous batching (`specpilot.engine.batch`), fp32 on the CPU: a request's tokens are the same whatever
its batch-mates, its row and when it arrives (batch invariance, with the row-independent ``stream`` linears),
they equal batch-1 decoding's, and every drafter (chain and tree) emits AR's tokens inside a batch too.
Requests beyond the rows wait and are served; bad requests are refused by name before any work.
"""

from __future__ import annotations

import copy

import pytest

from specpilot.engine.api import apply_model_options
from specpilot.engine.batch import BatchDecoder, BatchRequest
from specpilot.engine.decode import DecodeConfig
from specpilot.engine.drafters.ngram import NgramDrafter
from specpilot.engine.graphs import GraphRunner
from specpilot.engine.options import EngineOptions
from tests.engine.conftest import make_engine
from tests.engine.test_lossless import _tiny_prompts


@pytest.fixture(scope="module")
def tiny_stream(tiny):
    """The tiny model with the stream backend's linears (rows independent of the block's row count)."""
    model, tok = copy.deepcopy(tiny)
    return apply_model_options(model, EngineOptions(linear_backend="stream").resolved(dtype="fp32")), tok


def _decoder(model, rows: int, drafter: str, tree: bool = False, block: int = 4, nodes: int = 8) -> BatchDecoder:
    cfg = DecodeConfig(block_size=block, tree=tree, tree_nodes=nodes)
    drafters = [NgramDrafter(min_match=1) if drafter == "ngram" else None for _ in range(rows)]
    return BatchDecoder(model, drafters, cfg, rows=rows, max_len=256, stop_ids=model.cfg.stop_ids)


def _batch_one(model_tok, prompts, max_new, **options) -> list[list[int]]:
    engine = make_engine(model_tok, **options)
    return [engine.generate(p, max_new).tokens for p in prompts]


def test_a_batch_gives_each_request_its_batch_one_tokens(tiny_stream):
    """Eight requests of different lengths over three rows, arriving at different steps: each one's tokens
    equal batch-1 AR decoding's, with AR, an n-gram chain and an n-gram tree in the batch."""
    prompts = _tiny_prompts(3, n=8)
    max_new = [40, 24, 40, 8, 33, 40, 1, 17]
    reference = [make_engine(tiny_stream, drafter="none").generate(p, n).tokens for p, n in zip(prompts, max_new, strict=True)]
    requests = [BatchRequest(f"r{i}", p, n, arrival_step=(0, 0, 0, 2, 5, 5, 9, 30)[i])
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    model = tiny_stream[0]
    for drafter, tree in (("none", False), ("ngram", False), ("ngram", True)):
        result = _decoder(model, 3, drafter, tree).run(requests)
        got = [result.generations[f"r{i}"].tokens for i in range(len(prompts))]
        assert got == reference, (drafter, tree)
        assert max(s.rows for s in result.steps) == 3  # the rows were full: later requests waited
        if drafter == "ngram":
            assert sum(s.committed for s in result.steps) > len(result.steps) * 1.0  # drafts were accepted
        first = {r: g.joined_step for r, g in result.generations.items()}
        assert first["r7"] >= 30 and all(g.finished_step >= g.joined_step for g in result.generations.values())


def test_a_requests_tokens_do_not_depend_on_its_batch_mates(tiny_stream):
    """The same request alone, among others, in another row and arriving later: bit for bit the same
    tokens and the same accepted lengths a step (its logits do not move)."""
    prompts = _tiny_prompts(5, n=6)
    target = BatchRequest("t", prompts[0], 48)
    model = tiny_stream[0]
    alone = _decoder(model, 1, "ngram").run([target]).generations["t"]
    crowd = [BatchRequest(f"o{i}", p, 48 - 5 * i) for i, p in enumerate(prompts[1:])]
    late = BatchRequest("t", prompts[0], 48, arrival_step=4)  # joins a running batch, in another row
    for rows, requests in ((4, crowd + [target]), (6, crowd[::-1] + [late])):
        mixed = _decoder(model, rows, "ngram").run(requests).generations["t"]
        assert mixed.tokens == alone.tokens and mixed.committed == alone.committed, rows


def test_requests_joining_at_one_step_prefill_in_one_forward(tiny_stream, monkeypatch):
    """Stock admission: the prompts that join at one step run as one ragged forward (cut at
    `PREFILL_TOKENS` tokens; a longer prompt alone), and each request still gets its batch-1 tokens."""
    import specpilot.engine.batch as batch

    prompts = _tiny_prompts(7, n=7)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 12).tokens for p in prompts]
    model = tiny_stream[0]
    calls: list[list[int]] = []  # the cache rows of each forward
    forward_ragged = model.forward_ragged
    monkeypatch.setattr(model, "forward_ragged", lambda *a, **k: calls.append(list(a[5])) or forward_ragged(*a, **k))
    for limit, first_forwards in ((batch.PREFILL_TOKENS, [[0, 1, 2, 3, 4]]), (1, [[0], [1], [2], [3], [4]])):
        monkeypatch.setattr(batch, "PREFILL_TOKENS", limit)
        calls.clear()
        dec = _decoder(model, 5, "ngram")
        for i, p in enumerate(prompts):
            dec.submit(BatchRequest(f"r{i}", p, 12))
        record = dec.step()
        assert calls[:len(first_forwards)] == first_forwards and record.prefills == 5 and record.prefill_s > 0
        while dec.busy:
            dec.step()
        got = dict(dec.finished())
        assert [got[f"r{i}"].tokens for i in range(7)] == reference, limit


def test_smollm2_batched_equals_batch_one(smollm2, smol_reference):
    """SmolLM2 with the stream backend, eight dev prompts over four rows with the n-gram tree: each
    request's tokens equal batch-1 AR decoding's with the same linears."""
    model, tok = smollm2
    stream = apply_model_options(copy.deepcopy(model), EngineOptions(linear_backend="stream").resolved(dtype="fp32"))
    prompts, _ = smol_reference
    prompts = prompts[:6]
    reference = _batch_one((stream, tok), prompts, 24, drafter="none")
    result = _decoder(stream, 4, "ngram", tree=True, nodes=8).run(
        [BatchRequest(str(i), p, 24, arrival_step=i % 3) for i, p in enumerate(prompts)])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference


def test_bad_batches_are_refused_before_any_work(tiny):
    model = tiny[0]
    dec = _decoder(model, 2, "none")
    for reqs, message in (([BatchRequest("a", [], 4)], "prompt is empty"),
                          ([BatchRequest("a", [1, 2], 0)], "max_new_tokens must be >= 1"),
                          ([BatchRequest("a", [1] * 250, 8)], "exceed a cache row"),
                          ([BatchRequest("a", [1], 4), BatchRequest("a", [2], 4)], "unique")):
        with pytest.raises(ValueError, match=message):
            dec.run(reqs)
    with pytest.raises(ValueError, match="one drafter"):
        BatchDecoder(model, [None], DecodeConfig(), rows=2, max_len=64)


def test_closed_loop_clients_get_every_answer_and_the_load_is_measured(tiny_stream):
    """`specpilot.harness.loadgen.closed_loop`: three clients, seven requests: each answered once with its
    prompt's batch-1 tokens, never more than three in flight, and the summary's figures consistent
    (latency covers the time to first token; p99 >= p50; the step cost is keyed by rows in flight)."""
    from specpilot.harness.loadgen import closed_loop

    prompts = _tiny_prompts(11, n=4)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 20).tokens for p in prompts]
    dec = _decoder(tiny_stream[0], 3, "ngram")
    load = closed_loop(dec, prompts, concurrency=3, max_new_tokens=20, total=7)
    assert sorted(r.request_id for r in load.requests) == [f"q{i}" for i in range(7)]
    assert all(r.tokens == reference[r.prompt_index] for r in load.requests)
    assert max(load.step_rows) == 3 and not dec.busy
    assert all(0 < r.ttft_s <= r.latency_s for r in load.requests)
    s = load.summary()
    assert s["requests"] == 7 and s["output_tokens"] == sum(map(len, (r.tokens for r in load.requests)))
    assert s["latency_p99_s"] >= s["latency_p50_s"] > 0 and s["tok_s"] > 0 and s["tau"] >= 1.0
    assert set(s["step_s_by_rows"]) <= {"1", "2", "3"}
    assert 0 < s["host_share"] < 1 and len(load.step_wall_s) == len(load.step_forward_s)
    split = s["time_split"]
    assert set(split) == {"prefill", "draft", "forward", "other"} and abs(sum(split.values()) - 1) < 1e-3
    assert split["prefill"] > 0 and split["draft"] > 0 and split["forward"] > 0
    # the steady window ends when the 7th request is sent: before the load ends, with fewer tokens than it
    assert 0 < s["steady_s"] < s["wall_s"] and 0 < load.steady_tokens < s["output_tokens"]
    assert load.steady_tokens >= sum(len(r.tokens) for r in load.requests[:4])  # at least 4 answered by then
    assert closed_loop(dec, prompts, concurrency=3, max_new_tokens=20, total=3).summary()["steady_s"] == 0
    with pytest.raises(ValueError, match="concurrency >= 1"):
        closed_loop(dec, prompts, concurrency=0, max_new_tokens=4, total=1)


def test_a_frozen_heap_leaves_what_lives_out_of_collections_and_thaws_after():
    """`loadgen.frozen_heap`: objects alive at its start are frozen (out of the collector's passes), cycles
    made inside are still collected, a nested block leaves the outer freeze alone, and the heap thaws when the
    block ends."""
    import gc
    import weakref

    from specpilot.harness.loadgen import frozen_heap

    class Node:
        pass

    alive = Node()
    alive.me = alive
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        made = Node()
        made.me = made
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
        frozen = gc.get_freeze_count()
        with frozen_heap():  # nested: the outer freeze stands, before and after
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0 and alive.me is alive


def test_online_requests_queue_beyond_the_rows_and_ids_stay_unique_in_flight(tiny):
    dec = _decoder(tiny[0], 1, "none")
    dec.submit(BatchRequest("a", [1, 2, 3], 4))
    dec.submit(BatchRequest("b", [4, 5, 6], 4))
    with pytest.raises(ValueError, match="already waiting or in flight"):
        dec.submit(BatchRequest("a", [1], 2))
    done = []
    while dec.busy:
        dec.step()
        assert len(dec.active) <= 1
        done += [rid for rid, _ in dec.finished()]
    assert done == ["a", "b"]
    dec.submit(BatchRequest("a", [1, 2, 3], 4))  # a finished id may be sent again


def test_draft_tokens_go_where_they_are_likeliest_accepted():
    """`allocate_drafts`: a row whose drafts are accepted 90% of the time gets most of a shared budget,
    caps hold, and the budget is never exceeded; `acceptance_rate` starts a new row at one half."""
    from specpilot.engine.batch import acceptance_rate, allocate_drafts

    assert acceptance_rate([], []) == 0.5 and acceptance_rate([4, 4], [4, 4]) == 0.9
    assert allocate_drafts([0.9, 0.2, 0.5], [8, 8, 8], 10) == [8, 0, 2]  # 0.9 ** 8 = 0.43 > 0.5 ** 2 > 0.2
    assert allocate_drafts([0.9, 0.9], [3, 8], 20) == [3, 8]  # caps bind before the budget
    assert allocate_drafts([0.5, 0.5], [4, 4], 0) == [0, 0]


@pytest.mark.parametrize("policy", [dict(node_budget=6), dict(adaptive_block=True), dict(node_budget=9, adaptive_block=True)])
@pytest.mark.parametrize("tree", [False, True])
def test_batch_mechanisms_change_what_is_drafted_never_the_tokens(tiny_stream, policy, tree):
    """A shared node budget and per-request block lengths only choose how many drafts each row verifies:
    every request still gets batch-1 AR's tokens, and the step's drafts stay within the budget."""
    from specpilot.engine.batch import BatchPolicy

    prompts = _tiny_prompts(7, n=6)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 32).tokens for p in prompts]
    cfg = DecodeConfig(block_size=6, tree=tree, tree_nodes=8)
    dec = BatchDecoder(tiny_stream[0], [NgramDrafter(min_match=1) for _ in range(4)], cfg, rows=4, max_len=256,
                       stop_ids=tiny_stream[0].cfg.stop_ids, policy=BatchPolicy(**policy))
    result = dec.run([BatchRequest(str(i), p, 32, arrival_step=i) for i, p in enumerate(prompts)])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference
    if policy.get("node_budget"):
        assert all(s.verified - s.rows <= policy["node_budget"] for s in result.steps)


@pytest.mark.parametrize("tree", [False, True])
def test_speculation_stops_under_full_load_and_resumes_as_the_batch_thins(tiny_stream, tree):
    """`max_spec_rows`: a step with more decoding rows than the limit verifies every row's root alone; one
    with fewer drafts again; every request still gets batch-1 AR's tokens."""
    from specpilot.engine.batch import BatchPolicy

    prompts = _tiny_prompts(9, n=6)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 24 + 4 * i).tokens for i, p in enumerate(prompts)]
    cfg = DecodeConfig(block_size=4, tree=tree, tree_nodes=8)
    dec = BatchDecoder(tiny_stream[0], [NgramDrafter(min_match=1) for _ in range(4)], cfg, rows=4, max_len=256,
                       stop_ids=tiny_stream[0].cfg.stop_ids, policy=BatchPolicy(max_spec_rows=2))
    # staggered lengths: the batch runs full, then thins as the short requests end
    result = dec.run([BatchRequest(str(i), p, 24 + 4 * i) for i, p in enumerate(prompts)])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference
    decoding = [s for s in result.steps if s.prefills == 0]
    assert all(s.verified == s.rows for s in decoding if s.rows > 2)
    assert any(s.verified > s.rows for s in decoding if s.rows <= 2)  # drafts again once two rows or fewer are left
    with pytest.raises(ValueError):
        BatchPolicy(max_spec_rows=-1)


def test_a_client_that_goes_away_frees_its_row_and_the_others_are_unaffected(tiny_stream):
    """`cancel` mid-generation: the row is free at the next step (a waiting request takes it), the
    cancelled request never finishes, and every other request still gets its batch-1 tokens."""
    prompts = _tiny_prompts(13, n=4)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 24).tokens for p in prompts]
    dec = _decoder(tiny_stream[0], 2, "ngram")
    for i, p in enumerate(prompts):
        dec.submit(BatchRequest(str(i), p, 24))
    dec.step()
    dec.step()
    assert dec.cancel("0") and not dec.cancel("0") and dec.cancel("3")  # in flight, then waiting
    done = {}
    while dec.busy:
        dec.step()
        done.update(dec.finished())
    assert set(done) == {"1", "2"} and [done["1"].tokens, done["2"].tokens] == reference[1:3]
    assert done["2"].joined_step == 2  # it took the cancelled request's row at the next step


@pytest.mark.parametrize("chunk", [3, 16])
@pytest.mark.parametrize("drafter,tree", [("none", False), ("ngram", False), ("ngram", True)])
def test_segmented_prompt_admission_rides_in_the_steps(tiny_stream, chunk, drafter, tree):
    """Prompts admitted in segments inside the steps' forwards (``prefill_chunk``): no step runs more
    prompt tokens than the budget, no request gets a token before its whole prompt has run, and every
    request still gets batch-1 AR's tokens (on these prompts the segmented keys give the same argmax;
    the option is still forced, not trusted: its bits may differ from a whole-prompt prefill's)."""
    from specpilot.engine.batch import BatchPolicy

    prompts = _tiny_prompts(17, n=6)
    max_new = [20, 1, 33, 12, 28, 20]
    reference = [make_engine(tiny_stream, drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    cfg = DecodeConfig(block_size=4, tree=tree, tree_nodes=8)
    drafters = [NgramDrafter(min_match=1) if drafter == "ngram" else None for _ in range(3)]
    dec = BatchDecoder(tiny_stream[0], drafters, cfg, rows=3, max_len=256, stop_ids=tiny_stream[0].cfg.stop_ids,
                       policy=BatchPolicy(prefill_chunk=chunk))
    result = dec.run([BatchRequest(str(i), p, n, arrival_step=2 * i)
                      for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference
    assert all(s.prompt_tokens <= chunk for s in result.steps)
    assert sum(s.prompt_tokens for s in result.steps) == sum(map(len, prompts))  # every prompt token ran once
    assert any(s.prompt_tokens and s.rows for s in result.steps)  # a segment rode beside decoding rows
    for g in result.generations.values():
        assert g.first_token_at >= g.submitted_at and g.prefill_s > 0


def _three_rows_step(model):
    """Two caches of 4 rows where rows 3, 0, 1 hold a prompt each and row 2 stays empty, and one step for
    those rows: a chain of 3, a tree of 4 (``tree``, its depths 0 1 1 2) and a chain of 5 after their
    prompts; returns (caches, starts, lengths, rows, tokens, depths, tree)."""
    import torch

    prompts = _tiny_prompts(23, n=3)
    caches = [model.new_cache(128, batch=4) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            for row, p in zip((3, 0, 1), prompts, strict=True):
                model.forward_ragged(torch.tensor(p), torch.arange(len(p)), cache, [0], [len(p)], [row], [None])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    starts, lengths, rows = [len(p) for p in prompts], [3, 4, 5], [3, 0, 1]
    tokens = torch.randint(0, 250, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    depths = [torch.arange(3), torch.tensor([0, 1, 1, 2]), torch.arange(5)]
    return caches, starts, lengths, rows, tokens, depths, tree


def test_padded_attention_is_the_per_row_attention_in_one_call(tiny_stream):
    """`forward_ragged(padded=True)`: rows out of cache order, a cache row with no tokens, a chain, a tree
    and a prompt segment in one step give the per-row forward's logits (to fp32 rounding: the sum over keys
    runs over the longest row's slots) and write the same keys into the cache."""
    import torch

    model = tiny_stream[0]
    caches, starts, lengths, rows, tokens, depths, tree = _three_rows_step(model)
    positions = torch.cat([s + d for s, d in zip(starts, depths, strict=True)])
    masks = [None, tree, None]
    with torch.no_grad():
        per_row, _ = model.forward_ragged(tokens, positions, caches[0], starts, lengths, rows, masks)
        padded, _ = model.forward_ragged(tokens, positions, caches[1], starts, lengths, rows, masks, padded=True)
    assert torch.allclose(per_row, padded, rtol=1e-5, atol=1e-5)
    assert torch.allclose(caches[0].k, caches[1].k) and torch.allclose(caches[0].v, caches[1].v)
    with pytest.raises(ValueError, match="each cache row once"):
        model.forward_ragged(tokens, positions, caches[1], starts, lengths, [3, 3, 1], masks, padded=True)


@pytest.mark.parametrize("drafter,tree", [("none", False), ("ngram", False), ("ngram", True)])
def test_padded_attention_in_a_batch_keeps_each_requests_tokens(tiny_stream, drafter, tree):
    """``padded_attention`` with staggered arrivals and prompt segments: every request still gets batch-1
    AR's tokens on these prompts (the option is forced, not trusted: its bits may differ)."""
    from specpilot.engine.batch import BatchPolicy

    prompts = _tiny_prompts(29, n=6)
    max_new = [24, 3, 30, 12, 28, 20]
    reference = [make_engine(tiny_stream, drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    drafters = [NgramDrafter(min_match=1) if drafter == "ngram" else None for _ in range(3)]
    dec = BatchDecoder(tiny_stream[0], drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3,
                       max_len=256, stop_ids=tiny_stream[0].cfg.stop_ids,
                       policy=BatchPolicy(padded_attention=True, prefill_chunk=16))
    result = dec.run([BatchRequest(str(i), p, n, arrival_step=2 * i)
                      for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference


def test_static_rows_forward_is_the_per_row_forward(tiny_stream):
    """`forward_static` over every cache row (the batched CUDA-graph step, run eagerly): an idle row, a
    chain shorter than the step's T (padded), a tree, rows out of order; each real token's logits are the
    per-row forward's (to fp32 rounding), its keys land in the same slots, and the pads leave the rows'
    live slots untouched."""
    import torch

    model = tiny_stream[0]
    caches, starts, lengths, rows, tokens, depths, tree = _three_rows_step(model)
    positions = torch.cat([s + d for s, d in zip(starts, depths, strict=True)])
    with torch.no_grad():
        per_row, _ = model.forward_ragged(tokens, positions, caches[0], starts, lengths, rows, [None, tree, None])
        T, offsets = 5, [0, 3, 7]
        static_tokens = torch.zeros(4, T, dtype=torch.int64)
        static_positions = torch.arange(T).repeat(4, 1)
        static_masks = torch.eye(T, dtype=torch.bool).repeat(4, 1, 1)
        static_starts = torch.zeros(4, dtype=torch.int64)
        for row, start, n, o, d, mask in zip(rows, starts, lengths, offsets, depths,
                                             [torch.ones(3, 3, dtype=torch.bool).tril(), tree,
                                              torch.ones(5, 5, dtype=torch.bool).tril()], strict=True):
            static_tokens[row, :n] = tokens[o:o + n]
            static_positions[row] = start + torch.arange(T)
            static_positions[row, :n] = start + d
            static_masks[row, :n, :n] = mask
            static_starts[row] = start
        logits, _ = model.forward_static(static_tokens, static_positions, static_starts, static_masks, caches[1], 64)
    for row, start, n, o in zip(rows, starts, lengths, offsets, strict=True):
        assert torch.allclose(logits[row, :n], per_row[o:o + n], rtol=1e-5, atol=1e-5), row
        live = slice(0, start + n)
        assert torch.allclose(caches[0].k[:, row, :, live], caches[1].k[:, row, :, live], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="every cache row"):
        model.forward_static(static_tokens[:2], static_positions[:2], static_starts[:2], static_masks[:2], caches[1], 64)


class _CountingRunner(GraphRunner):
    """A runner that records each static step's (busy rows, T)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runs: list[tuple[int, int]] = []

    def run_rows(self, blocks, idle=None, drafts=None):
        argmax, hidden, T = super().run_rows(blocks, idle, drafts)
        self.runs.append((len(blocks), T))
        return argmax, hidden, T


@pytest.mark.parametrize("drafter,tree,chunk", [("none", False, 0), ("ngram", False, 0), ("ngram", True, 0),
                                                 ("ngram", False, 16)])
def test_static_steps_keep_each_requests_tokens(tiny_stream, drafter, tree, chunk):
    """The batched decoder's graph path (``cuda_graphs``), run without capture: every decode step is one
    static forward over all rows, padded to the longest tree, across attention-length buckets; a joining
    prompt runs as a static chain padded to a bucket on a one-row scratch cache; with prompt segments those
    steps run the ragged forward. Each request gets batch-1 AR's tokens on these
    prompts (forced, not trusted, in a round: the padded sum over keys may round differently)."""
    from specpilot.engine.batch import BatchPolicy

    prompts = _tiny_prompts(29, n=6)
    max_new = [24, 3, 30, 12, 28, 20]
    reference = [make_engine(tiny_stream, drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    model = tiny_stream[0]
    drafters = [NgramDrafter(min_match=1) if drafter == "ngram" else None for _ in range(3)]
    dec = BatchDecoder(model, drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3, max_len=256,
                       stop_ids=model.cfg.stop_ids, policy=BatchPolicy(prefill_chunk=chunk),
                       static_steps=lambda cache: _CountingRunner(model, cache, bucket=16, capture=False))
    runs = dec.runner.runs
    result = dec.run([BatchRequest(str(i), p, n, arrival_step=2 * i)
                      for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference
    decode_steps = [s for s in result.steps if s.rows and not s.prompt_tokens]
    assert len(runs) == len(decode_steps) > 0  # every decode step, and only those, ran the static forward
    assert any(rows < 3 for rows, _ in runs)  # with idle rows
    if drafter == "ngram":
        assert any(t > 1 for _, t in runs)
    if not chunk:  # the joins (one at a time here) ran as padded static chains on the scratch cache
        assert len(dec.prefill_runner.runs) == len(prompts) and {t for _, t in dec.prefill_runner.runs} == {64}


@pytest.fixture(scope="module")
def tiny_fused(tiny):
    """The tiny model with ``fused_kernels`` (its PyTorch references off CUDA), then the stream linears."""
    model, tok = copy.deepcopy(tiny)
    opts = EngineOptions(fused_kernels=True, linear_backend="stream").resolved(dtype="fp32")
    return apply_model_options(model, opts), tok


@pytest.mark.parametrize("static,tree,chunk", [(True, False, 0), (True, True, 0), (True, False, 16),
                                               (False, False, 0)])
def test_fused_kernels_over_many_rows_keep_each_requests_tokens(tiny_stream, tiny_fused, static, tree, chunk):
    """``fused_kernels`` in a batch: the graph path's static steps (each cache row's RoPE and cache writes
    by slot, then one attention over the rows), the scratch-row prefill, prompt segments and the eager
    ragged forwards all give each request the stock model's batch-1 AR tokens (fp32, CPU references)."""
    from specpilot.engine.batch import BatchPolicy
    from specpilot.engine.fused import is_fused

    prompts = _tiny_prompts(31, n=5)
    max_new = [20, 5, 26, 14, 22]
    reference = [make_engine(tiny_stream, drafter="none").generate(p, n).tokens
                 for p, n in zip(prompts, max_new, strict=True)]
    model = tiny_fused[0]
    assert is_fused(model)
    drafters = [NgramDrafter(min_match=1) for _ in range(3)]
    runner = (lambda cache: _CountingRunner(model, cache, bucket=16, capture=False)) if static else None
    dec = BatchDecoder(model, drafters, DecodeConfig(block_size=4, tree=tree, tree_nodes=8), rows=3, max_len=256,
                       stop_ids=model.cfg.stop_ids, policy=BatchPolicy(prefill_chunk=chunk), static_steps=runner)
    result = dec.run([BatchRequest(str(i), p, n, arrival_step=i)
                      for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))])
    assert [result.generations[str(i)].tokens for i in range(len(prompts))] == reference
    if static:
        assert any(rows > 1 for rows, _ in dec.runner.runs)  # steps of several rows ran the static forward


def test_a_captured_prefill_is_read_with_the_steps_verify(tiny_stream):
    """Under decode graphs a prompt that joins beside decoding rows is only queued: the step verifies the
    other rows, its first token is read after that step's verify, and it decodes from the next step on;
    when no row is decoding yet, the joins are read at once and decode in the same step."""
    model = tiny_stream[0]
    prompts = _tiny_prompts(37, n=3)
    reference = [make_engine(tiny_stream, drafter="none").generate(p, 12).tokens for p in prompts]
    dec = BatchDecoder(model, [None] * 3, DecodeConfig(), rows=3, max_len=256, stop_ids=(),
                       static_steps=lambda cache: GraphRunner(model, cache, bucket=16, capture=False))
    dec.submit(BatchRequest("a", prompts[0], 12))
    assert dec.step().rows == 1  # read at once: "a" decoded in its first step
    dec.submit(BatchRequest("b", prompts[1], 12))
    dec.submit(BatchRequest("c", prompts[2], 12))
    record = dec.step()
    assert record.rows == 1 and record.prefills == 2  # "b" and "c" were queued beside "a"'s step
    joined = [row for row in dec.active.values() if row.request.request_id != "a"]
    assert all(row.pending is None and len(row.gen.tokens) == 1 and not row.gen.verified for row in joined)
    assert dec.step().rows == 3
    while dec.busy:
        dec.step()
    done = dict(dec.finished())
    assert [done[r].tokens for r in "abc"] == reference
