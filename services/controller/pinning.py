"""Where the controller's timing workers run: one core beside each timing GPU.

A fresh GPU worker's speed follows the core the scheduler gives it, so each timing device's workers
are pinned (`timing_cpus`, passed to `specpilot.sandbox.Sandbox.cpus`). Pure helpers (`parse_cpulist`,
`pick_cores`) beside the one that reads the machine (`device_local_cpus`).
"""

from __future__ import annotations

import os
from pathlib import Path

from specpilot.sandbox import SandboxError


def parse_cpulist(text: str) -> set[int]:
    """CPU ids of a Linux cpulist such as ``"0-7,16-23"`` (sysfs ``local_cpulist``)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pick_cores(local: list[set[int]], allowed: set[int]) -> list[int]:
    """One core per device, each from the device's local cores where it may (else any allowed core),
    all different, taken from the top (low-numbered cores tend to take the machine's interrupts and
    housekeeping). ``local[i]`` empty: nothing known about device ``i``."""
    taken: list[int] = []
    for near in local:
        free = sorted(allowed - set(taken))
        if not free:
            raise SandboxError(f"{len(local)} devices but only {len(allowed)} usable CPUs")
        pool = [c for c in free if c in near] or free
        taken.append(pool[-1])
    return taken


def device_local_cpus(device: str) -> set[int]:
    """The CPUs on the NUMA node of a CUDA device (its PCI function's ``local_cpulist``); empty
    when unknown (a CPU device, no sysfs, a torch without PCI ids)."""
    if not device.startswith("cuda"):
        return set()
    try:
        import torch

        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev.index if dev.index is not None else torch.cuda.current_device())
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text())
    except (AttributeError, OSError, RuntimeError, ValueError):
        return set()


def timing_cpus(devices: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The core each timing device's workers are pinned to: one core beside each GPU.

    A fresh GPU worker's speed follows the core the scheduler gives it (a 135M model's step is mostly
    the host's launches and syncs): per-worker levels that no number of requests per trial averages
    out (docs/FIGURES.md, "Lab notes moved from code"). Workers that run one at a time (one device,
    interleaved or not) share that core; two devices get two cores."""
    allowed = os.sched_getaffinity(0)
    cores = pick_cores([device_local_cpus(d) for d in devices], allowed)
    return {d: (c,) for d, c in zip(devices, cores, strict=True)}
