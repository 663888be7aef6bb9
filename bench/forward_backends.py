"""Whole SmolLM2 forwards by CPU linear backend: a prefill, and blocks of T tokens after a cached
context, each backend timed in turn within one process (interleaved repetitions), so a drifting
machine moves every row alike.

    python bench/forward_backends.py                               # bf16: onednn_all, stream
    python bench/forward_backends.py --dtype fp32 --backends default,onednn_all,stream,stream-avx2

A backend is a ``linear_backend`` value; ``stream-fma`` is ``stream`` with bf16 weights packed for the
kernel's FMA code instead of its AMX tiles (`specpilot.kernels.cpu_gemm.use_amx`), ``stream-avx2`` that with its AVX-512
code turned off (`specpilot.kernels.cpu_gemm.use_avx512`). Per backend and work: min and median milliseconds
over ``--reps`` interleaved repetitions after an untimed one (a block's time is the best of 5 calls
within a repetition).
Prints a table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.harness.deployment import load_engine  # noqa: E402
from specpilot.kernels import cpu_gemm  # noqa: E402


def _time_forward(model, cache, tokens: torch.Tensor, start: int, calls: int) -> float:
    positions = torch.arange(start, start + tokens.shape[1])
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        model(tokens, positions, cache, start, last_only=start == 0)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


@torch.no_grad()
def measure(model, cache, works: list[str], prompt_tokens: int, context: int) -> dict[str, float]:
    """ms of each work: "prefill" (``prompt_tokens`` from an empty cache) or "T" (T new tokens after
    ``context`` cached ones)."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    out = {}
    for work in works:
        if work == "prefill":
            out[work] = _time_forward(model, cache, torch.randint(0, vocab, (1, prompt_tokens), generator=gen), 0, 1)
        else:
            model(torch.randint(0, vocab, (1, context), generator=gen), torch.arange(context), cache, 0, last_only=True)
            out[work] = _time_forward(model, cache, torch.randint(0, vocab, (1, int(work)), generator=gen), context, 5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default="smollm2-cpu")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--backends", default="onednn_all,stream",
                    help="comma-separated: default, onednn, onednn_all, stream, stream-fma, stream-avx2")
    ap.add_argument("--tokens", default="1,8,17", help="block sizes T after the cached context")
    ap.add_argument("--prompt", type=int, default=115, help="prefill tokens (0: no prefill)")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before a block")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(b.startswith("stream") for b in backends) and not cpu_gemm.available():
        print(f"error: linear_backend=stream cannot run here: {cpu_gemm.cpu_supported()[1]}", file=sys.stderr)
        return 2
    works = (["prefill"] if args.prompt else []) + [t.strip() for t in args.tokens.split(",") if t.strip()]
    models, caches = {}, {}
    for name in backends:
        option = "stream" if name.startswith("stream") else name
        if option == "stream":
            cpu_gemm.use_amx(name == "stream")  # read at packing: stream-fma / -avx2 pack for FMAs
        with console.status(f"loading {args.deployment} with linear_backend={option}"):
            model = load_engine(args.deployment, {"linear_backend": option, "drafter": "none",
                                                  "dtype": args.dtype}).model
        models[name] = model
        caches[name] = model.new_cache(max(args.prompt, args.context + max(int(w) for w in works if w != "prefill")))
    cpu_gemm.use_amx(True)
    times: dict[str, dict[str, list[float]]] = {b: {w: [] for w in works} for b in backends}
    for rep in range(-1, args.reps):  # repetition -1 warms up (first calls plan and allocate), untimed
        for name, model in models.items():
            if name.startswith("stream"):
                cpu_gemm.use_avx512(name != "stream-avx2")
            for work, ms in measure(model, caches[name], works, args.prompt, args.context).items():
                if rep >= 0:
                    times[name][work].append(ms)
        console.print(f"repetition {rep + 1}/{args.reps} done" if rep >= 0 else "warmed up")
    if "stream-avx2" in models:
        cpu_gemm.use_avx512(True)
    table = Table(title=f"{args.deployment} {args.dtype} forwards, {args.threads} threads, ms (min / median of "
                        f"{args.reps}); prefill {args.prompt} tokens, blocks after {args.context} cached")
    table.add_column("backend")
    for work in works:
        table.add_column(work if work == "prefill" else f"T = {work}", justify="right")
    rows = []
    for name in backends:
        cells = {w: {"min_ms": min(v), "median_ms": statistics.median(v)} for w, v in times[name].items()}
        rows.append({"backend": name, **cells})
        table.add_row(name, *(f"{c['min_ms']:.1f} / {c['median_ms']:.1f}" for c in cells.values()))
    Console().print(table)
    print(json.dumps({"bench": "forward_backends", "deployment": args.deployment, "dtype": args.dtype,
                      "threads": args.threads, "prompt": args.prompt, "context": args.context,
                      "avx512": cpu_gemm.cpu_has_avx512(), "amx_bf16": "amx_bf16" in cpu_gemm.cpu_flags(),
                      "amx": cpu_gemm.cpu_has_amx(),
                      "date": time.strftime("%Y-%m-%d"), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
