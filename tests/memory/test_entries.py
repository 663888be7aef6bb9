"""Memory-entry validation on the real stock tree, and requirement filtering."""

import shutil
import subprocess
from pathlib import Path

from specpilot import entries
from specpilot.engine.options import requirement_tables
from specpilot.paths import REPO_ROOT

OPTIONS_PY = "engine/options.py"


def _source_system(tmp: Path, edit: str) -> tuple[str, dict[str, str]]:
    """A copy of stock with ``edit`` appended to engine/options.py: its diff against stock and its hashes."""
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
    assert "does not apply" in entries.validate("diff --git a/engine/nope.py b/engine/nope.py\n--- a/engine/nope.py\n"
                                                "+++ b/engine/nope.py\n@@ -1 +1 @@\n-x\n+y\n", files)
    assert entries.validate(delta, {}) != ""
    # an extra file in the source that the delta does not create
    assert "missing" in entries.validate(delta, {**files, "engine/extra.py": "0" * 64})


def test_a_stock_that_changed_since_registration_is_named(tmp_path):
    delta, files = _source_system(tmp_path, "\n# a mechanism\n")
    stock = entries.tree_hashes(REPO_ROOT)
    assert entries.validate(delta, files, stock_files=stock) == ""  # the stock the delta was made against
    edited = {**stock, OPTIONS_PY: "0" * 64}  # as if engine/options.py had changed here since then
    problem = entries.validate(delta, files, stock_files=edited)
    assert "not the stock the delta was made against" in problem and OPTIONS_PY in problem


def test_requirements_filter_entries_by_deployment():
    cpu = {"device_kind": "cpu", "dtype": "fp32", "model_family": "llama", "mode": "batch1"}
    gpu = {**cpu, "device_kind": "cuda", "dtype": "bf16"}
    req = dict(cpu)  # every fact as a requirement (what entries required before requirements_for)
    assert entries.matches(req, cpu) and not entries.matches(req, gpu)
    assert entries.matches({"device_kind": ["cpu", "cuda"]}, gpu)
    assert not entries.matches({"arch": "sm90"}, gpu)  # a fact the deployment lacks fails


def test_an_entry_requires_only_what_it_changes():
    """Requirements come from what the entry sets (not every fact of where it was found), so the
    parallel drafter follows its target to a bf16 or GPU deployment, the CPU kernel follows the CPU
    to the tiny model, and code or changed tokens stay where they were judged."""
    from specpilot.harness.deployment import load_deployment

    smol, tiny, h200 = (load_deployment(n).facts() for n in ("smollm2-cpu", "tiny-cpu", "smollm2-h200"))
    assert smol["model_family"] == "llama"  # from the target's config, not spelled in the deployment code
    drafter = entries.requirements_for({"drafter": "parallel", "block_size": 2}, smol, code_delta=False,
                                       outputs_identical=True, **requirement_tables())
    assert drafter == {"mode": "batch1", "target": "smollm2-135m"}
    assert entries.matches(drafter, h200) and not entries.matches(drafter, tiny)
    kernel = entries.requirements_for({"linear_backend": "stream"}, smol, code_delta=False, outputs_identical=True,
                                      **requirement_tables())
    assert kernel == {"mode": "batch1", "device_kind": ["cpu"]}
    assert entries.matches(kernel, tiny) and not entries.matches(kernel, h200)
    code = entries.requirements_for({"exact_head": True}, smol, code_delta=True, outputs_identical=False,
                                    **requirement_tables())
    assert code == {"mode": "batch1", "device_kind": ["cpu"], "model_family": "llama", "dtype": "fp32"}
    assert entries.matches(code, tiny) and not entries.matches(code, {**tiny, "dtype": "bf16"})


def test_a_stock_snapshot_keeps_entries_checkable_after_the_checkout_changes(tmp_path):
    """Round 21's case: the runtime was edited while a round ran and its first entry was rejected as
    'not the stock the delta was made against'. A stock filed in the snapshot store when first seen
    checks the entry whatever the checkout holds later; a stock the store never saw is named."""
    live = tmp_path / "live"
    for r in entries.ROOTS:
        shutil.copytree(REPO_ROOT / r, live / r, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    stock = entries.tree_hashes(live)
    delta, files = _source_system(tmp_path, "\n# a mechanism\n")
    store = tmp_path / "store"
    assert entries.snapshot(store, live=live) == len(set(stock.values()))  # the service's start-up
    assert entries.snapshot(store, live=live) == 0  # content-addressed: nothing twice
    (live / OPTIONS_PY).write_text("# edited after the round started\n")
    assert "not the stock" in entries.validate(delta, files, stock=live, stock_files=stock)  # the old way
    assert entries.validate(delta, files, stock=live, stock_files=stock, store=store) == ""
    fresh = tmp_path / "fresh-store"  # another data directory that never saw that stock
    problem = entries.validate(delta, files, stock=live, stock_files=stock, store=fresh)
    assert "not in the snapshot store" in problem and OPTIONS_PY in problem and "memory import" in problem


def test_hostile_entries_write_and_read_nothing_outside(tmp_path):
    """An export is hostile input (issue 53's attack): stock paths that climb or are absolute, a "blob hash"
    that is a path to the controller's key, a blob that is a link, a delta outside the runtime. Nothing is
    written outside the work folder, no key is copied, and each entry is refused with what is wrong."""
    import hashlib
    import os

    from specpilot.app.cmd_memory import file_stock

    key = tmp_path / "data" / "bundles" / "controller" / "key.pem"
    key.parent.mkdir(parents=True)
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    os.chmod(key, 0o600)
    store = tmp_path / "store"
    store.mkdir()
    good = hashlib.sha256(b"x = 1\n").hexdigest()
    cases = {
        "../escaped.py": good,
        "/tmp/absolute-escape.py": good,
        "engine/../../escaped.py": good,
        "engine/ok.py": "../data/bundles/controller/key.pem",
        "specpilot/harness/worker.py": good,
    }
    for rel, sha in cases.items():
        problem = entries.validate("", {"engine/x.py": good}, stock=tmp_path, stock_files={rel: sha}, store=store)
        assert problem.startswith("its stock file "), (rel, problem)
    outside = "diff --git a/specpilot/harness/worker.py b/specpilot/harness/worker.py\n--- a/specpilot/harness/" \
              "worker.py\n+++ b/specpilot/harness/worker.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert entries.validate(outside, {"engine/x.py": good}).startswith("its delta breaks the patch policy (paths:")
    assert not (tmp_path / "escaped.py").exists() and not Path("/tmp/absolute-escape.py").exists()
    assert entries.snapshot(store, {"../data/bundles/controller/key.pem": good}, live=tmp_path / "live") == 0
    # an export's stock folder: a link named like a hash, a blob whose content is not its name, a good blob
    export = tmp_path / "export" / "stock"
    export.mkdir(parents=True)
    os.symlink(key, export / hashlib.sha256(key.read_bytes()).hexdigest())
    (export / ("0" * 64)).write_text("not what the name says")
    (export / good).write_text("x = 1\n")
    filed = file_stock(tmp_path / "export", tmp_path / "data2")
    kept = sorted(p.name for p in (tmp_path / "data2" / "memory" / "stock").iterdir())
    assert filed == 1 and kept == [good]
    assert not any("PRIVATE KEY" in p.read_text() for p in (tmp_path / "data2" / "memory" / "stock").iterdir())
