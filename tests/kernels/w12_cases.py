"""Shared inputs for the W12 tests: adversarial BF16 tensors and kernel cases.

Not a test module. ``python -m tests.kernels.w12_cases IN OUT`` runs the kernel cases in a fresh
process, so ``TRITON_INTERPRET=1`` can be set before triton's ``@jit`` decorators run (another
test module may already have imported the kernel in the pytest process).
"""

from __future__ import annotations

import sys

import torch

# BF16 bit patterns of note
POS_ZERO, NEG_ZERO = 0x0000, 0x8000
POS_INF, NEG_INF = 0x7F80, 0xFF80
QNAN, SNAN_PAYLOAD, NEG_NAN_PAYLOAD = 0x7FC0, 0x7F81, 0xFFFF
DENORMALS = (0x0001, 0x007F, 0x8001, 0x8040)


def from_bits(bits, shape=None) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int32).to(torch.int16)  # wraps 0x8000.. to negative int16
    t = t.view(torch.bfloat16)
    return t.reshape(shape) if shape is not None else t


def normal(n: int, k: int, std: float = 0.02, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * std).to(torch.bfloat16)


def adversarial() -> dict[str, torch.Tensor]:
    """Tensors that exercise every escape path and odd shape."""
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    out["all_pos_zero"] = torch.zeros(5, 40, dtype=torch.bfloat16)
    out["all_neg_zero"] = from_bits([NEG_ZERO] * 96, (3, 32))
    out["mixed_zeros"] = from_bits([POS_ZERO, NEG_ZERO] * 50, (4, 25))
    out["denormals"] = from_bits(list(DENORMALS) * 16, (8, 8))
    # one row spanning 2**-120 .. 2**120 (far more than 16 binades), sign alternating
    span = torch.tensor([2.0 ** e * (-1) ** e for e in range(-120, 121, 3)], dtype=torch.float32)
    out["wide_row"] = span.to(torch.bfloat16)[None, :]
    specials = [POS_INF, NEG_INF, QNAN, SNAN_PAYLOAD, NEG_NAN_PAYLOAD, 0x7FA5, 0xFFC1, NEG_ZERO, POS_ZERO]
    w = normal(6, 70, seed=2)
    flat = w.view(torch.int16).reshape(-1)
    pos = torch.randperm(flat.numel(), generator=g)[: len(specials) * 3]
    flat[pos] = torch.tensor(specials * 3, dtype=torch.int32).to(torch.int16)
    out["nan_inf_payloads"] = w
    out["every_bf16_pattern"] = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    out["random_bits"] = torch.randint(-32768, 32768, (33, 77), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out["one_by_one"] = torch.tensor([[0.5]], dtype=torch.bfloat16)
    out["k_1"] = normal(7, 1, seed=3)
    out["n_1_odd_k"] = normal(1, 1001, seed=4)
    out["k_33"] = normal(19, 33, seed=5)
    out["k_4099"] = normal(3, 4099, seed=6)
    big = normal(17, 129, std=3.0, seed=7)  # wide dynamic range: some weights fall out of the window
    big[0] *= 1e30
    big[1, :64] *= 1e-30
    out["wide_rows_mixed"] = big
    return out


def kernel_cases() -> list[dict]:
    """Kernel cases for the interpreter: odd shapes, M in {1, 3, 16, 64}, escapes, 16-bit inputs, and the
    shapes split-K covered while it was in the package (2026-12-07: its patch is in docs/results/w12-kernel)."""
    cases = []
    shapes = [(37, 100), (40, 257), (33, 96), (17, 64), (20, 1000), (48, 33)]
    ms = [1, 3, 16, 64]
    for i, (n, k) in enumerate(shapes):
        for m in ms if i < 2 else ms[i % 4 : i % 4 + 1]:
            cases.append({"name": f"m{m}_n{n}_k{k}", "m": m, "n": n, "k": k, "seed": 10 * i + m})
    cases.append({"name": "escapes_m3", "m": 3, "n": 24, "k": 80, "seed": 99, "escapes": True})
    cases.append({"name": "escapes_m1", "m": 1, "n": 24, "k": 80, "seed": 98, "escapes": True})
    cases.append({"name": "k300_m1", "m": 1, "n": 40, "k": 300, "seed": 97})
    cases.append({"name": "k300_m5", "m": 5, "n": 40, "k": 300, "seed": 96})
    cases.append({"name": "bf16_m2", "m": 2, "n": 30, "k": 64, "seed": 95, "dtype": "bfloat16"})
    # 16-bit x read as int64 words in the FMA path (8 rows a program)
    cases.append({"name": "bf16_m8", "m": 8, "n": 20, "k": 64, "seed": 94, "dtype": "bfloat16"})
    cases.append({"name": "fp16_m6", "m": 6, "n": 20, "k": 128, "seed": 93, "dtype": "float16"})
    cases.append({"name": "bf16_m3_k96", "m": 3, "n": 37, "k": 96, "seed": 92, "dtype": "bfloat16"})
    cases.append({"name": "bf16_m3_k33", "m": 3, "n": 37, "k": 33, "seed": 91, "dtype": "bfloat16"})
    cases.append({"name": "k256_m16", "m": 16, "n": 40, "k": 256, "seed": 90})
    return cases


def case_inputs(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, w)`` for a case: x fp32 (or the case's dtype), w BF16 with planted escapes."""
    w = normal(c["n"], c["k"], std=0.05, seed=c["seed"])
    if c.get("escapes"):
        flat = w.view(torch.int16).reshape(-1)
        flat[3] = 0x7F80  # +inf in row 0
        flat[c["k"] + 1] = 0x0001  # denormal in row 1
        flat[2 * c["k"] + 5] = torch.tensor(0x7FC1, dtype=torch.int32).to(torch.int16)  # NaN in row 2
        w[5, 7] = 3e30  # far above the window
        w[6, :4] = 1e-30  # far below
        w[7, :10] = 0  # zeros: in-code, not escapes
    g = torch.Generator().manual_seed(c["seed"] + 1)
    x = torch.randn(c["m"], c["k"], generator=g)
    return x.to(getattr(torch, c.get("dtype", "float32"))), w


def run_cases(cases: list[dict]) -> dict[str, list[torch.Tensor]]:
    """Pack and run every case twice with the Triton kernel (whatever TRITON_INTERPRET says)."""
    from specpilot.kernels.w12.format import pack
    from specpilot.kernels.w12.kernel import pick_config, w12_matmul

    out = {}
    for c in cases:
        x, w = case_inputs(c)
        p = pack(w)
        cfg = pick_config(c["m"], c["n"], c["k"])
        out[c["name"]] = [w12_matmul(x, p, cfg), w12_matmul(x, p, cfg)]
    return out


if __name__ == "__main__":
    torch.save(run_cases(torch.load(sys.argv[1])), sys.argv[2])
