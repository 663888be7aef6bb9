"""Benchmark: W12 GEMV/GEMM vs torch BF16 matmul on Llama-8B layer shapes (one CUDA GPU).

For each shape ``N x K`` and batch ``M``, both formats cycle through enough weight copies
(>= ``--min-bytes`` per format) that the weights never sit in L2, inside one CUDA graph of many
calls; time per call = graph replay time / calls (median of ``--reps`` replays). Bandwidth =
bytes of the weights read per call / time. Prints a table, one JSON line per result and a final
summary JSON line (geometric-mean speedup over torch at M = 1..16, the minimum).

``--sweep`` first times a grid of launch configurations (the tensor-core kernel's with its split-K
factors; the Triton ones compiled in parallel worker processes) at M in {1, 2, 4, 8, 16} and reports
the best per shape, the input for
``pick_config``'s table (kinds ``fma``, ``dot``: Triton) or ``pick_mma_config``'s (kind ``mma``: the
CUDA C++ tensor-core kernel); the final table then uses the best swept configuration at those M
(column ``cfg``, marked ``*``). Without a sweep each case runs as ``w12_matmul`` dispatches it (its
tensor-core mode, `use_tensor_core_kernel`); the Triton kernel's own time is a column too.

    PYTHONPATH=. python bench/w12_bench.py [--sweep] [--kinds mma] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.kernels.w12 import cuda_mma  # noqa: E402
from specpilot.kernels.w12.cuda_mma import MmaConfig  # noqa: E402
from specpilot.kernels.w12.format import W12Weight, pack  # noqa: E402
from specpilot.kernels.w12.kernel import (  # noqa: E402
    TUNED_ENV,
    Config,
    launch_from_fields,
    merge_tuned,
    pick_config,
    tensor_core_config,
    tuned_from_json,
    tuned_to_json,
    w12_matmul,
)

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
MS = [1, 2, 4, 8, 16, 32, 64]
SWEEP_MS = [1, 2, 4, 8, 16]


# The tl.dot path at every M (rows past M are masked): wide tiles (BN up to 256) reuse each warp's x
# operand over more weight rows (2.4 instructions a weight at BN = 256, BJ = 32, against 3.9 at
# 32 x 256: sm_90 SASS of Triton 3.9 here). (They were swept with split-K, which left the package on
# 2026-12-07: kernel.REMOVED_SPLIT_K.)
# Nsight Compute on 2026-12-01 (README.md): the 11-29 winner 32 x 256 at 3 stages stages 82 KB of
# shared memory a program, so 2 programs (8 warps) fit an SM; DRAM ran at 58% of peak with 0.43
# eligible warps a scheduler. Hence tiles with 1-2 stages (planes loaded straight to registers, or
# one buffer ahead) and 8 warps, for more loads in flight. (bn, bj, stages, warps).
DOT_TILES = ((32, 256, 3, 4), (64, 128, 3, 4), (128, 64, 3, 4), (128, 64, 4, 4), (256, 32, 3, 4), (256, 32, 4, 4),
             (128, 32, 4, 4), (32, 128, 1, 4), (32, 256, 1, 4), (32, 128, 2, 4), (32, 256, 2, 4), (64, 128, 2, 8),
             (64, 256, 1, 8), (128, 128, 2, 8))
KINDS = ("fma", "dot", "mma")
# Kinds of earlier sweeps whose launches left the package on 2026-12-07 (cuda_mma.REMOVED_LAUNCHES re-adds them):
# tma (the TMA launch, Hopper), tmap (the same on a persistent grid)
REMOVED_KINDS = ("tma", "tmap")
# The tensor-core kernel's grid: (64-column chunks a step, warps a block), one 16-row tile a warp; splits below.
# Launches without the pipeline lost every case on the H100 (2026-12-05), and two tiles a warp every case of
# session 39: both left the package on 2026-12-07 (cuda_mma.REMOVED_LAUNCHES). (The shared-memory ring lost too:
# docs/results/w12-kernel/h100-2026-12-05-ring.patch.)
MMA_TILES = tuple(itertools.product((1, 2, 4), (2, 4, 8)))


def sweep_configs(m: int, kinds: tuple[str, ...] = KINDS) -> list[Config | MmaConfig]:
    """Candidates for batch ``m`` of the given kinds: the tl.dot path (``dot``), the CUDA C++ tensor-core
    launches (``mma``) and the CUDA-core path (``fma``, M <= 8)."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    out = []
    if "dot" in kinds:
        out += [Config(bm=bm, bn=bn, bj=bj, use_dot=True, num_warps=w, num_stages=st)
                for bn, bj, st, w in DOT_TILES]
    if "mma" in kinds and m <= cuda_mma.MAX_ROWS:
        out += [cfg for c, w in MMA_TILES if (cfg := MmaConfig(chunks=c, warps=w)).fits(m)]
    if "fma" in kinds and m <= 8:
        fbm = 1 << (m - 1).bit_length()
        for warps, bj, bn in itertools.product((1, 2, 4), (256, 512, 1024), (2, 4, 8)):
            words = bn * bj // (128 * warps)  # int32 words per thread and plane
            # x's words at >= 2 a thread (else a layout conversion every step); fewer registers at BM >= 4
            if bj >= 256 * warps and 4 <= words <= (16 if fbm <= 2 else 8):
                out.append(Config(bm=fbm, bn=bn, bj=bj, use_dot=False, num_warps=warps, num_stages=1))
    return out


def splits_for(cfg: Config | MmaConfig, n: int, k: int) -> list[int]:
    """Split-K factors worth timing for a tensor-core launch: each split keeps >= 2 steps, and the grid <= 16
    blocks an SM; [1] for a Triton tile (its kernels have no split-K)."""
    kh = 16 * ((k + 31) // 32)
    if isinstance(cfg, MmaConfig):
        tiles, steps = -(-n // (16 * cfg.warps)), kh // (64 * cfg.chunks)
        return [s for s in (1, 2, 4, 8, 16) if s == 1 or (steps >= 2 * s and tiles * s <= 16 * 132)]
    return [1]


def _compile_worker(job: tuple[int, dict]) -> str:
    """Compile one configuration for one M class (warms the shared Triton cache)."""
    m, cfg_d = job
    cfg = Config(**cfg_d)
    try:
        n, k = 256, 4096
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        p = pack(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w12_matmul(x, p, cfg)
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - report and skip configurations that do not compile
        return f"{type(e).__name__}: {str(e)[:200]}"


def precompile(jobs: list[tuple[int, Config]], workers: int) -> dict[tuple[int, str], str]:
    import multiprocessing as mp

    t = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        res = pool.map(_compile_worker, [(m, asdict(c)) for m, c in jobs], chunksize=1)
    print(f"# precompiled {len(jobs)} variants in {time.perf_counter() - t:.1f} s "
          f"({sum(r != 'ok' for r in res)} failed)", flush=True)
    return {(m, c.key()): r for (m, c), r in zip(jobs, res, strict=True)}


def time_per_call(fns: list, min_us: float, est_us: float, reps: int) -> float:
    """Microseconds per call: CUDA graph of calls cycling through ``fns``; median of replays."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    calls = max(len(fns), math.ceil(min_us / max(est_us, 1.0)))
    calls = len(fns) * math.ceil(calls / len(fns))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = time_per_call([lambda: b.copy_(a)], 20_000, 500, 5)
    return 2 * a.numel() / us / 1e6


class ShapeBench:
    def __init__(self, n: int, k: int, min_bytes: float, seed: int = 0):
        self.n, self.k = n, k
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        p = pack(w)
        self.copies = max(2, min(64, math.ceil(min_bytes / (2 * n * k))))
        self.w = [w] + [w.clone() for _ in range(self.copies - 1)]
        self.p = [p] + [W12Weight(n=n, k=k, **{f: t.clone() for f, t in p.tensors().items()})
                        for _ in range(self.copies - 1)]
        self.bf16_bytes = 2 * n * k
        self.w12_bytes = p.nbytes
        self.escapes = p.escapes

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)

    def torch_us(self, x: torch.Tensor, reps: int) -> float:
        fns = [lambda w=w: torch.nn.functional.linear(x, w) for w in self.w]
        return time_per_call(fns, 3000, self.bf16_bytes / 3e6, reps)

    def w12_us(self, x: torch.Tensor, cfg: Config | None, reps: int, min_us: float = 3000) -> float:
        fns = [lambda p=p: w12_matmul(x, p, cfg) for p in self.p]
        return time_per_call(fns, min_us, self.w12_bytes / 3e6, reps)

    def check(self, x: torch.Tensor, cfg: Config | None) -> float:
        y = w12_matmul(x, self.p[0], cfg).double()
        ref = x.double() @ self.w[0].double().T
        return float((y - ref).norm() / ref.norm())


def default_config(m: int, n: int, k: int) -> Config | MmaConfig:
    """The configuration ``w12_matmul`` uses without one (bf16 ``x``): its tensor-core mode's choice."""
    if m <= cuda_mma.MAX_ROWS and k % 8 == 0:
        if (mma := tensor_core_config(m, n, k, torch.device("cuda", torch.cuda.current_device()))) is not None:
            return mma
    return pick_config(m, n, k, torch.cuda.get_device_name())


def run_sweep(shapes, reps: int, min_bytes: float, workers: int, out, kinds: tuple[str, ...] = KINDS,
              sweep_ms: list[int] = SWEEP_MS) -> dict:
    """Time every swept configuration (and split) per shape and M class, and ``pick_config``'s own;
    return the best."""
    def candidates(m: int, n: int, k: int) -> list[Config | MmaConfig]:
        cfgs = sweep_configs(m, kinds)
        own = pick_config(m, n, k, torch.cuda.get_device_name())
        return cfgs if own in cfgs or not {"fma", "dot"} & set(kinds) else [own, *cfgs]

    jobs = list({(m, c.key()): (m, c) for n, k in shapes for m in sweep_ms for c in candidates(m, n, k)
                 if isinstance(c, Config)}.values())
    status = precompile(jobs, workers) if jobs else {}
    status.update({(m, c.key()): "ok" for n, k in shapes for m in sweep_ms for c in candidates(m, n, k)
                   if isinstance(c, MmaConfig)})
    best: dict[tuple[int, int, int], tuple[float, Config]] = {}
    for n, k in shapes:
        sb = ShapeBench(n, k, min_bytes)
        for m in sweep_ms:
            x = sb.x(m)
            rows = []
            for cfg in candidates(m, n, k):
                if status.get((m, cfg.key())) != "ok":
                    continue
                for s in splits_for(cfg, n, k):
                    c = replace(cfg, splits=s) if isinstance(cfg, MmaConfig) else cfg
                    try:
                        us = sb.w12_us(x, c, reps, min_us=1500)
                    except Exception as e:  # noqa: BLE001
                        print(f"# {c.key()} failed: {e}", flush=True)
                        continue
                    rows.append((us, c))
            rows.sort(key=lambda r: r[0])
            if rows:
                best[(n, k, m)] = rows[0]
                err = sb.check(x, rows[0][1])
                rec = {"bench": "w12_sweep", "shape": [n, k], "m": m, "best_us": round(rows[0][0], 2),
                       "best": asdict(rows[0][1]), "rel_err": err,
                       "top5": [[round(u, 2), c.key()] for u, c in rows[:5]],
                       "all": {c.key(): round(u, 2) for u, c in rows},
                       "default_us": round(next((u for u, c in rows if c == default_config(m, n, k)), float("nan")), 2),
                       "default": default_config(m, n, k).key(),
                       "tried": len(rows)}
                print(json.dumps(rec), flush=True)
                if out:
                    out.write(json.dumps(rec) + "\n")
        del sb
        torch.cuda.empty_cache()
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-bytes", type=float, default=1e9, help="weight bytes per format to cycle through")
    ap.add_argument("--sweep", action="store_true", help="time a grid of configurations first")
    ap.add_argument("--kinds", default=",".join(KINDS), help="kernel kinds the sweep tries (pick_config's own "
                    "choice is always timed too): fma, dot (Triton), mma (CUDA C++ tensor cores). The TMA launch "
                    f"(kinds tma, tmap) left the package: {cuda_mma.REMOVED_LAUNCHES} re-adds it")
    ap.add_argument("--sweep-m", default=",".join(map(str, SWEEP_MS)), help="batch sizes the sweep covers")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    ap.add_argument("--write-tuned", default=None, metavar="FILE",
                    help="write the table's launches that beat the Triton kernels' own choice (tensor-core launches "
                         f"and swept Triton tiles) as a tuned table (JSON; `{TUNED_ENV}=FILE` makes w12_matmul's "
                         "dispatch use them)")
    ap.add_argument("--base-tuned", default=None, metavar="FILE",
                    help=f"a previous sweep's tuned table: the dispatch uses it (as `{TUNED_ENV}=FILE` would), and "
                         "--write-tuned writes it back with the entries of the swept shapes and M classes replaced "
                         "by this sweep's")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "w12_summary", "error": "no CUDA device"}))
        return 1
    import triton

    base = None
    if args.base_tuned:
        try:
            base = tuned_from_json(json.loads(Path(args.base_tuned).read_text()))
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            ap.error(f"--base-tuned {args.base_tuned}: {e}")
        merge_tuned(base)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    out = open(args.out, "a") if args.out else None  # noqa: SIM115
    dev = torch.cuda.get_device_properties(0)
    env = {"bench": "w12_env", "device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "copy_tb_s": round(copy_bandwidth(), 3)}
    print(json.dumps(env), flush=True)
    if out:
        out.write(json.dumps(env) + "\n")
    if not cuda_mma.available():
        print(f"# tensor-core kernel unavailable: {cuda_mma.cuda_ready()[1] or 'its build failed'}", flush=True)
    kinds = tuple(args.kinds.split(","))
    if removed := set(kinds) & set(REMOVED_KINDS):
        ap.error(f"--kinds: {', '.join(sorted(removed))}: the TMA launch left the package ({cuda_mma.REMOVED_LAUNCHES} "
                 "re-adds it)")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    sweep_ms = [int(v) for v in args.sweep_m.split(",")]
    best = run_sweep(shapes, 3, args.min_bytes, args.workers, out, kinds, sweep_ms) if args.sweep else {}

    results = []
    for n, k in shapes:
        sb = ShapeBench(n, k, args.min_bytes)
        for m in ms:
            x = sb.x(m)
            tuned = best.get((n, k, m))  # swept at this very M, or none: pick_config's choice
            cfg = tuned[1] if tuned is not None else None
            t_torch = sb.torch_us(x, args.reps)
            t_w12 = sb.w12_us(x, cfg, args.reps)
            triton_cfg = pick_config(m, n, k, dev.name)
            t_triton = t_w12 if cfg is None and default_config(m, n, k) == triton_cfg else sb.w12_us(x, triton_cfg, args.reps)
            used = cfg or default_config(m, n, k)
            rec = {"bench": "w12_gemv", "device": dev.name, "shape": [n, k], "m": m, "us": round(t_w12, 2),
                   "tb_s": round(sb.w12_bytes / t_w12 / 1e6, 3), "torch_us": round(t_torch, 2),
                   "torch_tb_s": round(sb.bf16_bytes / t_torch / 1e6, 3), "vs_torch": round(t_torch / t_w12, 3),
                   "triton_us": round(t_triton, 2), "triton_vs_torch": round(t_torch / t_triton, 3),
                   "config": used.key(), "launch": asdict(used),
                   "tuned": tuned is not None, "copies": sb.copies,
                   "escapes": sb.escapes, "rel_err": sb.check(x, cfg)}
            results.append(rec)
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
        del sb
        torch.cuda.empty_cache()

    _table(results, env)
    if args.write_tuned:
        won = winners(results, dev.name)
        if base is not None:
            won = rebase(base.get(dev.name, {}), won, {(n, k, cuda_mma.m_class(m)) for n, k in shapes
                                                       for m in (sweep_ms if args.sweep else ms)})
        Path(args.write_tuned).write_text(json.dumps(tuned_to_json({dev.name: won}), indent=1))
        print(f"# {sum(map(len, won.values()))} launches beat the Triton kernels' own choice: {args.write_tuned}",
              flush=True)
    small = [r["vs_torch"] for r in results if r["m"] <= 16]
    summary = {"bench": "w12_summary", "device": dev.name, "date": time.strftime("%Y-%m-%d"),
               "geomean_speedup_m1_16": round(math.exp(statistics.mean(math.log(v) for v in small)), 3) if small else None,
               "min_speedup_m1_16": min(small) if small else None,
               "min_case": min((r for r in results if r["m"] <= 16), key=lambda r: r["vs_torch"], default={}).get("shape"),
               "triton_geomean_m1_16": round(math.exp(statistics.mean(math.log(r["triton_vs_torch"]) for r in results
                                                                      if r["m"] <= 16)), 3) if small else None,
               # each case on the faster kernel: what the "auto" dispatch gives once its table holds these winners
               "best_of_both_geomean_m1_16": round(math.exp(statistics.mean(
                   math.log(max(r["vs_torch"], r["triton_vs_torch"])) for r in results if r["m"] <= 16)), 3)
               if small else None,
               "best_of_both_min_m1_16": min((max(r["vs_torch"], r["triton_vs_torch"]) for r in results if r["m"] <= 16),
                                             default=None),
               "tensor_core_kernel": cuda_mma.available(),
               "geomean_speedup_all": round(math.exp(statistics.mean(math.log(r["vs_torch"]) for r in results)), 3),
               "max_rel_err": max(r["rel_err"] for r in results), "copy_tb_s": env["copy_tb_s"],
               "swept": bool(best)}
    if out:
        out.write(json.dumps(summary) + "\n")
        out.close()
    print(json.dumps(summary), flush=True)
    return 0


def winners(results: list[dict], card: str) -> dict[tuple[int, int], dict[int, Config | MmaConfig]]:
    """The launches of ``results`` (w12_gemv records) faster than the Triton kernels' own choice on ``card``, by
    shape and M class: one card's part of a tuned table (`kernel.tuned_to_json`), tensor-core launches and
    swept Triton tiles alike."""
    out: dict[tuple[int, int], dict[int, Config | MmaConfig]] = {}
    for r in results:
        cfg = launch_from_fields(r["launch"])
        if r["us"] < r["triton_us"] and cfg != pick_config(r["m"], *r["shape"], card):
            out.setdefault(tuple(r["shape"]), {})[cuda_mma.m_class(r["m"])] = cfg
    return out


def rebase(base: dict, won: dict, covered: set[tuple[int, int, int]]) -> dict:
    """``base`` (one card's tuned entries) with this run's ``won`` on top: a covered ``(n, k, M class)`` without a
    winner keeps only a Triton entry of ``base`` (the run's Triton choice was that entry, and it won), never a
    tensor-core one (the run timed it against that choice and it lost)."""
    out = {shape: dict(by_m) for shape, by_m in base.items()}
    for (n, k, mc) in covered:
        if isinstance(out.get((n, k), {}).get(mc), MmaConfig):
            del out[(n, k)][mc]
    for shape, by_m in won.items():
        out.setdefault(shape, {}).update(by_m)
    return {shape: by_m for shape, by_m in out.items() if by_m}


def _table(results: list[dict], env: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"W12 vs torch bf16 on {env['device']} (copy {env['copy_tb_s']} TB/s)")
    for c in ("N x K", "M", "w12 us", "w12 TB/s", "torch us", "torch TB/s", "speedup", "triton us", "triton x", "cfg"):
        t.add_column(c, justify="right")
    for r in results:
        t.add_row("x".join(map(str, r["shape"])), str(r["m"]), f"{r['us']:.1f}", f"{r['tb_s']:.2f}",
                  f"{r['torch_us']:.1f}", f"{r['torch_tb_s']:.2f}", f"{r['vs_torch']:.2f}",
                  f"{r['triton_us']:.1f}", f"{r['triton_vs_torch']:.2f}",
                  r["config"] + ("*" if r["tuned"] else ""))
    Console(width=160).print(t)


if __name__ == "__main__":
    raise SystemExit(main())
