"""EAGLE-style drafter: a small recurrent step over the target's hidden state, one draft token at a time.

Inputs (all from the target, nothing re-run): the final-norm hidden state ``h_t`` that chose the
root ``x_{t+1}`` and the target's (frozen) token embeddings. Starting from ``s_0 = h_t``, one step

    s_{j+1} = W_out Blocks(W_in [norm(s_j); norm(e(x_{t+1+j}))])        the drafter's guess of h_{t+1+j}
    logits_{j+1} = s_{j+1} . H_d^T + b                                   H_d: the target's LM-head rows
                                                                         of a small draft vocabulary

drafts ``x_{t+2+j}``; the drafted token is fed back as the next step's input. The state is the
drafter's own (it never sees the target's later hidden states), which is also how it is trained:
`specpilot drafter train --kind eagle` unrolls the step K times on the target's greedy tokens, so
draft j+1 is learned in exactly the situation where it matters (drafts 1..j were right, i.e. equal
to the target's greedy tokens), with no exposure bias. The state is regressed onto the target's
hidden states as well, so with a tied head ``s . H_d^T`` approximates the target's own logits.

`propose` drafts a chain greedily (n == 1), or for trees (n > 1) runs a small beam: every depth
expands the ``beam`` best paths by their ``branch`` most likely tokens in one batched step, and
each expanded prefix becomes a candidate scored by its cumulative probability (best first).

The weights file (`specpilot.engine.drafters.parallel.save_drafter` format, ``config.kind == "eagle"``)
records the target, the draft vocabulary, the hash of the training data and the figures. A drafter
only proposes: acceptance stays exact greedy matching in `specpilot.engine.tree`, so outputs never change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specpilot.engine.drafters.parallel import WEIGHTS_DIR, _Norm, _Residual, load_net
from specpilot.engine.tree import Candidate

DEFAULT_WEIGHTS = {"smollm2-135m": WEIGHTS_DIR / "smollm2_eagle.pt"}


@dataclass(frozen=True)
class EagleConfig:
    target: str  # specpilot.engine.model.CONFIGS name of the target
    dim: int  # target hidden size
    width: int = 576  # drafter hidden size
    blocks: int = 1  # residual MLP blocks per step
    k: int = 6  # steps unrolled in training (drafting deeper works, untrained)
    draft_vocab: int = 4096
    kind: str = "eagle"  # tells the weights file apart from a parallel drafter's


class EagleDrafterNet(nn.Module):
    def __init__(self, cfg: EagleConfig, vocab_ids: Tensor, target_embed: Tensor, target_head: Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        d, w = cfg.dim, cfg.width
        self.state_norm = _Norm(d)
        self.token_norm = _Norm(d)
        self.inp = nn.Linear(2 * d, w, bias=False)
        self.blocks = nn.Sequential(*(_Residual(w, 2 * w) for _ in range(cfg.blocks)))
        self.out = nn.Linear(w, d, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.draft_vocab))
        head = target_embed if target_head is None else target_head  # tied targets: the same rows
        # Frozen, not saved: they come from the target at load time.
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.register_buffer("embed", target_embed, persistent=False)  # [V, d], the target's
        self.register_buffer("out_embed", head[vocab_ids.long()].clone(), persistent=False)

    def step(self, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """state [B, d], tokens [B] (the token the state's position chose) -> (next state, logits [B, draft_vocab])."""
        z = torch.cat([self.state_norm(state), self.token_norm(self.embed[tokens])], dim=-1)
        nxt = self.out(self.blocks(self.inp(z)))
        return nxt, nxt @ self.out_embed.T + self.bias

    def unroll(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced unroll (training): hidden [B, d] chose tokens[:, 0]; tokens [B, J] are fed in
        turn. Returns states [B, J, d] (guesses of the target's next hidden states) and logits [B, J, V_d]."""
        states, logits, s = [], [], hidden
        for j in range(tokens.shape[1]):
            s, lg = self.step(s, tokens[:, j])
            states.append(s)
            logits.append(lg)
        return torch.stack(states, 1), torch.stack(logits, 1)


class EagleDrafter:
    """The `specpilot.engine.drafters.Drafter` over a trained `EagleDrafterNet`."""

    def __init__(self, net: EagleDrafterNet, beam: int = 4, branch: int = 4):
        self.net = net.eval()
        self.cfg = net.cfg
        self.beam, self.branch = beam, branch

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def propose(self, context: list[int], last_hidden: Tensor | None, k: int, n: int) -> list[Candidate]:
        if last_hidden is None or k <= 0 or not context:
            return []
        net = self.net
        state = last_hidden.reshape(1, -1).to(net.out_embed.dtype)
        token = torch.tensor([context[-1]], device=state.device)
        if n <= 1:
            tokens, logp_sum, scores = [], 0.0, []
            for _ in range(k):
                state, logits = net.step(state, token)
                logp = torch.log_softmax(logits[0].float(), dim=-1)
                best, idx = logp.max(dim=-1)
                token = net.vocab_ids[idx].reshape(1)
                tokens.append(int(token))
                logp_sum += float(best)
                scores.append(logp_sum)
            return [Candidate(tuple(tokens), tuple(torch.tensor(scores).exp().tolist()))]
        return self._beam(state, token, k)

    def _beam(self, state: Tensor, token: Tensor, k: int) -> list[Candidate]:
        """Every expanded prefix of a ``beam``-wide, ``branch``-deep search, best first."""
        net = self.net
        paths: list[tuple[tuple[int, ...], tuple[float, ...]]] = [((), ())]  # tokens, cumulative log-probs
        cands: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
        for _ in range(k):
            state, logits = net.step(state, token)  # one batched step for all live paths
            logp = torch.log_softmax(logits.float(), dim=-1)
            vals, idx = logp.topk(min(self.branch, logp.shape[-1]), dim=-1)
            toks = net.vocab_ids[idx]
            grown = []
            for b, (path, cum) in enumerate(paths):
                base = cum[-1] if cum else 0.0
                for v, t in zip(vals[b].tolist(), toks[b].tolist(), strict=True):
                    grown.append((base + v, b, path + (t,), cum + (base + v,)))
            grown.sort(key=lambda g: -g[0])
            cands += [(p, c) for _, _, p, c in grown]
            keep = grown[: self.beam]
            paths = [(p, c) for _, _, p, c in keep]
            rows = torch.tensor([b for _, b, _, _ in keep], device=state.device)
            state = state[rows]
            token = torch.tensor([p[-1] for p, _ in paths], device=state.device)
        cands.sort(key=lambda pc: -pc[1][-1])
        return [Candidate(p, tuple(torch.tensor(c).exp().tolist())) for p, c in cands]


def build_net(model, cfg: EagleConfig, vocab_ids: Tensor) -> EagleDrafterNet:
    """An untrained net for ``model`` (a specpilot.engine.model.Transformer), reading its embedding and LM-head rows."""
    return EagleDrafterNet(cfg, vocab_ids, model.embed.weight.detach(), model.lm_head.weight.detach())


def load_eagle_drafter(model, path: Path | str | None = None) -> EagleDrafter:
    """The EAGLE-style drafter for ``model`` from ``path`` or the shipped file for its target."""
    net = load_net(model, path, "eagle", DEFAULT_WEIGHTS, EagleConfig,
                   lambda cfg, vocab_ids: build_net(model, cfg, vocab_ids))
    return EagleDrafter(net)
