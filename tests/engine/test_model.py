"""The decoder: config registry, cache consistency, dtypes, and parity with transformers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specpilot.engine.model import CONFIGS, SDPA, BlockMask, build_random, get_config, greedy_ids


def test_smollm2_config_matches_gguf_metadata():
    import gguf

    from specpilot.engine.weights import gguf_metadata_config, smollm2_gguf_path

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    assert gguf_metadata_config(reader, "smollm2-135m") == CONFIGS["smollm2-135m"]
    c = CONFIGS["smollm2-135m"]
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.vocab_size, c.intermediate) == (30, 576, 9, 3, 49152, 1536)
    assert c.tie_embeddings and c.rope_theta == 100000.0


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt5'; known: smollm2-135m, tiny, tiny-wide, llama3-8b"):
        get_config("gpt5")


def test_incremental_decoding_matches_one_full_forward(tiny):
    """Prefill + blocks at later positions (the cache path) == one causal forward over everything."""
    model, _ = tiny
    seq = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, full_h = model(seq, torch.arange(20), model.new_cache(32), 0)
        cache = model.new_cache(32)
        parts = []
        for a, b in [(0, 7), (7, 8), (8, 13), (13, 20)]:
            logits, _ = model(seq[:, a:b], torch.arange(a, b), cache, a)
            parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert full_h.shape == (1, 20, 64)


@pytest.mark.parametrize("B,H,KV,T,L", [(1, 9, 3, 5, 40), (4, 4, 2, 1, 17), (3, 9, 3, 7, 7)])
def test_masked_grouped_query_attention_equals_sdpa_with_repeated_kv(B, H, KV, T, L):
    """SDPA's masked GQA as G*T rows a KV head (no K/V copies) == every query head against its own
    copy of its KV head; random masks, so a wrong row order of the tiled mask would show."""
    g = torch.Generator().manual_seed(B * 100 + T)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, H, T, 64), (B, KV, L, 64), (B, KV, L, 64)))
    G = H // KV
    for mask in (torch.rand(T, L, generator=g) > 0.4, torch.rand(B, 1, T, L, generator=g) > 0.4):
        mask[..., 0] = True  # every query sees something
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)
        torch.testing.assert_close(SDPA()(q, k, v, mask, False), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_block_mask_gives_sdpa_the_same_bits(dtype):
    """`BlockMask` (the additive bias tiled once a forward) == the bool mask tiled in each layer, bit
    for bit: SDPA adds exactly that bias for a bool mask."""
    g = torch.Generator().manual_seed(7)
    for T, L in ((8, 300), (9, 137), (16, 64)):
        q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((1, 9, T, 64), (1, 3, L, 64), (1, 3, L, 64)))
        allowed = torch.rand(T, L, generator=g) > 0.3
        allowed[:, 0] = True
        assert torch.equal(SDPA()(q, k, v, BlockMask.of(allowed, 3, dtype), False), SDPA()(q, k, v, allowed, False))


def test_last_only_and_cache_overflow(tiny):
    model, _ = tiny
    seq = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        full, _ = model(seq, torch.arange(6), model.new_cache(8), 0)
        last, _ = model(seq, torch.arange(6), model.new_cache(8), 0, last_only=True)
        assert last.shape == (1, 1, 320)
        torch.testing.assert_close(last[0, 0], full[0, -1])
        with pytest.raises(ValueError, match="cache slots needed"):
            model(seq, torch.arange(6), model.new_cache(4), 0)


def test_bf16_and_fp32_head(tiny):
    model16 = build_random(CONFIGS["tiny"], dtype=torch.bfloat16)
    seq = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        l16, h16 = model16(seq, torch.arange(5), model16.new_cache(8), 0)
        ref, _ = tiny[0](seq, torch.arange(5), tiny[0].new_cache(8), 0)
        assert l16.dtype == torch.bfloat16 and h16.dtype == torch.bfloat16
        # Same weights (same seed) in bf16: close to fp32, not equal.
        assert (l16.float() - ref).abs().max() < 0.1 * ref.abs().max()
        model16.use_fp32_head()
        l32, _ = model16(seq, torch.arange(5), model16.new_cache(8), 0)
        assert l32.dtype == torch.float32


def test_tied_head_shares_the_embedding(smollm2):
    model, _ = smollm2
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646],
    [504, 3458, 282, 4811, 314],
    list(range(100, 164)),
    [2, 2, 2, 17, 30000, 49151, 5],
]


@pytest.mark.slow
def test_logits_match_transformers_from_the_same_gguf(smollm2):
    """Our SmolLM2 vs transformers' LlamaForCausalLM loading the same GGUF file (no hub access)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import LlamaForCausalLM

    from specpilot.engine.weights import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model, _ = smollm2
    with torch.no_grad():
        for ids in PROMPTS:
            ref = hf(torch.tensor([ids])).logits[0]
            ours, _ = model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)), 0)
            torch.testing.assert_close(ours[0], ref, rtol=1e-4, atol=2e-4)
            assert torch.equal(ours[0].argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_ids_is_argmax_on_ties_nan_and_inf(dtype):
    """`greedy_ids` replaces argmax for speed; it must pick the same index: the first of tied maxima,
    a NaN before anything, +inf before finite values."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows, vocab = 1 + trial % 7, int(torch.randint(2, 3000, (), generator=g))
        logits = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # many ties
        if trial % 5 == 0:
            logits[trial % rows, int(torch.randint(vocab, (), generator=g))] = float("nan")
        if trial % 3 == 0:
            logits[:, int(torch.randint(vocab, (), generator=g))] = float("inf")
        assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1)), trial
    assert greedy_ids(torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=dtype)).tolist() == [1]
