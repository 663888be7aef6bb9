"""Engine test fixtures: one SmolLM2 (fp32, CPU) per session, shared by every test that needs it.

The converted weights live in the default model cache (``$SPECPILOT_DATA`` or
``~/.local/share/specpilot``), so only the first run ever converts the GGUF (~15 s).
"""

from __future__ import annotations

import pytest

from specpilot_engine.api import Engine
from specpilot_engine.options import EngineOptions


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32 on the CPU."""
    from specpilot_engine.weights import load_model

    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def tiny():
    from specpilot_engine.weights import load_model

    return load_model("tiny", dtype="fp32")


def make_engine(model_tok, **options) -> Engine:
    """An engine over an already loaded model (options that rebuild the model are not applied)."""
    model, tok = model_tok
    return Engine(model, tok, EngineOptions(**options).resolved(dtype="fp32"))


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
