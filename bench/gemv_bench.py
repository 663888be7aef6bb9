"""The norm + GEMV kernel (`specpilot.kernels.fused.norm_linear`, option ``fused_gemv``) against the
``fused_kernels`` launches it replaces, on SmolLM2's layer shapes, one CUDA GPU.

    python bench/gemv_bench.py                      # pick_gemv_config's tiles, M = 1, 5, 17
    python bench/gemv_bench.py --sweep --json OUT   # and every tile of the grid below

Per case (op x M), in bf16:
- baseline: what a ``fused_kernels`` step launches for the op: the add + RMSNorm kernel and cuBLAS's
  ``F.linear`` (qkv, gate/up), the SiLU·mul kernel after gate/up; o and down are cuBLAS alone;
- gemv: one `norm_linear` launch with `pick_gemv_config`'s tile (``--sweep``: each tile too).
Timing: a CUDA graph of 30 launches over 30 distinct weight copies (a step's 30 layers: their
weights do not stay in L2 between layers), replayed ``--reps`` times; microseconds per launch (so
the graph's launch gaps are counted, as in a decode-step replay). Outputs are checked against the
reference (within bf16 rounding of another reduction order).

Prints each case as it ends, then a table (per case: baseline, gemv, speedup, tile, best swept
tile; then the per-layer sums); the last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.kernels.fused import kernel, reference  # noqa: E402
from specpilot.kernels.fused.kernel import GemvConfig, pick_gemv_config  # noqa: E402

D, INNER, QKV = 576, 1536, 960  # SmolLM2-135M: hidden, MLP width, (9 + 2 * 3) heads x 64
LAYERS = 30
# op: (output columns N, K, norm before, SiLU·mul after)
OPS = {"qkv": (QKV, D, True, False), "o": (D, D, False, False), "gate_up": (INNER, D, True, True),
       "down": (D, INNER, False, False)}


def sweep_grid(m: int) -> list[GemvConfig]:
    """Tiles to time at ``m`` rows: multiply-adds in registers up to 8 rows, tl.dot from 5 rows."""
    bm = 1 << (m - 1).bit_length()
    out = []
    if m <= 8:
        for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (64, 128, 256, 512, 1024), (1, 2, 4), (1, 2)):
            per_thread = bm * bn * bk // (32 * warps)
            if 4 <= per_thread <= 64 and bk >= 32 * warps:
                out.append(GemvConfig(bm, bn, bk, warps, stages))
    if m >= 5:
        bm = min(64, max(16, bm))
        out += [GemvConfig(bm, bn, bk, warps, stages)
                for bn, bk, warps, stages in itertools.product((16, 32), (64, 128, 256), (4,), (2, 3))]
    return out


def _compile_worker(job: tuple[str, int, tuple]) -> str:
    """Compile one tile for one op (fills the shared Triton cache the timed process then reads)."""
    op, m, cfg = job
    n, k, norm, silu = OPS[op]
    try:
        h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((2 if silu else 1) * n, k, device="cuda", dtype=torch.bfloat16)
        kernel.norm_linear(h, h if norm else None, h[0] if norm else None, 1e-5, w, silu, GemvConfig(*cfg))
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is reported and skipped
        return f"{type(e).__name__}: {str(e)[:120]}"


def precompile(jobs: list[tuple[str, int, GemvConfig]], workers: int) -> None:
    import multiprocessing as mp

    t = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        res = pool.map(_compile_worker, [(op, m, (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages))
                                         for op, m, c in jobs], chunksize=4)
    print(f"# precompiled {len(jobs)} variants in {time.perf_counter() - t:.1f} s "
          f"({sum(r != 'ok' for r in res)} failed)", flush=True)


def graph_us(fn, reps: int) -> float:
    """Microseconds per call of ``fn(layer)`` for layer 0..29, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(LAYERS):  # warm-up (compiles, cuBLAS workspaces) outside the capture
            fn(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            fn(layer)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * LAYERS)


def case(op: str, m: int, sweep: bool, reps: int) -> dict:
    n, k, norm, silu = OPS[op]
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = [torch.randn((2 if silu else 1) * n, k, device=dev, generator=g).mul_(0.02).to(dt) for _ in range(LAYERS)]
    h = torch.randn(m, k, device=dev, generator=g).to(dt)
    delta = torch.randn(m, k, device=dev, generator=g).to(dt) if norm else None
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt) if norm else None

    def baseline(layer):
        x = kernel.add_rms_norm(h, delta, nw, 1e-5)[0] if norm else h
        y = F.linear(x, weights[layer])
        return kernel.silu_mul(y) if silu else y

    def gemv(cfg):
        return lambda layer: kernel.norm_linear(h, delta, nw, 1e-5, weights[layer], silu, cfg)[0]

    ref = reference.norm_linear(h, delta, nw, 1e-5, weights[3], silu)[0].float()
    picked = pick_gemv_config(m, n, k, silu)
    got = gemv(picked)(3).float()
    err = float((got - ref).abs().max())
    out = {"op": op, "m": m, "n": n, "k": k, "baseline_us": graph_us(baseline, reps),
           "gemv_us": graph_us(gemv(picked), reps), "config": picked.name, "max_abs_err": err,
           "close": bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2))}
    if sweep:
        timed = []
        for cfg in sweep_grid(m):
            try:
                timed.append((graph_us(gemv(cfg), reps), cfg.name))
            except Exception as e:  # a tile the compiler refuses (registers, shared memory): skipped
                timed.append((float("inf"), f"{cfg.name}: {type(e).__name__}"))
        timed.sort()
        out["swept"] = [{"us": round(t, 2), "config": c} for t, c in timed[:8]]
        out["best_us"], out["best_config"] = timed[0]
    return out


def table(rows: list[dict], layers: dict[int, dict], device: str) -> None:
    """The cases and the per-layer sums (a layer = the four ops) as a rich table."""
    from rich.console import Console
    from rich.table import Table

    sweep = any("best_us" in r for r in rows)
    t = Table(title=f"norm + GEMV vs the fused_kernels launches, microseconds a launch, {device}")
    for c in ("op", "M", "baseline", "gemv", "speedup", "tile") + (("best", "best tile") if sweep else ()):
        t.add_column(c, justify="left" if "tile" in c or c == "op" else "right")
    for r in rows:
        t.add_row(r["op"], str(r["m"]), f"{r['baseline_us']:.2f}", f"{r['gemv_us']:.2f}",
                  f"{r['baseline_us'] / r['gemv_us']:.2f}x" + ("" if r["close"] else " MISMATCH"), r["config"],
                  *((f"{r['best_us']:.2f}", r["best_config"]) if sweep else ()))
    for m, sums in layers.items():
        t.add_row("a layer", str(m), f"{sums['baseline_us']:.2f}", f"{sums['gemv_us']:.2f}",
                  f"{sums['baseline_us'] / sums['gemv_us']:.2f}x", "", *((f"{sums['best_us']:.2f}", "") if sweep else ()),
                  style="bold")
    Console(width=150).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,5,17", help="rows per launch (1: AR; 5: a chain of 4; 17: a 16-node tree)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sweep", action="store_true", help="time every tile of sweep_grid too")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workers", type=int, default=12, help="processes compiling the sweep's tiles first")
    ap.add_argument("--json", type=Path, default=None, help="write every case (and the sweep) here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    ms, ops = [int(m) for m in args.ms.split(",")], args.ops.split(",")
    if args.sweep and args.workers > 1:
        precompile([(op, m, c) for m in ms for op in ops for c in sweep_grid(m)], args.workers)
    rows = []
    for m in ms:
        for op in ops:
            rows.append(case(op, m, args.sweep, args.reps))
            r = rows[-1]
            print(f"{op:8s} M={m:<3d} baseline {r['baseline_us']:6.2f} us  gemv {r['gemv_us']:6.2f} us ({r['config']})"
                  + (f"  best {r['best_us']:6.2f} ({r['best_config']})" if args.sweep else "")
                  + ("" if r["close"] else f"  MISMATCH {r['max_abs_err']:.3g}"), flush=True)
    layers = {}
    for m in sorted({r["m"] for r in rows}):
        mine = [r for r in rows if r["m"] == m]
        layers[m] = {k: round(sum(r[k] for r in mine), 2) for k in ("baseline_us", "gemv_us")
                     + (("best_us",) if args.sweep else ())}
    table(rows, layers, torch.cuda.get_device_name())
    summary = {"bench": "gemv", "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "per_layer_us": layers, "all_close": all(r["close"] for r in rows), "seconds": round(time.time() - t0, 1),
               "cases": [{k: v for k, v in r.items() if k != "swept"} for r in rows]}
    if args.json:
        args.json.write_text(json.dumps({**summary, "cases": rows}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
