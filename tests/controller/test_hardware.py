"""The controller's device measurement (`specpilot.services.controller.hardware.measure`): peaks and floors
the cost model divides by. On the CPU here; the kernel floor of a CUDA graph on a GPU (``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch

from specpilot.services.controller import hardware


def test_the_cpu_is_measured_and_has_no_kernel_floor():
    threads = torch.get_num_threads()
    try:
        hw = hardware.measure("cpu", "fp32", threads=1, repeats=2)
    finally:  # measure sets the process's torch threads: the rest of the suite keeps its own
        torch.set_num_threads(threads)
    assert hw["bandwidth_bytes_s"] > 1e8 and hw["flops_s"] > 1e8  # a copy and a matmul ran
    assert 0 < hw["launch_s"] < 1e-3
    assert hw["kernel_floor_s"] == 0.0 and "graph" not in hw["method"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_kernels_floor_is_measured_in_a_graph_below_its_eager_launch():
    hw = hardware.measure("cuda", "bf16", repeats=3)
    assert 0 < hw["kernel_floor_s"] < hw["launch_s"] and hw["kernel_floor_s"] < 2e-5
    assert "CUDA graph" in hw["method"]
