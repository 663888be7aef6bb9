"""Agent-written code runs only in the sandbox: probes through the subagent's own tools.

Each probe is a patch an agent could apply (it passes the policy: only `engine/` changes)
whose code runs when the engine is imported, so `run_tests` and `finish`'s option check run it. It
tries to escape; any success raises ``ESCAPED``. The tools must return a result (an error where the
run was killed), the service's process must be untouched, and nothing outside the sandbox may change.
"""

from __future__ import annotations

import socket
import subprocess
import textwrap

import pytest

from specpilot.paths import REPO_ROOT
from specpilot.sandbox import Limits, bwrap_available
from specpilot.services.subagent.workspace import Tools, Workspace, build_workspace
from tests.controller.patches import FORK_BOMB

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")

TARGET = "engine/options.py"
ANCHOR = "from __future__ import annotations\n"
QUICK_TEST = {"pattern": "test_stock_defaults", "path": "tests/engine/test_options.py"}


def probe_diff(code: str) -> str:
    """A diff running ``code`` when `specpilot.engine.options` is imported (after its __future__ import)."""
    import difflib

    old = (REPO_ROOT / TARGET).read_text()
    new = old.replace(ANCHOR, ANCHOR + textwrap.dedent(code).strip() + "\n", 1)
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{TARGET}", f"b/{TARGET}"))


@pytest.fixture
def data(tmp_path):
    """A service data directory with what a subagent host holds: its bundle and a ledger."""
    d = tmp_path / "data"
    (d / "bundles" / "subagent").mkdir(parents=True)
    (d / "bundles" / "subagent" / "key.pem").write_text("secret key")
    (d / "ledger.duckdb").write_bytes(b"secret ledger")
    return d


def tools_with(tmp_path, data, code: str, timeout_s: float = 120.0) -> Tools:
    ws = Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"), hide=(data,),
                   limits=Limits(memory_bytes=3 << 30, pids=64))
    tools = Tools(ws, test_timeout_s=timeout_s)
    applied = tools.call("apply_diff", {"diff": probe_diff(code)})
    assert not applied.error, applied.text
    return tools


def test_an_agents_tests_cannot_reach_the_network_secrets_or_files_outside(tmp_path, data, monkeypatch, outside_tmp):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")  # what the subagent's own process holds
    own_bundle = outside_tmp / "subagent"  # a bundle outside the data directory
    own_bundle.mkdir(parents=True)
    (own_bundle / "key.pem").write_text("secret key")
    monkeypatch.setenv("SPECPILOT_BUNDLE", str(own_bundle))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    outside = tmp_path / "outside.txt"
    ws_file = tmp_path / "ws" / "engine" / "pwned.py"
    tools = tools_with(tmp_path, data, f"""
    import os as _os, socket as _socket
    try:
        _socket.create_connection(("127.0.0.1", {port}), timeout=2)
        raise SystemExit("ESCAPED: reached a host port")
    except OSError:
        pass
    for _p in ("{data}/bundles/subagent/key.pem", "{data}/ledger.duckdb", "{own_bundle}/key.pem"):
        if _os.path.exists(_p):
            raise SystemExit("ESCAPED: can see " + _p)
    if any("KEY" in _k or "TOKEN" in _k or _k.startswith("NATS") for _k in _os.environ):
        raise SystemExit("ESCAPED: secrets in the environment")
    try:
        open("/tmp/src/engine/pwned.py", "w").write("x")
        raise SystemExit("ESCAPED: wrote into the workspace")
    except OSError:
        pass
    for _p in ("{outside}", "{ws_file}"):  # a write may land in the private /tmp; the host must not see it
        try:
            _os.makedirs(_os.path.dirname(_p), exist_ok=True)
            open(_p, "w").write("x")
        except OSError:
            pass
    """)
    res = tools.call("run_tests", QUICK_TEST)
    listener.close()
    assert "ESCAPED" not in res.text and not res.error and "1 passed" in res.text, res.text
    assert not outside.exists() and not ws_file.exists()
    finished = tools.call("finish", {"options": {}, "notes": "probe"})  # the option check runs the code too
    assert "ESCAPED" not in finished.text and not finished.error, finished.text


def test_an_agents_fork_bomb_and_infinite_loop_are_killed_and_reported(tmp_path, data):
    bomb = tools_with(tmp_path / "bomb", data, FORK_BOMB, timeout_s=15.0)
    res = bomb.call("run_tests", QUICK_TEST)
    assert res.error and "timed out after 15 s (killed)" in res.text, res.text
    loop = tools_with(tmp_path / "loop", data, "while True:\n    pass\n", timeout_s=10.0)
    res = loop.call("run_tests", QUICK_TEST)
    assert res.error and "timed out after 10 s (killed)" in res.text, res.text
    pattern = f"pytest -q -x {QUICK_TEST['path']} -k {QUICK_TEST['pattern']}"  # what the killed runs ran
    left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert left == [], f"sandboxed processes survived: {left}"
    # the subagent's tools still work on a fresh workspace afterwards
    fine = Tools(Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "fine" / "ws")), test_timeout_s=300)
    assert not fine.call("run_tests", QUICK_TEST).error


def test_an_agents_memory_hog_is_killed_and_reported(tmp_path, data):
    hog = tools_with(tmp_path, data, """
    _hog = []
    while True:
        _hog.append(bytearray(64 << 20))
    """)
    res = hog.call("run_tests", QUICK_TEST)
    assert res.error and ("out of memory" in res.text or "MemoryError" in res.text), res.text


def test_a_scripted_agent_whose_tests_hang_is_told_and_its_subagent_goes_on(tmp_path, data):
    """Through the real Anthropic SDK against the local wire server: the agent's patch makes every test
    run hang; `run_tests` comes back as a tool error naming the kill, the loop goes on, and `finish`
    (whose option check imports the same code, without pytest) still returns the proposal."""
    from specpilot import schema
    from specpilot.providers import ProviderSpec
    from specpilot.services.subagent import llm
    from tests.subagent.wire import Call, ScriptedServer, Turn

    hang = probe_diff("import sys as _sys\nwhile 'pytest' in _sys.modules:\n    pass\n")
    turns = [Turn("", [Call("apply_diff", {"diff": hang})]), Turn("", [Call("run_tests", QUICK_TEST)]),
             Turn("Done.", [Call("finish", {"options": {}, "notes": "hangs under pytest"})])]
    ws = Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"), hide=(data,))
    direction = schema.DirectionPlanned(direction_id="d1", title="probe", rationale="a test", factor="overhead",
                                        deployment="tiny-cpu", provider="anthropic")
    with ScriptedServer(turns) as srv:
        prop = llm.propose(ProviderSpec("anthropic", "claude-test", srv.url), direction, Tools(ws, test_timeout_s=10),
                           "sk-test")
        reqs = [r for r in srv.requests if r.path == "/v1/messages"]
    (block,) = reqs[2].body["messages"][-1]["content"]  # the tool_result of run_tests
    assert block["is_error"] and "timed out after 10 s (killed)" in str(block["content"]), block
    assert "while 'pytest' in _sys.modules" in prop.diff and prop.notes.startswith("hangs under pytest")
