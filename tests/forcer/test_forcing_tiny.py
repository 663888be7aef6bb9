"""Token forcing on the tiny random model (real engine code, milliseconds per run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specpilot import forcing_rules
from specpilot.forcing_rules import Output
from specpilot.harness.forcing import Forcer
from tests.forcer.conftest import generate, scaled_layers

PROMPTS = ["Hello there", "The quick brown fox", "Write a poem", "SpecPilot"]
N_TOKENS = 32


@pytest.fixture(scope="module")
def stock_outputs(tiny_forcer) -> list[Output]:
    e = tiny_forcer.engine
    return [Output(tuple(ids), tuple(generate(tiny_forcer, ids, N_TOKENS))) for ids in map(e.tokenize, PROMPTS)]


def test_forced_pass_matches_the_models_own_logits(tiny_forcer, stock_outputs, one_thread):
    """Output position j is scored from the hidden state of sequence index len(prompt)-1+j."""
    model = tiny_forcer.model
    for o in stock_outputs:
        f = tiny_forcer.force(o.prompt_ids, o.tokens)
        seq = torch.tensor([[*o.prompt_ids, *o.tokens[:-1]]])
        with torch.no_grad():
            logits, _ = model(seq, torch.arange(seq.shape[1]), model.new_cache(seq.shape[1]), 0)
        own = logits[0, len(o.prompt_ids) - 1:].float()
        assert f.argmax.tolist() == own.argmax(-1).tolist()
        top = own.topk(2, dim=-1).values
        np.testing.assert_allclose(f.top2_gap, (top[:, 0] - top[:, 1]).numpy(), rtol=1e-4, atol=1e-4)
        assert not f.mismatch.any() and (f.margin == 0).all()  # stock's own greedy tokens


def test_stock_forced_against_itself_passes(tiny_forcer, stock_outputs, one_thread):
    rep = tiny_forcer.run(stock_outputs)
    assert rep.passed, rep.reason
    st = rep.stats
    assert st["system"]["mismatches"] == 0 and st["stock"]["mismatches"] == 0
    assert st["system"]["positions"] == sum(len(o.tokens) for o in stock_outputs)
    assert st["delta"] == forcing_rules.DELTA_FLOOR and st["stock_generated"] == len(stock_outputs)


def faulty_outputs(forcer: Forcer, outputs: list[Output]) -> list[Output]:
    """Outputs of the tiny model with both blocks' residual updates tripled."""
    with scaled_layers(forcer.model, [0, 1], 3.0):
        return [Output(o.prompt_ids, tuple(generate(forcer, o.prompt_ids, N_TOKENS))) for o in outputs]


def test_output_of_a_faulty_model_is_rejected(tiny_forcer, stock_outputs, one_thread):
    faulty = faulty_outputs(tiny_forcer, stock_outputs)
    assert any(f.tokens != o.tokens for f, o in zip(faulty, stock_outputs, strict=True))
    rep = tiny_forcer.run(faulty)
    assert not rep.passed
    assert not rep.stats["rate_rule"]["passed"] and not rep.stats["event_rule"]["passed"]
    assert rep.audited and not any(a["explained"] for a in rep.audited)
    a = rep.audited[0]
    assert a["margin"] > 2 * rep.stats["delta"] and a["system_token"] != a["argmax_token"]
    assert a["stock_token"] == a["argmax_token"]  # fp32 stock: its own pick is the FP32 argmax
    assert a["stock_pick"] == "forced argmax (fp32 CPU stock)"  # so no decode was needed to know it
    prefix = [*faulty[a["prompt_index"]].prompt_ids, *faulty[a["prompt_index"]].tokens[:a["position"]]]
    assert tiny_forcer.stock_pick(prefix) == a["stock_token"]  # and a decode agrees


def perturb(o: Output, positions: list[int], vocab: int) -> Output:
    toks = list(o.tokens)
    for j in positions:
        toks[j] = (toks[j] + 7) % vocab
    return Output(o.prompt_ids, tuple(toks))


def test_tokens_perturbed_at_large_margin_positions_are_rejected(tiny_forcer, stock_outputs, one_thread):
    vocab = tiny_forcer.model.cfg.vocab_size
    faulty = [perturb(o, [5, 20], vocab) for o in stock_outputs]  # 8 substitutions in 128 tokens
    rep = tiny_forcer.run(faulty)
    assert not rep.passed and not rep.stats["event_rule"]["passed"], rep.reason
    audited = {(a["prompt_index"], a["position"]) for a in rep.audited}
    assert {(i, j) for i in range(len(faulty)) for j in (5, 20)} <= audited
    assert rep.stats["system"]["unexplained"] >= 8


class ExplainingForcer(Forcer):
    """Stock's own pick is the system's token at chosen prefixes (as a bf16 stock can pick a token the
    FP32 head ranks second): those events are explained."""

    follows_exactly = False  # a stock whose pick can differ from its forced argmax: decode each event

    def __init__(self, base: Forcer, answers: dict[tuple[int, ...], int]):
        self.__dict__.update(base.__dict__)
        self.answers = answers

    def stock_pick(self, prefix):
        return self.answers.get(tuple(prefix), super().stock_pick(prefix))


def test_explained_events_do_not_fail_the_event_rule(tiny_forcer, stock_outputs, one_thread):
    vocab = tiny_forcer.model.cfg.vocab_size
    faulty = [perturb(o, [10], vocab) for o in stock_outputs[:3]] + stock_outputs[3:]
    answers = {(*o.prompt_ids, *o.tokens[:10]): o.tokens[10] for o in faulty[:3]}
    rep = ExplainingForcer(tiny_forcer, answers).run(faulty)
    explained = [a for a in rep.audited if a["explained"]]
    assert len(explained) == 3 and all(a["position"] == 10 for a in explained)
    # The tokens after an explained substitution are stock's old continuation, so any events there
    # stay unexplained; the rule counts only those.
    assert rep.stats["system"]["unexplained"] == len(rep.audited) - 3
    unexplained_only = tiny_forcer.run(faulty)
    assert unexplained_only.stats["system"]["unexplained"] == rep.stats["system"]["unexplained"] + 3


def test_audit_is_capped_and_extrapolated(tiny_forcer, stock_outputs, one_thread):
    faulty = faulty_outputs(tiny_forcer, stock_outputs)
    rep = tiny_forcer.run(faulty, max_audit=5, seed=3)
    sys_ = rep.stats["system"]
    assert sys_["events"] > 5 and sys_["audited"] == 5 == len(rep.audited)
    assert sys_["unexplained"] == round(sys_["events"] * sys_["unexplained_audited"] / 5)
    again = tiny_forcer.run(faulty, max_audit=5, seed=3)
    assert again.audited == rep.audited  # the sample is seeded


def test_given_stock_tokens_and_empty_outputs(tiny_forcer, stock_outputs, one_thread):
    given = [Output(o.prompt_ids, o.tokens, stock_tokens=o.tokens) for o in stock_outputs]
    rep = tiny_forcer.run([*given, Output(given[0].prompt_ids, ())])
    assert rep.passed and rep.stats["stock_generated"] == 1
    assert rep.stats["system"]["positions"] == sum(len(o.tokens) for o in stock_outputs)


def test_too_long_for_the_context_is_refused(tiny_forcer):
    n = tiny_forcer.model.cfg.max_seq_len
    with pytest.raises(ValueError, match="context"):
        tiny_forcer.force([1] * n, [2])


def test_cli_force_json(tiny_forcer, stock_outputs, tmp_path, capsys, one_thread):
    from specpilot.app.cli import main

    path = tmp_path / "outputs.jsonl"
    vocab = tiny_forcer.model.cfg.vocab_size
    rows = [{"prompt_ids": list(o.prompt_ids), "tokens": list(o.tokens)} for o in stock_outputs]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["force", str(path), "--deployment", "tiny-cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["passed"] and out["stats"]["system"]["mismatches"] == 0 and out["audited"] == []

    bad = [perturb(o, [5, 20], vocab) for o in stock_outputs]
    path.write_text("\n".join(json.dumps({"prompt_ids": list(o.prompt_ids), "tokens": list(o.tokens)})
                              for o in bad))
    assert main(["force", str(path), "--deployment", "tiny-cpu", "--json"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not out["passed"] and len(out["audited"]) >= 8

    path.write_text(json.dumps({"prompt": "Hello there", "output": "eeee"}) + "\n")
    assert main(["force", str(path), "--deployment", "tiny-cpu"]) == 0  # text, tokenized by stock
    assert "PASSED" in capsys.readouterr().out
    path.write_text('{"tokens": [1]}\n')
    assert main(["force", str(path), "--deployment", "tiny-cpu"]) == 2  # unusable input


def test_force_outputs_is_what_the_controller_calls(stock_outputs, one_thread):
    from specpilot.harness.forcing import force_outputs

    rows = [{"prompt_ids": list(o.prompt_ids), "tokens": list(o.tokens)} for o in stock_outputs]
    rep = force_outputs("tiny-cpu", rows)
    assert rep["passed"] and set(rep) == {"passed", "reason", "stats", "audited"}
    assert rep["stats"]["deployment"] == "tiny-cpu"
    with pytest.raises(ValueError, match="no outputs"):
        force_outputs("tiny-cpu", [])
    from specpilot.harness.deployment import DeploymentError

    with pytest.raises(DeploymentError, match="no deployment 'no-such-deployment'"):
        force_outputs("no-such-deployment", rows)


def test_stock_drafting_the_systems_output_gives_stocks_exact_tokens(tiny_forcer, stock_outputs, one_thread):
    """`FollowDraft`: on an FP32 CPU stock the system's output is drafted while stock agrees with it;
    stock's tokens come out the same, whether the guess is right, wrong from some point, or garbage."""
    assert tiny_forcer.follows_exactly
    vocab = tiny_forcer.model.cfg.vocab_size
    for o in stock_outputs:
        wrong_late = perturb(o, [N_TOKENS // 2], vocab).tokens
        garbage = tuple((t + 3) % vocab for t in o.tokens)
        for guess in (o.tokens, wrong_late, garbage):
            tiny_forcer._stock_outputs.clear()
            assert tiny_forcer.stock_output(o.prompt_ids, N_TOKENS, guess) == o.tokens
    # a right guess takes few steps: the engine verifies block_size + 1 tokens each
    from specpilot.harness.forcing import FollowDraft

    e, o = tiny_forcer.engine, stock_outputs[0]
    own = e.drafter
    e.drafter = FollowDraft(len(o.prompt_ids), o.tokens, own)
    try:
        steps = e.generate(list(o.prompt_ids), N_TOKENS).steps
    finally:
        e.drafter = own
    assert steps <= -(-(N_TOKENS - 1) // (e.options.block_size + 1)) + 1


def test_stock_outputs_are_kept_between_forcers(tiny_forcer, stock_outputs, tmp_path, monkeypatch, one_thread):
    """The controller forces the same dev prompts for every candidate: stock's outputs are generated
    once per stock runtime and prompt, then read back (here by a second forcer that cannot generate)."""
    o = stock_outputs[0]
    first = Forcer(tiny_forcer.engine, memo_dir=tmp_path)
    assert first.stock_output(o.prompt_ids, N_TOKENS) == o.tokens
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_decoding(*a, **k):
        raise AssertionError("stock's output should have been read back")

    monkeypatch.setattr(tiny_forcer.engine, "generate", no_decoding)
    second = Forcer(tiny_forcer.engine, memo_dir=tmp_path)
    assert second.stock_output(o.prompt_ids, N_TOKENS) == o.tokens
    assert second.stock_output(o.prompt_ids, N_TOKENS // 2) == o.tokens[: N_TOKENS // 2]
