"""The AVX2 weight-streaming GEMM (`specpilot.kernels.cpu_gemm.packed_linear`, option ``linear_backend =
"stream"``) against PyTorch's CPU ``F.linear`` on SmolLM2's linear shapes, at M = 1-10 rows.

    python bench/cpu_gemm_bench.py                 # fp32 and bf16 weights, M = 1, 2, 4, 8, 10
    python bench/cpu_gemm_bench.py --threads 2 --rows 1,8 --dtypes bf16
    python bench/cpu_gemm_bench.py --rows 1,8,16,17,32 --dtypes bf16,bf16-amx   # AMX CPUs

``bf16-amx``: bf16 weights on the kernel's AMX path (`pack_amx`, `packed_linear_amx`; what
`StreamLinear` packs bf16 for where `cpu_has_amx`), ``bf16`` always on its FMA code.

Per (shape, dtype, M): median milliseconds of one call over ``--copies`` distinct weight copies
(rotated, so the weights come from DRAM as in a forward, not from cache), and the weight bytes
read per second; beside them a device copy's bandwidth (``a.copy_(b)``, read + write). Each
result is checked against ``F.linear`` in fp64. Prints a table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.kernels.cpu_gemm import (  # noqa: E402
    cpu_has_amx,
    cpu_supported,
    pack,
    pack_amx,
    packed_linear,
    packed_linear_amx,
)

# SmolLM2-135M: the LM head (tied), gate/up, down, q/o, k/v.
SHAPES = {"lm_head": (49152, 576), "gate_up": (1536, 576), "down": (576, 1536), "q_o": (576, 576), "k_v": (192, 576)}
# name: (weight dtype, pack, packed linear)
DTYPES = {"fp32": (torch.float32, pack, packed_linear), "bf16": (torch.bfloat16, pack, packed_linear),
          "bf16-amx": (torch.bfloat16, pack_amx, packed_linear_amx)}


def _median_ms(fn, weights, x, reps: int) -> float:
    fn(x, weights[0])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append((time.perf_counter() - t0) / len(weights))
    return 1e3 * statistics.median(times)


def copy_gbps(reps: int = 5) -> float:
    a = torch.randn(64 * 2**20)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,10", help="comma-separated M values")
    ap.add_argument("--dtypes", default="fp32,bf16", help="weight dtypes (paths): fp32, bf16, bf16-amx")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--copies", type=int, default=0, help="weight copies rotated (0: enough for ~200 MB)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    ok, why = cpu_supported()
    if not ok:
        print(f"error: the kernel cannot run here: {why}", file=sys.stderr)
        return 2
    if "bf16-amx" in args.dtypes.split(",") and not cpu_has_amx():
        print("error: bf16-amx needs a CPU with AMX-BF16 (amx_tile, amx_bf16) and Linux's permission",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    rows_list = [int(m) for m in args.rows.split(",")]
    results = []
    copy = copy_gbps()
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        for dname in args.dtypes.split(","):
            dtype, pack_fn, linear_fn = DTYPES[dname]
            copies = args.copies or max(2, 200_000_000 // (n * k * dtype.itemsize))
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            packed = [pack_fn(w) for w in weights]  # once, as a model does at load
            nbytes = n * k * dtype.itemsize
            for m in rows_list:
                x = torch.randn(m, k, dtype=dtype)
                exact = x.double() @ weights[0].double().T
                err = (linear_fn(x, packed[0], n).double() - exact).abs().max().item()
                scale = exact.abs().max().item()
                ours = _median_ms(lambda x, p, n=n, f=linear_fn: f(x, p, n), packed, x, args.reps)
                torch_ms = _median_ms(F.linear, weights, x, args.reps)
                results.append({"shape": shape_name, "n": n, "k": k, "dtype": dname, "rows": m, "stream_ms": ours,
                                "torch_ms": torch_ms, "stream_gbps": nbytes / ours / 1e6, "torch_gbps": nbytes / torch_ms / 1e6,
                                "speedup": torch_ms / ours, "max_rel_err": err / scale})
                console.print(f"{shape_name} {dname} M={m}: stream {ours:.3f} ms, torch {torch_ms:.3f} ms")
    table = Table(title=f"packed_linear vs F.linear, {args.threads} threads, copy {copy:.1f} GB/s (read + write)")
    for col in ("shape", "dtype", "M", "stream ms", "GB/s", "torch ms", "GB/s ", "speedup"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["shape"], r["dtype"], str(r["rows"]), f"{r['stream_ms']:.3f}", f"{r['stream_gbps']:.1f}",
                      f"{r['torch_ms']:.3f}", f"{r['torch_gbps']:.1f}", f"{r['speedup']:.2f}x")
    Console().print(table)
    print(json.dumps({"bench": "cpu_gemm", "threads": args.threads, "copy_gbps": copy, "date": time.strftime("%Y-%m-%d"),
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
