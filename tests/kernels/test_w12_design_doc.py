"""What docs/DESIGN.md §4 and kernels/w12/README.md say about the W12 kernels is what the code does: the rows the
tensor-core kernel takes, the dispatch's default mode and its per-card table, the one launch kind it has, and the
patches that hold the launch kinds that left the package. Each number or name is read from the doc's text and
compared with the code's constants (CPU only; no kernel runs)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from specpilot.kernels.w12 import cuda_mma, kernel

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kernels" / "w12" / "csrc"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.fixture(scope="module")
def design() -> str:
    """The W12 bullet of DESIGN.md §4, on one line."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    hit = re.search(r"^- `w12/` —.*?(?=^- `|^## )", text, re.S | re.M)
    assert hit, "DESIGN.md has no `w12/` bullet in its kernels section"
    return _flat(hit.group(0))


def _one(pattern: str, text: str) -> re.Match:
    hit = re.search(pattern, text)
    assert hit, f"not found: {pattern!r} in {text!r}"
    return hit


def test_the_rows_the_tensor_core_kernel_takes(design):
    readme = _flat((REPO / "kernels" / "w12" / "README.md").read_text())
    quoted = [int(v) for doc in (design, readme) for v in re.findall(r"\b1-(\d+)(?: bf16 rows|-row bf16)", doc)]
    assert len(quoted) >= 3, quoted  # DESIGN: the kernel and the "on" mode; README: its file table
    assert set(quoted) == {cuda_mma.MAX_ROWS}, quoted
    # the C++ side holds the same bound: the launcher and the binding's check
    assert int(_one(r"constexpr int kMaxRows = (\d+);", (CSRC / "w12_mma.cu").read_text()).group(1)) == cuda_mma.MAX_ROWS
    assert int(_one(r"m >= 1 && m <= (\d+)", (CSRC / "w12_mma_binding.cpp").read_text()).group(1)) == cuda_mma.MAX_ROWS


def test_the_default_dispatch(design):
    assert _one(r"tensor-core mode `(\w+)` by default", design).group(1) == kernel.DEFAULT_TENSOR_CORE_MODE
    assert kernel.DEFAULT_TENSOR_CORE_MODE in kernel.TENSOR_CORE_MODES
    env = _one(r"by default \(`(\w+)`\)", design).group(1)
    assert re.search(rf'os\.environ\.get\("{env}"', (REPO / "kernels" / "w12" / "kernel.py").read_text())
    # the per-card table it reads, and what the table holds today
    table = _one(r"per-card table `cuda_mma\.(\w+)`", design).group(1)
    assert getattr(cuda_mma, table) is cuda_mma.TUNED
    card, lo, hi, shapes = _one(r"today (.+?) at M = (\d+)-(\d+) on (\d+) shapes, no other card", design).groups()
    assert list(cuda_mma.TUNED) == [card]
    assert len(cuda_mma.TUNED[card]) == int(shapes)
    classes = {mc for by_m in cuda_mma.TUNED[card].values() for mc in by_m}
    rows = [m for m in range(1, cuda_mma.MAX_ROWS + 1) if cuda_mma.m_class(m) in classes]
    assert rows == list(range(int(lo), int(hi) + 1))
    # the other calls: the Triton kernels' rule and table
    assert _one(r"`(pick_config)`: the H200-swept `(\w+)`", design).group(2) == "TUNED_H200"
    assert callable(kernel.pick_config) and kernel.TUNED_H200


def test_one_tensor_core_launch_kind_and_the_removed_ones_are_patches(design):
    assert "one launch kind" in design
    assert {f.name for f in dataclasses.fields(cuda_mma.MmaConfig)} == {"chunks", "warps", "splits"}
    assert "split" not in {f.name for f in dataclasses.fields(kernel.Config)}
    folder, pattern = _one(r"patches in `(docs/results/w12-kernel/)` \(`(removed-[\w-]+\*\.patch)`\)", design).groups()
    found = {str(p.relative_to(REPO)) for p in (REPO / folder).glob(pattern)}
    assert {cuda_mma.REMOVED_LAUNCHES, kernel.REMOVED_SPLIT_K} <= found, found
