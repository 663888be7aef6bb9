"""Engine test fixtures: one SmolLM2 (fp32, CPU) per session, shared by every test that needs it.

The converted weights live in the default model cache (``$SPECPILOT_DATA`` or
``~/.local/share/specpilot``), so only the first run ever converts the GGUF (~15 s).
"""

from __future__ import annotations

import pytest

from specpilot.engine.api import Engine
from specpilot.engine.options import EngineOptions


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32 on the CPU."""
    from specpilot.engine.weights import load_model

    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def tiny():
    from specpilot.engine.weights import load_model

    return load_model("tiny", dtype="fp32")


def make_engine(model_tok, **options) -> Engine:
    """An engine over an already loaded model (options that rebuild the model are not applied)."""
    model, tok = model_tok
    return Engine(model, tok, EngineOptions(**options).resolved(dtype="fp32"))


def agree_up_to_near_ties(reference, prompts, got: list[list[int]], want: list[list[int]], label,
                          margin: float = 0.1) -> None:
    """On a GPU two systems' greedy outputs may part where two tokens nearly tie (a many-token step and a
    one-token step, or graphs and eager kernels, round differently; the lossless guarantee is fp32 on the
    CPU). Each pair agrees up to its first difference, and there ``reference``'s logits of the two tokens
    lie within ``margin`` standard deviations of its logits (forcing's rule, not bit equality)."""
    import torch

    device = reference.device
    for prompt, a, b in zip(prompts, got, want, strict=True):
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if i is None:
            assert len(a) == len(b), label
            continue
        ids = torch.tensor([prompt + b[:i]], device=device)
        with torch.no_grad():
            logits = reference(ids, torch.arange(ids.shape[1], device=device), reference.new_cache(ids.shape[1]),
                               0)[0][0, -1]
        gap = float((logits[a[i]] - logits[b[i]]).abs())
        assert gap <= margin * float(logits.std()), (label, i, gap, float(logits.std()))


@pytest.fixture(scope="session")
def smol_reference(smollm2):
    """Eight short dev prompts of SmolLM2 (4 HumanEval, 4 chat) and their AR outputs of 64 tokens."""
    from specpilot.harness.deployment import load_deployment
    from specpilot.harness.requests import encode_requests, load_requests

    _, tok = smollm2
    reqs = load_requests(load_deployment("smollm2-cpu"), "dev")
    # 4 HumanEval + 4 chat prompts, the shortest of each, so prefill stays cheap.
    by_set = {s: sorted((r for r in reqs if r.set == s), key=lambda r: len(r.text))[:4] for s in ("humaneval", "chat")}
    prompts = encode_requests(by_set["humaneval"] + by_set["chat"], tok)
    engine = make_engine(smollm2, drafter="none")
    return prompts, [engine.generate(p, 64).tokens for p in prompts]
