"""Arrival counters for kernels whose programs merge their own partial results (split work).

A kernel that splits one output tile over several programs can finish it in the same launch: each
program stores its partial, counts itself in with an atomic add, and the program that sees the
count reach the number of splits merges the partials in a fixed order and resets the counter to 0.
The merge order never depends on which program arrives last, so results stay deterministic.

Contract: the counters are zero between launches (every launch leaves its counters at 0), so a
CUDA graph that captured such a kernel needs no memset. They are allocated on first use, which
must happen before any capture (the engine's and the benches' warm-ups run eagerly first).
Kernels on one stream may share them (launches are serialised); launches of counter-using kernels
on several streams at once must not.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Buffers outgrown by a larger request stay allocated: a CUDA graph captured earlier still holds their
# address, and its replays would write into whatever reused freed memory.
_OUTGROWN: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device``, all 0."""
    device = torch.device(device)
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return counters
