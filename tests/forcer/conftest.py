"""Forcer test fixtures: stock forcers over the tiny model and SmolLM2, and ways to build faulty outputs.

Model tests run torch on one thread: on the shared 2-core machine two threads contend with
everything else and run several times slower. The setting is restored after each test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from specpilot.harness.forcing import Forcer, load_forcer


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_forcer() -> Forcer:
    return load_forcer("tiny-cpu")


@pytest.fixture(scope="session")
def smollm2_forcer() -> Forcer:
    return load_forcer("smollm2-cpu")


@contextlib.contextmanager
def scaled_layers(model: nn.Module, layers: list[int], factor: float = 0.0):
    """Run ``model`` with the residual update of the given decoder blocks scaled by ``factor``:
    0 skips them (a faulty shortcut); the tiny random model, which mostly copies its input through
    the residual, needs an amplified update (e.g. 3) to change its outputs."""

    def hook(module, args, out):
        return args[0] + factor * (out - args[0])

    handles = [model.layers[i].register_forward_hook(hook) for i in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def quantised_head(model: nn.Module, bits: int = 4):
    """Run ``model`` with a per-row symmetric ``bits``-bit LM head (a faster numerical shortcut)."""
    w = model.lm_head.weight.detach().float()
    levels = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / levels
    head = nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight = nn.Parameter((torch.round(w / scale) * scale).to(model.dtype), requires_grad=False)
    original = model.lm_head
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = original


def generate(forcer: Forcer, prompt: list[int] | tuple[int, ...], n: int) -> list[int]:
    """The forcer's engine generating ``n`` tokens, bypassing its stock-output memo."""
    return list(forcer.engine.generate(list(prompt), n).tokens)
