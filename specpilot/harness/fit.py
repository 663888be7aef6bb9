"""Training and scoring of `specpilot drafter train`: the optimisation loops, held-out figures, measured tau.

- `fit(net, n_examples, batch_loss, score, seconds, ...)`: AdamW with warm-up and cosine decay until a time
  budget, keeping the best held-out state; `train` (parallel drafter, on `make_examples` data) and
  `train_eagle` (eagle drafter, unrolled on `eagle_streams`) give it their losses, and `evaluate` /
  `evaluate_eagle` score held-out data (accuracy per position and the chain tau it implies). Each returns a
  dict of figures and trains ``net`` in place.
- `train_parallel_drafter` / `train_eagle_drafter(model, batches, val_batches, settings, deadline)`: from
  generated batches (`specpilot.harness.distill`) to a trained net, as the command runs them: examples, draft
  vocabulary, net, training until ``deadline``. `TrainSettings` holds the command's training flags. Each
  returns (net, training figures, data figures).
- `measured_tau(model, tokenizer, dep, weights, n)`: tau measured by the engine (chain, block 4) with a weights
  file on the first ``n`` dev requests of a `Deployment`, beside the n-gram drafter's.

Nothing here writes a file; progress goes to stderr (`specpilot.harness.distill.log`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.engine.drafters import eagle
from specpilot.engine.drafters.ngram import SuffixIndex
from specpilot.engine.drafters.parallel import ParallelConfig, ParallelDrafterNet, copy_span
from specpilot.harness.distill import (
    draft_vocabulary,
    eagle_batch,
    eagle_streams,
    fill_vocabulary,
    log,
    make_examples,
    to_draft_ids,
)


@dataclass(frozen=True)
class TrainSettings:
    """The training flags of `specpilot drafter train` (the command builds this from them; see its --help)."""

    k: int  # positions drafted per pass (parallel) / steps unrolled (eagle)
    draft_vocab: int
    width: int | None  # None: the target's hidden size
    lr: float
    train_batch: int
    seed: int
    weight_decay: float
    n_context: int  # parallel: committed tokens embedded
    lookup: bool  # parallel: the copy path
    lookup_periodic: bool
    copy_min_match: int
    blocks: int  # eagle: residual blocks per recurrent step
    reg_weight: float  # eagle: weight of the state regression beside the cross-entropy


def _net_inputs(data: dict, idx) -> tuple:
    """The net's inputs for examples ``idx`` (a slice or an index tensor) of `make_examples` data
    (hidden states may be kept in half precision: they are cast back here)."""
    hidden = data["hidden"][idx].float()
    if "look" in data:
        return hidden, data["ctx"][idx], data["look"][idx], data["match"][idx]
    return hidden, data["ctx"][idx]


def evaluate(net, data: dict, batch: int = 1024) -> dict:
    """Held-out top-1 accuracy per position and the chain tau it implies (accepted prefix + 1)."""
    net.eval()
    correct, accepted, n = None, 0.0, 0
    with torch.no_grad():
        for s in range(0, len(data["hidden"]), batch):
            inputs = _net_inputs(data, slice(s, s + batch))
            logp, ids = net.candidates(net(*inputs), inputs[2] if len(inputs) > 2 else None)
            guess = ids.gather(-1, logp.argmax(-1, keepdim=True))[..., 0]
            if len(inputs) > 2:  # what the drafter proposes: long matches' spans whole
                guess = copy_span(guess, inputs[2], inputs[3], net.cfg.copy_min_match)
            targets = data["targets"][s: s + batch]
            hit = (guess == targets) & (targets >= 0)
            correct = hit.sum(0) if correct is None else correct + hit.sum(0)
            accepted += hit.int().cumprod(1).sum().item()
            n += len(hit)
    net.train()
    return {"acc_per_pos": [round(c / n, 4) for c in correct.tolist()], "tau_chain_est": round(1 + accepted / n, 3)}


def train(net, data: dict, val: dict, seconds: float, lr: float, batch: int, seed: int, weight_decay: float) -> dict:
    """Train the parallel drafter on `make_examples` data (with draft ids ``y``) until ``seconds``."""
    device = data["hidden"].device
    weights = torch.tensor([0.8**j for j in range(net.cfg.k)], device=device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        idx = idx.to(device)
        inputs = _net_inputs(data, idx)
        logits, y = net(*inputs), data["y"][idx]
        if not net.cfg.lookup:
            return sum(weights[j] * F.cross_entropy(logits[:, j], y[:, j], ignore_index=-100)
                       for j in range(net.cfg.k)) / weights.sum()
        # Copy path: the target token is right through its vocabulary entry or through the copy
        # column (when the lookup proposed it): the loss is -log of their summed probability.
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = data["targets"][idx]
        via_vocab = logp.gather(-1, y.clamp(min=0)[..., None])[..., 0].masked_fill(y < 0, -math.inf)
        via_copy = logp[..., -1].masked_fill((inputs[2] != targets) | (targets < 0), -math.inf)
        nll = -torch.logaddexp(via_vocab, via_copy)
        counted = torch.isfinite(nll)
        per_pos = nll.masked_fill(~counted, 0).sum(0) / counted.sum(0).clamp(min=1)
        return (weights * per_pos).sum() / weights.sum()

    # Large evaluation batches: with millions of examples the periodic held-out score would
    # otherwise take as long as the training between two scores.
    return fit(net, len(data["hidden"]), batch_loss, lambda: evaluate(net, val, batch=8192), seconds, lr, batch, seed,
               weight_decay)


def fit(net, n_examples: int, batch_loss, score, seconds: float, lr: float, batch: int, seed: int,
        weight_decay: float) -> dict:
    """AdamW with warm-up and cosine decay until ``seconds``; ends with the best held-out state.

    ``batch_loss(indices)`` is the loss of a batch of example indices; ``score()`` evaluates on
    held-out data and returns a dict with ``tau_chain_est`` (higher is better).
    """
    g = torch.Generator().manual_seed(seed)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    best = (-1.0, None, 0)  # (held-out tau estimate, state, step)
    t0, step, losses = time.perf_counter(), 0, []
    # Estimate steps from the first ones so the cosine schedule ends with the budget.
    total = None
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed > seconds:
            break
        if step == 20:
            total = max(40, int(seconds / (elapsed / 20)))
        frac = step / total if total else 0.0
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        loss = batch_loss(torch.randint(0, n_examples, (batch,), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 200 == 0:
            ev = score()
            if ev["tau_chain_est"] > best[0]:
                best = (ev["tau_chain_est"], {k: v.detach().clone() for k, v in net.state_dict().items()}, step)
            log(f"step {step} loss {statistics_mean(losses[-200:]):.3f} {ev}")
    if best[1] is not None and score()["tau_chain_est"] < best[0]:
        net.load_state_dict(best[1])  # training ran past its best held-out point: keep the best
    return {"steps": step, "best_step": best[2], "final_loss": round(statistics_mean(losses[-100:]), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------
# Eagle: unrolled training


def evaluate_eagle(net, streams: dict, batch: int = 1024) -> dict:
    """Held-out top-1 accuracy per unrolled step (given a greedy prefix) and the implied chain tau."""
    net.eval()
    k, hits, counted, accepted = net.cfg.k, torch.zeros(net.cfg.k), torch.zeros(net.cfg.k), 0.0
    roots = streams["roots"]
    with torch.no_grad():
        for s in range(0, len(roots), batch):
            hidden, tokens, y, _ = eagle_batch(streams, roots[s: s + batch], k)
            _, logits = net.unroll(hidden, tokens)
            hit = (logits.argmax(-1) == y) & (y >= 0)
            hits += hit.sum(0).float()
            counted += (y >= 0).sum(0).float()
            accepted += hit.int().cumprod(1).sum().item()
    net.train()
    return {"acc_per_pos": [round(h / max(1.0, c), 4) for h, c in zip(hits.tolist(), counted.tolist(), strict=True)],
            "tau_chain_est": round(1 + accepted / max(1, len(roots)), 3)}


def train_eagle(net, data: dict, val: dict, seconds: float, lr: float, batch: int, seed: int, weight_decay: float,
                reg_weight: float) -> dict:
    """Unroll the recurrent step k times from the target's hidden state, fed the target's greedy tokens."""
    k = net.cfg.k
    weights = torch.tensor([0.8**j for j in range(k)])

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        hidden, tokens, y, target_hidden = eagle_batch(data, data["roots"][idx], k)
        states, logits = net.unroll(hidden, tokens)
        ce = torch.stack([F.cross_entropy(logits[:, j], y[:, j], ignore_index=-100) if (y[:, j] >= 0).any()
                          else logits.sum() * 0 for j in range(k)])
        counts = (y >= 0).float()
        reg = (F.smooth_l1_loss(states, target_hidden, reduction="none").mean(-1) * counts).sum(0) / counts.sum(0).clamp(min=1)
        return (weights * (ce + reg_weight * reg)).sum() / weights.sum()

    return fit(net, len(data["roots"]), batch_loss, lambda: evaluate_eagle(net, val), seconds, lr, batch, seed,
               weight_decay)


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


# ---------------------------------------------------------------------------------------------
# The two drafters, from generated batches


def train_parallel_drafter(model, batches: list[dict], val_batches: list[dict], settings: TrainSettings,
                           deadline: float) -> tuple[ParallelDrafterNet, dict, dict]:
    """(net, fit figures, data figures) of the parallel drafter trained until ``deadline`` (perf_counter)."""
    cfg, device, s, k = model.cfg, model.device, settings, settings.k
    index = SuffixIndex(periodic=s.lookup_periodic) if s.lookup else None
    t0 = time.perf_counter()
    train_data = make_examples(batches, s.n_context, k, index)
    val_data = make_examples(val_batches, s.n_context, k, index)
    log(f"examples built in {time.perf_counter() - t0:.1f} s")
    vocab_ids = draft_vocabulary(train_data["targets"], train_data["ctx"], s.draft_vocab)
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["targets"], vocab_ids, cfg.vocab_size)
    coverage = (train_data["y"] >= 0).sum().item() / max(1, (train_data["targets"] >= 0).sum().item())
    for d in (train_data, val_data):
        for key in ("hidden", "ctx", "y", "targets", "look", "match"):
            if key in d:
                d[key] = d[key].to(device)
    log(f"{len(train_data['hidden'])} train / {len(val_data['hidden'])} held-out examples; "
        f"draft vocab {len(vocab_ids)} covers {100 * coverage:.1f}% of targets")
    pcfg = ParallelConfig(target=cfg.name, dim=cfg.dim, width=s.width or cfg.dim, k=k,
                          n_context=s.n_context, draft_vocab=len(vocab_ids), lookup=s.lookup,
                          lookup_periodic=s.lookup_periodic,
                          copy_min_match=s.copy_min_match if s.lookup else 0)
    if index is not None:
        copyable = ((train_data["look"] == train_data["targets"]) & (train_data["targets"] >= 0)).float().mean(0)
        log(f"the lookup proposes the target token at {[round(x, 3) for x in copyable.tolist()]} of positions")
    net = ParallelDrafterNet(pcfg, vocab_ids.to(device), model.embed.weight.detach()).to(device)
    # Building the examples came out of the same budget.
    fit_figs = train(net, train_data, val_data, max(10.0, deadline - time.perf_counter()), s.lr, s.train_batch, s.seed,
                     s.weight_decay)
    held_out = evaluate(net, val_data)
    log(f"trained: {fit_figs}; held-out {held_out}")
    return net, {**fit_figs, "heldout": held_out}, {
        "train_examples": len(train_data["hidden"]), "heldout_examples": len(val_data["hidden"]),
        "draft_vocab_coverage": round(coverage, 4)}


def train_eagle_drafter(model, batches: list[dict], val_batches: list[dict], settings: TrainSettings,
                        deadline: float) -> tuple[eagle.EagleDrafterNet, dict, dict]:
    """(net, fit figures, data figures) of the eagle drafter trained until ``deadline`` (on the CPU)."""
    cfg, s, k = model.cfg, settings, settings.k
    train_data = eagle_streams(batches, k, use_prompt=True)
    val_data = eagle_streams(val_batches, k, use_prompt=False)  # judged on generated text, like the engine
    targets = train_data["greedy_next"][train_data["ok"]]
    vocab_ids = draft_vocabulary(targets, torch.empty(0, 1, dtype=torch.long), s.draft_vocab)
    # Tokens the data never showed still get a fair guess: the state is regressed onto the target's
    # hidden states and scored against the target's own head rows.
    vocab_ids = fill_vocabulary(vocab_ids, min(s.draft_vocab, cfg.vocab_size))
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["greedy_next"].masked_fill(~d["ok"], -1), vocab_ids, cfg.vocab_size)
    coverage = (train_data["y"] >= 0).sum().item() / max(1, len(targets))
    from_prompts = len(train_data["roots"]) - int(sum(b["alive"].sum() for b in batches))
    log(f"{len(train_data['roots'])} train roots ({from_prompts} in prompts) / {len(val_data['roots'])} held-out; "
        f"draft vocab {len(vocab_ids)} covers {100 * coverage:.1f}% of targets")
    ecfg = eagle.EagleConfig(target=cfg.name, dim=cfg.dim, width=s.width or cfg.dim, blocks=s.blocks, k=k,
                             draft_vocab=len(vocab_ids))
    # The streams live on the CPU, so the (small) net trains there whatever device generated the data.
    net = eagle.build_net(model, ecfg, vocab_ids.to(model.device)).float().cpu()
    fit_figs = train_eagle(net, train_data, val_data, max(10.0, deadline - time.perf_counter()), s.lr, s.train_batch, s.seed,
                           s.weight_decay, s.reg_weight)
    held_out = evaluate_eagle(net, val_data)
    log(f"trained: {fit_figs}; held-out {held_out}")
    return net, {**fit_figs, "heldout": held_out}, {
        "train_examples": len(train_data["roots"]), "train_examples_from_prompts": from_prompts,
        "heldout_examples": len(val_data["roots"]), "draft_vocab_coverage": round(coverage, 4)}


# ---------------------------------------------------------------------------------------------
# Measured tau with the engine


def measured_tau(model, tokenizer, dep, weights: Path, n_requests: int, max_new: int = 64, kind: str = "parallel") -> dict:
    """Tau (tokens committed a step) of the ``kind`` drafter in ``weights`` and of the n-gram drafter, with the
    engine's default options (a chain of 4 drafts, fp32), on the first ``n_requests`` dev requests of the
    `Deployment` ``dep``, ``max_new`` tokens each."""
    from specpilot.engine.api import Engine
    from specpilot.engine.options import EngineOptions
    from specpilot.harness.requests import encode_requests, fit_context, load_requests

    prompts = fit_context(encode_requests(load_requests(dep, "dev")[:n_requests], tokenizer), model.cfg.max_seq_len,
                          max_new)
    out = {}
    for name, opts in ((f"{kind}_chain4", EngineOptions(drafter=kind, drafter_weights=str(weights))),
                       ("ngram_chain4", EngineOptions(drafter="ngram"))):
        engine = Engine(model, tokenizer, opts.resolved(dtype="fp32"))
        committed = [c for p in prompts for c in engine.generate(p, max_new).accepted_per_step]
        out[name] = round(sum(committed) / max(1, len(committed)), 3)
    out["requests"], out["max_new_tokens"] = len(prompts), max_new
    return out
