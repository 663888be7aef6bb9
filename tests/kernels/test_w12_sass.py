"""The FMA path's claims in kernels/w12/README.md, checked on the SASS that Triton emits for sm_90 here
(no GPU needed): with >= 2 of a step's x words a thread the K loop has no layout-conversion barrier,
with one it has; a 16-bit x read as words costs fewer instructions than read by column."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SASS = Path(__file__).resolve().parents[2] / "bench" / "w12_sass.py"


def _k_loop(capsys, *args: str) -> tuple[dict, str]:
    spec = importlib.util.spec_from_file_location("w12_sass", SASS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(list(args)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1]), out[0]  # the summary, and the first loop's line (the K loop)


@pytest.mark.parametrize("bm", [1, 4])
def test_fma_loop_has_no_layout_conversion_with_two_x_words_a_thread(capsys, bm):
    tile = ("fma", "--bm", str(bm), "--bn", "4", "--bj", "256")  # 64 x words a step
    one_warp, one_warp_loop = _k_loop(capsys, *tile, "--warps", "1")  # 2 a thread
    _, two_warps_loop = _k_loop(capsys, *tile, "--warps", "2")  # 1 a thread
    by_column, by_column_loop = _k_loop(capsys, *tile, "--warps", "1", "--x-by-column")
    assert "'BAR'" not in one_warp_loop and "'BAR'" not in by_column_loop, (one_warp_loop, by_column_loop)
    assert "'BAR'" in two_warps_loop, two_warps_loop
    assert one_warp["spills"] == 0
    assert 0 < one_warp["main_loop"] < by_column["main_loop"]
