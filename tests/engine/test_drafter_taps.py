"""bench/drafter_taps.py's parts: the taps it records are the target's own layer outputs at the right
positions, and its taps arm starts as the last-layer net."""

from __future__ import annotations

import torch

from bench.drafter_taps import TapsNet, generate_with_taps
from specpilot.engine.drafters.parallel import ParallelConfig, ParallelDrafterNet
from specpilot.harness.distill import generate_batch


def test_taps_are_the_layers_outputs_behind_each_generated_token(tiny):
    model, _ = tiny
    d, taps = model.cfg.dim, [0, 1]
    prompts = [[5, 9, 14, 3, 22], [7, 1, 30]]
    got = generate_with_taps(model, prompts, 6, model.cfg.stop_ids, taps)
    plain = generate_batch(model, prompts, 6, model.cfg.stop_ids)
    assert got["hidden"].shape == (2, 6, 3 * d)
    assert torch.equal(got["tokens"], plain["tokens"])  # the hooks change nothing
    torch.testing.assert_close(got["hidden"][..., :d].float(), plain["hidden"].half().float())
    # one forward over a row's whole text: layer i's output at the position that chose token g
    for row, prompt in enumerate(prompts):
        seq = torch.tensor([prompt + got["tokens"][row].tolist()])
        outs = {}
        hooks = [model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i, outs=outs: outs.__setitem__(i, out[0])) for i in taps]
        try:
            with torch.no_grad():
                model(seq, torch.arange(seq.shape[1]), model.new_cache(seq.shape[1]), 0)
        finally:
            for h in hooks:
                h.remove()
        for j, i in enumerate(taps):
            want = outs[i][len(prompt) - 1: len(prompt) - 1 + 6]  # position P - 1 + g chose token g
            torch.testing.assert_close(got["hidden"][row, :, (1 + j) * d: (2 + j) * d].float(), want,
                                       atol=2e-2, rtol=1e-2)  # half precision, as the data keeps it


def test_the_taps_arm_starts_as_the_last_layer_net(tiny):
    model, _ = tiny
    d = model.cfg.dim
    torch.manual_seed(0)
    cfg = ParallelConfig(target=model.cfg.name, dim=d, width=32, k=3, draft_vocab=40)
    inner = ParallelDrafterNet(cfg, torch.randperm(model.cfg.vocab_size)[:40], model.embed.weight.detach())
    for p in inner.parameters():
        torch.nn.init.normal_(p, std=0.5)
    net = TapsNet(inner, 3)
    hidden, ctx = torch.randn(4, 3 * d), torch.randint(0, model.cfg.vocab_size, (4, cfg.n_context))
    with torch.no_grad():
        torch.testing.assert_close(net(hidden, ctx), inner(hidden[:, :d], ctx), atol=1e-4, rtol=1e-4)
        net.fuse.weight.add_(0.1)  # and the other layers do reach it once trained
        assert not torch.allclose(net(hidden, ctx), inner(hidden[:, :d], ctx), atol=1e-3)
