"""Deployments and request sets: parsing, stock options, the dev/sealed split."""

from __future__ import annotations

import re

import pytest

from specpilot.errors import UserError
from specpilot.harness.deployment import DeploymentError, list_deployments, load_deployment
from specpilot.harness.requests import REQUEST_SETS, disguise, load_requests, split_of


def test_shipped_deployments_load():
    assert {"smollm2-cpu", "smollm2-h200", "tiny-cpu"} <= set(list_deployments())
    for name in list_deployments():
        try:
            d = load_deployment(name)
        except DeploymentError as exc:  # a checkpoint deployment before its checkpoint is written
            assert name == "smollm2-hf-cpu" and "no checkpoint folder" in str(exc), exc
            continue
        assert d.name == name and d.options().dtype in ("fp32", "bf16")
    d = load_deployment("smollm2-cpu")
    o = d.options()
    assert (d.target, d.device, d.dtype, o.drafter, o.block_size) == ("smollm2-135m", "cpu", "fp32", "ngram", 4)
    assert load_deployment("smollm2-h200").options().dtype == "bf16"


def test_deployment_options_layer_overrides_on_stock():
    d = load_deployment("smollm2-h200")
    assert d.options() == d.options({})
    o = d.options({"verify": "tree", "dtype": "fp32"})
    assert (o.verify, o.dtype, o.block_size) == ("tree", "fp32", 4)
    # the GPU stock is a released engine's: CUDA graphs and fused kernels (issue 31)
    assert o.changed() == {"verify": "tree", "dtype": "fp32", "cuda_graphs": True, "fused_kernels": True}



def test_bad_deployment_files(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('target = "tiny"\nspeed = 3\n')
    with pytest.raises(DeploymentError, match=r"x.toml: unknown key `speed`; allowed: bench_requests, block_size"):
        load_deployment(p)
    p.write_text('target = "gpt5"\n')
    with pytest.raises(DeploymentError, match="unknown target 'gpt5'"):
        load_deployment(p)
    p.write_text('target = "tiny"\ndrafter = "medusa"\n')
    with pytest.raises(DeploymentError, match="unknown value 'medusa' for option 'drafter'"):
        load_deployment(p)
    p.write_text('target = "tiny"\nrequest_sets = ["mmlu"]\n')
    with pytest.raises(DeploymentError, match="unknown request sets"):
        load_deployment(p)
    p.write_text('target = "tiny"\nblock_size = [\n')
    with pytest.raises(DeploymentError, match="is not valid TOML"):
        load_deployment(p)
    with pytest.raises(DeploymentError, match="no deployment 'nosuch'.*known: .*smollm2-cpu, smollm2-cpu-batched, smollm2-h200, smollm2-h200-batched"):
        load_deployment("nosuch")
    assert issubclass(DeploymentError, UserError)  # the CLI prints it as one line and exits 2
    p.write_text('target = "tiny"\n[options]\nverify = "tree"\n')
    assert load_deployment(p).options().verify == "tree"


@pytest.mark.parametrize("body,message", [
    ("target = 42", r"x.toml: `target`: expected `str`, got `int`$"),
    ('device = "cpu"', r"x.toml: missing required key `target`$"),
    ('target = "tiny"\nmax_new_tokens = -5', r"`max_new_tokens`: expected `int` >= 1$"),
    ('target = "tiny"\nsealed_fraction = 1.5', r"`sealed_fraction`: expected `float` < 1.0$"),
    ('target = "tiny"\nmode = "streaming"', r"`mode`: invalid enum value 'streaming'; allowed: batch1, batched$"),
    ('target = "tiny"\nconcurrency = 4', r"concurrency 4 needs mode = 'batched'$"),
    ('target = "tiny"\npath = "/etc"', r"unknown key `path`"),
    ('target = "tiny"\n[options]\nverify = ["tree"]', r"`options\[...\]`: expected `bool \| int \| float \| str`, got `array`"),
])
def test_each_bad_field_is_named_in_one_line(tmp_path, body, message):
    """A deployment file is parsed into a typed structure: a wrong type, a value out of range, a missing key or
    a key the engine refuses is one line naming the file and the key, never a Python constructor message."""
    p = tmp_path / "x.toml"
    p.write_text(body + "\n")
    with pytest.raises(DeploymentError, match=message) as err:
        load_deployment(p)
    assert "\n" not in str(err.value) and str(p) in str(err.value)


def test_defaults_are_the_engines_own(tmp_path):
    """A deployment that names no drafter or block size runs EngineOptions' defaults (written once, there)."""
    from specpilot.engine.options import EngineOptions

    p = tmp_path / "bare.toml"
    p.write_text('target = "tiny"\n')
    d = load_deployment(p)
    assert d.drafter is None and d.block_size is None
    assert d.options().drafter == EngineOptions().drafter and d.options().block_size == EngineOptions().block_size


def test_split_is_deterministic_disjoint_and_complete():
    d = load_deployment("smollm2-cpu")
    dev, sealed, every = (load_requests(d, s) for s in ("dev", "sealed", "all"))
    ids = lambda rs: {r.id for r in rs}  # noqa: E731
    assert ids(dev).isdisjoint(ids(sealed)) and ids(dev) | ids(sealed) == ids(every)
    assert len(every) == 164 + len(REQUEST_SETS["chat"]())
    assert 0.35 < len(sealed) / len(every) < 0.65
    assert [r.id for r in load_requests(d, "dev")] == [r.id for r in dev]
    assert {r.set for r in dev[:2]} == {"humaneval", "chat"}  # interleaved
    assert all(r.chat for r in dev if r.set == "chat") and not any(r.chat for r in dev if r.set == "humaneval")
    # The split of an id depends only on (seed, id).
    assert split_of("chat/chat-001", 0, 0.5) == split_of("chat/chat-001", 0, 0.5)
    assert len({split_of(f"x/{i}", 1, 0.5) for i in range(20)}) == 2
    with pytest.raises(ValueError, match="unknown split"):
        load_requests(d, "test")


def test_sealed_requests_are_disguised_with_the_seed_and_dev_requests_are_not():
    """Public prompts can be memorised; the sealed ones exist only with the controller's secret seed."""
    import msgspec

    public = {r.id: r.text for r in load_requests(load_deployment("smollm2-cpu"), "all")}
    d = msgspec.structs.replace(load_deployment("smollm2-cpu"), split_seed=987654321)
    dev, sealed = load_requests(d, "dev"), load_requests(d, "sealed")
    assert all(r.text == public[r.id] for r in dev)
    assert all(r.text != public[r.id] for r in sealed)
    code = next(r for r in sealed if r.set == "humaneval")
    original = public[code.id]
    entry = re.search(r"^def (\w+)\(", original, re.M).group(1)
    assert entry not in code.text and code.text.count("def ") == original.count("def ")  # renamed everywhere
    compile(code.text + "    pass\n", code.id, "exec")  # still Python
    chat = next(r for r in sealed if r.set == "chat")
    assert chat.text.startswith(public[chat.id]) and chat.chat
    # deterministic in (seed, id); another seed, another text
    assert disguise(REQUEST_SETS["humaneval"]()[0], 1) == disguise(REQUEST_SETS["humaneval"]()[0], 1)
    assert disguise(REQUEST_SETS["humaneval"]()[0], 1).text != disguise(REQUEST_SETS["humaneval"]()[0], 2).text


def test_chat_prompts_are_unique_and_substantial():
    reqs = REQUEST_SETS["chat"]()
    assert len(reqs) >= 40 and len({r.id for r in reqs}) == len(reqs)
    assert all(len(r.text) > 15 for r in reqs)


def test_a_timing_table_is_checked_and_layered_on_the_defaults(tmp_path):
    from specpilot.harness.deployment import TIMING_DEFAULTS, load_deployment

    assert load_deployment("smollm2-cpu").timing_settings() == TIMING_DEFAULTS
    base = 'target = "tiny"\n'
    ok = tmp_path / "ok.toml"
    ok.write_text(base + "[timing]\nrequests = 12\n")
    assert load_deployment(ok).timing_settings() == {**TIMING_DEFAULTS, "requests": 12}
    for body, message in (("trails = 3", "unknown key `timing.trails`; allowed: max_new_tokens, noise_trials, "
                                          "requests, threads, trials"),
                          ("noise_trials = 2", "`timing.noise_trials`: expected `int` >= 4"),
                          ("trials = 0", "`timing.trials`: expected `int` >= 1"),
                          ('trials = "6"', "`timing.trials`: expected `int`, got `str`")):
        bad = tmp_path / "bad.toml"
        bad.write_text(base + "[timing]\n" + body + "\n")
        with pytest.raises(DeploymentError, match=message):
            load_deployment(bad)


def test_the_shipped_checkpoint_deployment_reads_its_folder_beside_the_repository(tmp_path):
    """``deployments/smollm2-hf-cpu.toml`` names ``checkpoints/smollm2-135m`` relative to itself: copied into
    another tree with a checkpoint in that place, it loads that checkpoint (a tiny one here)."""
    import shutil

    from specpilot.harness.deployment import DEPLOYMENTS_DIR
    from tests.engine.test_checkpoint import make_checkpoint, save_tokenizer

    (tmp_path / "deployments").mkdir()
    toml = shutil.copy(DEPLOYMENTS_DIR / "smollm2-hf-cpu.toml", tmp_path / "deployments")
    folder = tmp_path / "checkpoints" / "smollm2-135m"
    with pytest.raises(DeploymentError, match=f"no checkpoint folder {folder}"):
        load_deployment(toml)
    folder.mkdir(parents=True)
    make_checkpoint(folder, "llama-tied")
    save_tokenizer(folder)
    d = load_deployment(toml)
    assert d.target == f"hf:{folder}" and d.facts()["model_family"] == "llama" and d.device == "cpu"


def test_batched_deployments_say_their_concurrency_and_take_the_batching_options(tmp_path):
    dep = load_deployment("smollm2-cpu-batched")
    assert dep.mode == "batched" and dep.concurrency == 8 and dep.facts()["mode"] == "batched"
    opts = dep.options({"batch_node_budget": 12, "prefill_chunk": 64})
    assert opts.batch_node_budget == 12 and opts.linear_backend == "stream"  # stock rows are batch-invariant
    with pytest.raises(ValueError, match=r"\['batch_adaptive_block'\] only mean something"):
        load_deployment("smollm2-cpu").options({"batch_adaptive_block": True})
    p = tmp_path / "d.toml"
    for body, message in (('target = "tiny"\nconcurrency = 4\n', "needs mode = 'batched'"),
                          ('target = "tiny"\nmode = "batched"\nconcurrency = 0\n', "`concurrency`: expected `int` >= 1"),
                          ('target = "tiny"\nmode = "beam"\n', "`mode`: invalid enum value 'beam'; allowed: batch1, batched"),
                          ('target = "tiny"\nmode = "batched"\nconcurrency = 4\n[server]\ncommand = ["x"]\n',
                           "batches inside its server")):
        p.write_text(body)
        with pytest.raises(DeploymentError, match=message):
            load_deployment(p)
