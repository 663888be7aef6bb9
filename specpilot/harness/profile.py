"""Where a decode step's time goes, by kernel class: the profile and operator launches the cost model reads.

- `profile(engine, prompt, max_new)`: mean milliseconds a decode step in each kernel class (attention core,
  q/k/v/o/gate/up/down linears, LM head, norms, embedding), the drafter and the host (step time minus all of
  those). On a CPU a class's time is the wall clock inside its modules; on a GPU the device time of the
  kernels launched inside them (the PyTorch profiler), so a launch-bound step shows up as host time; a
  system replaying CUDA graphs takes each class's time from the same engine run eagerly.
- `launches(engine, prompt, max_new)`: mean operator launches a decode step in each kernel class.

The sandboxed timing worker answers the controller's ``measure`` with these (`specpilot.harness.replay`);
`specpilot bench` prints them. Only measures.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specpilot.engine.api import Engine
from specpilot.harness.speed import sync


def _kernel_class(name: str, module: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                "qkv_proj", "gate_up_proj"):  # the last two: fused_kernels (specpilot.engine.fused)
        return leaf
    if leaf == "core":
        return "attention"
    if leaf.endswith("norm"):
        return "norms"
    if leaf == "embed":
        return "embedding"
    return None


def _decode_hooks(model: torch.nn.Module, enter, leave) -> list:
    """Hooks calling ``enter(cls, module)`` / ``leave(cls, module)`` around every kernel-class module
    in the decode steps of one generation (its first forward, the prefill, is skipped)."""
    in_prefill = [True]
    calls = [0]

    def count(mod, args):
        calls[0] += 1
        in_prefill[0] = calls[0] == 1

    def pre(cls):
        def hook(mod, args):  # returns None: a pre-hook's result would replace the module's inputs
            if not in_prefill[0]:
                enter(cls, mod)
        return hook

    def post(cls):
        def hook(mod, args, out):  # returns None: a hook's result would replace the module's output
            if not in_prefill[0]:
                leave(cls, mod)
        return hook

    handles = [model.register_forward_pre_hook(count)]
    for name, mod in model.named_modules():
        if cls := _kernel_class(name, mod):
            handles += [mod.register_forward_pre_hook(pre(cls)), mod.register_forward_hook(post(cls))]
    return handles


PROFILE_RANGE = "specpilot::"  # prefix of the profiler ranges `profile` opens around kernel classes


def profile(engine: Engine, prompt: list[int], max_new: int) -> dict:
    """Mean milliseconds per decode step spent in each kernel class, the drafter and the host.

    On a CPU a class's time is the wall clock inside its modules. On a GPU it is the time its
    kernels ran on the device (the PyTorch profiler's CUPTI records, summed over the kernels
    launched inside the class's modules), not the time between CUDA events around the modules: in
    a launch-bound eager step the device waits for the host, and events would count that wait as
    the class's kernel time. Where the profiler records no kernels (no CUPTI), CUDA events are used."""
    device = engine.device
    cuda = device.type == "cuda"
    if cuda and engine.graphs:
        return _profile_graphed(engine, prompt, max_new)
    if cuda and (out := _profile_device_kernels(engine, prompt, max_new)) is not None:
        return out
    totals: dict[str, float] = defaultdict(float)
    pending: list[tuple[str, object, object]] = []
    starts: dict[int, object] = {}

    def enter(cls, mod):
        if cuda:
            starts[id(mod)] = torch.cuda.Event(enable_timing=True)
            starts[id(mod)].record()
        else:
            starts[id(mod)] = time.perf_counter()

    def leave(cls, mod):
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            pending.append((cls, starts.pop(id(mod)), ev))
        else:
            totals[cls] += time.perf_counter() - starts.pop(id(mod))

    handles = _decode_hooks(engine.model, enter, leave)
    try:
        r = engine.generate(prompt, max_new)
        sync(device)
    finally:
        for h in handles:
            h.remove()
    for cls, a, b in pending:
        totals[cls] += a.elapsed_time(b) / 1e3
    return _per_step(totals, r)


def _profile_graphed(engine: Engine, prompt: list[int], max_new: int) -> dict:
    """`profile` of a system that replays its steps as CUDA graphs. A replay bypasses the modules, so no
    class would be seen (the cost model's kernel and overhead factors read 1.00 on the H100, 2026-12-05).
    A graph replays the eager step's kernels, so each class's device time comes from the same engine
    run eagerly; the drafter's time, the step's and so the host's share come from the graphed run."""
    graphed = engine.generate(prompt, max_new)
    sync(engine.device)
    engine.graphs = False
    try:
        eager = profile(engine, prompt, max_new)
    finally:
        engine.graphs = True
    own = _per_step({}, graphed)
    out = {k: v for k, v in eager.items() if k not in own}
    out["drafter"] = own["drafter"]
    out["host_overhead"] = max(0.0, own["step_total"] - sum(out.values()))
    out["step_total"] = own["step_total"]
    return out


def _profile_device_kernels(engine: Engine, prompt: list[int], max_new: int) -> dict | None:
    """`profile` on a GPU from the profiler's kernel records; None when it recorded none."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    open_ranges: list = []

    def enter(cls, mod):
        rf = record_function(PROFILE_RANGE + cls)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(cls, mod):
        open_ranges.pop().__exit__(None, None, None)

    handles = _decode_hooks(engine.model, enter, leave)
    try:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = engine.generate(prompt, max_new)
            sync(engine.device)
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, float] = defaultdict(float)
    for e in prof.events():
        # The host-side range (the profiler may also mirror it as a device-side annotation, which
        # spans the device's idle gaps too); its device time sums the kernels launched inside it.
        if e.name.startswith(PROFILE_RANGE) and e.device_type == torch.autograd.DeviceType.CPU:
            totals[e.name[len(PROFILE_RANGE):]] += e.device_time_total / 1e6
    return _per_step(totals, r) if any(totals.values()) else None


def _per_step(totals: dict[str, float], r) -> dict:
    """Milliseconds per decode step: the classes' ``totals`` (seconds), the drafter, the host."""
    steps = max(1, r.steps)
    step_s = (sum(r.draft_s) + sum(r.verify_s)) / steps
    out = {k: 1e3 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["drafter"] = 1e3 * sum(r.draft_s) / steps
    out["host_overhead"] = max(0.0, 1e3 * step_s - sum(out.values()))
    out["step_total"] = 1e3 * step_s
    return out


def launches(engine: Engine, prompt: list[int], max_new: int = 16) -> dict[str, float]:
    """Mean operator launches per decode step in each kernel class.

    Every aten operator that is not a view is one launch: on a GPU at least one kernel the host must
    issue, on a CPU one dispatch. The cost model charges ``launches x launch time`` of a class to
    *overhead* rather than *kernel*: a launch-bound class is fixed by fewer launches (graphs, fusion),
    not by faster kernels. Steps replayed as CUDA graphs bypass the modules and count nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    metadata_only = {aten._unsafe_view.default, aten.detach.default, aten.lift_fresh.default}  # not tagged views
    current: list[str] = []
    counts: dict[str, int] = defaultdict(int)

    class CountLaunches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if current and not func.is_view and func not in metadata_only:
                counts[current[-1]] += 1
            return func(*args, **(kwargs or {}))

    handles = _decode_hooks(engine.model, lambda cls, mod: current.append(cls), lambda cls, mod: current.pop())
    try:
        with CountLaunches():
            r = engine.generate(prompt, max_new)
    finally:
        for h in handles:
            h.remove()
    return {cls: n / max(1, r.steps) for cls, n in sorted(counts.items())}

