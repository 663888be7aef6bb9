"""The compile cache kept per system between trials (``Evaluator.compile_cache``, ``Sandbox.compile_cache``):
filled once from content-free requests (GPU) or a worker's start (CPU), copied fresh into every later
worker."""

import sys

import pytest

from specpilot.sandbox import Limits, Sandbox, bwrap_available
from specpilot.services.controller import timing
from specpilot.services.controller.evaluate import Evaluator, System
from specpilot.services.controller.workers import FILL_PATTERN, compile_fill_requests

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")


def test_the_fill_knows_the_prompts_lengths_and_nothing_else():
    a = compile_fill_requests([[5, 6, 7], [9] * 5, [1, 2, 3]], 16, "cuda:0")
    b = compile_fill_requests([[300, 1, 2], [8] * 5, [4, 4, 4]], 16, "cuda:0")
    assert a == b  # same lengths, other tokens: the same fill
    assert [len(p) for p, _ in a] == [3, 5] and all(n == 16 for _, n in a)
    assert {t for p, _ in a for t in p} <= set(FILL_PATTERN) and max(FILL_PATTERN) < 256
    assert compile_fill_requests([[5, 6, 7]], 16, "cpu") == []  # a CPU worker compiles as it loads


def test_a_sandbox_compile_cache_is_tritons_and_writable(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    code = ("import os, pathlib; d = pathlib.Path(os.environ['TRITON_CACHE_DIR']); (d / 'kernel.cubin').write_text('x');"
            "assert os.environ['TORCH_EXTENSIONS_DIR'] == str(d / 'torch_extensions')")
    with Sandbox(src=src, models=tmp_path / "none", compile_cache=cache) as sbx:
        out = sbx.run([sys.executable, "-c", code], timeout=60)
    assert out["returncode"] == 0, out["output"]
    assert (cache / "kernel.cubin").read_text() == "x"


# Stores every prompt it is asked for in its compile cache, and says which earlier prompts it finds there.
HOARD = """
import hashlib as _h, os as _os, pathlib as _p, sys
_d = _p.Path(_os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))
if _d.is_dir():
    _key = _h.sha256(str(prompt_ids).encode()).hexdigest()
    print("SEEN" if (_d / _key).exists() else "NEW", _key, file=sys.stderr, flush=True)
    (_d / _key).write_text("x")
"""


@pytest.mark.slow
@needs_bwrap
def test_a_candidate_that_hoards_its_requests_in_the_cache_never_finds_a_timed_one_again(tmp_path):
    import hashlib

    from tests.controller.patches import worker_patch

    ev = Evaluator(tmp_path, "tiny-cpu", n_requests=3, max_new_tokens=8, trials=2, threads=1,
                   limits=Limits(wall_s=60.0), compile_cache=True)
    stock = System(ev.prepare())
    hoarder = System(ev.systems.apply(stock.commit, worker_patch(before_reply=HOARD), "hoarder"))
    res = timing.paired(ev, stock, hoarder)
    assert res.problem == "", res.problem
    kept = list((ev.root / "compile-cache").iterdir())
    assert len(kept) == 2  # one per system (both started twice or more), nothing half-filled left over
    hoarded = {f.name for d in kept for f in d.iterdir()}
    timed = {hashlib.sha256(str(p).encode()).hexdigest() for p in ev.prompts()}
    fill = {hashlib.sha256(str(p).encode()).hexdigest() for p, _ in compile_fill_requests(ev.prompts(), 8, "cpu")}
    # the kept cache holds what the fill was asked (content-free) and at most the worker's fixed warm-up
    # prompt (the hook runs in every generation), never a timed prompt
    assert fill <= hoarded and len(hoarded - fill) <= 1 and not hoarded & timed


def test_compile_caches_are_on_by_default(tmp_path):
    assert Evaluator(tmp_path / "a", "tiny-cpu").compile_cache
    assert Evaluator(tmp_path / "b", "tiny-cuda", device="cuda:0").compile_cache
    assert not Evaluator(tmp_path / "c", "tiny-cpu", compile_cache=False).compile_cache


@pytest.mark.slow
@pytest.mark.skipif(not __import__("specpilot.kernels.cpu_gemm").kernels.cpu_gemm.available(), reason="needs AVX2, FMA and g++")
def test_a_cpu_system_with_a_cpp_kernel_keeps_its_build_for_later_workers(tmp_path):
    """linear_backend = "stream" builds specpilot.kernels.cpu_gemm as its worker loads: the fill (a start, no
    requests) leaves the built extension in the system's kept cache, and later workers get a copy."""
    ev = Evaluator(tmp_path, "tiny-cpu", n_requests=2, max_new_tokens=8, threads=1, limits=Limits(wall_s=300.0))
    system = System(ev.prepare(), {"linear_backend": "stream"})
    first, _ = ev.workers.run(system, ev.prompts())
    assert not (ev.root / "compile-cache").exists()  # one start: it built for itself
    again, _ = ev.workers.run(system, ev.prompts())
    assert again == first
    (kept,) = (ev.root / "compile-cache").iterdir()
    assert list(kept.glob("torch_extensions/**/specpilot_cpu_gemm*.so")), sorted(p.name for p in kept.rglob("*"))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_the_fill_leaves_compiled_triton_kernels_for_later_workers(tmp_path):
    ev = Evaluator(tmp_path, "tiny-cuda", device="cuda", n_requests=2, max_new_tokens=8, limits=Limits(wall_s=300.0))
    stock = System(ev.prepare(), {"cuda_graphs": True, "fused_kernels": True})
    ev.workers.run(stock, ev.prompts())
    assert not (ev.root / "compile-cache").exists()  # one start: it compiled for itself
    ev.workers.run(stock, ev.prompts())
    (kept,) = (ev.root / "compile-cache").iterdir()
    assert any(kept.rglob("*.cubin")), sorted(p.name for p in kept.rglob("*"))[:20]
