"""The n-gram drafter (`specpilot.engine.drafters.ngram.NgramDrafter`): its proposals equal the plain
definition (every window of the context compared with its suffix, for every match length), kept here as
the reference, over random contexts that grow as a request's does, change request without a reset, and
repeat a small vocabulary (many hits, ties); chains and trees, every match setting."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specpilot.engine.drafters.ngram import NgramDrafter
from specpilot.engine.tree import Candidate


def reference_proposals(d: NgramDrafter, context: list[int], k: int, n: int) -> list[Candidate]:
    """The definition: for m from the longest match down, the windows equal to the last m tokens (each
    with a follower), their continuations scored by how often each prefix follows, best first."""
    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    found: dict[tuple[int, ...], tuple[float, ...]] = {}
    for m in range(min(d.max_match, L - 1), d.min_match - 1, -1):
        windows = sliding_window_view(ctx[: L - 1], m)
        hits = np.flatnonzero((windows == ctx[L - m:]).all(axis=1))[::-1][: d.max_hits]
        if hits.size == 0:
            continue
        conts = [tuple(ctx[i + m: i + m + k].tolist()) for i in hits]
        counts = Counter(c[:j] for c in conts for j in range(1, len(c) + 1))
        for c in conts:
            if c not in found:
                found[c] = tuple(m / d.max_match * counts[c[:j]] / len(conts) for j in range(1, len(c) + 1))
        if n == 1:
            break
    ranked = sorted(found.items(), key=lambda kv: [-s for s in kv[1]] + [0.0] * (k - len(kv[1])))
    return [Candidate(t, s) for t, s in ranked[: max(n, 1)]]


def test_proposals_equal_the_definition_as_contexts_grow_and_change():
    rng = random.Random(0)
    calls = 0
    for _ in range(200):
        max_match = rng.choice([1, 2, 3, 4, 6])
        d = NgramDrafter(max_match=max_match, min_match=rng.randint(1, max_match), max_hits=rng.choice([1, 4, 32]))
        vocab = rng.choice([2, 3, 8, 50])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for _ in range(20):
            k, n = rng.randint(1, 8), rng.choice([1, 1, 4, 8])
            assert d.propose(ctx, None, k, n) == reference_proposals(d, ctx, k, n), (ctx, k, n)
            calls += 1
            if rng.random() < 0.1:  # another request's context, with no reset in between
                ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            else:  # the same request: its committed tokens appended (sometimes none)
                ctx = ctx + [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
    assert calls == 4000


def test_a_long_context_grows_the_kept_array_and_a_reset_starts_over():
    d = NgramDrafter(min_match=1)
    ctx = [i % 97 for i in range(1000)]  # longer than the kept array's first capacity
    assert d.propose(ctx, None, 4, 1) == reference_proposals(d, ctx, 4, 1)
    assert d.propose(ctx, None, 4, 1)[0].tokens == (30, 31, 32, 33)  # the last token is 999 % 97 = 29
    d.reset()
    assert d.propose([5, 6, 5], None, 3, 1) == [Candidate((6, 5), (0.25, 0.25))]
    assert d.propose([], None, 3, 1) == [] and d.propose([1, 2], None, 0, 1) == []
