"""Drafters: propose continuations of the committed context for the target to verify.

The contract every drafter meets (`Drafter`):

    propose(context, last_hidden, k, n) -> list[Candidate]

- ``context``: every committed token (prompt + output so far); its last token is the root of the
  next verification, i.e. the bonus token of the previous step.
- ``last_hidden``: the target's final-norm hidden state at the token *before* the root (the one
  whose logits chose the root), shape [dim]; drafters that read the target use it.
- ``k``: the longest continuation wanted; ``n``: about how many candidates are useful (1 for a
  chain, the tree's node budget for trees).
- Candidates come back best first, each with a score per prefix (see `specpilot.engine.tree.Candidate`);
  an empty list means "no guess" and the step degenerates to one AR step.

`reset()` is called before each request. Drafters never see the target's logits and never decide
acceptance, so no drafter can change what the engine emits, only how fast.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from specpilot.engine.tree import Candidate


class Drafter(Protocol):
    def reset(self) -> None: ...

    def propose(self, context: list[int], last_hidden: Tensor | None, k: int, n: int) -> list[Candidate]: ...


def make_drafter(opts, model) -> Drafter | None:
    """The drafter ``opts.drafter`` names, for ``model`` (None for plain AR decoding)."""
    if opts.drafter == "none":
        return None
    if opts.drafter == "ngram":
        from specpilot.engine.drafters.ngram import NgramDrafter

        return NgramDrafter(max_match=opts.ngram_max_match, min_match=opts.ngram_min_match)
    if opts.drafter == "parallel":
        from specpilot.engine.drafters.parallel import load_parallel_drafter

        # With CUDA graphs the chain proposal is captured too (on a CUDA target; one replay a step);
        # with the stream backend the net's linears take the target's CPU kernel.
        return load_parallel_drafter(model, opts.drafter_weights or None, graph=opts.cuda_graphs,
                                     stream_linears=opts.linear_backend == "stream")
    if opts.drafter == "eagle":
        from specpilot.engine.drafters.eagle import load_eagle_drafter

        return load_eagle_drafter(model, opts.drafter_weights or None)
    raise ValueError(f"unknown drafter {opts.drafter!r}")
