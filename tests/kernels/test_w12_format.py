"""W12 format: bit-exact round trips (real, random, adversarial), bits per weight, the engine
hook on CPU and the ``w12 pack`` command."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from specpilot.kernels.w12 import W12Linear, decode, pack, quantize_model_linears, verify
from specpilot.kernels.w12.format import E0_MAX, E0_MIN, WINDOW, half_width, window_bits

from .w12_cases import adversarial, from_bits, normal


def bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int16)


def assert_round_trip(w: torch.Tensor, check_verify: bool = True):
    p = pack(w)
    got = decode(p)
    assert got.dtype == torch.bfloat16 and got.shape == w.shape
    assert torch.equal(bits(got), bits(w))
    if check_verify:
        verify(p, w)
    return p


@pytest.mark.parametrize("name", list(adversarial()))
def test_round_trip_adversarial(name):
    assert_round_trip(adversarial()[name])


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 4096), (5, 14336), (129, 576), (2, 31), (2, 33)])
def test_round_trip_normal(shape):
    p = assert_round_trip(normal(*shape, seed=shape[0]))
    assert p.kh == half_width(shape[1]) and p.kh % 16 == 0 and 2 * p.kh >= shape[1]


def test_every_pattern_is_exact_and_specials_escape():
    w = adversarial()["every_bf16_pattern"]
    p = assert_round_trip(w)
    u = bits(w).to(torch.int32) & 0xFFFF
    exponent = (u >> 7) & 0xFF
    must_escape = (exponent == 255) | ((exponent == 0) & ((u & 0x7F) != 0))  # inf/NaN, denormals
    esc = torch.zeros(w.numel(), dtype=torch.bool)
    esc[p.esc_idx.long()] = True
    assert esc[must_escape.reshape(-1)].all()


def test_zeros_cost_nothing():
    w = normal(64, 1024, seed=3)
    w[:, ::10] = 0.0
    w[::2, 1::10] = -0.0
    p = assert_round_trip(w)
    zero = (bits(w).to(torch.int32) & 0x7FFF) == 0
    esc = torch.zeros(w.numel(), dtype=torch.bool)
    esc[p.esc_idx.long()] = True
    assert not esc[zero.reshape(-1)].any()
    planes = p.low.numel() + p.nib.numel() + p.e0.numel() + 4 * p.esc_ptr.numel()
    assert p.nbytes == planes + 6 * p.escapes  # an escape costs 6 bytes; a zero costs nothing extra
    assert p.escapes <= pack(normal(64, 1024, seed=3)).escapes


def test_window_holds_15_binades_without_escapes():
    # row r spans exactly 15 consecutive binades starting at a different exponent per row
    rows = []
    for r in range(8):
        e = torch.arange(15) + 100 + 7 * r
        vals = (2.0 ** (e.double() - 127)) * (1 + torch.arange(15) / 16)
        rows.append(torch.cat([vals, -vals]).float())
    w = torch.stack(rows).to(torch.bfloat16)
    p = assert_round_trip(w)
    assert p.escapes == 0
    assert ((p.e0.int() >= E0_MIN) & (p.e0.int() <= E0_MAX)).all()
    o = (window_bits(p) >> 7) & 0xF
    assert int(o.min()) >= 1 and int(o.max()) <= WINDOW


def test_wide_row_escapes_only_outside_window():
    w = adversarial()["wide_row"]  # 81 values every 3rd binade across 240 binades
    p = assert_round_trip(w)
    assert p.escapes == w.numel() - 5  # a 15-binade window holds 5 of them


def test_verify_detects_a_flipped_bit():
    w = normal(8, 64)
    p = pack(w)
    p.low[3, 5] ^= 1
    with pytest.raises(ValueError, match="not bit-exact"):
        verify(p, w)


@pytest.mark.parametrize("n,k", [(256, 4096), (256, 14336), (512, 1024)])
def test_bits_per_weight_8b_shaped_normal(n, k):
    p = assert_round_trip(normal(n, k, seed=n + k))
    assert p.bits_per_weight <= 12.05


@pytest.mark.slow
def test_smollm2_all_tensors_bit_exact(smollm2_tensors):
    weights = stored = 0
    for _name, w in smollm2_tensors:
        m = w.reshape(1, -1) if w.dim() == 1 else w
        p = assert_round_trip(m, check_verify=False)  # decode once: 135 M weights on 2 cores
        weights += m.numel()
        stored += p.nbytes
    assert weights > 134_000_000
    assert 8 * stored / weights <= 12.05


@pytest.fixture(scope="module")
def smollm2_tensors():
    pytest.importorskip("gguf")
    from specpilot.app.cmd_w12 import gguf_tensors, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return list(gguf_tensors(path))


class Tiny(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 24)
        self.layers = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(24, 48), "down": nn.Linear(48, 24, bias=False)})])
        self.lm_head = nn.Linear(24, 40, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["down"](torch.relu(layer["up"](h)))
        return self.lm_head(h)


@pytest.mark.parametrize("tie", [False, True])
def test_quantize_model_linears_cpu_reference_is_exact(tie):
    model = Tiny(tie)
    ids = torch.tensor([[1, 5, 7, 39]])
    # expected: the same model with every swapped weight rounded to BF16, computed in fp32
    ref = Tiny(tie)
    for mod in (ref.layers[0]["up"], ref.layers[0]["down"]):
        mod.weight.data = mod.weight.data.to(torch.bfloat16).float()
    stats = quantize_model_linears(model, include_lm_head=False)
    assert set(stats["tensors"]) == {"layers.0.up", "layers.0.down"}
    assert stats["skipped"] == ["lm_head"]
    assert isinstance(model.layers[0]["up"], W12Linear) and isinstance(model.lm_head, nn.Linear)
    assert stats["escapes"] == sum(s["escapes"] for s in stats["tensors"].values())
    assert torch.equal(model(ids), ref(ids))


def test_quantize_includes_untied_head_on_request():
    model = Tiny(tie=False)
    stats = quantize_model_linears(model, include_lm_head=True)
    assert "lm_head" in stats["tensors"] and isinstance(model.lm_head, W12Linear)
    tied = Tiny(tie=True)
    stats = quantize_model_linears(tied, include_lm_head=True)
    assert "lm_head" in stats["skipped"]  # tied to the embedding


def test_w12linear_bf16_input_and_state_dict():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    q = W12Linear.from_linear(lin)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert torch.equal(q(x), lin(x))
    q2 = W12Linear(pack(lin.weight.detach()), lin.bias)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2(x), q(x))


def test_cli_random_8b_json(capsys):
    from specpilot.app.cmd_w12 import main

    assert main(["w12", "pack", "--random-8b", "--sample-rows", "64", "--json", "--device", "cpu"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["verified"] == "bit-exact"
    assert summary["matrices"]["weights"] > 8_000_000_000
    assert summary["matrices"]["bits_per_weight"] <= 12.05
    assert summary["all"]["bytes_saved"] > 0


def test_from_bits_helper():
    assert torch.equal(bits(from_bits([0x8000, 0x7F80])), torch.tensor([-32768, 0x7F80], dtype=torch.int16))
