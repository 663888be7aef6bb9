"""N-gram (prompt-lookup) drafter: propose what followed earlier occurrences of the context's suffix.

As in vLLM's and SGLang's ngram speculators: find the longest suffix of the context, between
``max_match`` and ``min_match`` tokens, that occurred earlier in the context, and propose the
tokens that followed it. Training-free; it shines on code and on answers that quote the prompt.

Scores (for trees): a continuation prefix seen after c of the H most recent occurrences of an
m-token match scores ``(m / max_match) * c / H``: longer matches and more frequent continuations
rank first; ties go to the most recent occurrence. Chains (``n == 1``) use the longest match only.
Each call scans the context for the last token's earlier occurrences (one O(len(context)) numpy pass),
then narrows them to longer matches; the context's array is kept between calls and only the tokens
committed since are converted (a request's drafter serves ~30-100 calls a second per row of a batch, so
the host time a call matters on a GPU).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from specpilot.engine.tree import Candidate


class NgramDrafter:
    def __init__(self, max_match: int = 4, min_match: int = 2, max_hits: int = 32):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match, self.min_match, self.max_hits = max_match, min_match, max_hits
        self.reset()

    def reset(self) -> None:
        self._seq: list[int] = []  # the context seen last, and the same tokens as an array (capacity doubles)
        self._buf = np.zeros(256, dtype=np.int64)

    def _array(self, context: list[int]) -> np.ndarray:
        """``context`` as an int64 array, converting only the tokens past the last call's context when it
        extends that one (a request's context grows by its committed tokens; another starts over)."""
        n = len(self._seq)
        if len(context) < n or context[:n] != self._seq:
            self._seq, n = [], 0
        new = context[n:]
        if len(context) > len(self._buf):
            self._buf = np.concatenate([self._buf[:n], np.zeros(2 * len(context) - n, dtype=np.int64)])
        self._buf[n:len(context)] = new
        self._seq.extend(new)
        return self._buf[:len(context)]

    def propose(self, context: list[int], last_hidden=None, k: int = 4, n: int = 1) -> list[Candidate]:
        if k <= 0:
            return []
        ctx = self._array(context)
        L = len(ctx)
        found: dict[tuple[int, ...], tuple[float, ...]] = {}
        # by_length[m - 1]: where earlier occurrences of the context's last m tokens end, each before the
        # last token (so each has at least one follower); each length narrows the one before
        ends = np.flatnonzero(ctx[: L - 1] == ctx[L - 1]) if L > 1 else np.zeros(0, dtype=np.int64)
        by_length = [ends]
        for back in range(1, min(self.max_match, L - 1)):
            if ends.size == 0:
                break
            ends = ends[ends >= back]
            ends = ends[ctx[ends - back] == ctx[L - 1 - back]]
            by_length.append(ends)
        for m in range(min(self.max_match, L - 1, len(by_length)), self.min_match - 1, -1):
            hits = (by_length[m - 1] - (m - 1))[::-1][: self.max_hits]  # window starts, most recent first
            if hits.size == 0:
                continue
            conts = [tuple(ctx[i + m: i + m + k].tolist()) for i in hits]  # most recent first
            counts = Counter(c[:d] for c in conts for d in range(1, len(c) + 1))
            weight = m / self.max_match
            for c in conts:
                if c not in found:
                    found[c] = tuple(weight * counts[c[:d]] / len(conts) for d in range(1, len(c) + 1))
            if n == 1:
                break
        # Best first: compare prefix scores depth by depth; a longer candidate wins a tie.
        ranked = sorted(found.items(), key=lambda kv: [-s for s in kv[1]] + [0.0] * (k - len(kv[1])))
        return [Candidate(tokens, scores) for tokens, scores in ranked[: max(n, 1)]]


class SuffixIndex:
    """The most recent earlier occurrence of the context's longest suffix, kept incrementally.

    ``lookup(context, k)`` returns ``(tokens, m)``: the (at most ``k``) tokens that followed the
    most recent earlier occurrence of the context's last ``m`` tokens, for the longest ``m`` in
    ``max_match .. min_match`` that occurred (occurrences end before the last token, as in
    `NgramDrafter`), or ``((), 0)``. Unlike `NgramDrafter`'s chain (the most frequent continuation)
    it takes the most recent one, and it indexes each new token once instead of re-scanning the
    context: O(new tokens) per call. A context that does not extend the indexed one (another
    request) is re-indexed from scratch, so any call sequence gives the same answers.

    With ``periodic`` a continuation that the context's end cuts short is continued as the repeat
    it is: the suffix recurs ``d`` tokens after its earlier occurrence, so token ``j`` of the
    continuation is ``seq[start + m + j % d]`` (an overlapping copy, as in LZ77). A loop of period
    ``d < k`` then yields ``k`` tokens instead of ``d``.

    The parallel drafter feeds these tokens to its heads (`specpilot.engine.drafters.parallel`), and its
    training data is built with the same class, so both see identical features.
    """

    def __init__(self, max_match: int = 4, min_match: int = 2, periodic: bool = False):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match, self.min_match, self.periodic = max_match, min_match, periodic
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []
        self.last: dict[int, dict[tuple[int, ...], int]] = {m: {} for m in range(self.min_match, self.max_match + 1)}

    def extend(self, tokens) -> None:
        """Append ``tokens`` to the indexed sequence."""
        seq, last = self.seq, self.last
        for token in tokens:
            p = len(seq)  # the new token's index: grams ending at p - 1 may now be matched
            for m, index in last.items():
                if p - m >= 0:
                    index[tuple(seq[p - m: p])] = p - m
            seq.append(int(token))

    def continuation(self, tail: list[int], k: int, min_match: int) -> tuple[int, ...]:
        """What followed the most recent indexed occurrence of ``tail``'s longest suffix of at least
        ``min_match`` tokens (at most ``k`` tokens, () when none): `query` for a sequence that
        continues the indexed one by tokens not yet committed (a draft), without indexing them."""
        seq = self.seq
        for m in range(min(self.max_match, len(tail)), max(min_match, self.min_match) - 1, -1):
            start = self.last[m].get(tuple(tail[len(tail) - m:]))
            if start is not None:
                return tuple(seq[start + m: start + m + k])
        return ()

    def query(self, k: int) -> tuple[tuple[int, ...], int]:
        """`lookup` of the indexed sequence itself."""
        seq, p = self.seq, len(self.seq) - 1
        for m in range(self.max_match, self.min_match - 1, -1):
            if p - m + 1 < 0:
                continue
            start = self.last[m].get(tuple(seq[p - m + 1:]))
            if start is not None:
                if self.periodic:
                    period = p - m + 1 - start  # the continuation the context holds: seq[start + m: p + 1]
                    return tuple(seq[start + m + j % period] for j in range(k)), m
                return tuple(seq[start + m: min(start + m + k, p + 1)]), m
        return (), 0

    def lookup(self, context: list[int], k: int) -> tuple[tuple[int, ...], int]:
        n = len(self.seq)
        if len(context) < n or context[:n] != self.seq:
            self.reset()
            n = 0
        self.extend(context[n:])
        return self.query(k)
