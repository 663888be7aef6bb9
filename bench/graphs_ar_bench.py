"""AR tokens/s of the engine, eager vs CUDA graphs, with transformers' greedy generation beside it.

    python bench/graphs_ar_bench.py --prompts out/cg/prompts.json --max-new-tokens 256

The model is SmolLM2-135M in bf16 on CUDA: the real weights when the GGUF is installed (and not
``--random``), else SmolLM2-shaped random weights (``stop_ids`` cleared, so every request decodes
``--max-new-tokens`` tokens; speed does not depend on the weights' values). Prompts are token-id
lists from a JSON file (``{"prompts": [[...], ...]}``), e.g. HumanEval requests tokenised on another
machine, or random ones of HumanEval-like lengths.

- graphs: ``Engine(drafter="none", cuda_graphs=True)`` on every prompt; an untimed pass captures
  every shape first. tokens/s = tokens / wall time of ``generate`` (prefill included).
- eager: the same engine without graphs on the first ``--eager-prompts`` prompts with
  ``--eager-max-new-tokens`` (eager steps are ~20 ms: kept short); its tokens must equal the graph
  run's first tokens (greedy outputs are prefixes of longer ones when nothing stops them).
- peer: transformers' ``generate`` (greedy, and prompt lookup) on the same weights
  (`specpilot.harness.peer.peer`), on ``--peer-prompts`` prompts, when transformers is installed.
- ``--fused``: the ``fused_kernels`` option (`specpilot.engine.fused`) on the model for every run above
  (``--gemv``: and ``fused_gemv``);
  ``--outputs FILE`` saves the graph run's tokens and ``--reference FILE`` compares them with
  another run's (how many requests are identical, and the mean length of the common prefix).
- profile (``--profile``): the kernels of one static decode forward (torch.profiler): count and
  GPU time per class, beside the graph replay time of that step.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.engine.api import Engine  # noqa: E402
from specpilot.engine.fused import fuse_model  # noqa: E402
from specpilot.engine.graphs import GraphRunner  # noqa: E402
from specpilot.engine.model import build_random, get_config  # noqa: E402
from specpilot.engine.options import EngineOptions  # noqa: E402
from specpilot.engine.tree import DraftTree  # noqa: E402
from specpilot.engine.weights import ByteTokenizer, ModelFileMissing, load_model  # noqa: E402


def _load(name: str, random: bool):
    if name == "smollm2-135m" and not random:
        try:
            model, tok = load_model(name, dtype="bf16", device="cuda")
            return model, tok, "real"
        except (ModelFileMissing, ImportError):
            pass
    cfg = replace(get_config(name), stop_ids=())
    return build_random(cfg, device="cuda", dtype=torch.bfloat16), ByteTokenizer(), "random"


def _tok_s(engine: Engine, prompts, max_new) -> tuple[float, list[list[int]], float]:
    toks, secs, outs, step_s, steps = 0, 0.0, [], 0.0, 0
    for p in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = engine.generate(p, max_new)
        torch.cuda.synchronize()
        secs += time.perf_counter() - t0
        toks += len(r.tokens)
        outs.append(r.tokens)
        step_s += sum(r.verify_s) + sum(r.draft_s)
        steps += r.steps
    return toks / secs, outs, 1e3 * step_s / max(1, steps)


def _kernel_class(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemv", "gemm", "cutlass", "xmma", "sm90", "cublas", "splitk", "norm_linear")):
        return "matmul"
    if any(k in n for k in ("fmha", "attention", "flash", "attn")):
        return "attention"
    return "elementwise/other"


def compare_outputs(outs: list[list[int]], reference: list[list[int]]) -> dict:
    """How many outputs equal the reference's, and the mean common prefix (tokens)."""
    prefixes = []
    for a, b in zip(outs, reference, strict=False):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    same = sum(a == b for a, b in zip(outs, reference, strict=False))
    return {"identical": same, "of": len(prefixes), "mean_common_prefix": round(statistics.mean(prefixes), 1)}


def kernel_profile(model, T: int = 1, context: int = 200) -> dict:
    """Kernels of one static decode forward of T tokens after ``context`` cached tokens."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(-(-(context + T) // 256) * 256)
    with torch.no_grad():
        model(torch.randint(0, model.cfg.vocab_size, (1, context), device="cuda"),
              torch.arange(context, device="cuda"), cache, 0, last_only=True)
    tree = DraftTree.chain(5, list(range(6, 6 + T - 1)))
    static = GraphRunner(model, cache, capture=False)
    graph = GraphRunner(model, cache)
    for r in (static, graph):
        for _ in range(3):
            r.run(tree, context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        static.run(tree, context)
        torch.cuda.synchronize()
    classes: dict[str, dict] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        c = classes.setdefault(_kernel_class(ev.name), {"kernels": 0, "us": 0.0})
        c["kernels"] += 1
        c["us"] += ev.device_time_total
    top = sorted(((ev.key, ev.count, ev.device_time_total) for ev in prof.key_averages()), key=lambda x: -x[2])[:12]
    replay = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.run(tree, context)
        b.record()
        torch.cuda.synchronize()
        replay.append(a.elapsed_time(b) * 1e3)
    return {"T": T, "context": context, "classes": {k: {"kernels": v["kernels"], "us": round(v["us"], 1)}
                                                    for k, v in classes.items()},
            "kernels": sum(v["kernels"] for v in classes.values()),
            "kernel_us": round(sum(v["us"] for v in classes.values()), 1),
            "graph_replay_us": round(statistics.median(replay), 1),
            "top": [{"kernel": k[:90], "count": n, "us": round(us, 1)} for k, n, us in top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random", action="store_true", help="random weights even when the GGUF is installed")
    ap.add_argument("--prompts", type=Path, default=None, help="JSON {'prompts': [[ids], ...]}; default: random")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eager-prompts", type=int, default=2)
    ap.add_argument("--eager-max-new-tokens", type=int, default=64)
    ap.add_argument("--peer-prompts", type=int, default=3)
    ap.add_argument("--peer-max-new-tokens", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--fused", action="store_true", help="the fused_kernels option (specpilot.engine.fused)")
    ap.add_argument("--gemv", action="store_true", help="with --fused: the fused_gemv option (norm + GEMV kernels)")
    ap.add_argument("--attention-slots-per-program", type=int, default=None,
                    help="with --fused: split the attention kernel's context over programs of this many slots "
                         "(specpilot.kernels.fused.kernel.SLOTS_PER_PROGRAM; default: one program per KV head)")
    ap.add_argument("--outputs", type=Path, default=None, help="write the graph run's tokens here (JSON)")
    ap.add_argument("--reference", type=Path, default=None, help="compare the graph run's tokens with this --outputs file")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-only", action="store_true", help="only the kernel profile (any model config)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok, weights = _load(args.model, args.random)
    if args.gemv and not args.fused:
        ap.error("--gemv needs --fused (the fused_gemv option folds into the fused blocks)")
    if args.fused:
        fuse_model(model, gemv=args.gemv)
    if args.attention_slots_per_program:
        from specpilot.kernels.fused import kernel as fused_kernel

        fused_kernel.SLOTS_PER_PROGRAM = args.attention_slots_per_program
    result: dict = {"bench": "graphs_ar", "model": args.model, "weights": weights, "dtype": "bf16",
                    "fused_kernels": args.fused, "fused_gemv": args.gemv, "attention_slots_per_program": args.attention_slots_per_program,
                    "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    if args.profile or args.profile_only:
        result["profile"] = [kernel_profile(model, T) for T in (1, 5)]
    if args.profile_only:
        print(json.dumps(result))
        return 0
    if args.prompts:
        prompts = json.loads(args.prompts.read_text())["prompts"][: args.limit]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.cfg.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(50, 170, (args.limit,), generator=g)]
    prompts = [[t % model.cfg.vocab_size for t in p] for p in prompts]
    result.update(prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], max_new_tokens=args.max_new_tokens)
    base = EngineOptions(drafter="none", dtype="bf16")
    graphs = Engine(model, tok, base.replace(cuda_graphs=True))
    eager = Engine(model, tok, base)
    t0 = time.perf_counter()
    for p in prompts:  # capture every shape
        graphs.generate(p, args.max_new_tokens)
    result["graphs_warmup_s"] = round(time.perf_counter() - t0, 2)
    result["graphs_captured"] = len(graphs._runner.shapes) if graphs._runner else 0
    g_tps, g_outs, g_step = _tok_s(graphs, prompts, args.max_new_tokens)
    result["graphs"] = {"tok_s": round(g_tps, 1), "step_ms": round(g_step, 4)}
    if args.outputs:
        args.outputs.write_text(json.dumps({"outputs": g_outs}))
    if args.reference:
        result["vs_reference"] = compare_outputs(g_outs, json.loads(args.reference.read_text())["outputs"])
    few = prompts[: args.eager_prompts]
    eager.generate(few[0], 8)
    e_tps, e_outs, e_step = _tok_s(eager, few, args.eager_max_new_tokens)
    n = args.eager_max_new_tokens
    result["eager"] = {"tok_s": round(e_tps, 1), "step_ms": round(e_step, 4), "prompts": len(few), "max_new_tokens": n}
    result["eager_equals_graphs"] = all(e == g[: len(e)] for e, g in zip(e_outs, g_outs, strict=False))
    result["speedup_graphs_over_eager"] = round(g_tps / e_tps, 2)
    if not args.no_peer:
        try:
            from specpilot.harness.peer import peer

            opts = base.replace(block_size=4)
            result["peer"] = peer(model, None, opts, prompts[: args.peer_prompts], args.peer_max_new_tokens,
                                  [o[: args.peer_max_new_tokens] for o in g_outs[: args.peer_prompts]])
        except Exception as e:  # the peer is a comparison, never a reason to lose the bench
            result["peer"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
