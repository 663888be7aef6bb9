"""Workspaces rebuilt from promotions, the agent's tools and their refusals, and the offline providers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specpilot import policy
from specpilot.paths import REPO_ROOT
from specpilot.providers import ProviderError
from specpilot.sandbox import SANDBOX_SRC, bwrap_available
from specpilot.services.subagent import offline
from specpilot.services.subagent.workspace import Tools, Workspace, WorkspaceError, build_workspace, git
from tests.subagent import scripts


def _fake_root(tmp: Path) -> Path:
    root = tmp / "src"
    for rel, text in {"engine/a.py": "x = 1\ny = 2\nz = 3\n", "kernels/k.py": "k = 0\n",
                      "deployments/d.toml": 'target = "tiny"\n', "tests/__init__.py": "",
                      "tests/engine/__init__.py": "", "tests/engine/test_a.py": "def test_a():\n    pass\n",
                      "services/secret.py": "nope\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_build_workspace_applies_promotions_in_order(tmp_path):
    root = _fake_root(tmp_path)
    first = scripts.diff("engine/a.py", "x = 1\ny = 2\nz = 3\n", "x = 10\ny = 2\nz = 3\n")
    second = scripts.diff("engine/a.py", "x = 10\ny = 2\nz = 3\n", "x = 10\ny = 2\nz = 3\nw = 4\n")  # needs first
    ws = Workspace(build_workspace(root, [("p1", first), ("p2", second)], dest=tmp_path / "ws"))
    assert (ws.path / "engine/a.py").read_text() == "x = 10\ny = 2\nz = 3\nw = 4\n"
    assert (ws.path / "tests/engine/test_a.py").is_file() and (ws.path / "deployments/d.toml").is_file()
    assert not (ws.path / "services").exists()  # only the system and its tests are copied
    log = git(ws.path, "log", "--format=%s").stdout.split("\n")
    assert log[:3] == ["promoted p2", "promoted p1", "stock"]
    assert ws.diff() == ""
    # the patch is engine/ and kernels/ against the current best; new files count, test edits do not
    (ws.path / "kernels/new.py").write_text("n = 1\n")
    (ws.path / "tests/engine/test_a.py").write_text("def test_a():\n    assert 0\n")
    (ws.path / "engine/__pycache__").mkdir()
    (ws.path / "engine/__pycache__/a.cpython-311.pyc").write_bytes(b"\0junk")
    d = ws.diff()
    assert policy.touched_paths(d) == {"kernels/new.py"} and policy.check(d, {}) is None
    ws.remove()
    assert not ws.path.exists()


def test_build_workspace_checks_the_controllers_trees(tmp_path):
    root = _fake_root(tmp_path)
    first = scripts.diff("engine/a.py", "x = 1\ny = 2\nz = 3\n", "x = 10\ny = 2\nz = 3\n")
    made = build_workspace(root, [("p1", first)], dest=tmp_path / "a")
    trees = {d: git(made, "rev-parse", f"HEAD:{d}").stdout.strip() for d in ("engine", "kernels")}
    build_workspace(root, [("best", first)], dest=tmp_path / "b", trees=trees)  # the same best: accepted
    with pytest.raises(WorkspaceError, match="differs from the controller's in engine/"):
        build_workspace(root, [], dest=tmp_path / "c", trees=trees)  # this host's stock is not that best


def test_build_workspace_names_the_patch_that_does_not_apply(tmp_path):
    root = _fake_root(tmp_path)
    bad = scripts.diff("engine/a.py", "x = 5\n", "x = 6\n")
    with pytest.raises(WorkspaceError, match="promoted patch p9"):
        build_workspace(root, [("p9", bad)], dest=tmp_path / "ws")


@pytest.fixture
def real_ws(tmp_path) -> Workspace:
    return Workspace(build_workspace(REPO_ROOT, [], dest=tmp_path / "ws"))


@pytest.mark.parametrize("path", ["services/controller/main.py", "../etc/passwd", "/etc/passwd", "engine/../specpilot",
                                  "deployments/chat_prompts.json", "tests/conftest.py", "pyproject.toml"])
def test_tools_refuse_reads_outside_the_system(real_ws, path):
    res = Tools(real_ws).call("read_file", {"path": path})
    assert res.error, res.text


def test_tools_read_list_and_line_ranges(real_ws):
    tools = Tools(real_ws)
    assert "engine/" in tools.call("list_files", {"path": ""}).text
    listing = tools.call("list_files", {"path": "engine/"}).text.splitlines()
    assert "engine/options.py" in listing and not any("__pycache__" in p for p in listing)
    assert "class EngineOptions" in tools.call("read_file", {"path": "engine/options.py"}).text
    assert tools.call("read_file", {"path": "engine/options.py", "start_line": 1, "end_line": 1}).text.startswith('"""')
    assert tools.call("read_file", {"path": "engine/drafters/weights/smollm2_parallel.pt"}).error  # binary
    assert tools.call("nope", {}).error and tools.call("read_file", {"wrong": 1}).error


@pytest.mark.parametrize("diff", [
    "diff --git a/tests/engine/test_x.py b/tests/engine/test_x.py\n--- a/tests/engine/test_x.py\n"
    "+++ b/tests/engine/test_x.py\n@@ -0,0 +1 @@\n+assert True\n",
    "--- a/engine/../services/x.py\n+++ b/engine/../services/x.py\n@@ -0,0 +1 @@\n+x\n",
    "--- a/specpilot/bus.py\n+++ b/specpilot/bus.py\n@@ -1 +1 @@\n-a\n+b\n",
    "not a diff at all\n",
])
def test_apply_diff_refuses_paths_outside_engine_and_kernels(real_ws, diff):
    res = Tools(real_ws).call("apply_diff", {"diff": diff})
    assert res.error and res.text.startswith("refused"), res.text
    assert real_ws.diff() == ""


def test_apply_diff_then_finish_checks_options_against_the_workspace(real_ws):
    tools = Tools(real_ws)
    bad = tools.call("apply_diff", {"diff": scripts.option_diff().replace(scripts.ANCHOR, "    no_such_line: int = 2")})
    assert bad.error and "does not apply" in bad.text
    assert not tools.call("apply_diff", {"diff": scripts.option_diff()}).error
    assert "demo_flag" in real_ws.diff()
    res = tools.call("finish", {"options": {"demo_flag": "maybe"}, "notes": "x"})
    assert res.error and "must be a boolean" in res.text and tools.finished is None
    res = tools.call("finish", {"options": {"Bad-Name": 1}, "notes": "x"})
    assert res.error and "options" in res.text
    res = tools.call("finish", {"options": {"demo_flag": True}, "notes": "adds a flag"})
    assert not res.error, res.text
    assert tools.finished.options == {"demo_flag": True} and tools.finished.notes == "adds a flag"


def test_run_tests_runs_the_workspace_engine_without_secrets(real_ws, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # as services run: the repository's engine is importable too
    # a test file the agent cannot write, placed by hand: it sees the workspace's engine and no keys
    where = SANDBOX_SRC if bwrap_available() else str(real_ws.path)  # the sandbox binds the workspace there
    probe = real_ws.path / "tests/engine/test_probe.py"
    probe.write_text("import os\nimport specpilot.engine.options\nimport specpilot.engine\n\ndef test_probe():\n"
                     f"    assert specpilot.engine.options.__file__.startswith({where!r})\n"
                     "    assert 'ANTHROPIC_API_KEY' not in os.environ\n")
    res = Tools(real_ws).call("run_tests", {"pattern": "probe", "path": "tests/engine/test_probe.py"})
    assert not res.error and "1 passed" in res.text, res.text
    assert Tools(real_ws).call("run_tests", {"path": "engine/options.py"}).error


# --- offline providers -----------------------------------------------------------------------------


def test_sweep_one_patch_per_valid_value():
    props = offline.sweep({"option": "block_size", "values": [2, 8, 0, "x", 8], "base": {"verify": "tree"}})
    # a proposal carries its own settings only: the controller lays them over the best it is timed against
    assert [p.options for p in props] == [{"block_size": 2}, {"block_size": 8}]
    assert all(p.diff == "" for p in props)
    # what the option needs, and a step shape the planner paired a value with, travel with it
    props = offline.sweep({"option": "tree_nodes", "values": [8], "base": {"verify": "tree", "block_size": 6},
                           "requires": {"verify": "tree"}})
    assert [p.options for p in props] == [{"verify": "tree", "tree_nodes": 8}]
    (p,) = offline.sweep({"option": "drafter", "values": ["parallel"], "joint": {"'parallel'": {"block_size": 2}}})
    assert p.options == {"drafter": "parallel", "block_size": 2} and "block_size=2" in p.notes
    with pytest.raises(ProviderError, match="objects of option settings"):
        offline.sweep({"option": "drafter", "values": ["parallel"], "joint": {"'parallel'": 2}})
    with pytest.raises(ProviderError, match="none of"):
        offline.sweep({"option": "no_such_option", "values": [1]})
    with pytest.raises(ProviderError, match="hints.values"):
        offline.sweep({"option": "block_size", "values": []})


def test_sweep_of_an_option_a_promotion_added(tmp_path):
    added = scripts.option_diff("    demo_int: int = 0  # added by a promotion")
    ws = Workspace(build_workspace(REPO_ROOT, [("p1", added)], dest=tmp_path / "ws"))
    props = offline.sweep({"option": "demo_int", "values": [1, 2, "two"]}, offline.workspace_validator(ws))
    assert [p.options for p in props] == [{"demo_int": 1}, {"demo_int": 2}]
    with pytest.raises(ProviderError):  # this host's stock engine has no such option
        offline.sweep({"option": "demo_int", "values": [1]})


def test_memory_entry_merges_three_way_onto_the_current_best(tmp_path):
    stock = (REPO_ROOT / scripts.OPTIONS).read_text()
    lines = stock.splitlines()
    # the line just above the entry's insertion point (inside its diff context), made different by a promotion
    near = lines[next(i for i, ln in enumerate(lines) if ln.startswith(scripts.ANCHOR)) - 1]
    promoted = stock.replace(near + "\n", near + "  # (comment changed by a promotion)\n", 1)
    promotion = scripts.diff(scripts.OPTIONS, stock, promoted)
    # the entry's delta is against stock; its context includes the line the promotion changed
    entry_field = "    entry_flag: bool = False  # from memory"
    delta = scripts.diff(scripts.OPTIONS, stock, scripts.add_field(stock, entry_field))
    ws = Workspace(build_workspace(REPO_ROOT, [("p1", promotion)], dest=tmp_path / "ws"))
    plain = subprocess.run(["git", "apply", "--check", "-"], input=delta, text=True, cwd=ws.path, capture_output=True)
    assert plain.returncode != 0  # so the 3-way merge is what makes it apply
    prop = offline.memory({"entry": {"entry_id": "m1", "delta": delta, "options": {"entry_flag": True}}}, ws)
    assert prop.options == {"entry_flag": True} and "3-way" in prop.notes
    added = [ln for ln in prop.diff.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    assert added == ["+" + entry_field]  # relative to the current best: only the entry's change
    text = (ws.path / scripts.OPTIONS).read_text()
    assert entry_field in text and "(comment changed by a promotion)" in text


def test_memory_entry_that_conflicts_fails_cleanly(tmp_path):
    stock = (REPO_ROOT / scripts.OPTIONS).read_text()
    line = next(ln for ln in stock.splitlines() if ln.startswith(scripts.ANCHOR))
    promotion = scripts.diff(scripts.OPTIONS, stock, stock.replace(line, line + " # promoted", 1))
    delta = scripts.diff(scripts.OPTIONS, stock, stock.replace(line, line + " # remembered", 1))
    ws = Workspace(build_workspace(REPO_ROOT, [("p1", promotion)], dest=tmp_path / "ws"))
    with pytest.raises(ProviderError, match="does not apply"):
        offline.memory({"entry": {"entry_id": "m2", "delta": delta, "options": {}}}, ws)
    assert ws.diff() == "" and git(ws.path, "status", "--porcelain").stdout == ""
    with pytest.raises(ProviderError, match="policy"):
        offline.memory({"entry": {"entry_id": "m3", "delta": "--- a/specpilot/x\n+++ b/specpilot/x\n", "options": {}}},
                       ws)
