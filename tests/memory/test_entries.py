"""Memory-entry validation on the real stock tree, and requirement filtering."""

import shutil
import subprocess
from pathlib import Path

from specpilot import entries
from specpilot.paths import REPO_ROOT

OPTIONS_PY = "specpilot_engine/options.py"


def _source_system(tmp: Path, edit: str) -> tuple[str, dict[str, str]]:
    """A copy of stock with ``edit`` appended to specpilot_engine/options.py: its diff against stock and its hashes."""
    src = tmp / "src"
    for r in entries.ROOTS:
        shutil.copytree(REPO_ROOT / r, src / r, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(["git", "init", "-q"], cwd=src, check=True)
    subprocess.run(["git", "add", "-A"], cwd=src, check=True)
    (src / OPTIONS_PY).write_text((src / OPTIONS_PY).read_text() + edit)
    delta = subprocess.run(["git", "diff"], cwd=src, check=True, capture_output=True, text=True).stdout
    return delta, entries.tree_hashes(src)


def test_a_delta_that_reproduces_its_source_is_accepted(tmp_path):
    delta, files = _source_system(tmp_path, "\n# a mechanism\n")
    assert delta and entries.validate(delta, files) == ""


def test_a_delta_that_does_not_reproduce_its_source_is_rejected(tmp_path):
    delta, files = _source_system(tmp_path, "\n# a mechanism\n")
    other, _ = _source_system(tmp_path / "other", "\n# something else\n")
    problem = entries.validate(other, files)
    assert "does not reproduce" in problem and OPTIONS_PY in problem
    assert "does not apply" in entries.validate("diff --git a/specpilot_engine/nope.py b/specpilot_engine/nope.py\n--- a/specpilot_engine/nope.py\n"
                                                "+++ b/specpilot_engine/nope.py\n@@ -1 +1 @@\n-x\n+y\n", files)
    assert entries.validate(delta, {}) != ""
    # an extra file in the source that the delta does not create
    assert "missing" in entries.validate(delta, {**files, "specpilot_engine/extra.py": "0" * 64})


def test_a_stock_that_changed_since_registration_is_named(tmp_path):
    delta, files = _source_system(tmp_path, "\n# a mechanism\n")
    stock = entries.tree_hashes(REPO_ROOT)
    assert entries.validate(delta, files, stock_files=stock) == ""  # the stock the delta was made against
    edited = {**stock, OPTIONS_PY: "0" * 64}  # as if specpilot_engine/options.py had changed here since then
    problem = entries.validate(delta, files, stock_files=edited)
    assert "not the stock the delta was made against" in problem and OPTIONS_PY in problem


def test_requirements_filter_entries_by_deployment():
    cpu = {"device_kind": "cpu", "dtype": "fp32", "model_family": "llama", "mode": "batch1"}
    gpu = {**cpu, "device_kind": "cuda", "dtype": "bf16"}
    req = entries.requirements_of(cpu)
    assert req == cpu
    assert entries.matches(req, cpu) and not entries.matches(req, gpu)
    assert entries.matches({"device_kind": ["cpu", "cuda"]}, gpu)
    assert not entries.matches({"arch": "sm90"}, gpu)  # a fact the deployment lacks fails
