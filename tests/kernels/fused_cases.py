"""Cases for the fused-kernel tests, run in a fresh process under ``TRITON_INTERPRET=1``.

Not a test module. ``python -m tests.kernels.fused_cases OUT`` runs every Triton kernel of
`specpilot.kernels.fused` and a fused tiny-model forward (eager and graph-safe) and saves the results with
the inputs, so ``TRITON_INTERPRET=1`` is set before triton's ``@jit`` decorators run.
"""

from __future__ import annotations

import sys

import torch


def kernel_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    B, T, H, KV, hd = 2, 3, 4, 2, 16
    return {
        "h": rand(3, 5, 577), "delta": rand(3, 5, 577), "norm_w": rand(577),
        "qkv": rand(B, T, (H + 2 * KV) * hd), "cos": rand(T, hd), "sin": rand(T, hd),
        "cos_rows": rand(B, 1, T, hd), "sin_rows": rand(B, 1, T, hd), "slots": torch.tensor([7, 9, 8]),
        "slots_rows": torch.tensor([[7, 9, 8], [3, 4, 5]]),
        "cache": torch.zeros(B, KV, 16, hd), "gate_up": rand(2, 3, 2 * 1500),
        "cache_filled": rand(1, KV, 16, hd), "qkv_one": rand(1, T, (H + 2 * KV) * hd), "bias": step_bias(),
        "cache_long": rand(1, KV, 256, hd), "bias_long": step_bias(length=200, start=190),
        "w_lin": rand(40, 577) * 0.05, "w_gate_up": rand(2 * 24, 577) * 0.05,
    }


def step_bias(G: int = 2, T: int = 3, length: int = 12, start: int = 7) -> torch.Tensor:
    """A tree step's additive bias [1, 1, G*T, length]: the prefix before ``start``, then block
    token 0 sees itself, 1 and 2 see 0 and themselves (the block sits at slots 7, 8, 9)."""
    allowed = torch.zeros(T, length, dtype=torch.bool)
    allowed[:, :start] = True
    for t, seen in enumerate([[0], [0, 1], [0, 2]]):
        allowed[t, [start + j for j in seen]] = True
    bias = torch.zeros(T, length).masked_fill(~allowed, float("-inf"))
    return bias.repeat(G, 1).view(1, 1, G * T, length)


HEADS = (4, 2)  # n_heads, n_kv of kernel_inputs' qkv


def run_kernels(x: dict[str, torch.Tensor], ops) -> dict[str, torch.Tensor]:
    """Every op of ``ops`` (the Triton kernels or the reference) on the inputs."""
    out = {}
    out["norm"], out["h"] = ops.add_rms_norm(x["h"], x["delta"], x["norm_w"], 1e-5)
    out["norm_no_delta"], _ = ops.add_rms_norm(x["h"], None, x["norm_w"], 1e-5)
    for suffix in ("", "_rows"):
        k, v = x["cache"].clone(), x["cache"].clone()
        out["q" + suffix] = ops.rope_qkv(x["qkv"], x["cos" + suffix], x["sin" + suffix], *HEADS, k, v, x["slots"])
        out["k" + suffix], out["v" + suffix] = k, v
    # a batched step: each cache row writes its own slots
    k, v = x["cache"].clone(), x["cache"].clone()
    out["q_slots_rows"] = ops.rope_qkv(x["qkv"], x["cos_rows"], x["sin_rows"], *HEADS, k, v, x["slots_rows"])
    out["k_slots_rows"], out["v_slots_rows"] = k, v
    out["silu"] = ops.silu_mul(x["gate_up"])
    k, v = x["cache_filled"].clone(), x["cache_filled"].clone() * 0.5
    slots = torch.tensor([7, 8, 9], device=x["qkv_one"].device)
    out["attn"] = ops.rope_attention(x["qkv_one"], x["cos"], x["sin"], *HEADS, k, v, slots, x["bias"], 12)
    out["attn_k"], out["attn_v"] = k, v
    k, v = x["cache_long"].clone(), x["cache_long"].clone() * 0.5
    out["attn_long"] = ops.rope_attention(x["qkv_one"], x["cos"], x["sin"], *HEADS, k, v, slots + 183,
                                          x["bias_long"], 200)
    # norm + GEMV: the tl.dot tiles at 15 and 3 rows, the multiply-add tiles at 1 and 2 rows (the AR
    # decode step), each with the add + norm, with SiLU·mul and plain
    h, d, w = x["h"], x["delta"], x["norm_w"]
    out["gemv_norm"], out["gemv_h"] = ops.norm_linear(h, d, w, 1e-5, x["w_lin"])
    out["gemv_silu"], out["gemv_h3"] = ops.norm_linear(h[0, :3], d[0, :3], w, 1e-5, x["w_gate_up"], True)
    out["gemv_norm1"], out["gemv_h1"] = ops.norm_linear(h[0, :1], d[0, :1], w, 1e-5, x["w_lin"])
    out["gemv_silu1"], _ = ops.norm_linear(h[2, :1], None, w, 1e-5, x["w_gate_up"], True)
    out["gemv_silu2"], out["gemv_h2"] = ops.norm_linear(h[1, :2], d[1, :2], w, 1e-5, x["w_gate_up"], True)
    out["gemv_plain"], _ = ops.norm_linear(h[1, :1], None, None, 0.0, x["w_lin"])
    out["gemv_plain2"], _ = ops.norm_linear(h[1, 2:4], None, None, 0.0, x["w_lin"])
    return out


def model_forwards(fused: bool, gemv: bool = False) -> dict[str, torch.Tensor]:
    """Logits of the tiny model (fp32), stock or fused (``gemv``: with ``fused_gemv``): a prefill,
    a chain step, a one-token step and a graph-safe tree step."""
    from specpilot.engine.fused import fuse_model
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.model import build_random, get_config
    from specpilot.engine.tree import DraftTree

    model = build_random(get_config("tiny"), seed=3)
    if fused:
        fuse_model(model, gemv=gemv)
    out = {}
    cache = model.new_cache(64)
    with torch.no_grad():
        prompt = torch.arange(10, 30).view(1, -1)
        out["prefill"], _ = model(prompt, torch.arange(20), cache, 0)
        out["chain"], _ = model(torch.tensor([[5, 6, 7]]), torch.arange(20, 23), cache, 20)
        out["step"], _ = model(torch.tensor([[8]]), torch.arange(23, 24), cache, 23)  # an AR step: 1 row
        tree = DraftTree([9, 4, 5, 6], [-1, 0, 0, 1])
        runner = GraphRunner(model, cache, bucket=16, capture=False)
        out["tree_argmax"], out["tree_hidden"] = runner.run(tree, 24)
        # continuous batching over 3 cache rows: a ragged prefill of two prompts, a padded ragged step,
        # then a graph-safe step of a tree (row 0) and a chain (row 2) beside an idle row
        rows = model.new_cache(64, batch=3)
        a, b = list(range(10, 27)), list(range(40, 51))
        out["rows_prefill"], _ = model.forward_ragged(torch.tensor(a + b), torch.cat([torch.arange(17), torch.arange(11)]),
                                                      rows, [0, 0], [17, 11], [0, 2], [None, None])
        out["rows_padded"], _ = model.forward_ragged(torch.tensor([5, 6, 7]), torch.tensor([17, 18, 11]), rows, [17, 11],
                                                     [2, 1], [0, 2], [None, None], padded=True)
        runner = GraphRunner(model, rows, bucket=16, capture=False)
        argmax, hidden, _ = runner.run_rows({0: (tree, 19), 2: (DraftTree.chain(8, [3, 2]), 12)}, idle={1: 0})
        out["rows_argmax"], out["rows_hidden"] = argmax, hidden
    return out


def main(path: str) -> None:
    from specpilot.kernels import counters
    from specpilot.kernels.fused import kernel

    x = kernel_inputs()
    out = {"inputs": x, "kernels": run_kernels(x, kernel), "model": model_forwards(fused=True),
           "model_gemv": model_forwards(fused=True, gemv=True)}
    kernel.SLOTS_PER_PROGRAM = 64  # the context split over 4 programs per KV head, merged by the last
    out["split"] = {"first": run_kernels(x, kernel), "again": run_kernels(x, kernel)}
    out["split_counts"] = counters._COUNTERS[torch.device("cpu")].clone()
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
