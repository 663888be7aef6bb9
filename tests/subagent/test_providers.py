"""Provider strings, API keys, and the real Anthropic and OpenAI SDKs driving the tool loop against a local
server that speaks their wire formats and replays a scripted transcript."""

from __future__ import annotations

import json

import pytest

from specpilot import policy, providers, schema
from specpilot.paths import REPO_ROOT
from specpilot.providers import MissingKey, ProviderError, ProviderSpec, api_key, parse_provider
from specpilot.services.subagent import llm
from specpilot.services.subagent.main import Best, Settings, produce
from specpilot.services.subagent.workspace import Tools, Workspace, build_workspace
from tests.subagent import scripts
from tests.subagent.wire import Call, Fail, ScriptedServer, Turn

DIRECTION = schema.DirectionPlanned(direction_id="d1", title="add a demo flag", rationale="a test", factor="overhead",
                                    deployment="tiny-cpu", hints={"where": "engine/options.py"})


@pytest.mark.parametrize("text, spec", [
    ("sweep", ProviderSpec("sweep")),
    ("memory", ProviderSpec("memory")),
    ("anthropic", ProviderSpec("anthropic", providers.DEFAULT_ANTHROPIC_MODEL)),
    ("anthropic:claude-x", ProviderSpec("anthropic", "claude-x")),
    ("openai", ProviderSpec("openai", providers.DEFAULT_OPENAI_MODEL)),
    ("OpenAI:gpt-x", ProviderSpec("openai", "gpt-x")),
    ("openai-compatible:http://h:8000/v1", ProviderSpec("openai-compatible", providers.DEFAULT_COMPATIBLE_MODEL,
                                                        "http://h:8000/v1")),
    ("openai-compatible:https://h.example:443/api/v1|Qwen/Qwen3-Coder:30b",
     ProviderSpec("openai-compatible", "Qwen/Qwen3-Coder:30b", "https://h.example:443/api/v1")),
])
def test_parse_provider(text, spec):
    assert parse_provider(text) == spec
    assert parse_provider(str(spec)) == spec  # str() is a provider string again


@pytest.mark.parametrize("text, fragment", [
    ("", "unknown provider"), ("gemini", "unknown provider"), ("sweep:x", "takes no argument"),
    ("openai-compatible:", "BASE_URL"), ("openai-compatible:localhost:8000", "http"),
    ("openai-compatible:http://h/v1|", "empty model"),
])
def test_parse_provider_errors(text, fragment):
    with pytest.raises(ProviderError, match=fragment):
        parse_provider(text)


def test_missing_key_names_the_variable(tmp_path):
    for text, var in (("anthropic", "ANTHROPIC_API_KEY"), ("openai:gpt-x", "OPENAI_API_KEY")):
        with pytest.raises(MissingKey, match=var):
            api_key(parse_provider(text), env={})
        assert api_key(parse_provider(text), env={var: " k "}) == "k"
    compatible = parse_provider("openai-compatible:http://h/v1")
    assert api_key(compatible, env={"OPENAI_API_KEY": "real-openai-key"}) == "none"  # never sent elsewhere
    assert api_key(compatible, env={"OPENAI_COMPATIBLE_API_KEY": "k2"}) == "k2"
    # the service fails before building anything, with the variable in the message
    d = schema.DirectionPlanned(direction_id="d", title="t", provider="anthropic")
    with pytest.raises(MissingKey, match="ANTHROPIC_API_KEY"):
        produce(d, Best(), Settings(work_dir=tmp_path / "work"), env={})
    assert not (tmp_path / "work").exists()


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"))


def _check_patch(prop) -> None:
    assert policy.touched_paths(prop.diff) == {"engine/options.py"} and policy.check(prop.diff, prop.options) is None
    assert "+" + scripts.DEMO_FIELD in prop.diff.splitlines()
    assert prop.options == {"demo_flag": True}
    assert prop.notes.startswith("demo flag behind an option")


def test_anthropic_sdk_drives_the_tool_loop(ws):
    with ScriptedServer(scripts.agent_turns()) as srv:
        spec = ProviderSpec("anthropic", "claude-test", srv.url)
        prop = llm.propose(spec, DIRECTION, Tools(ws, test_timeout_s=300), "sk-test", best_options={"block_size": 4})
        reqs = [r for r in srv.requests if r.path == "/v1/messages"]
    _check_patch(prop)
    assert len(reqs) == 5 and len(srv.requests) == 5
    # the key travels as x-api-key or, in newer SDKs, as a bearer token
    assert all("sk-test" in (r.headers.get("x-api-key", ""), r.headers.get("authorization", "").removeprefix("Bearer "))
               for r in reqs)
    first = reqs[0].body
    assert first["model"] == "claude-test" and first["max_tokens"] == llm.DEFAULT_MAX_TOKENS
    assert {t["name"] for t in first["tools"]} == {"list_files", "read_file", "apply_diff", "run_tests", "quick_time", "profile",
                                                        "finish"}
    assert all("input_schema" in t for t in first["tools"])
    assert "add a demo flag" in first["system"] and "tiny-cpu" in first["system"] and '"block_size": 4' in first["system"]

    def result(i: int) -> dict:
        """The tool_result block sent back after turn i."""
        msgs = reqs[i + 1].body["messages"]
        assert msgs[-2]["role"] == "assistant" and msgs[-2]["content"][-1]["id"] == f"toolu_{i}_0"
        (block,) = msgs[-1]["content"]
        assert block["type"] == "tool_result" and block["tool_use_id"] == f"toolu_{i}_0"
        return block

    assert "engine/options.py" in result(0)["content"] and not result(0)["is_error"]
    assert "class EngineOptions" in result(1)["content"]
    assert result(2)["content"].startswith("applied")
    assert "exit status 0" in result(3)["content"] and "1 passed" in result(3)["content"]


@pytest.mark.parametrize("how", ["openai-env-base-url", "openai-compatible"])
def test_openai_sdk_drives_the_tool_loop(ws, monkeypatch, how):
    with ScriptedServer(scripts.agent_turns(with_tests=how == "openai-compatible")) as srv:
        if how == "openai-compatible":
            spec = parse_provider(f"openai-compatible:{srv.openai_url}|local-model")
        else:  # the SDK itself honours OPENAI_BASE_URL
            monkeypatch.setenv("OPENAI_BASE_URL", srv.openai_url)
            spec = parse_provider("openai:gpt-test")
        prop = llm.propose(spec, DIRECTION, Tools(ws, test_timeout_s=300), "sk-o")
        reqs = [r for r in srv.requests if r.path == "/v1/chat/completions"]
    _check_patch(prop)
    assert len(reqs) == len(srv.requests) == (5 if how == "openai-compatible" else 4)
    assert all(r.headers["authorization"] == "Bearer sk-o" for r in reqs)
    first = reqs[0].body
    assert first["model"] == spec.model and first["messages"][0]["role"] == "system"
    assert {t["function"]["name"] for t in first["tools"]} >= {"apply_diff", "finish"}
    for i in range(len(reqs) - 1):
        msgs = reqs[i + 1].body["messages"]
        call = msgs[-2]["tool_calls"][0]
        assert call["id"] == f"call_{i}_0" and json.loads(call["function"]["arguments"]) is not None
        assert msgs[-1]["role"] == "tool" and msgs[-1]["tool_call_id"] == f"call_{i}_0"
    assert "class EngineOptions" in reqs[2].body["messages"][-1]["content"]
    if how == "openai-compatible":
        assert "1 passed" in reqs[4].body["messages"][-1]["content"]


def test_errors_go_back_to_the_model_and_no_finish_is_a_failure(ws):
    turns = [Turn("", [Call("apply_diff", {"diff": "--- a/tests/engine/x.py\n+++ b/tests/engine/x.py\n@@ -0,0 +1 @@\n+x\n"})]),
             Turn("thinking out loud, no tool"),
             Turn("", [Call("read_file", {"path": "../../etc/passwd"})])]
    with ScriptedServer(turns) as srv:
        with pytest.raises(ProviderError, match="no finish within 3 turns"):
            llm.propose(ProviderSpec("anthropic", "m", srv.url), DIRECTION, Tools(ws), "k", max_turns=3)
        bodies = srv.bodies("/v1/messages")
    refused = bodies[1]["messages"][-1]["content"][0]
    assert refused["is_error"] and "refused (paths)" in refused["content"]
    assert bodies[2]["messages"][-1] == {"role": "user", "content": llm.NUDGE}
    # a finish without any change is a failure too
    with ScriptedServer([Turn("", [Call("finish", {"options": {}, "notes": "nothing to gain"})])]) as srv:
        with pytest.raises(ProviderError, match="without a change.*nothing to gain"):
            llm.propose(ProviderSpec("openai", "m", srv.openai_url), DIRECTION, Tools(ws), "k")


def test_sdk_error_is_a_provider_error(ws):
    with ScriptedServer([]) as srv:  # /v1/messages is served; a wrong base path gets 404s
        with pytest.raises(ProviderError, match="NotFound"):
            llm.propose(ProviderSpec("anthropic", "m", srv.url + "/wrong"), DIRECTION, Tools(ws), "k")


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
@pytest.mark.parametrize(("fail", "named"), [
    (Fail(401, "authentication_error", "invalid x-api-key"), "AuthenticationError"),
    (Fail(404, "not_found_error", "model: claude-nope"), "NotFoundError"),
    (Fail(429, "rate_limit_error", "rate limit reached for requests"), "RateLimitError"),
])
def test_a_provider_that_refuses_is_a_provider_error_naming_the_cause(ws, kind, fail, named):
    with ScriptedServer(fail=fail) as srv:
        url = srv.url if kind == "anthropic" else srv.openai_url
        with pytest.raises(ProviderError, match=named) as caught:
            llm.propose(ProviderSpec(kind, "claude-nope", url), DIRECTION, Tools(ws), "sk-wrong")
    assert fail.message in str(caught.value)


def test_an_unreachable_provider_is_a_provider_error(ws):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ProviderError, match="APIConnectionError|Connection"):
        llm.propose(ProviderSpec("openai", "m", f"http://127.0.0.1:{port}/v1"), DIRECTION, Tools(ws), "k")


def test_a_conversation_ends_at_its_token_budget_and_reports_what_it_cost(ws):
    """An agent that never finishes: the token budget ends it, and the usage says so (for ConversationUsed)."""
    from specpilot.llm import Usage

    looping = [Turn("Looking.", [Call("list_files", {"path": "engine"})]) for _ in range(10)]
    usage = Usage()
    with ScriptedServer(looping) as srv:
        spec = ProviderSpec("anthropic", "claude-test", srv.url)
        with pytest.raises(ProviderError, match="tokens budget"):
            llm.propose(spec, DIRECTION, Tools(ws), "sk-test", usage=usage, max_total_tokens=250)
    assert usage.ended == "tokens" and usage.turns == 3 and usage.tools == ["list_files"] * 3
    assert usage.input_tokens + usage.output_tokens >= 250 and usage.wall_s > 0
