"""Hugging Face checkpoints as targets: tiny random checkpoints of each supported family, built and saved
with transformers in the test, give our engine the same logits as transformers in fp32; bad
checkpoints are refused by name before any weight is used."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specpilot.engine.checkpoint import CheckpointError, read_config
from specpilot.engine.weights import load_checkpoint

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
FAMILIES = {
    "llama3-scaled": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, use_sliding_window=False)),  # head_dim != 64/4
}
PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 103)), [7] * 40 + list(range(250, 290))]  # 100 > the 32-token boundary


def make_checkpoint(folder, family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**SIZES, **extra)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so logits are well separated
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
            else:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = make_checkpoint(tmp_path, family)
    model = load_checkpoint(tmp_path)
    cfg = model.cfg
    assert cfg.name == f"hf:{tmp_path}" and cfg.tie_embeddings == (family == "llama-tied")
    assert cfg.attn_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert (cfg.rope_scaling is not None) == (family == "llama3-scaled")
    with torch.no_grad():
        for ids in PROMPTS:
            ref = hf(torch.tensor([ids])).logits[0]
            ours, _ = model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)), 0)
            torch.testing.assert_close(ours[0], ref, rtol=1e-4, atol=1e-4)
            assert torch.equal(ours[0].argmax(-1), ref.argmax(-1))
            # the same logits one chunk at a time through the KV cache
            cache, cut = model.new_cache(len(ids)), len(ids) // 2
            first, _ = model(torch.tensor([ids[:cut]]), torch.arange(cut), cache, 0)
            second, _ = model(torch.tensor([ids[cut:]]), torch.arange(cut, len(ids)), cache, cut)
            torch.testing.assert_close(torch.cat([first[0], second[0]]), ref, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_too_large_for_the_device_is_refused_first(tmp_path, monkeypatch):
    import specpilot.engine.checkpoint as checkpoint

    make_checkpoint(tmp_path, "llama-tied")
    monkeypatch.setattr(checkpoint, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(checkpoint, "read_state", lambda *a, **k: pytest.fail("read before the size check"))
    with pytest.raises(CheckpointError, match=r"needs 0\.00 GiB in torch.float32 on cpu, but 0\.00 GiB is free"):
        load_checkpoint(tmp_path)
    assert checkpoint.free_bytes("cpu") > 0  # MemAvailable on this machine


def test_eos_ids_come_from_the_generation_config(tmp_path):
    make_checkpoint(tmp_path, "qwen2")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7, 11]}))
    cfg = read_config(tmp_path)
    assert cfg.stop_ids == (7, 11) and cfg.eos_id == 7


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    good = tmp_path / "good"
    make_checkpoint(good, "llama-tied")

    def variant(name: str):
        dest = tmp_path / name
        shutil.copytree(good, dest)
        return dest

    foreign = variant("foreign")
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported; supported: LlamaForCausalLM"):
        read_config(foreign)
    with pytest.raises(CheckpointError, match="no checkpoint folder .*nowhere"):
        read_config(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_config(tmp_path / "empty")
    wrong = variant("wrong-sizes")
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="config.json makes it"):
        load_checkpoint(wrong)
    sharded = variant("sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors named by the index is missing"):
        load_checkpoint(sharded)
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="the checkpoint has no layers.0"):
        load_checkpoint(sharded)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def save_tokenizer(folder, vocab_size: int = 300) -> None:
    """A small byte-level BPE tokenizer trained here, with a ChatML template, saved as a checkpoint's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n", "hello world, speculative decoding"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "chat_template": CHATML}))


def test_the_chat_template_renders_as_transformers_does(tmp_path):
    from specpilot.engine.checkpoint import CheckpointTokenizer

    make_checkpoint(tmp_path, "qwen2")
    save_tokenizer(tmp_path)
    ours = CheckpointTokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for system in (None, "You are terse."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi there"}]
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.chat_prompt("hi there", system) == want
    text = "def add(a, b): return a + b"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        CheckpointTokenizer(tmp_path)


@pytest.mark.parametrize("family", ["llama3-scaled", "qwen2", "qwen3"])
def test_speculative_decoding_on_a_checkpoint_is_lossless(tmp_path, family):
    """A deployment target ``hf:<folder>`` through the engine's own loading path: every drafter and
    verification gives AR's tokens, with the stock linears and with the CPU options that swap them
    (``linear_backend = "stream"``, which leaves Qwen2's biased q/k/v as they are, and the screened head)."""
    from specpilot.engine.api import build_engine
    from specpilot.engine.options import EngineOptions
    from specpilot.kernels import cpu_gemm

    def engine(**options):
        return build_engine(target, EngineOptions(**options).resolved(dtype="fp32"))

    make_checkpoint(tmp_path, family)
    save_tokenizer(tmp_path)
    target = f"hf:{tmp_path}"
    backends = [{}] + ([{"linear_backend": "stream", "screened_head": True}] if cpu_gemm.available() else [])
    for backend in backends:
        ar = engine(drafter="none", **backend)
        assert ar.model.cfg.name == target
        prompts = [ar.tokenize("def add(a, b):"), [5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9], list(range(3, 60))]
        ref = [ar.generate(p, 40).tokens for p in prompts]
        for options in ({"drafter": "ngram", "block_size": 4},
                        {"drafter": "ngram", "block_size": 8, "ngram_min_match": 1},
                        {"drafter": "ngram", "verify": "tree", "block_size": 4, "tree_nodes": 8, "ngram_min_match": 1}):
            spec = engine(**options, **backend)
            assert [spec.generate(p, 40).tokens for p in prompts] == ref, (options, backend)


def test_a_deployment_points_at_a_checkpoint_folder(tmp_path):
    from specpilot.harness.deployment import DeploymentError, load_deployment, load_engine

    make_checkpoint(tmp_path / "ckpt", "mistral")
    save_tokenizer(tmp_path / "ckpt")
    toml = tmp_path / "mine.toml"
    toml.write_text('target = "hf:ckpt"\ndevice = "cpu"\ndtype = "fp32"\nmode = "batch1"\ndrafter = "ngram"\n'
                    'block_size = 4\nrequest_sets = ["chat"]\nmax_new_tokens = 16\n')
    dep = load_deployment(toml)
    assert dep.target == f"hf:{tmp_path / 'ckpt'}" and dep.facts()["model_family"] == "mistral"
    engine = load_engine(dep)
    out = engine.generate(engine.tokenize("hello world"), 8)
    assert len(out.tokens) >= 1
    toml.write_text(toml.read_text().replace("hf:ckpt", "hf:missing"))
    with pytest.raises(DeploymentError, match="no checkpoint folder .*missing .a relative folder is relative to the deployment's file"):
        load_deployment(toml)


def test_transformers_peer_reads_the_checkpoint_itself(tmp_path):
    """`bench.peer` (the sealed final's transformers baseline) loads a checkpoint with transformers' own
    class (Qwen2 here, whose biases a Llama stand-in would drop) and agrees with our greedy outputs."""
    from specpilot.engine.options import EngineOptions
    from specpilot.harness.peer import peer

    make_checkpoint(tmp_path, "qwen2")
    model = load_checkpoint(tmp_path, name=f"hf:{tmp_path}")
    prompts = [[5, 9, 200, 17, 5, 9], list(range(3, 40))]
    with torch.no_grad():
        reference = []
        for p in prompts:  # our greedy continuation, 8 tokens, by full forwards
            ids = list(p)
            for _ in range(8):
                logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)), 0)
                ids.append(int(logits[0, -1].argmax()))
            reference.append(ids[len(p):])
    out = peer(model, None, EngineOptions(block_size=4).resolved(dtype="fp32"), prompts, 8, reference)
    assert out["greedy_matches_engine"] == 1.0, out


@pytest.mark.slow
def test_smollm2_exported_as_a_checkpoint_gives_the_gguf_paths_logits(tmp_path, smollm2):
    from specpilot.engine.weights import export_smollm2, load_model

    export_smollm2(tmp_path / "smol")
    model, tok = load_model(f"hf:{tmp_path / 'smol'}")
    gguf_model, gguf_tok = smollm2
    user = "Write a function that adds two numbers.\nBe brief."
    assert tok.chat_prompt(user) == gguf_tok.chat_prompt(user)
    assert tok.encode(tok.chat_prompt(user)) == gguf_tok.encode(gguf_tok.chat_prompt(user))
    assert model.cfg.stop_ids == gguf_model.cfg.stop_ids and model.cfg.eos_id == gguf_model.cfg.eos_id
    with torch.no_grad():
        for ids in ([1, 9690, 198, 2683, 359, 253, 5356, 5646], list(range(100, 164))):
            ours, _ = model(torch.tensor([ids]), torch.arange(len(ids)), model.new_cache(len(ids)), 0)
            ref, _ = gguf_model(torch.tensor([ids]), torch.arange(len(ids)), gguf_model.new_cache(len(ids)), 0)
            assert torch.equal(ours, ref)


def _checkpoint_deployment(tmp_path, family: str, options: str = ""):
    make_checkpoint(tmp_path / "ckpt", family)
    save_tokenizer(tmp_path / "ckpt")
    toml = tmp_path / "mine.toml"
    toml.write_text('target = "hf:ckpt"\ndevice = "cpu"\ndtype = "fp32"\nmode = "batch1"\ndrafter = "parallel"\n'
                    f'block_size = 4\nrequest_sets = ["chat"]\nmax_new_tokens = 16\n{options}')
    return toml


def _train(toml, kind: str) -> dict:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specpilot.app.cli", "drafter", "train", "--kind", kind, "--deployment", str(toml),
           "--minutes", "0.2", "--prompts", "12", "--docstrings", "100", "--batch", "8", "--new-tokens", "16", "--eval-requests", "2",
           "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_drafters_trained_for_a_checkpoint_are_found_and_lossless(tmp_path):
    """`specpilot drafter train --deployment` on a checkpoint target: the parallel drafter goes where the
    deployment's ``drafter_weights`` says (relative to its file), the EAGLE one beside the checkpoint where
    the engine looks by default; each records its data hash and figures, and AR = chain = tree with both."""
    from specpilot.engine.api import build_engine
    from specpilot.engine.options import EngineOptions
    from specpilot.harness.deployment import load_deployment, load_engine

    toml = _checkpoint_deployment(tmp_path, "qwen3", '[options]\ndrafter_weights = "drafters/parallel.pt"\n')
    target = f"hf:{tmp_path / 'ckpt'}"
    parallel, eagle = _train(toml, "parallel"), _train(toml, "eagle")
    assert parallel["drafter"] == str(tmp_path / "drafters" / "parallel.pt")
    assert eagle["drafter"] == str(tmp_path / "ckpt" / "specpilot" / "eagle_drafter.pt")
    for figures in (parallel, eagle):
        assert figures["target"] == target and len(figures["training_data_sha256"]) == 64
        assert figures["measured_tau"]["requests"] == 2 and figures["generated_tokens"] > 0
    blob = torch.load(eagle["drafter"], weights_only=True)
    assert blob["meta"]["training_data_sha256"] == eagle["training_data_sha256"]

    ar = build_engine(target, EngineOptions(drafter="none").resolved(dtype="fp32"))
    prompts = [ar.tokenize("def add(a, b):"), [5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9], list(range(3, 60))]
    ref = [ar.generate(p, 40).tokens for p in prompts]
    engines = {"parallel chain (the deployment's file)": load_engine(load_deployment(toml)),
               "parallel tree": load_engine(load_deployment(toml), {"verify": "tree", "tree_nodes": 8}),
               "eagle chain (beside the checkpoint)": build_engine(target, EngineOptions(drafter="eagle").resolved(dtype="fp32")),
               "eagle tree": build_engine(target, EngineOptions(drafter="eagle", verify="tree", tree_nodes=8,
                                                                block_size=6).resolved(dtype="fp32"))}
    for name, engine in engines.items():
        assert [engine.generate(p, 40).tokens for p in prompts] == ref, name
    assert type(engines["eagle tree"].drafter).__name__ == "EagleDrafter"


def test_a_sandbox_shows_the_deployments_files_outside_the_checkout(tmp_path):
    """A checkpoint, a drafter file and a deployment's TOML under /tmp are invisible in a sandbox (its /tmp
    is private) unless named: the controller's and the subagent's workers name them
    (`Deployment.external_paths`); a named path inside a hidden one is refused."""
    import sys

    from specpilot.harness.deployment import load_deployment
    from specpilot.sandbox import Sandbox, bwrap_available

    if not bwrap_available():
        pytest.skip("the sandbox needs bubblewrap (scripts/install.sh)")
    toml = _checkpoint_deployment(tmp_path, "qwen2", '[options]\ndrafter_weights = "d/p.pt"\n')
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.pt").write_bytes(b"weights")
    (tmp_path / "secret").write_text("no")
    dep = load_deployment(toml)
    paths = dep.external_paths()
    assert paths == [toml.resolve(), tmp_path / "ckpt", tmp_path / "d" / "p.pt"]
    assert load_deployment("tiny-cpu").external_paths() == []
    probe = ("import sys, pathlib; print([pathlib.Path(p).exists() for p in sys.argv[1:]])")
    looked = [str(toml), str(tmp_path / "ckpt" / "config.json"), str(tmp_path / "d" / "p.pt"), str(tmp_path / "secret")]
    src = tmp_path / "src"
    src.mkdir()
    for visible, seen in (([], "[False, False, False, False]"), (paths, "[True, True, True, False]")):
        with Sandbox(src=src, models=tmp_path / "none", visible=visible) as sbx:
            out = sbx.run([sys.executable, "-c", probe, *looked], timeout=60)
        assert out["returncode"] == 0 and out["output"].strip().endswith(seen), (visible, out["output"])
    with pytest.raises(ValueError, match="which sandboxes hide"):
        Sandbox(src=src, models=tmp_path / "none", hide=[tmp_path], visible=paths).argv(["true"])


def test_model_check_reads_a_checkpoint_without_loading_it_and_names_what_is_wrong(tmp_path):
    """`specpilot model check`: the facts of a checkpoint as JSON (the drafters beside it included), a
    broken one refused with exit 2 and its reason, `export-smollm2` refusing a folder that holds files."""
    import subprocess
    import sys

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "specpilot.app.cli", "model", *argv], capture_output=True,
                              text=True, timeout=120)

    make_checkpoint(tmp_path / "ckpt", "qwen2")
    save_tokenizer(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "specpilot").mkdir()
    (tmp_path / "ckpt" / "specpilot" / "eagle_drafter.pt").write_bytes(b"")
    out = cli("check", str(tmp_path / "ckpt"), "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["target"] == f"hf:{tmp_path / 'ckpt'}" and facts["family"] == "qwen2" and facts["qkv_bias"] is True
    assert (facts["layers"], facts["dim"], facts["vocab"]) == (2, 64, 300) and facts["parameters"] > 0
    assert facts["chat_template"].startswith("<|im_start|>user\nhi") and list(facts["drafters"]) == ["eagle"]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text(
        (tmp_path / "ckpt" / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 96'))
    out = cli("check", f"hf:{tmp_path / 'broken'}")
    assert out.returncode == 2 and "config.json makes it" in out.stderr, out.stderr
    out = cli("export-smollm2", str(tmp_path / "ckpt"))
    assert out.returncode == 2 and "is not an empty folder" in out.stderr, out.stderr
