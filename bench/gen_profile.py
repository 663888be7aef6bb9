"""Where `drafter train`'s lockstep generation (`specpilot.harness.distill.generate_batch`) spends its time.

Random SmolLM2-shaped weights (no model file needed), one batch of left-padded prompts; prints the
tokens/s and the top CUDA kernels of the PyTorch profiler, then a JSON line. Usage:

    python bench/gen_profile.py --device cuda --batch 1024 --prompt 160 --new 32 [--dtype bf16] [--tf32]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from specpilot.engine.model import build_random, get_config
from specpilot.harness.distill import generate_batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=160, help="longest prompt (others are shorter, left-padded)")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per row")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--tf32", action="store_true", help="TF32 matmuls (as `drafter train --tf32` generates)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build_random(get_config("smollm2-135m"), device=args.device, dtype=dtype).eval()
    model.init_buffers()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(args.prompt // 2, args.prompt + 1))]
               for _ in range(args.batch)]
    generate_batch(model, prompts[:8], 4, ())  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate_batch(model, prompts, args.new, ())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_batch(model, prompts, args.new, ())
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top), file=sys.stderr)
    print(json.dumps({"batch": args.batch, "prompt": args.prompt, "new": args.new, "dtype": args.dtype,
                      "tf32": args.tf32, "seconds": round(seconds, 3), "tok_s": round(args.batch * args.new / seconds),
                      "ms_per_step": round(1000 * seconds / args.new, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
