"""Draft trees: build them from a drafter's candidates, lay them out for one forward, accept a path.

A `DraftTree` is a list of nodes in forward order. Node 0 is the *root*: the last committed token,
whose KV is not in the cache yet. Every other node is a draft token whose parent comes earlier
(``parents[i] < i``). A chain is the tree whose parents are ``[-1, 0, 1, ..]``.

For one verification forward the tree gives:
- `attention_mask()`: node i may attend to node j iff j is i or one of its ancestors;
- `positions(start)`: ``start + depth`` (siblings share a position; slots stay ``start + i``).

`accept(argmax)` implements greedy acceptance: starting at the root, step to the child whose token
equals the target's argmax at the current node, while there is one. Every accepted draft token is
therefore the target's own greedy choice, and the argmax at the last accepted node is the bonus
token, committed too. The caller then compacts the accepted nodes' KV (`KVCache.compact`).

Nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Candidate:
    """One proposed continuation, with a score per prefix (higher = more likely to be accepted).

    ``scores[i]`` rates ``tokens[: i + 1]``; a prefix never rates below its extension (trees are
    built best-first, and a child is only worth verifying with its parent).
    """

    tokens: tuple[int, ...]
    scores: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.scores):
            raise ValueError("a candidate needs one score per token")


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"every parent must precede its child: {self.parents}")
        if not self.depths:
            self.depths = [0] * len(self.tokens)
            for i in range(1, len(self.tokens)):
                self.depths[i] = self.depths[self.parents[i]] + 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))

    @classmethod
    def chain(cls, root: int, drafts: list[int] | tuple[int, ...]) -> DraftTree:
        n = len(drafts) + 1
        # valid by construction, so built without `__post_init__`'s checks: a batched step builds one a row
        tree = cls.__new__(cls)
        tree.tokens, tree.parents, tree.depths = [root, *drafts], list(range(-1, n - 1)), list(range(n))
        return tree

    @classmethod
    def best_first(cls, root: int, candidates: list[Candidate], max_nodes: int, max_depth: int) -> DraftTree:
        """Merge candidates into a trie and keep the ``max_nodes`` best nodes (root excluded).

        A node's score is the best score any candidate gives that prefix. Since a prefix scores at
        least as well as its extensions (enforced here), taking nodes in score order, parents first
        on ties, always yields a connected tree in which parents precede children.
        """
        best: dict[tuple[int, ...], float] = {}
        order: dict[tuple[int, ...], int] = {}
        for cand in candidates:
            score = float("inf")
            for d in range(min(len(cand.tokens), max_depth)):
                prefix = cand.tokens[: d + 1]
                score = min(score, cand.scores[d])
                if score > best.get(prefix, float("-inf")):
                    best[prefix] = score
                order.setdefault(prefix, len(order))
        chosen = sorted(best, key=lambda p: (-best[p], len(p), order[p]))[:max_nodes]
        index = {(): 0}
        tokens, parents = [root], [-1]
        for prefix in chosen:
            index[prefix] = len(tokens)
            tokens.append(prefix[-1])
            parents.append(index[prefix[:-1]])
        return cls(tokens, parents)

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n, n] bool: True where node i may attend to node j (j is i or an ancestor of i)."""
        n = len(self.tokens)
        rows: list[list[bool]] = []
        for i in range(n):
            row = list(rows[self.parents[i]]) if i else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=device)

    def positions(self, start: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.int64, device=device) + start

    def accept(self, argmax: list[int]) -> tuple[list[int], int]:
        """(accepted node indices from the root, bonus token) given the target's argmax at each node."""
        if self.is_chain:  # node i's one child is i + 1
            node, last = 0, len(self.tokens) - 1
            while node < last and self.tokens[node + 1] == argmax[node]:
                node += 1
            return list(range(node + 1)), argmax[node]
        children = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens, strict=True)) if i}
        path, node = [0], 0
        while (nxt := children.get((node, argmax[node]))) is not None:
            path.append(nxt)
            node = nxt
        return path, argmax[node]


def matched_depth(candidates, truth: list[int]) -> int:
    """Longest prefix of ``truth`` that any candidate's tokens start with: how deep greedy acceptance would
    go in the trie of ``candidates`` had the target emitted ``truth`` (what a drafter's replay measures)."""
    best = 0
    for cand in candidates:
        m = 0
        for a, b in zip(cand, truth, strict=False):
            if a != b:
                break
            m += 1
        best = max(best, m)
    return best
