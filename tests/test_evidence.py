"""The evidence an agent is told (`specpilot.evidence`): attempts folded from the ledger's events, the
bundle bounded in size, refuted option values; and the LLM planner refusing to repeat a refuted direction
without naming new evidence."""

import json

from specpilot import evidence, schema
from specpilot.services.master.llm_planner import PlanBox

DIFF = """diff --git a/engine/decode.py b/engine/decode.py
--- a/engine/decode.py
+++ b/engine/decode.py
@@ -1,2 +1,3 @@
-a
+b
+c
 d
"""


def _history() -> list[schema.Event]:
    return [
        schema.DirectionPlanned(direction_id="d0", title="sweep ngram_min_match"),
        schema.PatchProposed(direction_id="d0", patch_id="p0", diff="", options={"ngram_min_match": 1}),
        schema.VerdictIssued(patch_id="p0", decision="reject", gain=-0.115, lower_bound=-0.126, bar=0.018,
                             reason="below_bar: lower bound -0.1260 <= bar 0.0180"),
        schema.DirectionPlanned(direction_id="d1", title="fuse the norms"),
        schema.PatchProposed(direction_id="d1", patch_id="p1", diff=DIFF, options={"fused_norms": True}),
        schema.PatchRefused(patch_id="p1", rule="paths", reason="outside the allowed roots"),
        schema.PatchProposed(direction_id="d1", patch_id="p2", diff="", options={"verify": "tree"}),
    ]


def test_attempts_say_what_was_tried_and_how_it_ended():
    tried = evidence.attempts(_history())
    assert [(a["patch_id"], a["direction"], a["decision"]) for a in tried] == [
        ("p0", "sweep ngram_min_match", "reject"), ("p1", "fuse the norms", "refused"),
        ("p2", "fuse the norms", "undecided")]
    assert tried[0]["gain"] == -0.115 and tried[0]["bar"] == 0.018 and "below_bar" in tried[0]["reason"]
    assert tried[1]["diff"] == "engine/decode.py +2 -1" and tried[1]["reason"].startswith("paths:")
    assert evidence.refuted(tried, "ngram_min_match", 1, {}) and not evidence.refuted(tried, "ngram_min_match", 3, {})
    assert not evidence.refuted(tried, "ngram_min_match", 1, {"verify": "tree"})  # another base: not refuted


def test_the_bundle_is_bounded_and_says_what_it_left_out():
    profile = schema.ProfileMeasured(device="cpu", step_s=0.0657, t_ar_s=0.0586, tau=1.35, n_tokens=5,
                                     classes_s={f"class_{i}": i / 1e3 for i in range(40)}, chain_cost={4: 1.63})
    hw = schema.HardwareMeasured(device="cpu (1 threads)", bandwidth_bytes_s=13e9, flops_s=0.15e12)
    ceiling = schema.CeilingComputed(ceiling_speedup=1.7, factors={"tau": 1.04, "kernel": 1.2, "overhead": 1.16})
    many = evidence.attempts(_history()) * 200
    full = evidence.bundle(facts={"device_kind": "cpu"}, best_options={}, attempts=many, hardware=hw,
                           profile=profile, ceiling=ceiling, entries=[{"entry_id": "e1", "title": "t", "delta": DIFF}])
    assert len(json.dumps(full)) <= evidence.MAX_BYTES and full["tried_left_out"] > 0
    assert full["tried"][-1] == many[-1]  # the newest attempts are kept
    assert list(full["profile"]["classes_ms"])[0] == "class_39" and len(full["profile"]["classes_ms"]) <= 12
    assert full["device"]["bandwidth_gb_s"] == 13.0 and full["ceiling"]["factors"]["tau"] == 1.04
    assert full["memory_entries"][0]["delta"] == "engine/decode.py +2 -1"
    assert "class_39" in evidence.render(full) and evidence.render({}) == "none recorded yet"


def test_the_llm_planner_cannot_repeat_a_refuted_direction_without_new_evidence():
    tried = evidence.attempts(_history())
    box = PlanBox({"ngram_min_match", "verify"}, {}, coder="anthropic", devices=2, attempts=tried)
    again = {"title": "min match 1 again", "factor": "tau", "option": "ngram_min_match", "values": [1]}
    res = box.call("plan", {"directions": [again]})
    assert res.error and "already rejected from this base" in res.text and box.finished is None
    res = box.call("plan", {"directions": [{"title": "Fuse the norms", "factor": "kernel"}]})
    assert res.error and "already tried and rejected" in res.text
    new = {**again, "new_evidence": "the best now verifies trees, where short matches fill more nodes"}
    assert not box.call("plan", {"directions": [new, {"title": "min match 3", "factor": "tau",
                                                      "option": "ngram_min_match", "values": [3]}]}).error
    assert box.finished[0].hints["new_evidence"].startswith("the best now") and "new_evidence" not in box.finished[1].hints


def test_a_subagent_is_told_the_evidence_its_direction_carries():
    from specpilot.services.subagent.llm import system_prompt

    bundle = evidence.bundle(facts={"device_kind": "cpu"}, best_options={}, attempts=evidence.attempts(_history()))
    d = schema.DirectionPlanned(direction_id="d2", title="a better drafter", evidence=bundle)
    prompt = system_prompt(d, {}, max_turns=10)
    assert '"decision": "reject"' in prompt and '"gain": -0.115' in prompt and "below_bar" in prompt
    assert "none recorded yet" in system_prompt(schema.DirectionPlanned(direction_id="d3", title="t"), {}, 10)
