"""The EAGLE-style drafter: proposals, losslessness, its weights file, and its training data and run."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.app.cmd_drafter import main as train_main
from specpilot.engine.drafters.eagle import (
    DEFAULT_WEIGHTS,
    EagleConfig,
    EagleDrafter,
    build_net,
    load_eagle_drafter,
)
from specpilot.engine.drafters.parallel import save_drafter
from specpilot.harness.distill import eagle_batch, eagle_streams, generate_batch, to_draft_ids
from tests.engine.conftest import make_engine
from tests.engine.test_parallel_drafter import random_drafter


def random_eagle(model, vocab: int = 64, k: int = 3, seed: int = 0) -> EagleDrafter:
    torch.manual_seed(seed)
    cfg = EagleConfig(target=model.cfg.name, dim=model.cfg.dim, width=32, k=k, draft_vocab=vocab)
    net = build_net(model, cfg, torch.randperm(model.cfg.vocab_size)[:vocab])
    for p in net.parameters():  # make the (identity-initialised) blocks do something
        torch.nn.init.normal_(p, std=0.5)
    return EagleDrafter(net)


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 20))] for _ in range(n)]


def test_chain_and_tree_proposals(tiny):
    model, _ = tiny
    d = random_eagle(model)
    h = torch.randn(model.cfg.dim)
    (chain,) = d.propose([1, 2, 3], h, 5, 1)  # deeper than trained: the recurrence just continues
    assert len(chain.tokens) == 5 and set(chain.tokens) <= set(d.net.vocab_ids.tolist())
    assert all(1.0 >= a >= b > 0.0 for a, b in zip(chain.scores, chain.scores[1:], strict=False))
    tree = d.propose([1, 2, 3], h, 4, 16)
    assert len({c.tokens for c in tree}) == len(tree) > 4
    assert [c.scores[-1] for c in tree] == sorted((c.scores[-1] for c in tree), reverse=True)  # best first
    assert all(list(c.scores) == sorted(c.scores, reverse=True) for c in tree)  # a prefix rates >= its extensions
    assert tree[0].tokens == chain.tokens[:1]  # the best depth-1 node is the greedy draft
    assert max(len(c.tokens) for c in tree) == 4
    assert d.propose([1], None, 4, 1) == [] and d.propose([1], h, 0, 1) == []


@pytest.mark.parametrize("seed", range(3))
def test_tiny_eagle_is_lossless(tiny, seed):
    model, _ = tiny
    prompts = _prompts(seed)
    ref = [make_engine(tiny, drafter="none").generate(p, 48).tokens for p in prompts]
    for verify, block, nodes in (("chain", 4, 16), ("chain", 1, 16), ("tree", 4, 12), ("tree", 5, 30)):
        e = make_engine(tiny, drafter="ngram", verify=verify, block_size=block, tree_nodes=nodes)
        e.drafter = random_eagle(model, vocab=320, seed=seed)  # every token drafted: sometimes right
        assert [e.generate(p, 48).tokens for p in prompts] == ref


def test_save_load_and_errors(tiny, tmp_path, smollm2):
    model, _ = tiny
    d = random_eagle(model)
    path = tmp_path / "e.pt"
    save_drafter(path, d.net, {"training_data_sha256": "x" * 64, "figures": {}})
    loaded = load_eagle_drafter(model, path)
    h = torch.randn(model.cfg.dim)
    # fp16 storage: same proposals as the fp32 original on this input.
    assert loaded.propose([1, 2, 3], h, 4, 1)[0].tokens == d.propose([1, 2, 3], h, 4, 1)[0].tokens
    with pytest.raises(ValueError, match="trained for 'tiny'"):
        load_eagle_drafter(smollm2[0], path)
    with pytest.raises(FileNotFoundError, match="specpilot drafter train --kind eagle"):
        load_eagle_drafter(model)  # no shipped file for the tiny model
    parallel = tmp_path / "p.pt"
    save_drafter(parallel, random_drafter(model).net, {"figures": {}})
    with pytest.raises(ValueError, match="holds a 'parallel' drafter, not a 'eagle' one"):
        load_eagle_drafter(model, parallel)
    # Through the engine's options: drafter="eagle" reads drafter_weights.
    e = make_engine(tiny, drafter="eagle", drafter_weights=str(path))
    assert isinstance(e.drafter, EagleDrafter)


def test_streams_line_up_with_generation(tiny):
    """Stream position i: token s_i, the hidden state that predicts it, the target's greedy token there."""
    model, _ = tiny
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    b = generate_batch(model, prompts, 6, model.cfg.stop_ids, keep_prompt=True)
    assert torch.equal(b["prompt_hidden"][:, -1], b["hidden"][:, 0])
    assert torch.equal(b["prompt_argmax"][:, -1], b["tokens"][:, 0])
    k = 3
    st = eagle_streams([b], k, use_prompt=True)
    st["y"] = to_draft_ids(st["greedy_next"].masked_fill(~st["ok"], -1), torch.arange(model.cfg.vocab_size),
                           model.cfg.vocab_size)
    row_len = 4 + 6 + k  # P - 1 prompt positions, G generated, k padding
    # Row 0's first generated token: its root is greedy; the unroll is fed the generated tokens.
    i = 4
    assert int(st["tokens"][i]) == int(b["tokens"][0, 0]) and bool(st["greedy"][i])
    hidden, tokens, y, target_hidden = eagle_batch(st, torch.tensor([i]), k)
    assert torch.equal(hidden[0], b["hidden"][0, 0])
    assert tokens[0].tolist() == b["tokens"][0, :k].tolist()
    assert y[0].tolist() == b["tokens"][0, 1: k + 1].tolist()
    assert torch.equal(target_hidden[0], b["hidden"][0, 1: k + 1])
    # Row 1 is left-padded by 3: its first 3 stream positions are padding, never roots.
    assert not st["ok"][row_len: row_len + 3].any()
    # A prompt position whose next text token is not greedy ends the chain there: later steps are ignored.
    for r in st["roots"].tolist():
        _, _, y, _ = eagle_batch(st, torch.tensor([r]), k)
        for j in range(1, k):
            if not bool(st["greedy"][r + j]):
                assert (y[0, j:] == -100).all()


def test_tiny_training_run_writes_a_loadable_file(tiny, tmp_path):
    out = tmp_path / "tiny_eagle.pt"
    assert train_main(["--kind", "eagle", "--deployment", "tiny-cpu", "--minutes", "0.15", "--prompts", "16",
                       "--batch", "8", "--new-tokens", "12", "--draft-vocab", "64", "--eval-requests", "0",
                       "--train-batch", "32", "--out", str(out)]) == 0
    blob = torch.load(out, weights_only=True)
    assert blob["config"]["kind"] == "eagle" and len(blob["meta"]["training_data_sha256"]) == 64
    assert {"heldout", "train_examples", "generated_tokens"} <= set(blob["meta"]["figures"])
    d = load_eagle_drafter(tiny[0], out)
    prompt = _prompts(0, 1)[0]
    ref = make_engine(tiny, drafter="none").generate(prompt, 32).tokens
    assert make_engine(tiny, drafter="eagle", drafter_weights=str(out)).generate(prompt, 32).tokens == ref
    assert d.cfg.draft_vocab == len(blob["vocab_ids"])


def test_shipped_smollm2_eagle_is_small_documented_and_lossless(smollm2):
    path = DEFAULT_WEIGHTS["smollm2-135m"]
    assert path.stat().st_size <= 10_000_000
    blob = torch.load(path, weights_only=True)
    meta = blob["meta"]
    assert len(meta["training_data_sha256"]) == 64 and meta["args"]["kind"] == "eagle"
    assert {"heldout", "measured_tau", "generated_tokens"} <= set(meta["figures"])
    model, tok = smollm2
    prompts = [tok.encode("def fibonacci(n):\n    "), tok.encode(tok.chat_prompt("Name three colors."))]
    ref = [make_engine(smollm2, drafter="none").generate(p, 24).tokens for p in prompts]
    for opts in (dict(verify="chain", block_size=4), dict(verify="tree", block_size=4, tree_nodes=16)):
        e = make_engine(smollm2, drafter="eagle", **opts)
        assert [e.generate(p, 24).tokens for p in prompts] == ref
