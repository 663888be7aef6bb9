"""Profile W12 launches with Nsight Compute: what bounds a configuration (one CUDA GPU).

Runs ``--calls`` calls of each listed case on weights cycled so they do not sit in L2 (as
``w12_bench.py`` does), outside graphs, so ``ncu`` sees ordinary launches. A case is
``NxK:M`` with an optional configuration key (``Config.key()``, or ``MmaConfig.key()`` for the
CUDA C++ tensor-core kernel, e.g. ``mma_r1_c4_w4_s1_pipe``; the keys of its removed launch kinds, ``tma_...``,
``mma_r2_...`` and ``mma_...`` without ``_pipe``, need ``cuda_mma.REMOVED_LAUNCHES`` applied first); without one
``pick_config``'s choice runs. Torch's bf16 ``linear`` on the same shape runs after each case (``--torch``).

    ncu --clock-control none --launch-skip 4 --launch-count 1 -k regex:w12 --section SpeedOfLight \
        python bench/w12_profile.py 28672x4096:8 28672x4096:1

``ncu`` is optional: without it the script prints the per-call time of each case (CUDA events).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.w12_bench import ShapeBench  # noqa: E402
from specpilot.kernels.w12.cuda_mma import REMOVED_LAUNCHES, MmaConfig  # noqa: E402
from specpilot.kernels.w12.kernel import Config, pick_config, w12_matmul  # noqa: E402

# a Triton launch's key: always "_s1" (one K split; its kernels have no split-K)
KEY = re.compile(r"(dot|fma)_bm(\d+)_bn(\d+)_bj(\d+)_s1_w(\d+)_st(\d+)")
MMA_KEY = re.compile(r"mma_r1_c(\d+)_w(\d+)_s(\d+)_pipe")
# keys of the launch kinds that left the package (non-pipelined, two tiles a warp, the TMA launch)
REMOVED_KEY = re.compile(r"mma_r\d+_c\d+_w\d+_s\d+(_pipe)?|tma_\w+")


def parse_case(case: str) -> tuple[int, int, int, Config | MmaConfig | None]:
    """``NxK:M[:KEY]`` -> (n, k, m, config or None)."""
    parts = case.split(":")
    if len(parts) not in (2, 3) or "x" not in parts[0]:
        raise SystemExit(f"a case is NxK:M[:CONFIG_KEY], got {case!r}")
    n, k = map(int, parts[0].split("x"))
    m = int(parts[1])
    if len(parts) == 2:
        return n, k, m, None
    if hit := MMA_KEY.fullmatch(parts[2]):
        chunks, warps, splits = hit.groups()
        return n, k, m, MmaConfig(chunks=int(chunks), warps=int(warps), splits=int(splits))
    if REMOVED_KEY.fullmatch(parts[2]):
        raise SystemExit(f"{parts[2]}: that launch kind left the package ({REMOVED_LAUNCHES} re-adds it)")
    hit = KEY.fullmatch(parts[2])
    if not hit:
        raise SystemExit(f"not a configuration key (e.g. dot_bm16_bn32_bj256_s1_w4_st3; Triton split-K, _s2 and up, "
                         f"left the package: kernel.REMOVED_SPLIT_K): {parts[2]!r}")
    kind, bm, bn, bj, warps, stages = hit.groups()
    return n, k, m, Config(bm=int(bm), bn=int(bn), bj=int(bj), use_dot=kind == "dot", num_warps=int(warps),
                           num_stages=int(stages))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="NxK:M[:CONFIG_KEY]")
    ap.add_argument("--calls", type=int, default=8, help="calls per case (ncu's --launch-skip picks among them)")
    ap.add_argument("--torch", action="store_true", help="also run torch bf16 linear on each case")
    ap.add_argument("--min-bytes", type=float, default=2e9, help="weight bytes cycled through (beyond L2)")
    a = ap.parse_args(argv)
    for case in a.cases:
        n, k, m, cfg = parse_case(case)
        bench = ShapeBench(n, k, a.min_bytes)
        x = bench.x(m)
        cfg = cfg or pick_config(m, n, k)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for i in range(a.calls):
            if i == a.calls - 1:
                events[0].record()
            w12_matmul(x, bench.p[i % bench.copies], cfg)  # an MmaConfig goes to the tensor-core kernel
        events[1].record()
        torch.cuda.synchronize()
        line = f"{case:28s} {cfg.key():36s} last call {events[0].elapsed_time(events[1]) * 1e3:8.1f} us"
        if a.torch:
            for i in range(a.calls):
                if i == a.calls - 1:
                    events[0].record()
                torch.nn.functional.linear(x, bench.w[i % bench.copies])
            events[1].record()
            torch.cuda.synchronize()
            line += f" | torch {events[0].elapsed_time(events[1]) * 1e3:8.1f} us"
        print(line, flush=True)
        del bench
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
