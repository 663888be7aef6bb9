"""Lab bench: does the parallel drafter draft better from several of the target's layers than from its last?

EAGLE-3 feeds its drafter the target's low, middle and high layers instead of the last hidden state only
(the last one is specialised for the very next token; positions t+2.. need what earlier layers still hold).
Issue 31's round needs a drafter that commits ~3.3 tokens a step; this measures, before any engine work,
whether that input would raise the parallel drafter's acceptance.

One set of self-distillation data (`specpilot.harness.corpus`'s prompts and `distill.generate_batch`), generated once
with the residual stream after ``--taps`` layers recorded beside the final-norm state, trains two arms for the
same seconds, the same seed and the same batches:

- ``last``: the shipped architecture (`ParallelDrafterNet`, copy path included) on the final-norm state;
- ``taps``: the same net, its hidden input replaced by ``W [norm(h_last); norm(h_a); norm(h_b) ...]`` (a learned
  projection of the normalised taps back to the target's width, trained with the net).

Both are scored on the same held-out sequences (5% of the batches) by `fit.evaluate`: top-1 accuracy per
drafted position and the chain tau it implies. Nothing is saved or shipped: the engine does not hand a drafter
the target's inner layers (that plumbing comes only if this wins). Prints a table and a JSON line.

    python bench/drafter_taps.py --gen-minutes 20 --train-minutes 8 --taps 9,19
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.engine.drafters.ngram import SuffixIndex  # noqa: E402
from specpilot.engine.drafters.parallel import ParallelConfig, ParallelDrafterNet, _Norm  # noqa: E402
from specpilot.harness.corpus import collect_prompts  # noqa: E402
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, load_deployment  # noqa: E402
from specpilot.harness.distill import draft_vocabulary, generate_batch, make_examples, to_draft_ids  # noqa: E402
from specpilot.harness.fit import evaluate, train  # noqa: E402


class TapsNet(nn.Module):
    """`ParallelDrafterNet` whose hidden input is a learned projection of several normalised target layers
    (``hidden`` [B, n_taps * d], the final-norm state first)."""

    def __init__(self, inner: ParallelDrafterNet, n_taps: int):
        super().__init__()
        d = inner.cfg.dim
        self.inner, self.cfg, self.n_taps = inner, inner.cfg, n_taps
        self.norms = nn.ModuleList(_Norm(d) for _ in range(n_taps))
        self.fuse = nn.Linear(n_taps * d, d, bias=False)
        with torch.no_grad():  # start as the last-layer net: the first tap passes through
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d] = torch.eye(d)

    def forward(self, hidden: Tensor, *rest) -> Tensor:
        parts = hidden.view(hidden.shape[0], self.n_taps, -1)
        fused = self.fuse(torch.cat([n(parts[:, i]) for i, n in enumerate(self.norms)], dim=-1))
        return self.inner(fused, *rest)

    def candidates(self, logits: Tensor, look: Tensor | None = None):
        return self.inner.candidates(logits, look)


ARMS = ("last", "taps")


def _log(msg: str) -> None:
    print(f"[drafter_taps {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def generate_with_taps(model, prompts: list[list[int]], new_tokens: int, stop_ids, taps: list[int]) -> dict:
    """`distill.generate_batch`, with the residual stream after each tapped layer at the same positions as its
    hidden states, concatenated after them: hidden [B, G, (1 + len(taps)) * d]."""
    seen: dict[int, list[Tensor]] = {i: [] for i in taps}
    hooks = [model.layers[i].register_forward_hook(lambda _m, _a, out, i=i: seen[i].append(out[:, -1].float()))
             for i in taps]
    try:
        b = generate_batch(model, prompts, new_tokens, stop_ids)
    finally:
        for h in hooks:
            h.remove()
    G = b["hidden"].shape[1]
    # the last forward's taps belong to no recorded token (generation stops after it): keep the first G
    extra = [torch.stack(seen[i][:G], 1).cpu() for i in taps]
    b["hidden"] = torch.cat([b["hidden"], *extra], dim=-1).half()
    return b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="its target (and tokenizer) is used")
    ap.add_argument("--taps", default="9,19", help="0-based layers whose output the taps arm also reads")
    ap.add_argument("--gen-minutes", type=float, default=20.0, help="time generating the shared data")
    ap.add_argument("--train-minutes", type=float, default=8.0, help="training time of each arm")
    ap.add_argument("--prompts", type=int, default=3000, help="standard-library prompts of each kind")
    ap.add_argument("--docstrings", type=int, default=3000)
    ap.add_argument("--general-chat", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=32, help="prompts generated in lockstep")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train-batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the target generates and the arms train (a GPU: minutes "
                    "for millions of tokens; this 2-core CPU generates ~30 tokens/s, too few to train on)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which arms to train ({', '.join(ARMS)})")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:  # before minutes of generation, not after
        ap.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from specpilot.engine.weights import load_model

    dep = load_deployment(args.deployment)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = device.type == "cuda"  # as train-gen: argmax differs only at near-ties
    model, tok = load_model(dep.target, dtype="fp32", device=device)
    cfg = model.cfg
    taps = [int(v) for v in args.taps.split(",") if v]
    if any(not 0 <= i < cfg.n_layers - 1 for i in taps):
        ap.error(f"--taps: layers are 0..{cfg.n_layers - 2} (the last one's output is the final state)")
    rng = random.Random(args.seed)
    prompts = collect_prompts(dep, tok, rng, 192, args.prompts, include_dev=False, docstrings=args.docstrings,
                                variants=True, general_chat=args.general_chat)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [order[i: i + args.batch] for i in range(0, len(order), args.batch)]
    rng.shuffle(groups)
    batches, t0 = [], time.perf_counter()
    for grp in groups:
        if time.perf_counter() - t0 > 60 * args.gen_minutes and len(batches) >= 4:
            break
        batches.append(generate_with_taps(model, [prompts[i] for i in grp], args.new_tokens, cfg.stop_ids, taps))
        n_tok = sum(int(b["alive"].sum()) for b in batches)
        _log(f"{len(batches)} batches, {n_tok} tokens, {n_tok / (time.perf_counter() - t0):.0f} tok/s")
    gen_s = time.perf_counter() - t0
    n_val = max(1, len(batches) // 20)
    index = SuffixIndex(periodic=True)
    train_data = make_examples(batches[n_val:], 3, args.k, index)
    val_data = make_examples(batches[:n_val], 3, args.k, index)
    vocab_ids = draft_vocabulary(train_data["targets"], train_data["ctx"], 4096)
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["targets"], vocab_ids, cfg.vocab_size)
        for key in ("hidden", "ctx", "y", "targets", "look", "match"):
            d[key] = d[key].to(device)
    vocab_ids = vocab_ids.to(device)
    pcfg = ParallelConfig(target=cfg.name, dim=cfg.dim, k=args.k, n_context=3, draft_vocab=len(vocab_ids),
                          lookup=True, lookup_periodic=True, copy_min_match=3)
    width = cfg.dim
    results = {}
    for arm in arms:
        torch.manual_seed(args.seed)
        inner = ParallelDrafterNet(pcfg, vocab_ids, model.embed.weight.detach())
        if arm == "last":
            net = inner.to(device)
            tr = {**train_data, "hidden": train_data["hidden"][:, :width]}
            va = {**val_data, "hidden": val_data["hidden"][:, :width]}
        else:  # "taps"
            net, tr, va = TapsNet(inner, 1 + len(taps)).to(device), train_data, val_data
        fit = train(net, tr, va, 60 * args.train_minutes, args.lr, args.train_batch, args.seed, 0.1)
        results[arm] = {**evaluate(net, va), "steps": fit["steps"], "best_step": fit["best_step"]}
        _log(f"{arm}: {results[arm]}")

    table = Table(title=f"parallel drafter, last layer vs taps {taps} (held-out sequences)")
    for col in ("arm", "tau (chain est.)", *[f"acc t+{j + 2}" for j in range(args.k)], "steps"):
        table.add_column(col, justify="right")
    for arm, r in results.items():
        table.add_row(arm, f"{r['tau_chain_est']:.3f}", *[f"{a:.3f}" for a in r["acc_per_pos"]], str(r["steps"]))
    Console().print(table)
    print(json.dumps({"bench": "drafter_taps", "taps": taps, "target": cfg.name, "batches": len(batches),
                      "train_examples": len(train_data["hidden"]), "heldout_examples": len(val_data["hidden"]),
                      "generation_seconds": round(gen_s, 1), "train_seconds_each": 60 * args.train_minutes,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "cpu_threads": torch.get_num_threads(), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
