"""Peak memory bandwidth, matmul FLOP/s and launch time of the timing device (`HardwareMeasured`).

Trusted code in the controller's process: a large device-to-device copy (bytes read + written
over the best of several repeats), a square matmul in the deployment's dtype, and a run of tiny
in-place additions issued back to back (the host's cost of one eager operator launch: on a GPU the
floor of a kernel the host must issue, on a CPU one dispatch); on a GPU the same additions replayed as
one CUDA graph too (``kernel_floor_s``: the device's own floor of a kernel, launches taken off the host).
The cost model divides by these, so they are measured, never looked up.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time


def device_label(device: str) -> str:
    """How `HardwareMeasured` and `ProfileMeasured` name the device: the GPU's name, or the CPU and
    the threads this process runs with (set by `measure` at phase 0, kept for later profiles)."""
    import torch

    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


# the CPU instruction sets a kernel's speed turns on, most capable first (`machine`)
ISA_LEVELS = (("amx", {"amx_tile", "amx_bf16"}), ("avx512-bf16", {"avx512f", "avx512_bf16"}),
              ("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"}))


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo, or None (no such line, or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), None)
    except OSError:
        return None


def cpu_isa() -> str:
    """The most capable of `ISA_LEVELS` this CPU has ("other" when none, or /proc/cpuinfo is unreadable)."""
    flags = set((_cpuinfo("flags") or "").split())
    return next((name for name, needs in ISA_LEVELS if needs <= flags), "other")


def machine(device: str, threads: int | None, dtype: str) -> dict[str, str | int]:
    """The kind of machine a finding was made on, as memory entries carry it: what a timing's outcome
    turns on (the ISA or the GPU, the worker's threads, the dtype). Two machines of one kind are expected to
    rank options alike; a finding from another kind is a hypothesis (`services.master.planner.plan`)."""
    if device.startswith("cuda"):
        return {"device_kind": "cuda", "device": device_label(device), "threads": threads or 0, "dtype": dtype}
    return {"device_kind": "cpu", "device": cpu_isa(), "threads": threads or os.cpu_count() or 1, "dtype": dtype}


def fingerprint(device: str) -> str:
    """What makes timings on this machine comparable: the CPU model, its cores and this host's kernel
    build (and the GPU's name for a CUDA device), hashed."""
    cpu = _cpuinfo("model name") or platform.processor() or platform.machine()
    parts = [cpu, str(os.cpu_count()), platform.release()]
    if device.startswith("cuda"):
        parts.append(device_label(device))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure(device: str = "cpu", dtype: str = "fp32", threads: int | None = None, repeats: int = 5) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32

    def best_of(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return best

    n_bytes = (1 << 30) if cuda else (256 << 20)
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src))
    size = 8192 if cuda else 1024
    a = torch.randn(size, size, device=dev).to(dt)
    b = torch.randn(size, size, device=dev).to(dt)
    mm_s = best_of(lambda: a @ b)
    tiny = torch.zeros(1, device=dev)
    n_launches = 2000

    def launch_run():
        for _ in range(n_launches):
            tiny.add_(1.0)

    launch_s = best_of(launch_run) / n_launches
    kernel_floor_s, graphed = 0.0, ""
    if cuda:  # the same additions captured once and replayed: what a kernel costs the device with no host in the way
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            launch_run()  # warm-up on a side stream, as capture asks
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(graph):
            launch_run()
        kernel_floor_s = best_of(graph.replay) / n_launches
        graphed = ", replayed as one CUDA graph"
    return {"device": device_label(device), "bandwidth_bytes_s": 2 * n_bytes / copy_s, "flops_s": 2 * size**3 / mm_s,
            "launch_s": launch_s, "kernel_floor_s": kernel_floor_s,
            "method": f"best of {repeats}: copy of {n_bytes >> 20} MiB (read + write), {size}^3 matmul in {dtype}, "
                      f"{n_launches} one-element additions{graphed}"}
