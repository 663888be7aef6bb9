"""Verification cost c(N) of the engine's target forward, for any model config (random weights).

    python bench/engine_bench.py --model llama3-8b --device cuda --dtype bf16 --context 1024

Times one target forward of 1 + N tokens (root + N chain drafts) at a given cache length, the way
`engine.decode.verify` runs it (chain: causal; tree: explicit mask), with CUDA events on GPUs and
the wall clock on CPUs (median of ``--reps``). ``c(N) = t(N) / t(0)``; t(0) is an AR step. Also
checks on the device that speculative decoding of a tiny model emits the AR tokens. Needs no
model files (random weights), so it runs on machines without the GGUF. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.decode import DecodeConfig, generate  # noqa: E402
from engine.drafters.ngram import NgramDrafter  # noqa: E402
from engine.model import DTYPES, build_random, get_config  # noqa: E402
from engine.tree import DraftTree  # noqa: E402


def time_forward(model, n: int, context: int, tree: bool, reps: int) -> float:
    """Median seconds of one forward of 1 + n tokens after ``context`` cached tokens."""
    cache = model.new_cache(context + n + 1)
    dev = model.device
    with torch.no_grad():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), device=dev), torch.arange(context, device=dev), cache, 0,
              last_only=True)
        if tree and n > 1:  # a two-branch tree of n drafts
            half = n // 2
            t = DraftTree([0] * (n + 1), [-1, *range(0, half), 0, *range(half + 1, n)])
            mask = t.attention_mask(dev)
            pos = t.positions(context, dev)
        else:
            mask, pos = None, torch.arange(context, context + n + 1, device=dev)
        toks = torch.randint(0, model.cfg.vocab_size, (1, n + 1), device=dev)
        times = []
        for _ in range(reps + 3):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                logits, _ = model(toks, pos, cache, context, mask)
                logits.argmax(-1)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                logits, _ = model(toks, pos, cache, context, mask)
                logits.argmax(-1)
                times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def exactness_check(device: str) -> bool:
    """Speculative == AR on the tiny model on this device (fp32)."""
    model = build_random(get_config("tiny"), device=device, dtype=torch.float32)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1, 2, 5, 6]
    cache = model.new_cache(256)
    ar = generate(model, cache, prompt, 64, None, DecodeConfig()).tokens
    ok = True
    for cfg in (DecodeConfig(block_size=4), DecodeConfig(block_size=6, tree=True, tree_nodes=16)):
        ok &= generate(model, model.new_cache(256), prompt, 64, NgramDrafter(4, 1), cfg).tokens == ar
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ns", default="0,1,2,4,8,16,32,64")
    ap.add_argument("--tree", action="store_true", help="verify two-branch trees instead of chains")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    ok = exactness_check(args.device)
    model = build_random(get_config(args.model), device=device, dtype=DTYPES[args.dtype])
    ns = [int(x) for x in args.ns.split(",")]
    t = {n: time_forward(model, n, args.context, args.tree, args.reps) for n in ns}
    base = t[ns[0]]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for n in ns:
        print(f"N={n:3d}  {1e3 * t[n]:8.3f} ms  c={t[n] / base:5.2f}", file=sys.stderr)
    print(json.dumps({"bench": "engine_verify_cost", "model": args.model, "device": name, "dtype": args.dtype,
                      "context": args.context, "tree": args.tree, "t_ms": {n: round(1e3 * t[n], 4) for n in ns},
                      "c": {n: round(t[n] / base, 4) for n in ns}, "spec_equals_ar": ok}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
