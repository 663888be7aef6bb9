"""The CUDA C++ tensor-core W12 kernel (``kernels/w12/cuda_mma.py``) against the PyTorch
reference on a GPU (``gpu`` marker): shapes with K tails and padding, every launch variant, escapes
(NaN, inf, denormals, out-of-window), int64 escape indices, determinism, CUDA graph replay, and the
dispatch of ``w12_matmul``. On the CPU: the configuration rule, and that the kernel file compiles for
sm_90a with ``nvcc`` where one is installed (without spills in the decode loop's kernels)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpilot.kernels.w12 import decode, pack
from specpilot.kernels.w12.cuda_mma import CSRC, MmaConfig, pick_mma_config, tuned_mma_config
from specpilot.kernels.w12.format import W12Weight

from .test_w12_kernel import check_close, gpu_inputs, reference, with_every_escape

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pick_is_pure_and_splits_small_grids():
    a = pick_mma_config(4, 4096, 4096, 132)
    assert a == pick_mma_config(4, 4096, 4096, 132)
    assert a.splits > 1  # 128 tiles of 32 rows: splits fill 132 multiprocessors
    big = pick_mma_config(4, 128256, 4096, 132)
    assert big.splits == 1  # 4008 tiles already fill the card
    # the pipeline's registers: 4 chunks a step up to 8 rows of x, 2 up to 16, 1 beyond
    assert [pick_mma_config(m, 28672, 4096, 132).chunks for m in (1, 8, 9, 16, 17, 32)] == [4, 4, 2, 2, 1, 1]
    # a card's swept winners come from its own table, and only for the M class swept
    h100 = "NVIDIA H100 80GB HBM3"
    assert pick_mma_config(4, 28672, 4096, 132, h100) == MmaConfig(chunks=4, warps=2)
    assert tuned_mma_config(4, 28672, 4096, h100) == MmaConfig(chunks=4, warps=2)
    assert tuned_mma_config(16, 28672, 4096, h100) is None and tuned_mma_config(4, 28672, 4096, "NVIDIA H200") is None
    assert pick_mma_config(1, 4096, 576, 132).splits == 1  # two 128-column steps: nothing to split


def test_the_tensor_core_mode_is_checked():
    from specpilot.kernels.w12.kernel import use_tensor_core_kernel

    before = use_tensor_core_kernel()
    try:
        assert use_tensor_core_kernel(True) == "on" and use_tensor_core_kernel(False) == "off"
        assert use_tensor_core_kernel("auto") == "auto"
        with pytest.raises(ValueError, match="tensor-core mode"):
            use_tensor_core_kernel("sometimes")
    finally:
        use_tensor_core_kernel(before)


def test_launches_fit_the_rows_of_x():
    # two steps' fragments in registers: chunks x 8-row groups of x <= 4, for 1-32 rows of x (a 16-draft
    # verification has 17)
    assert MmaConfig(chunks=4).fits(8) and not MmaConfig(chunks=4).fits(9)
    assert MmaConfig(chunks=2).fits(16) and not MmaConfig(chunks=2).fits(17)
    assert MmaConfig(chunks=1).fits(17) and MmaConfig(chunks=1).fits(32) and not MmaConfig(chunks=1).fits(33)
    assert not MmaConfig(chunks=1).fits(0)
    assert MmaConfig(chunks=4, warps=2, splits=3).key() == "mma_r1_c4_w2_s3_pipe"  # the records' keys


def test_a_record_of_a_removed_tensor_core_launch_names_the_patch_that_re_adds_it():
    from specpilot.kernels.w12 import cuda_mma, kernel

    # tuned files and bench records of before 2026-12-07 carry the removed kinds' fields: with the values of the
    # launch that remains they are read as it, otherwise refused with the patch's name
    old = {"rows": 1, "chunks": 4, "warps": 2, "splits": 1, "pipelined": True, "stages": 0, "persistent": 0}
    assert kernel.launch_from_fields(old) == MmaConfig(chunks=4, warps=2)
    for removed in ({"pipelined": False}, {"rows": 2}, {"stages": 4, "pipelined": False},
                    {"stages": 2, "persistent": 8, "pipelined": False}):
        with pytest.raises(ValueError, match="removed-2026-12-07-tma-persistent-rows2-unpipelined.patch"):
            kernel.launch_from_fields({**old, **removed})
    with pytest.raises(ValueError, match="left the package"):
        kernel.tuned_from_json({"Card": {"4096x4096": {"4": {**old, "stages": 4, "pipelined": False}}}})
    assert (Path(__file__).resolve().parents[2] / cuda_mma.REMOVED_LAUNCHES).is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernel_compiles_for_hopper(tmp_path):
    # -split-compile=0: ptxas on every core (on 2 cores 60 s against 102 s one kernel at a time), as the build does
    proc = subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-split-compile=0", "-Xptxas", "-v", "-c",
                           str(CSRC / "w12_mma.cu"), "-o", str(tmp_path / "w12_mma.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = re.findall(r"Compiling entry function '(\w+)'", proc.stderr)
    # row groups {1, 2, 3, 4} x chunks {1, 2, 4} where chunks x groups <= 4: 3 + 2 + 1 + 1
    assert len(kernels) == 7
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    # the one-row-group, one-tile variants (M <= 8, the commonest) must not spill at all
    assert spills and all(int(s) <= 64 for s in spills), proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# CUDA


def _variants(m):
    return [cfg for chunks in (1, 2, 4) for warps in (1, 4, 8) for splits in (1, 3, 8)
            if (cfg := MmaConfig(chunks=chunks, warps=warps, splits=splits)).fits(m)]


# (N, K): Llama shapes, SmolLM2's K = 576 (kh = 288: a 32-column tail), K = 2080 (a 16-column tail),
# K = 1000 (planes padded past K: x must not be read there), N not a multiple of any tile
SHAPES = [(4096, 4096), (123, 14336), (1536, 576), (576, 1536), (300, 2080), (77, 1000)]


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 17, 32])
def test_matches_reference(n, k, m):
    from specpilot.kernels.w12.cuda_mma import w12_mma_matmul

    x, w = gpu_inputs(n, k, m, torch.bfloat16, seed=n + k + m)
    p = pack(w)
    y = w12_mma_matmul(x, p)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = reference(x.float(), decode(p).float())
    check_close(y, ref, rtol=1e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 17, 27])
def test_every_variant_with_escapes(m):
    from specpilot.kernels.w12.cuda_mma import w12_mma_matmul

    n, k = 300, 2080
    x, w = gpu_inputs(n, k, m, torch.bfloat16, seed=m)
    with_every_escape(w)
    p = pack(w)
    assert p.escapes >= 104
    ref = reference(x.float(), w.float())
    wide = W12Weight(n=p.n, k=p.k, low=p.low, nib=p.nib, e0=p.e0, esc_ptr=p.esc_ptr, esc_idx=p.esc_idx.long(),
                     esc_val=p.esc_val)
    for cfg in _variants(m):
        y = w12_mma_matmul(x, p, cfg)
        check_close(y, ref, rtol=1e-2)
        assert torch.equal(y.view(torch.int16), w12_mma_matmul(x, p, cfg).view(torch.int16)), cfg
        assert torch.equal(y.view(torch.int16), w12_mma_matmul(x, wide, cfg).view(torch.int16)), cfg
        if cfg.warps > 1:  # a warp's tile is the same work in a block of one warp: the same bits
            one = MmaConfig(chunks=cfg.chunks, warps=1, splits=cfg.splits)
            assert torch.equal(y.view(torch.int16), w12_mma_matmul(x, p, one).view(torch.int16)), cfg


@gpu
@needs_cuda
def test_deterministic_and_graph_replay():
    x, w = gpu_inputs(4096, 4096, 8, torch.bfloat16, seed=0)
    p = pack(w)
    for cfg in (MmaConfig(chunks=2, warps=4, splits=8), MmaConfig(chunks=4, warps=2, splits=4),
                MmaConfig(chunks=1, warps=8, splits=3)):
        _check_deterministic_and_replayed(x, p, cfg)


def _check_deterministic_and_replayed(x, p, cfg):
    from specpilot.kernels.w12.cuda_mma import w12_mma_matmul

    ys = [w12_mma_matmul(x, p, cfg).view(torch.int16).clone() for _ in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w12_mma_matmul(x, p, cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w12_mma_matmul(x, p, cfg)
    for _ in range(3):  # the split counters are back at zero after every replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), ys[0]), cfg


@gpu
@needs_cuda
def test_w12_matmul_routes_bf16_to_tensor_cores():
    from specpilot.kernels.w12 import cuda_mma
    from specpilot.kernels.w12.kernel import pick_config, use_tensor_core_kernel, w12_matmul

    x, w = gpu_inputs(1536, 576, 4, torch.bfloat16, seed=3)
    p = pack(w)
    from specpilot.kernels.w12.cuda_mma import w12_mma_matmul

    before = use_tensor_core_kernel()
    try:
        use_tensor_core_kernel(True)
        assert torch.equal(w12_matmul(x, p).view(torch.int16), w12_mma_matmul(x, p).view(torch.int16))
        use_tensor_core_kernel(False)
        y_triton = w12_matmul(x, p)
        assert torch.equal(y_triton.view(torch.int16), w12_matmul(x, p, pick_config(4, 1536, 576)).view(torch.int16))
        use_tensor_core_kernel("auto")  # an unswept shape stays on Triton; a swept winner goes to tensor cores
        assert torch.equal(w12_matmul(x, p).view(torch.int16), y_triton.view(torch.int16))
        swept = MmaConfig(chunks=1, warps=4, splits=2)
        cuda_mma.TUNED.setdefault(torch.cuda.get_device_name(), {})[(1536, 576)] = {4: swept}
        assert torch.equal(w12_matmul(x, p).view(torch.int16), w12_mma_matmul(x, p, swept).view(torch.int16))
    finally:
        cuda_mma.TUNED.get(torch.cuda.get_device_name(), {}).pop((1536, 576), None)
        use_tensor_core_kernel(before)
    check_close(y_triton, reference(x.float(), w.float()), rtol=1e-2)
    # outside the contract (fp32 x, 33 rows) w12_matmul stays on Triton and still answers
    check_close(w12_matmul(x.float(), p), reference(x.float(), w.float()), rtol=1e-5)
    x33 = torch.randn(33, 576, device="cuda", dtype=torch.bfloat16)
    check_close(w12_matmul(x33, p), reference(x33.float(), w.float()), rtol=1e-2)
    with pytest.raises(ValueError, match="does not take 17 rows"):
        w12_mma_matmul(torch.randn(17, 576, device="cuda", dtype=torch.bfloat16), p, MmaConfig(chunks=2))


def test_the_bench_sweeps_launches_the_kernel_takes_and_the_profile_reads_their_keys():
    from bench.w12_bench import sweep_configs
    from bench.w12_profile import parse_case

    for m in (1, 8, 9, 16, 17, 32):
        cfgs = sweep_configs(m, ("mma",))
        assert cfgs and all(isinstance(c, MmaConfig) and c.fits(m) for c in cfgs)
        for c in cfgs:  # every key names its launch: ncu-w12 and --write-tuned readers rebuild it from the key
            assert parse_case(f"4096x4096:{m}:{c.key()}") == (4096, 4096, m, c)
    for c in sweep_configs(4, ("fma", "dot")):
        assert parse_case(f"4096x4096:4:{c.key()}") == (4096, 4096, 4, c)
    for key in ("tma_c4_w4_s1_st2", "tma_r2_c1_w8_s2_st2_p1", "mma_r2_c1_w4_s1_pipe", "mma_r1_c2_w4_s8"):
        with pytest.raises(SystemExit, match="left the package"):
            parse_case(f"4096x4096:1:{key}")


def test_a_tuned_table_round_trips_and_a_bad_one_is_named(tmp_path):
    from specpilot.kernels.w12 import kernel

    triton_tile = kernel.Config(bm=4, bn=8, bj=512, use_dot=False, num_warps=2, num_stages=1)
    table = {"Some Card": {(4096, 4096): {16: MmaConfig(chunks=2, warps=4, splits=2), 4: triton_tile},
                           (6144, 4096): {1: MmaConfig(chunks=4, warps=2)}}}
    assert kernel.tuned_from_json(kernel.tuned_to_json(table)) == table
    with pytest.raises(ValueError, match="NxK"):
        kernel.tuned_from_json({"Some Card": {"4096": {"16": {}}}})
    with pytest.raises(ValueError, match="MmaConfig or Config fields"):
        kernel.tuned_from_json({"Some Card": {"4096x4096": {"16": {"lanes": 3}}}})
    # the file named by the environment, read in a fresh process when the dispatch is imported: its tensor-core
    # launches go to the card's tensor-core table, its Triton tiles to pick_config on that card (on that card only)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(kernel.tuned_to_json(table)))
    code = ("from specpilot.kernels.w12.kernel import pick_config as p, tuned_mma_config as t; "
            "print(t(9, 4096, 4096, 'Some Card').key(), t(1, 4096, 4096, 'Some Card'), "
            "p(3, 4096, 4096, 'Some Card').key(), p(3, 4096, 4096, 'Other Card') == p(3, 4096, 4096))")
    env = {**os.environ, kernel.TUNED_ENV: str(path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["mma_r1_c2_w4_s2_pipe", "None", triton_tile.key(), "True"]
    assert kernel.pick_config(3, 4096, 4096, "Some Card") != triton_tile  # this process read no file
    path.write_text("{not json")
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--write-tuned" in bad.stderr


def test_a_record_of_a_triton_split_k_launch_names_the_patch_that_re_adds_it():
    from specpilot.kernels.w12 import kernel

    # tuned files and bench records of before 2026-12-07 carry "split": 1 is the launch that remains
    old = {"bm": 16, "bn": 32, "bj": 256, "split": 1, "use_dot": True, "num_warps": 4, "num_stages": 3, "asm": True}
    assert kernel.launch_from_fields(old) == kernel.Config(bm=16, bn=32, bj=256, use_dot=True, num_stages=3)
    assert kernel.launch_from_fields(old).key() == "dot_bm16_bn32_bj256_s1_w4_st3"  # the records' key
    with pytest.raises(ValueError, match="removed-2026-12-07-triton-split-k.patch"):
        kernel.launch_from_fields({**old, "split": 2})
    with pytest.raises(ValueError, match="split-K left the package"):
        kernel.tuned_from_json({"Card": {"4096x4096": {"32": {**old, "split": 2}}}})
    assert (Path(__file__).resolve().parents[2] / kernel.REMOVED_SPLIT_K).is_file()


def test_a_tuned_entry_of_one_kind_replaces_the_other_kinds_for_its_case(monkeypatch):
    from specpilot.kernels.w12 import cuda_mma, kernel

    monkeypatch.setattr(cuda_mma, "TUNED", {})
    monkeypatch.setattr(kernel, "TUNED", cuda_mma.TUNED)
    monkeypatch.setattr(kernel, "TUNED_TRITON", {})
    mma = MmaConfig(chunks=2, warps=4, splits=2)
    tile = kernel.Config(bm=16, bn=32, bj=128, use_dot=True, num_warps=4, num_stages=2)
    kernel.merge_tuned({"Card": {(4096, 4096): {16: mma}}})
    assert cuda_mma.tuned_mma_config(12, 4096, 4096, "Card") == mma
    kernel.merge_tuned({"Card": {(4096, 4096): {16: tile}}})
    assert cuda_mma.tuned_mma_config(12, 4096, 4096, "Card") is None
    assert kernel.pick_config(12, 4096, 4096, "Card") == tile
    kernel.merge_tuned({"Card": {(4096, 4096): {16: mma}}})
    assert kernel.pick_config(12, 4096, 4096, "Card") != tile and cuda_mma.tuned_mma_config(12, 4096, 4096, "Card") == mma


def test_the_bench_keeps_only_launches_that_beat_the_triton_kernels_own_choice():
    from dataclasses import asdict

    from bench.w12_bench import winners
    from specpilot.kernels.w12.kernel import Config, pick_config

    own = pick_config(4, 4096, 4096, "Card")
    tile = Config(bm=4, bn=8, bj=512, use_dot=False, num_warps=2, num_stages=1)
    mma = MmaConfig(chunks=4, warps=2)
    records = [{"shape": [4096, 4096], "m": 4, "us": 9.0, "triton_us": 10.0, "launch": asdict(tile)},
               {"shape": [4096, 4096], "m": 16, "us": 9.0, "triton_us": 10.0, "launch": asdict(mma)},
               {"shape": [6144, 4096], "m": 1, "us": 11.0, "triton_us": 10.0, "launch": asdict(mma)},  # slower
               {"shape": [6144, 4096], "m": 4, "us": 9.0, "triton_us": 10.0,  # Triton's own choice, timed twice
                "launch": asdict(pick_config(4, 6144, 4096, "Card"))}]
    assert own != tile
    assert winners(records, "Card") == {(4096, 4096): {4: tile, 16: mma}}


def test_a_rebased_tuned_table_keeps_what_the_sweep_did_not_cover():
    from bench.w12_bench import rebase
    from specpilot.kernels.w12.kernel import Config

    old_mma, new_mma = MmaConfig(chunks=4, warps=2), MmaConfig(chunks=2, warps=2)
    fma = Config(bm=1, bn=4, bj=512, use_dot=False, num_warps=1, num_stages=1)
    dot = Config(bm=16, bn=32, bj=256, use_dot=True, num_warps=4, num_stages=3)
    wide = Config(bm=32, bn=64, bj=128, use_dot=True, num_warps=4, num_stages=3)
    base = {(4096, 4096): {1: fma, 8: old_mma, 16: dot}, (6144, 4096): {8: old_mma, 32: old_mma}}
    covered = {(n, k, mc) for n, k in ((4096, 4096), (6144, 4096)) for mc in (8, 16, 32)}
    won = {(6144, 4096): {32: wide}, (4096, 4096): {8: new_mma}}
    # uncovered M class 1 stays; covered: a winner replaces, a tensor-core entry with no winner goes (it lost to
    # the Triton choice), a Triton entry with no winner stays (it was that choice); empty shapes drop out
    assert rebase(base, won, covered) == {(4096, 4096): {1: fma, 8: new_mma, 16: dot}, (6144, 4096): {32: wide}}
    assert base[(6144, 4096)] == {8: old_mma, 32: old_mma}  # the base table is not modified
