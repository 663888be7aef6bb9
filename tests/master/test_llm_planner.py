"""The LLM planner through the real Anthropic and OpenAI SDKs against a local server speaking their
wire formats: a bad plan is refused back to the model, a corrected one becomes directions."""

import pytest

from specpilot.providers import MissingKey, ProviderError
from specpilot.services.master.llm_planner import PlanBox, plan_with_llm
from specpilot.services.master.main import check_providers
from tests.subagent.wire import Call, ScriptedServer, Turn

KNOWN = {"block_size", "verify", "cuda_graphs"}
CONTEXT = {"ceiling": {"factors": {"tau": 1.2, "kernel": 1.5, "overhead": 4.0}}, "tried": []}
BAD = {"directions": [{"title": "warp speed", "factor": "overhead", "option": "warp_drive", "values": [9]}]}
GOOD = {"directions": [{"title": "capture the step in CUDA graphs", "factor": "overhead", "option": "cuda_graphs",
                        "values": [True], "rationale": "overhead 4x"}]}
TURNS = [Turn("Trying an option.", [Call("plan", BAD)]), Turn("Corrected.", [Call("plan", GOOD)])]


def _check(directions):
    (d,) = directions
    assert d.provider == "sweep" and d.factor == "overhead"
    assert d.hints == {"option": "cuda_graphs", "values": [True], "base": {"block_size": 6}}


def test_anthropic_planner_corrects_itself(monkeypatch):
    with ScriptedServer(TURNS) as srv:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.url)  # the SDK reads it, as in a deployment
        _check(plan_with_llm("anthropic:claude-test", CONTEXT, KNOWN, {"block_size": 6}, "sweep", 1,
                             env={"ANTHROPIC_API_KEY": "k"}))
        bodies = srv.bodies("/v1/messages")
        assert len(bodies) == 2 and bodies[0]["tools"][0]["name"] == "plan"
        assert "overhead" in bodies[0]["system"]
        result = bodies[1]["messages"][-1]["content"][0]
        assert result["type"] == "tool_result" and result["is_error"] and "warp_drive" not in result["content"]
        assert "option must be one of" in result["content"]


def test_openai_compatible_planner():
    with ScriptedServer(TURNS) as srv:
        _check(plan_with_llm(f"openai-compatible:{srv.openai_url}|test", CONTEXT, KNOWN, {"block_size": 6}, "sweep", 1,
                             env={}))
        bodies = srv.bodies("/v1/chat/completions")
        assert bodies[1]["messages"][-1]["role"] == "tool"


def test_plan_box_rules():
    box = PlanBox(KNOWN, {}, coder="sweep", devices=2)
    assert box.call("nope", {}).error and box.call("plan", {"directions": []}).error
    open_task = {"directions": [{"title": "fuse the norms", "factor": "kernel"}]}
    assert "only runs option sweeps" in box.call("plan", open_task).text and box.finished is None
    llm_box = PlanBox(KNOWN, {}, coder="anthropic", devices=2)
    assert not llm_box.call("plan", open_task).error
    assert llm_box.finished[0].provider == "anthropic"
    assert box.call("plan", {"directions": [{"title": "x", "factor": "speed"}]}).error


def test_planner_strings_are_checked_and_keys_named():
    check_providers("rules", "sweep")
    check_providers("openai-compatible:http://localhost:1/v1", "anthropic")
    with pytest.raises(ValueError):
        check_providers("sweep", "sweep")
    with pytest.raises(ProviderError):
        check_providers("rules", "gemini")
    with pytest.raises(MissingKey, match="OPENAI_API_KEY"):
        plan_with_llm("openai", CONTEXT, KNOWN, {}, "sweep", 1, env={})
