"""Draft trees on hand-built examples: layout, masks, positions, acceptance, cache rollback."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.decode import verify
from specpilot.engine.tree import Candidate, DraftTree

#        0:r
#       /    \
#    1:a      2:b
#    /  \       \
#  3:c  4:d     5:e
TREE = DraftTree(tokens=[100, 11, 12, 13, 14, 15], parents=[-1, 0, 0, 1, 1, 2])


def test_depths_mask_positions():
    assert TREE.depths == [0, 1, 1, 2, 2, 2]
    assert not TREE.is_chain
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(TREE.attention_mask(), expected)
    assert TREE.positions(7).tolist() == [7, 8, 8, 9, 9, 9]


@pytest.mark.parametrize("argmax, path, bonus", [
    ([11, 14, 0, 0, 99, 0], [0, 1, 4], 99),  # a then d accepted, bonus from d
    ([12, 0, 15, 0, 0, 42], [0, 2, 5], 42),  # b then e: the second branch
    ([13, 0, 0, 0, 0, 0], [0], 13),  # nothing accepted: bonus is the root's argmax
    ([11, 15, 0, 0, 0, 0], [0, 1], 15),  # 15 is a child of b, not of a: rejected
])
def test_accept(argmax, path, bonus):
    assert TREE.accept(argmax) == (path, bonus)


def test_chain():
    c = DraftTree.chain(5, [6, 7, 8])
    assert c.is_chain and c.parents == [-1, 0, 1, 2] and c.depths == [0, 1, 2, 3]
    assert torch.equal(c.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert c.accept([6, 7, 9, 0]) == ([0, 1, 2], 9)
    assert c.accept([6, 7, 8, 3]) == ([0, 1, 2, 3], 3)  # all accepted + bonus


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="precede"):
        DraftTree(tokens=[1, 2, 3], parents=[-1, 2, 0])


def test_best_first_merges_prefixes_and_respects_budget():
    cands = [
        Candidate((1, 2, 3), (0.9, 0.8, 0.5)),
        Candidate((1, 2, 4), (0.9, 0.7, 0.6)),  # shares (1, 2): merged, best score kept
        Candidate((5, 6), (0.4, 0.3)),
        Candidate((7,), (0.95,)),
    ]
    t = DraftTree.best_first(0, cands, max_nodes=10, max_depth=3)
    # Order: 7 (.95), 1 (.9), 1-2 (.8), 1-2-4 (.6), 1-2-3 (.5), 5 (.4), 5-6 (.3)
    assert t.tokens == [0, 7, 1, 2, 4, 3, 5, 6]
    assert t.parents == [-1, 0, 0, 2, 3, 3, 0, 6]
    t = DraftTree.best_first(0, cands, max_nodes=4, max_depth=3)
    assert t.tokens == [0, 7, 1, 2, 4] and t.parents == [-1, 0, 0, 2, 3]
    t = DraftTree.best_first(0, cands, max_nodes=10, max_depth=1)
    assert t.tokens == [0, 7, 1, 5] and max(t.depths) == 1


def test_best_first_clamps_increasing_scores():
    # A child scoring above its parent is clamped, so the parent is always chosen first.
    t = DraftTree.best_first(0, [Candidate((1, 2), (0.1, 0.9)), Candidate((3,), (0.5,))], max_nodes=2, max_depth=2)
    assert t.tokens == [0, 3, 1] and t.parents == [-1, 0, 0]


def _chain_run(model, prefix, path_tokens):
    """Logits and KV of running prefix then path_tokens as a plain causal sequence."""
    cache = model.new_cache(64)
    seq = torch.tensor([prefix + path_tokens])
    logits, _ = model(seq, torch.arange(seq.shape[1]), cache, 0)
    return logits[0, len(prefix):], cache


def test_tree_forward_matches_each_path_and_rollback_keeps_the_accepted_path(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (9,), generator=g).tolist()
    tree = DraftTree(tokens=[prefix[-1], 40, 41, 42, 43, 44], parents=[-1, 0, 0, 1, 1, 2])
    prompt = prefix[:-1]
    cache = model.new_cache(64)
    with torch.no_grad():
        model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, 0)
        logits, _ = model(torch.tensor([tree.tokens]), tree.positions(len(prompt)), cache, len(prompt),
                          tree.attention_mask())
        for node in range(len(tree)):
            path = [node]
            while tree.parents[path[-1]] != -1:
                path.append(tree.parents[path[-1]])
            toks = [tree.tokens[i] for i in reversed(path)]
            ref, _ = _chain_run(model, prompt, toks)
            torch.testing.assert_close(logits[0, node], ref[-1], rtol=1e-5, atol=1e-5)

    # Force acceptance of root -> node 2 -> node 5 by making the "target argmax" say so, then check
    # the cache rollback: slots start.. hold exactly the KV of prompt + [root, 41, 44] run as a chain.
    start = len(prompt)
    with torch.no_grad():
        model(torch.tensor([prompt]), torch.arange(start), cache, 0)
        argmax_of = {0: 41, 2: 44, 5: 7}

        class Forced(torch.nn.Module):  # wraps the model so verify sees the forced argmax
            def __init__(self, m):
                super().__init__()
                self.m, self.device, self.cfg = m, m.device, m.cfg

            def forward(self, tokens, positions, cache, start, mask=None, last_only=False):
                logits, hidden = self.m(tokens, positions, cache, start, mask, last_only)
                forced = torch.full_like(logits, -1e9)
                for node, tok in argmax_of.items():
                    forced[0, node, tok] = 0.0
                return forced, hidden

        committed, _ = verify(Forced(model), cache, tree, start)
        assert committed == [41, 44, 7]
        _, ref_cache = _chain_run(model, prompt, [tree.tokens[0], 41, 44])
        n = start + 3
        torch.testing.assert_close(cache.k[:, :, :, :n], ref_cache.k[:, :, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :, :n], ref_cache.v[:, :, :, :n], rtol=1e-5, atol=1e-5)


def test_cache_compact_moves_exact_slots(tiny):
    model, _ = tiny
    cache = model.new_cache(16)
    cache.k.copy_(torch.arange(16.0).view(1, 1, 1, 16, 1).expand_as(cache.k))
    cache.v.copy_(-cache.k)
    cache.compact(4, [0, 2, 5])
    assert cache.k[0, 0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 7]
    assert cache.v[1, 0, 1, 4:7, 3].tolist() == [-4, -6, -9]
    before = cache.k.clone()
    cache.compact(4, [0, 1, 2])  # a chain's accepted prefix is already in place
    assert torch.equal(cache.k, before)


def test_chain_acceptance_is_the_longest_prefix_the_target_agrees_with():
    """A chain's acceptance (its fast path): drafts are accepted while each equals the target's argmax at
    its parent; the bonus is the argmax after the last one; a chain built by `chain` is a valid tree."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        drafts = [rng.randrange(4) for _ in range(rng.randrange(0, 9))]
        argmax = [rng.randrange(4) for _ in range(len(drafts) + 1)]
        tree = DraftTree.chain(9, drafts)
        assert tree == DraftTree([9, *drafts], list(range(-1, len(drafts))))  # what the checked constructor builds
        n = 0
        while n < len(drafts) and drafts[n] == argmax[n]:
            n += 1
        assert tree.accept(argmax) == (list(range(n + 1)), argmax[n])
