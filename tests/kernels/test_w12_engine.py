"""Engine equality: ``weight_format="w12"`` emits the same tokens as BF16-rounded weights on the
tiny model in fp32 (CPU reference path), chain and tree verification alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specpilot.harness.deployment import load_engine
from specpilot.kernels.w12 import W12Linear  # noqa: E402


def _bf16_weights(engine) -> None:
    """Round every linear weight that W12 replaces to BF16, in place (the reference system)."""
    head = engine.model.lm_head if hasattr(engine.model, "lm_head") else None
    for mod in engine.model.modules():
        if isinstance(mod, nn.Linear) and mod is not head:
            mod.weight.data = mod.weight.data.to(torch.bfloat16).to(mod.weight.dtype)


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_w12_same_tokens_as_bf16_weights(verify):
    ref = load_engine("tiny", {"verify": verify})
    _bf16_weights(ref)
    w12 = load_engine("tiny", {"verify": verify, "weight_format": "w12"})
    swapped = [m for m in w12.model.modules() if isinstance(m, W12Linear)]
    assert len(swapped) >= 7 * ref.cfg.n_layers  # q, k, v, o, gate, up, down per layer
    tokens = torch.tensor([[3, 70, 105, 111, 32, 119, 255]])
    pos = torch.arange(tokens.shape[1])
    with torch.no_grad():  # the prefill logits agree bit for bit
        a = w12.model(tokens, pos, w12.model.new_cache(16), 0)[0]
        b = ref.model(tokens, pos, ref.model.new_cache(16), 0)[0]
    assert torch.equal(a, b)
    for text in ("hello world", "def f(x):\n    return"):
        prompt = ref.tokenize(text)
        assert w12.generate(prompt, 40).tokens == ref.generate(prompt, 40).tokens

