"""Self-distillation data of `specpilot drafter train`: the target's own greedy continuations, as tensors.

- `generate_batch(model, prompts, new_tokens, stop_ids)` continues a batch of prompts (token ids) greedily in
  lockstep, left-padded, and returns the tokens, the hidden state behind each and which are alive (before a
  stop); ``keep_prompt`` adds the prefill's view of the prompts (the eagle drafter trains on it too).
- `generate_data(model, prompts, rng, ...)` runs `generate_batch` over all the prompts (similar lengths
  together, batch order from ``rng``) until a deadline; with ``data`` every batch is kept there as a shard
  (`save_shard`: ``data/batch-NNNNN.pt``, written atomically, hidden states in half precision) and a later
  call with the same prompts reads it back (`load_shard`) instead of generating it. `data_sha256` names what
  came out (the weights file records it).
- Parallel drafter: `make_examples` flattens batches into (hidden, context, next-K targets) examples, with
  the copy path's features (`lookup_features`) when given an index. Eagle drafter: `eagle_streams` keeps the
  rows as flat sequences and `eagle_batch` cuts unroll windows out of them.
- Draft vocabulary: `draft_vocabulary` (most frequent tokens), `fill_vocabulary`, `to_draft_ids`.

`log` is the progress line every stage of the command writes on stderr. Nothing here trains.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.engine.drafters.ngram import SuffixIndex
from specpilot.engine.drafters.parallel import padded_lookup
from specpilot.errors import UserError


def log(msg: str) -> None:
    """One timestamped progress line of `specpilot drafter train` on stderr (generation, training, command)."""
    print(f"[drafter train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], new_tokens: int, stop_ids, keep_prompt: bool = False) -> dict:
    """Greedy continuations of left-padded prompts in lockstep, with the hidden state behind each token.

    Returns tokens [B, G], hidden [B, G, d] (hidden[:, g] chose tokens[:, g]), alive [B, G] (False
    after a stop token), the prompts and their last 8 tokens for context. With ``keep_prompt`` also the
    prefill's view of the prompts: prompt_tokens [B, P] (left-padded), prompt_keys [B, P] (False on
    padding), prompt_hidden [B, P, d] and prompt_argmax [B, P] (the target's greedy next token
    after each prompt position).
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
    prompt_view = {}
    if keep_prompt:  # one row at a time: B x P x vocab logits would not fit in memory
        prompt_view = {"prompt_tokens": toks.cpu(), "prompt_keys": keys[:, :P].cpu(), "prompt_hidden": hidden.float().cpu(),
                       "prompt_argmax": torch.stack([model.lm_head(row).argmax(-1) for row in hidden]).cpu()}
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
            "alive": torch.stack(alive, 1).cpu(), "prompt_tail": [p[-8:] for p in prompts],
            "prompts": [list(p) for p in prompts], **prompt_view}


def lookup_features(prompt: list[int], tokens: list[int], k: int, index: SuffixIndex) -> tuple[list, list]:
    """(look [G][k], match [G]) at every generated root: what the parallel drafter's copy path is
    given there (`SuffixIndex.lookup` of prompt + tokens[:g+1], `padded_lookup`), computed by the
    same class and padding the drafter uses when it runs."""
    index.reset()
    index.extend(prompt)
    look, match = [], []
    for token in tokens:  # lookup(prompt + tokens[:g+1]) without re-checking the prefix each time
        index.extend((token,))
        found, m = index.query(k)
        look.append(padded_lookup(found, k))
        match.append(m)
    return look, match


def make_examples(batches: list[dict], n_context: int, k: int, index: SuffixIndex | None = None) -> dict:
    """Flatten generated batches into (hidden, context tokens, next-K targets) examples.

    Position g of a row: hidden[g] chose the root tokens[g]; the context is the n_context tokens
    ending at the root; the targets are tokens[g+1 .. g+k] (-1 past the generation or a stop).
    With ``index`` also the copy path's features: look [N, k] and match [N] (`lookup_features`).
    """
    H, C, T, LK, MT = [], [], [], [], []
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
        if index is not None:  # alive is a prefix of each row, so row i's examples are its first n
            for i, n in enumerate(alive.sum(1).tolist()):
                look, match = lookup_features(b["prompts"][i], toks[i, :n].tolist(), k, index)
                LK.append(torch.tensor(look, dtype=torch.long).view(n, k))
                MT.append(torch.tensor(match, dtype=torch.long))
    out = {"hidden": torch.cat(H), "ctx": torch.cat(C), "targets": torch.cat(T)}
    if index is not None:
        out["look"], out["match"] = torch.cat(LK), torch.cat(MT)
    return out


# ---------------------------------------------------------------------------------------------
# Shards on disk, and the generation loop over them


def save_shard(path: Path, batch: dict) -> None:
    """One generated batch as a `--data` file (hidden states in half precision), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: v.half() if k.endswith("hidden") else v for k, v in batch.items()}, tmp)
    tmp.replace(path)


def load_shard(path: Path, prompts: list[list[int]], new_tokens: int, half: bool) -> dict:
    """A `save_shard` file, checked to hold ``prompts`` continued by ``new_tokens`` tokens."""
    try:
        batch = torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"{path} is not a generated batch ({e}); delete it or use another --data directory") from e
    if batch.get("prompts") != prompts or batch["tokens"].shape[1] != new_tokens:
        raise UserError(f"{path} was generated from other prompts or lengths (another --seed, prompt flag, "
                         f"--batch or --new-tokens): use another --data directory")
    return batch if half else {k: v.float() if k.endswith("hidden") else v for k, v in batch.items()}


@dataclass(frozen=True)
class Generated:
    """What `generate_data` gathered: `generate_batch` dicts and the prompts they continue, in one order."""

    batches: list[dict]
    prompts: list[list[int]]
    generated: int  # tokens this call generated (not those read back from shards)
    seconds: float

    @property
    def tokens(self) -> int:
        """Tokens of every batch, up to each row's stop."""
        return sum(int(b["alive"].sum()) for b in self.batches)


def generate_data(model, prompts: list[list[int]], rng, batch: int, new_tokens: int, deadline: float, *,
                  keep_prompt: bool, half: bool, data: Path | None = None, tf32: bool = False) -> Generated:
    """`generate_batch` over ``prompts``, ``batch`` at a time, until ``deadline`` (perf_counter) has passed and
    two batches are there (one to hold out, one to train on).

    ``keep_prompt`` keeps the prefill's view (eagle); ``half`` keeps hidden states in half precision (the
    parallel drafter's examples do). With ``data`` batch ``i`` is ``data/batch-{i:05d}.pt``: read back when
    there (whatever the deadline), else generated and written there. ``tf32``: TF32 matmuls while generating
    (CUDA; the setting is put back after)."""
    batches, used = [], []
    # Similar lengths per batch waste less padding; batch order stays seeded-random.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [order[i: i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(groups)
    t_gen, generated = time.perf_counter(), 0
    was_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for gi, grp in enumerate(groups):
            ps = [prompts[i] for i in grp]
            shard = data / f"batch-{gi:05d}.pt" if data else None
            if shard is not None and shard.is_file():
                batches.append(load_shard(shard, ps, new_tokens, half=half))
            elif time.perf_counter() > deadline and len(batches) >= 2:  # one to hold out, one to train on
                break
            else:
                b = generate_batch(model, ps, new_tokens, model.cfg.stop_ids, keep_prompt=keep_prompt)
                if half:
                    b["hidden"] = b["hidden"].half()
                if shard is not None:
                    save_shard(shard, b)
                batches.append(b)
                generated += int(b["alive"].sum())
            used += ps
            n_tok = sum(int(b["alive"].sum()) for b in batches)
            log(f"{len(used)} prompts, {n_tok} tokens ({generated / (time.perf_counter() - t_gen):.0f} tok/s generated "
                f"here, {len(batches)} batches)")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was_tf32
    return Generated(batches, used, generated, time.perf_counter() - t_gen)


def data_sha256(prompts: list[list[int]], batches: list[dict]) -> str:
    """SHA-256 of the training data: the prompts and the tokens generated after them."""
    return hashlib.sha256(json.dumps({"prompts": prompts, "outputs": [b["tokens"].tolist() for b in batches]},
                                     separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Draft vocabulary


def draft_vocabulary(targets: torch.Tensor, ctx: torch.Tensor, size: int) -> torch.Tensor:
    counts = Counter(targets[targets >= 0].tolist())
    counts.update(ctx[:, -1].tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


def fill_vocabulary(vocab_ids: torch.Tensor, size: int) -> torch.Tensor:
    """``vocab_ids`` topped up to ``size`` with the lowest token ids not in it (BPE ids grow with merge
    order, so low ids are common tokens): requests use tokens the training data never showed."""
    have = set(vocab_ids.tolist())
    extra = [t for t in range(size + len(have)) if t not in have][: max(0, size - len(have))]
    return torch.tensor(sorted(have | set(extra)))


def to_draft_ids(targets: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target token ids -> draft-vocabulary indices; unknown or missing -> -100 (ignored)."""
    lookup = torch.full((vocab_size,), -100, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    out = torch.full_like(targets, -100)
    ok = targets >= 0
    out[ok] = lookup[targets[ok]]
    return out


# ---------------------------------------------------------------------------------------------
# Eagle: sequences


def eagle_streams(batches: list[dict], k: int, use_prompt: bool) -> dict:
    """Generated rows (and, with ``use_prompt``, the prompts before them) as flat sequences.

    Position i of a row holds a token ``s_i``, the target's hidden state ``H_i`` computed at the
    token before it, the target's greedy choice ``a_i = argmax(H_i)`` and ``ok_i`` (H_i is real:
    not padding, not past a stop). Generated tokens are greedy by construction (a_i == s_i); in a
    prompt, s_i is the text and may differ. ``greedy_i = ok_i and a_i == s_i``. Every row ends with
    k padding positions, so an unroll from any position stays inside the flat arrays.
    """
    S, H, A, OK = [], [], [], []
    for b in batches:
        parts = [(b["tokens"], b["hidden"], b["tokens"], b["alive"])]
        if use_prompt and "prompt_tokens" in b:
            # Prompt position p's hidden state predicts prompt token p+1 (the last one predicts tokens[:, 0]).
            parts.insert(0, (b["prompt_tokens"][:, 1:], b["prompt_hidden"][:, :-1], b["prompt_argmax"][:, :-1],
                             b["prompt_keys"][:, :-1]))
        B, d = b["tokens"].shape[0], b["hidden"].shape[-1]
        parts.append((torch.zeros(B, k, dtype=torch.long), torch.zeros(B, k, d), torch.zeros(B, k, dtype=torch.long),
                      torch.zeros(B, k, dtype=torch.bool)))
        for out, i in ((S, 0), (H, 1), (A, 2), (OK, 3)):
            out.append(torch.cat([part[i] for part in parts], dim=1).flatten(0, 1))
    s, a, ok = torch.cat(S), torch.cat(A), torch.cat(OK)
    greedy = ok & (a == s)
    return {"tokens": s, "hidden": torch.cat(H), "greedy_next": a, "ok": ok, "greedy": greedy,
            # Roots: the engine's root is always the target's greedy token.
            "roots": greedy.nonzero().squeeze(1)}


def eagle_batch(streams: dict, roots: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(hidden [B, d], input tokens [B, k], draft-id targets [B, k] (-100: ignored), target hidden [B, k, d]).

    Step j (1-based) is fed s_{i+j-1} and must predict a_{i+j}; it counts only where s_{i+1..i+j-1}
    were the target's greedy tokens (otherwise the chain never gets there) and H_{i+j} is real.
    """
    pos = roots[:, None] + torch.arange(k + 1)  # [B, k+1]: root .. root + k
    reachable = streams["greedy"][pos[:, 1:]].int().cumprod(1)  # reachable[:, j-1]: s_{i+1..i+j} greedy
    counts = torch.cat([torch.ones_like(reachable[:, :1]), reachable[:, :-1]], dim=1).bool() & streams["ok"][pos[:, 1:]]
    y = streams["y"][pos[:, 1:]].masked_fill(~counts, -100)
    return streams["hidden"][roots], streams["tokens"][pos[:, :-1]], y, streams["hidden"][pos[:, 1:]]
