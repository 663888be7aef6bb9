"""linear_backend="onednn": packed CPU linears compute what nn.Linear computes, and one-row calls
take the default path exactly."""

import pytest
import torch
from torch import nn

from engine.api import load_engine
from engine.packed import PackedLinear, available

pytestmark = pytest.mark.skipif(not available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_packed_linear_matches_nn_linear(rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=False)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        expected, got = linear(x), packed(x)
    assert got.shape == expected.shape
    if rows == 1:
        assert torch.equal(got, expected)  # the one-row path is the default one, bit for bit
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_engine_with_packed_linears_emits_the_stock_tokens():
    prompt = list(b"def add(a, b):\n    return a + b\n\ndef add(")
    stock = load_engine("tiny-cpu").generate(prompt, 24).tokens
    packed = load_engine("tiny-cpu", {"linear_backend": "onednn"})
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 2 * 7 + 1
    assert packed.generate(prompt, 24).tokens == stock
