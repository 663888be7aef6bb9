"""linear_backend="onednn" / "onednn_all": packed CPU linears compute what nn.Linear computes;
with "onednn" one-row calls take the default path exactly, with "onednn_all" the packed one."""

import pytest
import torch
from torch import nn

from specpilot.engine.packed import PackedLinear, available
from specpilot.harness.deployment import load_engine

pytestmark = pytest.mark.skipif(not available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_packed_linear_matches_nn_linear(rows, one_row):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=False)
    packed = PackedLinear(linear, one_row)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        expected, got = linear(x), packed(x)
    assert got.shape == expected.shape
    if rows == 1 and not one_row:
        assert torch.equal(got, expected)  # the one-row path is the default one, bit for bit
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_engine_with_packed_linears_emits_the_stock_tokens():
    prompt = list(b"def add(a, b):\n    return a + b\n\ndef add(")
    stock = load_engine("tiny-cpu").generate(prompt, 24).tokens
    packed = load_engine("tiny-cpu", {"linear_backend": "onednn"})
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 2 * 7 + 1
    assert packed.generate(prompt, 24).tokens == stock
    every = load_engine("tiny-cpu", {"linear_backend": "onednn_all", "drafter": "none"})
    assert all(m.one_row for m in every.model.modules() if isinstance(m, PackedLinear))
    assert every.generate(prompt, 24).tokens == stock
