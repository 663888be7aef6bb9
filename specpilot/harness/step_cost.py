"""What a batched step costs: the forward of B rows of N + 1 new tokens against B rows of one token.

- `step_cost(model, rows, tokens, context, reps)`: median seconds of one ragged forward of ``rows`` rows of
  ``tokens`` new tokens each at ``context`` cached slots (``padded``: attention as one call; ``graphs``: as
  the batched decoder replays it under CUDA graphs). The sandboxed worker answers the controller's
  ``batch_cost`` with it (the cost model's batched ceiling and overhead).
- `cost_table(model, batch_sizes, ns, context, reps)`: ``t(N, B)`` and ``c(N, B) = t(N, B) / t(0, B)``, AR's
  own growth with rows, and the ceiling ``(N + 1) / c(N, B)`` were every draft accepted (`specpilot bench`
  on a batched deployment, ``bench/batch_cost.py``).

Only measures; progress goes to stderr.
"""

from __future__ import annotations

import statistics
import time

import torch

from specpilot import output


def step_cost(model, rows: int, tokens: int, context: int, reps: int, padded: bool = False,
              graphs: bool = False) -> float:
    """Median seconds of one ragged forward of ``rows`` rows of ``tokens`` new tokens each, every row at
    ``context`` cached slots (their contents do not change the work); ``padded``: attention as one call
    over every row (the ``batch_attention = "padded"`` step); ``graphs``: the step as the batched decoder
    replays it under ``cuda_graphs`` (`GraphRunner.run_rows`, every row a chain)."""
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.tree import DraftTree

    cache = model.new_cache(context + tokens + 1, batch=rows)
    device = model.device
    ids = torch.randint(0, model.cfg.vocab_size, (rows * tokens,), device=device)
    if graphs:
        runner = GraphRunner(model, cache)
        chains = {r: (DraftTree(ids[r * tokens:(r + 1) * tokens].tolist(), list(range(-1, tokens - 1))), context)
                  for r in range(rows)}
        step = lambda: runner.run_rows(chains)[0]  # noqa: E731
    else:
        positions = torch.arange(context, context + tokens, device=device).repeat(rows)
        args = (ids, positions, cache, [context] * rows, [tokens] * rows, list(range(rows)), [None] * rows)
        step = lambda: model.forward_ragged(*args, padded=padded)[0].argmax(-1)  # noqa: E731
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step().tolist()  # the step's sync, as decoding has it
            if i:  # the first call pays one-off costs (a graph's capture)
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_table(model, batch_sizes: list[int], ns: list[int], context: int, reps: int, graphs: bool = False) -> dict:
    """``t(N, B)`` in ms and ``c(N, B) = t(N, B) / t(0, B)`` for B rows of N drafts plus a root each
    (``graphs``: replayed as CUDA graphs, `step_cost`)."""
    from rich.progress import Progress

    rows = []
    step_cost(model, max(batch_sizes), max(ns, default=0) + 1, context, reps=1, graphs=graphs)  # warm-up
    with Progress(transient=True, console=output.console(stderr=True)) as progress:
        task = progress.add_task("c(N, B)", total=len(batch_sizes) * (len(ns) + 1))
        ar1 = None
        for b in batch_sizes:
            ar = step_cost(model, b, 1, context, reps, graphs=graphs)
            ar1 = ar1 or ar
            progress.advance(task)
            row = {"b": b, "t_ar_ms": 1e3 * ar, "ar_scaling": ar / ar1, "c": {}, "ceiling": {}}
            for n in ns:
                c = step_cost(model, b, n + 1, context, reps, graphs=graphs) / ar
                row["c"][str(n)] = c
                row["ceiling"][str(n)] = (n + 1) / c
                progress.advance(task)
            rows.append(row)
    return {"context": context, "reps": reps, "graphs": graphs, "rows": rows}

