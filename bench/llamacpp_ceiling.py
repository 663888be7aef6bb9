"""How fast can n-gram speculation make llama.cpp's server here? A measured bound, not a guess.

Two measurements on the live ``llama-server`` of a server deployment (stock flags, AR):

- **c(k)**: the seconds of one forward over ``k`` new tokens at the requests' context, over one AR
  step. Each point sends the prompt with ``cache_prompt`` on (the server keeps its KV cache), then the
  same prompt plus ``k`` more tokens: the server reports the ``k`` new tokens' evaluation time
  (``timings.prompt_ms``). One AR step is ``predicted_ms / predicted_n`` of a greedy completion.
- **tau(N)**: tokens a step of the best n-gram tree of ``N`` nodes in hindsight (our lookup drafter's
  candidates on the server's own greedy output, `ServerEngine.measure`, pooled as the cost model pools
  them, `costmodel.pooled_replay`), and the same for the single best chain.

Verifying ``N`` drafts costs ``c(N + 1)`` AR steps, so a drafter that always drafts ``N`` tokens from
these candidates reaches at most ``tau(N) / c(N + 1)`` over AR (the table's rows). One that drafts at
each step exactly as many tokens as will be accepted (an oracle of the draft length: no wasted row,
no draft where the lookup misses, which costs one AR step) reaches ``tokens / sum of c(depth + 1)``
along the output ("adaptive" below): no drafter proposing from the lookup's candidates, however it
sizes its drafts, beats that over this server's AR here. The draft's own time only lowers both.
Prints a table, then one JSON line.

Usage: ``python bench/llamacpp_ceiling.py [--deployment llamacpp-smollm2-cpu] [--requests 6] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from specpilot.engine.weights import load_tokenizer
from specpilot.harness.deployment import load_deployment
from specpilot.harness.requests import encode_requests, load_requests
from specpilot.harness.server import ServerEngine
from specpilot.services.master.costmodel import pooled_replay

KS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 33)
BUDGETS = (1, 2, 3, 4, 5, 7, 8, 11, 15, 16, 23, 32)


def step_cost(server: ServerEngine, prompt: list[int], k: int, repeats: int) -> float:
    """Median seconds to evaluate ``k`` new tokens after ``prompt`` (its KV cache kept by the server)."""
    extra = list(prompt[-k:]) if len(prompt) >= k else (list(prompt) * k)[:k]
    times = []
    for _ in range(repeats):
        base = {"n_predict": 0, "cache_prompt": True, "temperature": 0.0, "samplers": ["top_k"], "top_k": 1}
        server._post("/completion", {**base, "prompt": list(prompt)})
        reply = server._post("/completion", {**base, "prompt": list(prompt) + extra})
        t = reply.get("timings") or {}
        if int(t.get("prompt_n", -1)) != k:  # the cache was not reused as asked: the point would lie
            raise RuntimeError(f"the server evaluated {t.get('prompt_n')} tokens where {k} were new")
        times.append(float(t["prompt_ms"]) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default="llamacpp-smollm2-cpu")
    ap.add_argument("--requests", type=int, default=6, help="dev requests to replay and to take contexts from")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="measurements a point (the median is kept)")
    args = ap.parse_args()
    dep = load_deployment(args.deployment)
    spec = dep.server_spec()
    if spec is None or spec.api != "llamacpp":
        raise SystemExit(f"{dep.name} is not a llama.cpp server deployment")
    tok = load_tokenizer(dep.target)
    prompts = encode_requests(load_requests(dep, "dev")[: args.requests], tok)
    with ServerEngine(spec, {}, tok) as server:
        server.generate(prompts[0], 16)  # warm up
        measured = [server.measure(p, args.max_new_tokens) for p in prompts]
        t0 = time.perf_counter()
        ar = [server._post("/completion", {"prompt": list(p), "n_predict": args.max_new_tokens, "temperature": 0.0,
                                           "samplers": ["top_k"], "top_k": 1, "ignore_eos": True,
                                           "cache_prompt": False})["timings"] for p in prompts]
        ar_step_s = sum(t["predicted_ms"] for t in ar) / sum(t["predicted_n"] for t in ar) / 1e3
        wall_s = time.perf_counter() - t0
        contexts = [p + m["tokens"][: args.max_new_tokens // 2] for p, m in zip(prompts, measured, strict=True)]
        cost = {k: statistics.mean(step_cost(server, c, k, args.repeats) for c in contexts) / ar_step_s for k in KS}
    tree = pooled_replay([m["depths"] for m in measured], BUDGETS)
    chain = pooled_replay([m["chain_depths"] for m in measured], BUDGETS)

    def c_of(n: int) -> float:  # c at n tokens, linear between the measured points
        lo = max(k for k in KS if k <= n)
        hi = min((k for k in KS if k >= n), default=lo)
        return cost[lo] if hi == lo else cost[lo] + (cost[hi] - cost[lo]) * (n - lo) / (hi - lo)

    def adaptive(depths: list[int]) -> tuple[int, float]:
        """(tokens, AR steps of cost) of the walk that drafts exactly the matched depth at each step."""
        n, pos, cost = len(depths), min(1, len(depths)), 0.0
        while pos < n:
            d = min(depths[pos], max(KS) - 1, n - pos - 1)
            cost += c_of(d + 1) if d else 1.0
            pos += d + 1
        return n - min(1, n), cost

    walks = [adaptive(m["chain_depths"]) for m in measured]
    adaptive_bound = sum(t for t, _ in walks) / sum(c for _, c in walks)
    rows = [{"nodes": n, "c": round(c_of(n + 1), 3), "tau_tree": round(tree[n], 3), "tau_chain": round(chain[n], 3),
             "bound_tree": round(tree[n] / c_of(n + 1), 3), "bound_chain": round(chain[n] / c_of(n + 1), 3)}
            for n in BUDGETS if n + 1 <= max(KS)]
    print(f"{'N':>3} {'c(N+1)':>7} {'tau tree':>9} {'tau chain':>10} {'bound tree':>11} {'bound chain':>12}")
    for r in rows:
        print(f"{r['nodes']:>3} {r['c']:>7.3f} {r['tau_tree']:>9.3f} {r['tau_chain']:>10.3f} "
              f"{r['bound_tree']:>11.3f} {r['bound_chain']:>12.3f}")
    best = max(rows, key=lambda r: r["bound_tree"])
    print(f"AR step {ar_step_s * 1e3:.2f} ms ({1 / ar_step_s:.0f} tok/s decode, {wall_s:.1f} s for {len(prompts)} "
          f"requests); a fixed draft of N tokens reaches at most {best['bound_tree']:.2f}x over AR (N = "
          f"{best['nodes']}); drafting exactly what will be accepted, at most {adaptive_bound:.2f}x")
    print(json.dumps({"bench": "llamacpp_ceiling", "deployment": dep.name, "date": time.strftime("%Y-%m-%d"),
                      "machine": platform.processor() or platform.machine(), "requests": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "ar_step_ms": round(ar_step_s * 1e3, 3),
                      "c": {str(k): round(v, 3) for k, v in cost.items()}, "rows": rows,
                      "best_bound": best["bound_tree"], "best_nodes": best["nodes"],
                      "adaptive_bound": round(adaptive_bound, 3)}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
