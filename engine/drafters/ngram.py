"""N-gram (prompt-lookup) drafter: propose what followed earlier occurrences of the context's suffix.

As in vLLM's and SGLang's ngram speculators: find the longest suffix of the context, between
``max_match`` and ``min_match`` tokens, that occurred earlier in the context, and propose the
tokens that followed it. Training-free; it shines on code and on answers that quote the prompt.

Scores (for trees): a continuation prefix seen after c of the H most recent occurrences of an
m-token match scores ``(m / max_match) * c / H``: longer matches and more frequent continuations
rank first; ties go to the most recent occurrence. Chains (``n == 1``) use the longest match only.
Stateless between calls (the context is re-scanned each step; that is O(len(context)) numpy work).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.tree import Candidate


class NgramDrafter:
    def __init__(self, max_match: int = 4, min_match: int = 2, max_hits: int = 32):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match, self.min_match, self.max_hits = max_match, min_match, max_hits

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], last_hidden=None, k: int = 4, n: int = 1) -> list[Candidate]:
        if k <= 0:
            return []
        ctx = np.asarray(context, dtype=np.int64)
        L = len(ctx)
        found: dict[tuple[int, ...], tuple[float, ...]] = {}
        for m in range(min(self.max_match, L - 1), self.min_match - 1, -1):
            # Windows that end before the last token, so each hit has at least one follower.
            windows = sliding_window_view(ctx[: L - 1], m)
            hits = np.flatnonzero((windows == ctx[L - m:]).all(axis=1))[::-1][: self.max_hits]
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
