"""An agent's feedback tools on the tiny deployment: `quick_time` and `profile` run the workspace and the
current best as sandboxed timing workers and answer with advice (a ratio, tokens per step, kernel
classes), saying when the workspace's tokens are not the best's."""

from __future__ import annotations

import pytest

from specpilot.paths import REPO_ROOT
from specpilot.sandbox import bwrap_available
from specpilot.services.subagent.advice import Advisor
from specpilot.services.subagent.workspace import Tools, Workspace, build_workspace
from tests.controller.patches import NEAR_TIE_FLIP

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")


@pytest.fixture
def tools(tmp_path) -> Tools:
    data = tmp_path / "data"
    ws = Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"), hide=(data,))
    return Tools(ws, advisor=Advisor("tiny-cpu", data, base_options={}))


def test_quick_time_and_profile_advise_on_the_workspace(tools):
    res = tools.call("quick_time", {"options": {"verify": "tree"}})
    assert not res.error and res.text.startswith("advice, not a verdict") and "identical to the best's" in res.text
    assert "x the best's speed" in res.text
    res = tools.call("profile", {"options": {}})
    assert not res.error and "tokens per step" in res.text and "ms per request by kernel class" in res.text
    assert tools.call("quick_time", {"options": {"no_such_option": 1}}).error  # checked like finish's options


def test_quick_time_says_when_the_tokens_are_not_the_best(tools):
    assert not tools.call("apply_diff", {"diff": NEAR_TIE_FLIP}).error
    res = tools.call("quick_time", {"options": {"near_tie_flip": 1000.0}})  # always the runner-up token
    assert not res.error and "NOT the best's" in res.text, res.text


def test_without_an_advisor_the_tools_say_so(tmp_path):
    ws = Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"))
    res = Tools(ws).call("profile", {})
    assert res.error and "not available" in res.text
