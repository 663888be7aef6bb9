"""`SuffixIndex`: the copy path's lookup, against a brute-force scan of the context."""

from __future__ import annotations

import random

import pytest

from specpilot.engine.drafters.ngram import SuffixIndex


def brute_force(context: list[int], k: int, max_match: int = 4, min_match: int = 2):
    """The longest suffix (max_match..min_match) with an earlier occurrence ending before the last
    token; the tokens after its most recent occurrence, cut at the context's end."""
    last = len(context) - 1
    for m in range(max_match, min_match - 1, -1):
        if m > len(context):
            continue
        suffix = context[len(context) - m:]
        for start in range(last - m, -1, -1):  # occurrences end at start + m - 1 <= last - 1
            if context[start: start + m] == suffix:
                return tuple(context[start + m: min(start + m + k, last + 1)]), m
    return (), 0


@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_brute_force_while_the_context_grows(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([3, 5, 12])  # small alphabets repeat often, large ones rarely
    seq = [rng.randrange(alphabet) for _ in range(300)]
    index = SuffixIndex()
    hits = 0
    for n in range(1, len(seq) + 1):
        k = rng.choice([1, 4, 6])
        got = index.lookup(seq[:n], k)
        assert got == brute_force(seq[:n], k), (n, k)
        hits += got[1] > 0
    assert hits > 100  # the comparison covered real matches, not just misses


def test_another_context_is_reindexed_and_answers_the_same():
    rng = random.Random(7)
    a = [rng.randrange(4) for _ in range(80)]
    b = [rng.randrange(4) for _ in range(60)]
    index = SuffixIndex()
    index.lookup(a, 4)
    assert index.lookup(b, 4) == SuffixIndex().lookup(b, 4) == brute_force(b, 4)  # b does not extend a
    assert index.lookup(b[:30], 3) == brute_force(b[:30], 3)  # a shorter context: re-indexed too
    assert SuffixIndex(3, 1).lookup([5, 6, 5], 2) == ((6, 5), 1)  # match lengths are parameters
    assert SuffixIndex().lookup([1, 2, 3], 4) == ((), 0)
    with pytest.raises(ValueError, match="min_match <= max_match"):
        SuffixIndex(2, 3)


def test_periodic_lookup_continues_a_repeat_past_the_context_end():
    seq = [1, 2, 3, 1, 2, 3, 1, 2]
    assert SuffixIndex().lookup(seq, 5) == ((3, 1, 2), 4)  # cut where the context ends
    assert SuffixIndex(periodic=True).lookup(seq, 5) == ((3, 1, 2, 3, 1), 4)  # the period-3 loop goes on
    assert SuffixIndex(periodic=True).lookup([7, 7, 7], 4) == ((7, 7, 7, 7), 2)
    rng = random.Random(3)
    for _ in range(200):  # periodic answers extend the cut ones, and are always k long when found
        ctx = [rng.randrange(3) for _ in range(rng.randrange(3, 40))]
        (cut, m), (full, m2) = SuffixIndex().lookup(ctx, 6), SuffixIndex(periodic=True).lookup(ctx, 6)
        assert m == m2 and full[: len(cut)] == cut and (len(full) == 6 if m else full == ())


@pytest.mark.parametrize("seed", range(4))
def test_continuation_of_a_draft_equals_a_lookup_of_the_extended_context(seed):
    """``continuation(tail, k, min_match)`` answers for context + draft what `lookup` would, with the
    occurrence searched in the committed context only and nothing indexed."""
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(200)]
    index = SuffixIndex()
    found = 0
    for n in range(10, len(seq) - 6, 7):
        index.lookup(seq[:n], 4)
        draft = seq[n: n + rng.randrange(1, 6)]
        tail = seq[:n][-4:] + draft
        for min_match in (2, 3):
            got = index.continuation(tail, 6, min_match)
            want = ()
            for m in range(4, min_match - 1, -1):  # the most recent occurrence inside seq[:n]
                hits = [s for s in range(n - m - 1, -1, -1) if seq[s: s + m] == tail[-m:]]
                if hits:
                    want = tuple(seq[hits[0] + m: min(hits[0] + m + 6, n)])
                    break
            assert got == want, (n, draft, min_match)
            found += bool(got)
        assert index.seq == seq[:n]  # nothing was indexed
    assert found > 20
