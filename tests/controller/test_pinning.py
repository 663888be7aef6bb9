"""Pinning timing workers to cores (``Sandbox.cpus``, ``pinning.timing_cpus``, ``Evaluator.pin_cpus``)."""

import os
import sys

import pytest

from specpilot.sandbox import Sandbox, SandboxError
from specpilot.services.controller.evaluate import Evaluator
from specpilot.services.controller.pinning import parse_cpulist, pick_cores, timing_cpus


def test_cpulists_are_parsed_like_sysfs_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()


def test_cores_come_from_each_devices_node_and_are_never_shared():
    allowed = set(range(32))
    node0, node1 = set(range(16)), set(range(16, 32))
    assert pick_cores([node1], allowed) == [31]  # the top core of the GPU's own node
    assert pick_cores([node0, node1], allowed) == [15, 31]
    assert pick_cores([node0, node0], allowed) == [15, 14]  # two GPUs on one node: two cores
    assert pick_cores([set()], {0, 1}) == [1]  # nothing known: any allowed core
    assert pick_cores([{40, 41}], {0, 1}) == [1]  # the node's cores are not ours to use
    with pytest.raises(SandboxError, match="only 1 usable"):
        pick_cores([set(), set()], {0})


def test_a_cpu_device_gets_one_of_this_process_cores():
    (core,) = timing_cpus(("cpu",))["cpu"]
    assert core in os.sched_getaffinity(0)


def test_every_process_of_a_pinned_sandbox_runs_on_its_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    src = tmp_path / "src"
    src.mkdir()
    # the child a worker starts (a compiler, say) inherits the pin too
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
            "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip())")
    with Sandbox(src=src, models=tmp_path / "none", cpus=(core,)) as sbx:
        out = sbx.run([sys.executable, "-c", code], timeout=60)
        assert sbx.describe()["cpus"] == [core]
    assert out["returncode"] == 0, out["output"]
    assert out["output"].split() == [f"[{core}]", f"[{core}]"]


def test_gpu_workers_are_pinned_by_default_and_cpu_workers_are_not(tmp_path):
    assert Evaluator(tmp_path / "a", "tiny-cpu").workers.cpus("cpu") is None
    ev = Evaluator(tmp_path / "b", "tiny-cpu", pin_cpus=True)
    assert ev.workers.cpus("cpu") is not None and set(ev.workers.cpus("cpu")) <= os.sched_getaffinity(0)
    assert Evaluator(tmp_path / "c", "tiny-cuda", device="cuda:0").pin_cpus
    assert not Evaluator(tmp_path / "d", "tiny-cuda", device="cuda:0", pin_cpus=False).pin_cpus


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_gets_a_core_on_its_own_numa_node():
    from specpilot.services.controller.pinning import device_local_cpus

    local = device_local_cpus("cuda:0")
    assert local, "no local_cpulist for cuda:0's PCI address"
    (core,) = timing_cpus(("cuda:0",))["cuda:0"]
    assert core in local or not local & os.sched_getaffinity(0)
