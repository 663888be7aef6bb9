"""Verification cost c(N) of the engine's target forward, for any model config (random weights).

    python bench/engine_bench.py --model llama3-8b --device cuda --dtype bf16 --context 1024
    python bench/engine_bench.py --model llama3-8b --cuda-graphs --with-eager   # both, side by side
    python bench/engine_bench.py --model llama3-8b --cuda-graphs --fused        # fused_kernels option
    python bench/engine_bench.py --model llama3-8b --cuda-graphs --fused --w12  # then again with W12 weights

Times one target forward of 1 + N tokens (root + N chain drafts) at a given cache length, the way
`specpilot.engine.decode.verify` runs it (chain: causal; tree: explicit mask) -- eagerly, or with
``--cuda-graphs`` as the replay of a captured `specpilot.engine.graphs.GraphRunner` step (inputs copied in,
graph replayed, argmax) -- with CUDA events on GPUs and the wall clock on CPUs (median of
``--reps``). On CUDA it also reports the wall time of a step including the host sync.
``c(N) = t(N) / t(0)``; t(0) is an AR step. On CUDA the byte floor of an AR step is the bytes of the
weights one step reads (every linear and the LM head; one embedding row is ignored) over the
measured device-to-device copy bandwidth (bytes read + written / time), and ``ratio`` = t(0) /
floor. ``--w12`` then packs every linear and the LM head into W12 (``specpilot.kernels.w12``, checked bit for
bit at load) and times the same steps again in the same process (mode ``<mode>_w12``, with
``w12_speedup`` = bf16 AR step / W12 AR step). Also checks on the device that speculative decoding
of a tiny model emits the AR tokens (with graphs too). Needs no model files (random weights). The
last line is JSON.
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

from specpilot.engine.decode import DecodeConfig, generate  # noqa: E402
from specpilot.engine.drafters.ngram import NgramDrafter  # noqa: E402
from specpilot.engine.fused import fuse_model  # noqa: E402
from specpilot.engine.graphs import GraphRunner, graphs_supported  # noqa: E402
from specpilot.engine.model import DTYPES, build_random, get_config  # noqa: E402
from specpilot.engine.tree import DraftTree  # noqa: E402


def _round_up(n: int, m: int = 256) -> int:
    return -(-n // m) * m


def time_forward(model, n: int, context: int, tree: bool, reps: int, graphs: bool = False) -> dict:
    """Median milliseconds of one forward of 1 + n tokens (+ argmax) after ``context`` cached tokens:
    ``t`` (CUDA events, or the wall clock on CPUs) and, on CUDA, ``wall`` (host clock around the
    step and a device sync, i.e. what a decode step waits for)."""
    cache = model.new_cache(_round_up(context + n + 1))  # as the engine sizes it
    dev = model.device
    cuda = dev.type == "cuda"
    with torch.no_grad():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), device=dev), torch.arange(context, device=dev), cache, 0,
              last_only=True)
        toks = torch.randint(0, model.cfg.vocab_size, (1, n + 1), device=dev)
        if tree and n > 1:  # a two-branch tree of n drafts
            half = n // 2
            t = DraftTree(toks[0].tolist(), [-1, *range(0, half), 0, *range(half + 1, n)])
        else:
            t = DraftTree.chain(toks[0, 0].item(), toks[0, 1:].tolist())
        mask = None if t.is_chain else t.attention_mask(dev)
        pos = t.positions(context, dev)
        if graphs:
            runner = GraphRunner(model, cache)

            def step():
                return runner.run(t, context)[0]
        else:
            def step():
                return model(toks, pos, cache, context, mask)[0].argmax(-1)

        times, walls = [], []
        for _ in range(reps + 3):  # the first 3 are warm-up (and, with graphs, the capture)
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                a.record()
                step()
                b.record()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
    out = {"t": 1e3 * statistics.median(times[3:])}
    if walls:
        out["wall"] = 1e3 * statistics.median(walls[3:])
    return out


def exactness_check(device: str) -> dict:
    """Speculative == AR on the tiny model on this device (fp32); with CUDA graphs too on CUDA."""
    model = build_random(get_config("tiny"), device=device, dtype=torch.float32)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1, 2, 5, 6]
    ar = generate(model, model.new_cache(256), prompt, 64, None, DecodeConfig()).tokens
    cfgs = [(DecodeConfig(), None), (DecodeConfig(block_size=4), NgramDrafter(4, 1)),
            (DecodeConfig(block_size=6, tree=True, tree_nodes=16), NgramDrafter(4, 1))]
    out = {"spec_equals_ar": all(generate(model, model.new_cache(256), prompt, 64, d, c).tokens == ar
                                 for c, d in cfgs[1:])}
    if graphs_supported(device):
        ok = True
        for c, d in cfgs:
            cache = model.new_cache(256)
            ok &= generate(model, cache, prompt, 64, d, c, (), GraphRunner(model, cache, bucket=32)).tokens == ar
        out["graphs_equal_ar"] = ok
    return out


def copy_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``reps``."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times[2:])


def step_weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter except the embedding table (one
    row of it is read), unless the LM head shares it."""
    tied = model.lm_head.weight is model.embed.weight
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if name != "embed.weight" or tied)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ns", default="0,1,2,4,8,16,32,64")
    ap.add_argument("--tree", action="store_true", help="verify two-branch trees instead of chains")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cuda-graphs", action="store_true", help="time steps as CUDA graph replays (specpilot.engine.graphs)")
    ap.add_argument("--with-eager", action="store_true", help="with --cuda-graphs: time eager steps too, side by side")
    ap.add_argument("--fused", action="store_true", help="the fused_kernels option (specpilot.engine.fused) on the timed model")
    ap.add_argument("--w12", action="store_true", help="then time again with W12 weights (linears and LM head)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.cuda_graphs and not graphs_supported(device):
        ap.error("--cuda-graphs needs a CUDA device")
    check = exactness_check(args.device)
    model = build_random(get_config(args.model), device=device, dtype=DTYPES[args.dtype])
    if args.fused:
        fuse_model(model)
    ns = [int(x) for x in args.ns.split(",")]
    modes = (["eager"] if not args.cuda_graphs or args.with_eager else []) + (["graphs"] if args.cuda_graphs else [])
    result: dict = {"bench": "engine_verify_cost", "model": args.model, "dtype": args.dtype, "context": args.context,
                    "tree": args.tree, "fused_kernels": args.fused, "date": time.strftime("%Y-%m-%d"),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **check}
    if device.type == "cuda":
        bw = copy_bandwidth(device)
        wbytes = step_weight_bytes(model)
        result.update(copy_tb_s=round(bw / 1e12, 3), weight_bytes=wbytes, floor_ms=round(1e3 * wbytes / bw, 4))
    result["modes"] = {}
    passes = [(m, m) for m in modes]
    if args.w12:
        passes += [(m, f"{m}_w12") for m in modes]
    for mode, label in passes:
        if label.endswith("_w12") and "w12" not in result:
            from specpilot.kernels.w12 import quantize_model_linears

            t0 = time.perf_counter()
            stats = quantize_model_linears(model, include_lm_head=True)
            result["w12"] = {"bits_per_weight": round(stats["bits_per_weight"], 4), "escapes": stats["escapes"],
                             "pack_s": round(time.perf_counter() - t0, 1)}
        t = {n: time_forward(model, n, args.context, args.tree, args.reps, graphs=mode == "graphs") for n in ns}
        base = t[ns[0]]["t"]
        r = {"t_ms": {n: round(t[n]["t"], 4) for n in ns}, "c": {n: round(t[n]["t"] / base, 4) for n in ns}}
        if "wall" in t[ns[0]]:
            r["wall_ms"] = {n: round(t[n]["wall"], 4) for n in ns}
        if "floor_ms" in result:
            r["ratio_to_floor"] = round(base / result["floor_ms"], 3)  # the BF16 weights' floor
        result["modes"][label] = r
        for n in ns:
            wall = f"  wall {t[n]['wall']:8.3f} ms" if "wall" in t[n] else ""
            print(f"{label:10s} N={n:3d}  {t[n]['t']:8.3f} ms{wall}  c={t[n]['t'] / base:5.2f}", file=sys.stderr)
    if args.w12:
        last = modes[-1]
        result["w12_speedup"] = round(result["modes"][last]["t_ms"][ns[0]] / result["modes"][f"{last}_w12"]["t_ms"][ns[0]], 3)
    main_mode = result["modes"][modes[-1]]
    result["t_ms"], result["c"] = main_mode["t_ms"], main_mode["c"]  # the last mode's, as before
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
