"""A timing worker: one process, one loaded engine, one request at a time over stdin/stdout.

    python -m specpilot.harness.worker --deployment smollm2-cpu --options '{"verify": "tree"}'

Protocol (one JSON object per line; stdout carries nothing else, logs go to stderr):
1. After loading and one short warm-up generation the worker prints ``{"ready": true}``, or
   ``{"ready": false, "error": "..."}`` and exits with status 1.
2. For each line ``{"prompt_ids": [...], "max_new_tokens": N}`` on stdin it generates greedily,
   synchronises the device, and prints ``{"tokens": [...], "steps": n}`` (``steps``: target
   forwards after the prefill). A bad request gets ``{"error": "..."}`` and the worker goes on.
3. ``{"load": {"requests": [[...], ...], "max_new_tokens": N, "concurrency": C}}`` (a batched deployment)
   serves the requests as ``C`` closed-loop clients would (`specpilot.harness.loadgen.closed_loop` over
   `Engine.batch_decoder`) and prints ``{"outputs": [[...], ...], "steps": n}``, the tokens in request order.
4. ``{"measure": {"prompt_ids": [...], "max_new_tokens": N}}`` answers with what the cost model
   needs (``specpilot.harness.replay.measure``: tokens, steps, kernel-class profile, matched drafter depths).
   Its figures are planning inputs, never verdicts. ``{"batch_cost": {"rows": B, "context": C, "drafts": [n, ...]}}``
   answers ``{"t_ar_s": t, "t_one_row_s": t1, "c": {n: c(n, B)}}``: the forward of B rows of one token, of
   one row of B tokens (the same linear work without the per-row part), and of 1 + n tokens a row against
   the first (`specpilot.harness.step_cost.step_cost`, with the engine's ``batch_attention`` and graphs), for the
   cost model's batched ceiling and overhead.
5. It exits when stdin closes (stopping the server of a server deployment, `specpilot.harness.server`).

The controller times each request from its own clock (send to reply) and keeps the reference
tokens; the worker reports no timings, so it cannot misreport them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from specpilot.harness.deployment import DEFAULT_DEPLOYMENT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.harness.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="deployment name or TOML path")
    ap.add_argument("--options", default="{}", help="JSON dict of engine option overrides")
    ap.add_argument("--device", default=None, help="override the deployment's device")
    ap.add_argument("--data-dir", default=None, help="SpecPilot data directory (model cache)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)

    # The protocol owns stdout; anything a library prints goes to stderr instead.
    proto, sys.stdout = sys.stdout, sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj, separators=(",", ":")) + "\n")
        proto.flush()

    try:
        from pathlib import Path

        import torch

        from specpilot.harness.deployment import load_engine

        if args.threads:
            torch.set_num_threads(args.threads)
        device = torch.device(args.device) if args.device else None
        if device is not None and device.type == "cuda" and device.index is not None:
            # Libraries that launch on "the current device" (Triton, cuBLAS handles) must find this
            # one; a plain "cuda" is the current device already (and set_device refuses it).
            torch.cuda.set_device(device)

        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError("--options must be a JSON object")
        engine = load_engine(args.deployment, options, device=args.device,
                             data_dir=Path(args.data_dir) if args.data_dir else None)
        # Warm up allocator, kernels and the cache so the first timed request is not the slowest.
        engine.generate(engine.tokenize("def f(x):\n    return") or [0], 8)
        engine.synchronize()
    except Exception as e:  # any failure to start is reported on the protocol
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True})

    from specpilot.harness.loadgen import frozen_heap

    with frozen_heap():  # started: the model and the interpreter leave the collector's full passes
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                if "measure" in req:
                    from specpilot.harness.replay import measure

                    m = req["measure"]
                    # a server measures itself (`ServerEngine.measure`): its kernels and drafts are its own
                    own = getattr(engine, "measure", None)
                    send((own or functools.partial(measure, engine))(m["prompt_ids"], int(m["max_new_tokens"])))
                    continue
                if "batch_cost" in req:
                    from specpilot.harness.step_cost import step_cost

                    b = req["batch_cost"]
                    rows, context = int(b["rows"]), int(b["context"])
                    cost = functools.partial(step_cost, engine.model, context=context, reps=3,
                                             padded=engine.options.batch_attention == "padded", graphs=engine.graphs)
                    t_ar = cost(rows, 1)
                    # one row of `rows` tokens: the same linear work as the batched AR step, without its per-row part
                    send({"t_ar_s": t_ar, "t_one_row_s": cost(1, rows),
                          "c": {str(n): cost(rows, 1 + int(n)) / t_ar for n in b["drafts"]}})
                    continue
                if "load" in req:
                    send(serve_load(engine, req["load"]))
                    continue
                result = engine.generate(req["prompt_ids"], int(req["max_new_tokens"]))
                engine.synchronize()
                send({"tokens": result.tokens, "steps": result.steps})
            except Exception as e:  # a bad request must not kill the worker
                send({"error": f"{type(e).__name__}: {e}"})
    if close := getattr(engine, "close", None):  # a server deployment's process
        close()
    return 0


def serve_load(engine, load: dict) -> dict:
    """A ``load`` request answered: every request's tokens in request order, and the target forwards."""
    from specpilot.harness.loadgen import closed_loop

    prompts = [[int(t) for t in p] for p in load["requests"]]
    max_new, concurrency = int(load["max_new_tokens"]), int(load["concurrency"])
    if not prompts or concurrency < 1 or max_new < 1:
        raise ValueError("a load needs requests, concurrency >= 1 and max_new_tokens >= 1")
    decoder = engine.batch_decoder(concurrency, max(map(len, prompts)) + max_new)
    result = closed_loop(decoder, prompts, concurrency, max_new, len(prompts))
    engine.synchronize()
    outputs = {r.prompt_index: r.tokens for r in result.requests}
    return {"outputs": [outputs[i] for i in range(len(prompts))], "steps": len(result.step_rows)}


if __name__ == "__main__":
    status = main()
    # The protocol is over and a server deployment's process is stopped: nothing is left to save, and the
    # interpreter's teardown of torch (~0.4 s on 2 cores) only makes the controller wait, once per worker.
    for stream in (sys.__stdout__, sys.stdout, sys.stderr):  # main() moved sys.stdout; send() flushed the protocol
        stream.flush()
    os._exit(status)
