"""`specpilot drafter train`: train the parallel drafter by self-distillation, on the CPU, in minutes.

1. Prompts from text on the machine: the deployment's *dev* requests (never the sealed ones),
   code from Python's standard library (the lines before a ``def``), and chat prompts made from
   standard-library module docstrings. All choices are seeded.
2. Self-distillation data: the target greedily continues every prompt (batched, left-padded,
   lockstep); each generated position t gives (hidden state that chose x_{t+1}, last tokens,
   the target's next K tokens). Training on the target's *own* outputs is what makes drafts
   match its argmax.
3. Draft vocabulary: the most frequent tokens of that data.
4. Training: AdamW, cross-entropy per drafted position (earlier positions weigh more), until the
   time budget; 5% of the sequences are held out.
5. Figures: held-out accuracy per position, the chain tau they imply, and tau measured by the
   engine (chain, block 4) on a few dev requests. They are saved in the weights file with the
   SHA-256 of the training data and the command line.

Generation and training share one time budget (``--minutes``). Everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.deployment import DEFAULT_DEPLOYMENT
from engine.drafters.parallel import DEFAULT_WEIGHTS, ParallelConfig, ParallelDrafterNet, save_drafter


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="its target and dev requests are used")
    ap.add_argument("--out", type=Path, default=None, help="weights file (default: the shipped file for the target)")
    ap.add_argument("--minutes", type=float, default=18.0, help="total time budget (generation + training)")
    ap.add_argument("--gen-share", type=float, default=0.6, help="share of the budget spent generating data")
    ap.add_argument("--batch", type=int, default=16, help="prompts generated in lockstep")
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=2000, help="standard-library prompts of each kind (code, chat)")
    ap.add_argument("--device", default="cpu", help="where the target generates and the drafter trains")
    ap.add_argument("--k", type=int, default=4, help="positions drafted per pass")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--width", type=int, default=None, help="drafter width (default: the target's hidden size)")
    ap.add_argument("--n-context", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--eval-requests", type=int, default=8,
                    help="first dev requests, kept out of training, on which tau is measured (0 skips)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data-dir", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpilot drafter train", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def _log(msg: str) -> None:
    print(f"[drafter train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# 1. Prompts


def _stdlib_files(rng: random.Random) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    rng.shuffle(files)
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_code_prompts(rng: random.Random, n: int) -> list[str]:
    """The ~24 lines up to and including a ``def`` line (and its docstring's first line)."""
    out = []
    for f in _stdlib_files(rng):
        if (text := _read(f)) is None:
            continue
        lines = text.splitlines()
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")]
        for i in rng.sample(defs, min(3, len(defs))):
            end = i + 2 if i + 1 < len(lines) and '"""' in lines[i + 1] else i + 1
            out.append("\n".join(lines[max(0, i - 24): end]) + "\n")
        if len(out) >= n:
            break
    return out[:n]


_CHAT_TEMPLATES = [
    "What is the Python module {m} used for? Here is its description: {d}",
    "Explain in simple terms: {d}",
    "Write a short Python example that uses the {m} module.",
    "Summarize this in one or two sentences: {d}",
    "I am learning Python. When should I use the {m} module, and what are its main functions?",
    "Write a function that uses the {m} module and explain how it works.",
    "Explain what this Python function does:\n{f}",
    "Write a docstring and two usage examples for this function:\n{f}",
    "Rewrite this function to be easier to read:\n{f}",
]


def stdlib_chat_prompts(rng: random.Random, n: int) -> list[str]:
    """Questions about standard-library modules and functions, from their docstrings and code."""
    out = []
    for f in _stdlib_files(rng):
        if (text := _read(f)) is None:
            continue
        s = text.lstrip()
        doc = ""
        for q in ('"""', "'''"):
            if s.startswith(q) and (end := s.find(q, 3)) > 3:
                doc = s[3:end].strip().split("\n\n")[0].replace("\n", " ")
        lines = text.splitlines()
        defs = [i for i, line in enumerate(lines) if line.startswith("def ") and line.rstrip().endswith(":")]
        func = ""
        if defs:
            i = rng.choice(defs)
            body = [lines[i]] + [ln for ln in lines[i + 1: i + 16] if ln.startswith((" ", "\t")) or not ln.strip()]
            func = "\n".join(body).rstrip()
        choices = [t for t in _CHAT_TEMPLATES if ("{d}" not in t or 20 < len(doc) < 400) and ("{f}" not in t or func)]
        if choices:
            out.append(rng.choice(choices).format(m=f.stem, d=doc, f=func))
        if len(out) >= n:
            break
    return out[:n]


def collect_prompts(dep, tokenizer, rng: random.Random, max_tokens: int, n_each: int,
                    skip_dev: int = 0) -> list[list[int]]:
    """Training prompts. The first ``skip_dev`` dev requests are left out: tau is measured on them."""
    from engine.requests import encode_requests, load_requests

    dev = load_requests(dep, "dev")[skip_dev:]  # never the sealed split: it is the final, unseen evaluation
    prompts = encode_requests(dev, tokenizer)
    prompts += [tokenizer.encode(t) for t in stdlib_code_prompts(rng, n_each)]
    prompts += [tokenizer.encode(tokenizer.chat_prompt(t)) for t in stdlib_chat_prompts(rng, n_each)]
    prompts = [p[-max_tokens:] for p in prompts if p]
    rng.shuffle(prompts)
    return prompts


# ---------------------------------------------------------------------------------------------
# 2. Self-distillation data


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], new_tokens: int, stop_ids) -> dict:
    """Greedy continuations of left-padded prompts in lockstep, with the hidden state behind each token.

    Returns tokens [B, G], hidden [B, G, d] (hidden[:, g] chose tokens[:, g]), alive [B, G] (False
    after a stop token) and the prompts' last n tokens for context.
    """
    B, P, G = len(prompts), max(map(len, prompts)), new_tokens
    dev = model.device
    toks = torch.zeros(B, P, dtype=torch.long, device=dev)
    keys = torch.zeros(B, P + G, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        toks[i, P - len(p):] = torch.tensor(p)
        keys[i, P - len(p): P] = True
    pos = (keys[:, :P].cumsum(1) - 1).clamp(min=0)
    cache = model.new_cache(P + G, batch=B)
    # Padding queries attend to themselves only, so they stay finite (NaNs would leak through 0-weights).
    mask = torch.ones(P, P, dtype=torch.bool, device=dev).tril()[None, None] & keys[:, None, None, :P]
    mask |= torch.eye(P, dtype=torch.bool, device=dev)[None, None]
    logits, hidden = model(toks, pos, cache, 0, mask, last_only=True)
    nxt, h = logits[:, -1].argmax(-1), hidden[:, -1]
    cur = pos[:, -1:] + 1
    stops = torch.tensor(list(stop_ids) or [-1], device=dev)
    out_t, out_h, alive = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for g in range(G):
        out_t.append(nxt)
        out_h.append(h.float())
        alive.append(~done)
        done = done | torch.isin(nxt, stops)
        if g == G - 1:
            break
        keys[:, P + g] = True
        logits, hidden = model(nxt[:, None], cur, cache, P + g, keys[:, None, None, : P + g + 1])
        nxt, h = logits[:, 0].argmax(-1), hidden[:, 0]
        cur = cur + 1
    return {"tokens": torch.stack(out_t, 1).cpu(), "hidden": torch.stack(out_h, 1).cpu(),
            "alive": torch.stack(alive, 1).cpu(), "prompt_tail": [p[-8:] for p in prompts]}


def make_examples(batches: list[dict], n_context: int, k: int) -> dict:
    """Flatten generated batches into (hidden, context tokens, next-K targets) examples.

    Position g of a row: hidden[g] chose the root tokens[g]; the context is the n_context tokens
    ending at the root; the targets are tokens[g+1 .. g+k] (-1 past the generation or a stop).
    """
    H, C, T = [], [], []
    for b in batches:
        toks, hid, alive = b["tokens"], b["hidden"], b["alive"]
        B, G = toks.shape
        tails = torch.tensor([([t[0]] * n_context + t)[-(n_context - 1):] if n_context > 1 else [] for t in b["prompt_tail"]],
                             dtype=torch.long).view(B, n_context - 1)
        seq = torch.cat([tails, toks], dim=1)  # [B, n_context - 1 + G]
        ctx = seq.unfold(1, n_context, 1)  # [B, G, n_context]: window g ends at tokens[g]
        padded = torch.cat([toks.masked_fill(~alive, -1), torch.full((B, k), -1, dtype=torch.long)], dim=1)
        tgt = padded.unfold(1, k, 1)[:, 1: G + 1]  # [B, G, k]: tokens[g+1 .. g+k]
        H.append(hid[alive])
        C.append(ctx[alive])
        T.append(tgt[alive])
    return {"hidden": torch.cat(H), "ctx": torch.cat(C), "targets": torch.cat(T)}


# ---------------------------------------------------------------------------------------------
# 3-4. Vocabulary and training


def draft_vocabulary(targets: torch.Tensor, ctx: torch.Tensor, size: int) -> torch.Tensor:
    counts = Counter(targets[targets >= 0].tolist())
    counts.update(ctx[:, -1].tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


def to_draft_ids(targets: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target token ids -> draft-vocabulary indices; unknown or missing -> -100 (ignored)."""
    lookup = torch.full((vocab_size,), -100, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    out = torch.full_like(targets, -100)
    ok = targets >= 0
    out[ok] = lookup[targets[ok]]
    return out


def evaluate(net, data: dict, batch: int = 1024) -> dict:
    """Held-out top-1 accuracy per position and the chain tau it implies (accepted prefix + 1)."""
    net.eval()
    correct, accepted, n = None, 0.0, 0
    with torch.no_grad():
        for s in range(0, len(data["hidden"]), batch):
            logits = net(data["hidden"][s: s + batch], data["ctx"][s: s + batch])
            hit = logits.argmax(-1) == data["y"][s: s + batch]
            correct = hit.sum(0) if correct is None else correct + hit.sum(0)
            accepted += hit.int().cumprod(1).sum().item()
            n += len(hit)
    net.train()
    return {"acc_per_pos": [round(c / n, 4) for c in correct.tolist()], "tau_chain_est": round(1 + accepted / n, 3)}


def train(net, data: dict, val: dict, seconds: float, lr: float, batch: int, seed: int, weight_decay: float) -> dict:
    """AdamW with warm-up and cosine decay until ``seconds``; ends with the best held-out state."""
    g = torch.Generator().manual_seed(seed)
    device = data["hidden"].device
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    best = (-1.0, None, 0)  # (held-out tau estimate, state, step)
    n = len(data["hidden"])
    weights = torch.tensor([0.8**j for j in range(net.cfg.k)], device=device)
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
        idx = torch.randint(0, n, (batch,), generator=g).to(device)
        logits = net(data["hidden"][idx], data["ctx"][idx])
        y = data["y"][idx]
        loss = sum(weights[j] * F.cross_entropy(logits[:, j], y[:, j], ignore_index=-100)
                   for j in range(net.cfg.k)) / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 200 == 0:
            ev = evaluate(net, val)
            if ev["tau_chain_est"] > best[0]:
                best = (ev["tau_chain_est"], {k: v.detach().clone() for k, v in net.state_dict().items()}, step)
            _log(f"step {step} loss {statistics_mean(losses[-200:]):.3f} {ev}")
    if best[1] is not None and evaluate(net, val)["tau_chain_est"] < best[0]:
        net.load_state_dict(best[1])  # training ran past its best held-out point: keep the best
    return {"steps": step, "best_step": best[2], "final_loss": round(statistics_mean(losses[-100:]), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


# ---------------------------------------------------------------------------------------------
# 5. Measured tau with the engine


def measured_tau(model, tokenizer, dep, weights: Path, n_requests: int, max_new: int = 64) -> dict:
    from engine.api import Engine
    from engine.options import EngineOptions
    from engine.requests import encode_requests, load_requests

    prompts = encode_requests(load_requests(dep, "dev")[:n_requests], tokenizer)
    out = {}
    for name, opts in (("parallel_chain4", EngineOptions(drafter="parallel", drafter_weights=str(weights))),
                       ("ngram_chain4", EngineOptions(drafter="ngram"))):
        engine = Engine(model, tokenizer, opts.resolved(dtype="fp32"))
        committed = [c for p in prompts for c in engine.generate(p, max_new).accepted_per_step]
        out[name] = round(sum(committed) / max(1, len(committed)), 3)
    out["requests"], out["max_new_tokens"] = len(prompts), max_new
    return out


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from engine.deployment import load_deployment
    from engine.weights import load_model

    t_start = time.perf_counter()
    budget = 60.0 * args.minutes
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dep = load_deployment(args.deployment)
    out_path = args.out or DEFAULT_WEIGHTS.get(dep.target)
    if out_path is None:
        raise SystemExit(f"no default weights path for target {dep.target!r}: pass --out")
    device = torch.device(args.device)
    model, tok = load_model(dep.target, dtype="fp32", device=device, data_dir=args.data_dir)
    cfg = model.cfg

    prompts = collect_prompts(dep, tok, rng, args.max_prompt_tokens, args.prompts, skip_dev=args.eval_requests)
    _log(f"{len(prompts)} prompts; generating for up to {args.gen_share * budget:.0f} s")
    batches, used = [], []
    gen_deadline = t_start + args.gen_share * budget
    # Similar lengths per batch waste less padding; batch order stays seeded-random.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [order[i: i + args.batch] for i in range(0, len(order), args.batch)]
    rng.shuffle(groups)
    t_gen = time.perf_counter()
    for grp in groups:
        if time.perf_counter() > gen_deadline:
            break
        ps = [prompts[i] for i in grp]
        batches.append(generate_batch(model, ps, args.new_tokens, cfg.stop_ids))
        used += ps
        n_tok = sum(int(b["alive"].sum()) for b in batches)
        _log(f"generated {len(used)} prompts, {n_tok} tokens ({n_tok / (time.perf_counter() - t_gen):.0f} tok/s)")
    gen_seconds = time.perf_counter() - t_gen
    data_hash = hashlib.sha256(json.dumps({"prompts": used, "outputs": [b["tokens"].tolist() for b in batches]},
                                          separators=(",", ":")).encode()).hexdigest()

    # Hold out whole batches (sequences), so held-out examples share no sequence with training ones.
    n_val = max(1, len(batches) // 20)
    train_data = make_examples(batches[n_val:], args.n_context, args.k)
    val_data = make_examples(batches[:n_val], args.n_context, args.k)
    vocab_ids = draft_vocabulary(train_data["targets"], train_data["ctx"], args.draft_vocab)
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["targets"], vocab_ids, cfg.vocab_size)
    coverage = (train_data["y"] >= 0).sum().item() / max(1, (train_data["targets"] >= 0).sum().item())
    for d in (train_data, val_data):
        for key in ("hidden", "ctx", "y"):
            d[key] = d[key].to(device)
    _log(f"{len(train_data['hidden'])} train / {len(val_data['hidden'])} held-out examples; "
         f"draft vocab {len(vocab_ids)} covers {100 * coverage:.1f}% of targets")

    pcfg = ParallelConfig(target=cfg.name, dim=cfg.dim, width=args.width or cfg.dim, k=args.k,
                          n_context=args.n_context, draft_vocab=len(vocab_ids))
    net = ParallelDrafterNet(pcfg, vocab_ids.to(device), model.embed.weight.detach()).to(device)
    eval_reserve = 60.0 if args.eval_requests else 5.0
    train_seconds = max(10.0, budget - (time.perf_counter() - t_start) - eval_reserve)
    fit = train(net, train_data, val_data, train_seconds, args.lr, args.train_batch, args.seed, args.weight_decay)
    held_out = evaluate(net, val_data)
    _log(f"trained: {fit}; held-out {held_out}")

    meta = {
        "training_data_sha256": data_hash,
        "command": " ".join(sys.argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "trained_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "figures": {
            "prompts": len(used), "generated_tokens": sum(int(b["alive"].sum()) for b in batches),
            "generation_seconds": round(gen_seconds, 1), "train_examples": len(train_data["hidden"]),
            "heldout_examples": len(val_data["hidden"]), "draft_vocab_coverage": round(coverage, 4),
            **fit, "heldout": held_out,
        },
    }
    save_drafter(out_path, net, meta)
    if args.eval_requests:
        meta["figures"]["measured_tau"] = measured_tau(model, tok, dep, out_path, args.eval_requests)
        save_drafter(out_path, net, meta)
    meta["figures"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    save_drafter(out_path, net, meta)
    _log(f"wrote {out_path} ({out_path.stat().st_size / 1e6:.1f} MB)")
    print(json.dumps({"drafter": str(out_path), "target": cfg.name, **meta["figures"],
                      "training_data_sha256": data_hash}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
