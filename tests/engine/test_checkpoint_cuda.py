"""Checkpoint targets on a CUDA device (``gpu`` marker; skipped without one): tiny random checkpoints of
each family (`tests.engine.test_checkpoint.make_checkpoint`) load on the GPU and match transformers there;
CUDA graphs give the eager engine's tokens for AR, chain and tree (in fp32; in bf16 up to near-ties, as
forcing judges); W12 weights (bf16 stored losslessly, biases kept) give AR's tokens whatever the drafter, up
to near-ties; ``fused_kernels`` works on the Llama layout and is
refused by name on Qwen2/Qwen3.

Runs on a GPU machine without the services' dependencies:
``python -m pytest --noconftest tests/engine/test_checkpoint_cuda.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from specpilot.engine.api import build_engine
from specpilot.engine.options import EngineOptions
from specpilot.engine.weights import load_checkpoint
from tests.engine.conftest import agree_up_to_near_ties
from tests.engine.test_checkpoint import FAMILIES, PROMPTS, make_checkpoint, save_tokenizer

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DECODES = {"ar": {"drafter": "none"}, "chain": {"drafter": "ngram", "block_size": 4, "ngram_min_match": 1},
           "tree": {"drafter": "ngram", "verify": "tree", "block_size": 4, "tree_nodes": 8, "ngram_min_match": 1}}
GEN_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9], list(range(3, 60)), [11, 12] * 20]


def _engine(target: str, dtype: str, **options):
    return build_engine(target, EngineOptions(**options).resolved(dtype=dtype), device="cuda")


def _tokens(engine) -> list[list[int]]:
    return [engine.generate(p, 48).tokens for p in GEN_PROMPTS]


def _agree_up_to_near_ties(folder, got: list[list[int]], want: list[list[int]], label) -> None:
    """`agree_up_to_near_ties` with the fp32 checkpoint as the reference."""
    agree_up_to_near_ties(load_checkpoint(folder, device="cuda"), GEN_PROMPTS, got, want, label)


@pytest.fixture(params=list(FAMILIES))
def checkpoint(request, tmp_path):
    make_checkpoint(tmp_path, request.param)
    save_tokenizer(tmp_path)
    return request.param, tmp_path


def test_logits_match_transformers_on_cuda(checkpoint):
    family, folder = checkpoint
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    model = load_checkpoint(folder, device="cuda")
    with torch.no_grad():
        for ids in PROMPTS:
            ref = hf(torch.tensor([ids], device="cuda")).logits[0]
            ours, _ = model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda"),
                            model.new_cache(len(ids)), 0)
            torch.testing.assert_close(ours[0], ref, rtol=1e-3, atol=1e-3)
            assert torch.equal(ours[0].argmax(-1), ref.argmax(-1)), family


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_graphs_give_the_eager_tokens(checkpoint, dtype):
    family, folder = checkpoint
    target = f"hf:{folder}"
    for name, options in DECODES.items():
        eager = _tokens(_engine(target, dtype, **options))
        graphs = _tokens(_engine(target, dtype, cuda_graphs=True, **options))
        if dtype == "fp32":
            assert graphs == eager, (family, dtype, name)
        else:
            _agree_up_to_near_ties(folder, graphs, eager, (family, dtype, name))


def test_w12_weights_decode_the_same_whatever_the_drafter(checkpoint):
    family, folder = checkpoint
    target = f"hf:{folder}"
    w12 = {name: _tokens(_engine(target, "bf16", weight_format="w12", **o)) for name, o in DECODES.items()}
    for name in ("chain", "tree"):
        _agree_up_to_near_ties(folder, w12[name], w12["ar"], (family, name))
    engine = _engine(target, "bf16", weight_format="w12")
    packed = [m for m in engine.model.modules() if type(m).__name__ == "W12Linear"]
    assert packed and any(m.bias is not None for m in packed) == (family == "qwen2"), family  # Qwen2's biases kept


def test_fused_kernels_cover_the_llama_layout_and_refuse_the_rest(checkpoint):
    family, folder = checkpoint
    target = f"hf:{folder}"
    if family in ("qwen2", "qwen3"):
        with pytest.raises(ValueError, match="fused_kernels does not cover"):
            _engine(target, "bf16", fused_kernels=True)
        return
    fused = _tokens(_engine(target, "bf16", fused_kernels=True, **DECODES["chain"]))
    graphs = _tokens(_engine(target, "bf16", fused_kernels=True, cuda_graphs=True, **DECODES["chain"]))
    _agree_up_to_near_ties(folder, graphs, fused, family)
