"""The certified exact-argmax LM head against the full head: milliseconds per call and candidate columns.

Real hidden states (SmolLM2's final norm over a prompt, or any deployment's target), the head of each
``linear_backend`` with and without `specpilot.engine.screened_head.ScreenedHead`, calls of 1, 3 and 5
rows alternating full and screened (so each call meets the other's cache footprint, as in a forward);
median of ``--reps``. Checks that the argmax is the full head's on every call. Prints a table; the last
line is JSON.

    python bench/screened_head_bench.py [--deployment smollm2-cpu] [--threads 2] [--reps 15] [--no-amx]
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

from specpilot.engine.screened_head import ScreenedHead  # noqa: E402
from specpilot.harness.deployment import load_engine  # noqa: E402
from specpilot.kernels import cpu_gemm  # noqa: E402

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="smollm2-cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,3,5")
    ap.add_argument("--no-amx", action="store_true", help="screen on the FMA path (as on CPUs without AMX-BF16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.no_amx:
        cpu_gemm.use_amx(False)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for backend in ("default", "stream"):
        engine = load_engine(args.deployment, {"linear_backend": backend, "drafter": "none"})
        model, head = engine.model, engine.model.lm_head
        screened = ScreenedHead(head)
        ids = engine.tokenize(PROMPT, chat=True)
        with torch.no_grad():
            _, hidden = model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids) + 1), 0)
            hidden = hidden[0]
            for rows in rows_list:
                full_ms, screened_ms, cands, same = [], [], [], True
                for rep in range(args.reps + 1):
                    h = hidden[rep % (len(ids) - rows):][:rows]
                    t0 = time.perf_counter()
                    full = head(h)
                    t1 = time.perf_counter()
                    out = screened(h)
                    t2 = time.perf_counter()
                    if rep:  # the first call of each is a warm-up
                        full_ms.append(1e3 * (t1 - t0))
                        screened_ms.append(1e3 * (t2 - t1))
                    cands.append(screened.candidates[-1] if screened.candidates else -1)
                    same &= torch.equal(full.argmax(-1), out.argmax(-1))
                results.append({"backend": backend, "rows": rows, "full_ms": statistics.median(full_ms),
                                "screened_ms": statistics.median(screened_ms), "max_candidates": max(cands),
                                "argmax_same": same, "amx": screened.amx, "bit_exact": screened.bit_exact})
    table = Table(title=f"LM head of {args.deployment}, {args.threads} threads, median of {args.reps} "
                        f"(AMX screen: {cpu_gemm.use_amx()})")
    for col in ("backend", "rows", "full ms", "screened ms", "speedup", "candidates (max)", "argmax same"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["backend"], str(r["rows"]), f"{r['full_ms']:.2f}", f"{r['screened_ms']:.2f}",
                      f"{r['full_ms'] / r['screened_ms']:.2f}x", str(r["max_candidates"]), str(r["argmax_same"]))
    Console().print(table)
    print(json.dumps({"deployment": args.deployment, "threads": args.threads, "results": results}))
    return 0 if all(r["argmax_same"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
