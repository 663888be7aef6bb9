"""The certified exact-argmax LM head (`specpilot.engine.screened_head`, ``screened_head = True``).

The bound must hold (the full head's argmax is always a candidate, near ties and exact ties
included), the head must give the full head's argmax (and, over a `stream` head, its exact bits on
the candidates), it must fall back where it cannot screen, and decoding with it must emit exactly
the tokens decoding without it emits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specpilot.engine.api import build_engine
from specpilot.engine.options import EngineOptions
from specpilot.engine.packed import StreamLinear
from specpilot.engine.screened_head import ScreenedHead, reference_argmax_candidates
from specpilot.kernels import cpu_gemm
from tests.engine.conftest import make_engine
from tests.engine.test_lossless import _tiny_prompts

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="needs specpilot.kernels.cpu_gemm (AVX2 + a compiler)")


def _near_tie_rows(weight: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Rows h whose two largest logits differ by about one ulp: h along w_a + w_b, nudged."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = torch.randint(0, weight.shape[0], (2,), generator=g).tolist()
        b = b if b != a else (a + 1) % weight.shape[0]
        d = weight[a] - weight[b]
        h = (weight[a] + weight[b]) * 3.0 + torch.randn(weight.shape[1], generator=g) * 0.01
        h = h - d * (h @ d) / (d @ d) + d * 1e-7 * (1 if a % 2 else -1)  # equal logits, then a hair apart
        rows.append(h)
    return torch.stack(rows)


def test_the_bound_keeps_the_argmax_even_at_near_and_exact_ties():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 256, generator=g)
    weight[7] = weight[4001]  # an exact tie: the first index must win, as argmax gives it
    h = torch.cat([torch.randn(64, 256, generator=g) * 4, _near_tie_rows(weight, 64, 1),
                   (weight[4001] * 2).unsqueeze(0)])
    full = F.linear(h, weight)
    for i in range(h.shape[0]):
        cols = reference_argmax_candidates(h[i:i + 1], weight)
        assert cols is not None and int(full[i].argmax()) in cols.tolist(), i
        # every index holding the row's maximum is a candidate
        assert set((full[i] == full[i].max()).nonzero().squeeze(1).tolist()) <= set(cols.tolist())
    assert int(full[-1].argmax()) == 7
    # the screen is selective: random rows leave a handful of candidates of 4096
    assert max(reference_argmax_candidates(h[j:j + 1], weight).numel() for j in range(64)) < 64


def test_non_finite_rows_fall_back_to_the_full_head():
    weight = torch.randn(512, 64)
    h = torch.randn(2, 64)
    h[1, 3] = float("nan")
    assert reference_argmax_candidates(h, weight) is None


@needs_kernel
@pytest.mark.parametrize("backend", ["default", "stream"])
def test_the_screened_head_gives_the_full_heads_argmax(backend):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8192, 512, generator=g) / 8
    head = nn.Linear(512, 8192, bias=False)
    head.weight = nn.Parameter(weight, requires_grad=False)
    if backend == "stream":
        head = StreamLinear(head.weight)
    screened = ScreenedHead(head)
    assert screened.active and screened.weight is head.weight
    for rows in (1, 3, 5, 8, 17):
        h = torch.cat([torch.randn(rows - 1, 512, generator=g) * 3, _near_tie_rows(weight, 1, rows)])
        with torch.no_grad():
            full, out = head(h), screened(h)
        assert out.shape == full.shape
        kept = torch.isfinite(out).any(0)
        picked = out.argmax(-1)
        if backend == "stream":  # the full head's bits: its very argmax
            assert torch.equal(picked, full.argmax(-1)), rows
        else:  # F.linear over the candidates may round otherwise: the pick is the max or a one-ulp tie
            best = full.max(-1).values
            assert (full.gather(1, picked[:, None])[:, 0] >= best - 4e-7 * best.abs()).all(), rows
        assert 0 < int(kept.sum()) <= 256  # of 8192: random Gaussian logits are not peaked
        if backend == "stream":  # the kernel's columns are independent: the full head's bits
            assert torch.equal(out[:, kept], full[:, kept])
        else:
            torch.testing.assert_close(out[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(out[:, ~kept]).all()


@needs_kernel
def test_it_steps_aside_where_it_cannot_screen():
    head = nn.Linear(64, 1024, bias=False).to(torch.bfloat16)
    screened = ScreenedHead(head)  # a bf16 head is already as cheap as the screen
    assert not screened.active
    h = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(screened(h), head(h))
    assert not ScreenedHead(nn.Linear(64, 1024, bias=True)).active  # a bias the screen does not see

    class Pruned(nn.Module):  # exposes a weight but computes something else: not screened
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(1024, 64), requires_grad=False)

        def forward(self, x):
            return F.linear(x, self.weight[:512])

    pruned = Pruned()
    assert not ScreenedHead(pruned).active and ScreenedHead(pruned)(torch.randn(2, 64)).shape == (2, 512)
    fp32 = ScreenedHead(nn.Linear(64, 1024, bias=False))
    bad = torch.randn(2, 64)
    bad[0, 0] = float("inf")
    assert torch.equal(fp32(bad).isnan(), fp32._head(bad).isnan())  # the full head's answer, not a screen's
    assert fp32.candidates[-1] == -1 and fp32(torch.randn(0, 64)).shape == (0, 1024)


@needs_kernel
@pytest.mark.parametrize("backend", ["default", "stream"])
def test_decoding_with_it_emits_the_same_tokens(backend):
    prompts = _tiny_prompts(3, n=3)
    outs = {}
    for screened in (False, True):
        opts = EngineOptions(linear_backend=backend, screened_head=screened, dtype="fp32")
        engine = build_engine("tiny-wide", opts)
        assert isinstance(engine.model.lm_head, ScreenedHead) == screened
        for cfg in (dict(drafter="none"), dict(drafter="ngram", block_size=4, ngram_min_match=1),
                    dict(drafter="ngram", verify="tree", block_size=4, tree_nodes=8, ngram_min_match=1)):
            e = make_engine((engine.model, engine.tokenizer), **cfg)
            outs[screened, str(cfg)] = [e.generate(p, 48).tokens for p in prompts]
    for key in [k for k in outs if not k[0]]:
        assert outs[True, key[1]] == outs[key], key
    assert outs[False, str(dict(drafter="none"))] == outs[False, str(dict(drafter="ngram", block_size=4, ngram_min_match=1))]


@pytest.mark.slow
@needs_kernel
def test_smollm2_screened_equals_stock_ar(smollm2, smol_reference):
    """On SmolLM2's real prompts, decoding through the screened head emits the stock AR tokens. One
    configuration (CI time): the 24-node tree, whose 25-row verifications screen the most rows at once;
    the one-row and chain heads are the same code (`tests/engine/test_screened_head.py` above)."""
    from tests.engine.test_lossless import SMOL_CONFIGS

    prompts, ref = smol_reference
    model, tok = smollm2
    stock_head = model.lm_head
    try:
        model.lm_head = ScreenedHead(stock_head)
        engine = make_engine(smollm2, **SMOL_CONFIGS["ngram-tree-b8-n24-min1"])
        assert [engine.generate(p, 64).tokens for p in prompts] == ref
        assert model.lm_head.candidates and 0 < max(model.lm_head.candidates) <= 256
    finally:
        model.lm_head = stock_head
