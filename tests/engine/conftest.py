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
