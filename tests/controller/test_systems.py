"""The systems repository: a data directory made by SpecPilot 0.1 is refused with the command that
migrates it, and `migrate` carries each best branch over with its runtime paths renamed."""

from __future__ import annotations

import shutil

import pytest

from specpilot.errors import UserError
from specpilot.paths import REPO_ROOT
from specpilot.services.controller.systems import PatchDoesNotApply, Systems, export_system, migrate

ANCHOR = "class DraftTree"


def _old_data_dir(tmp_path):
    """A 0.1-style systems repository: the runtime under engine/ and kernels/, the worker inside, and
    two best branches: one that changes engine/tree.py, one that changed the (now harness) worker."""
    root = tmp_path / "data" / "controller" / "systems"
    root.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "specpilot_engine", root / "engine", ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    shutil.copytree(REPO_ROOT / "specpilot_kernels", root / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "engine" / "worker.py").write_text("print('ready')\n")
    old = Systems(root)
    old.git("init", "-q", "-b", "stock")
    old.git("add", "-A")
    old.git("commit", "-q", "-m", "stock (0.1)")
    stock = old.git("rev-parse", "HEAD")
    tree = (root / "engine" / "tree.py").read_text()
    assert ANCHOR in tree
    diff = _edit(root, "engine/tree.py", tree.replace(ANCHOR, "# carried by migrate\n" + ANCHOR, 1))
    old.advance("tiny-cpu", old.apply_unchecked(stock, diff, "a code promotion"))
    diff = _edit(root, "engine/worker.py", "print('ready!')\n")
    old.advance("smollm2-cpu", old.apply_unchecked(stock, diff, "a worker promotion"))
    return tmp_path / "data"


def _edit(root, path: str, text: str) -> str:
    before = (root / path).read_text()
    (root / path).write_text(text)
    diff = Systems(root).git("diff", "--", path, strip=False)
    (root / path).write_text(before)
    return diff


def test_an_old_data_directory_is_refused_then_migrated(tmp_path, monkeypatch):
    def apply_unchecked(self, base, diff, message):  # 0.1's repository took engine/ paths
        self.git("checkout", "-q", "--detach", base)
        self.git("apply", "-", input=diff)
        self.git("commit", "-qam", message)
        commit = self.git("rev-parse", "HEAD")
        self.git("checkout", "-q", "stock")
        return commit

    monkeypatch.setattr(Systems, "apply_unchecked", apply_unchecked, raising=False)
    data = _old_data_dir(tmp_path)
    systems = Systems(data / "controller" / "systems")
    with pytest.raises(UserError, match=r"made by SpecPilot 0.1.*specpilot migrate --data"):
        systems.ensure_stock()
    with pytest.raises(UserError, match="specpilot migrate"):
        export_system(data, "tiny-cpu", tmp_path / "out", lambda commit: {})

    done = migrate(data)
    assert any("moved the 0.1 systems repository" in d for d in done)
    assert any(d.startswith("best/tiny-cpu: carried over") for d in done), done
    assert any(d.startswith("best/smollm2-cpu: its code change does not apply") for d in done), done
    assert (data / "controller" / "systems-0.1" / ".git").is_dir()

    old_best = Systems(data / "controller" / "systems-0.1").best("tiny-cpu")
    res = export_system(data, "tiny-cpu", tmp_path / "out", lambda commit: {"verify": "tree"})
    assert res["options"] == {"verify": "tree"}
    assert "# carried by migrate" in (tmp_path / "out" / "specpilot_engine" / "tree.py").read_text()
    assert "specpilot_engine/tree.py" in (tmp_path / "out" / "final.patch").read_text()
    assert res["commit"] != res["stock"]
    systems = Systems(data / "controller" / "systems")
    assert systems.best("smollm2-cpu") == res["stock"]
    assert systems.resolve(old_best) == res["commit"]  # the ledger's old commit leads to the carried one
    assert systems.resolve("0" * 40) is None
    assert migrate(data) == [f"nothing to migrate: {data / 'controller' / 'systems'} already has this version's layout"]


def test_a_patch_written_on_an_earlier_best_is_integrated_onto_the_latest(tmp_path):
    """Two directions of one wave start from the same best; the first is promoted. The second's diff,
    written on the old best, is merged onto the new one (both changes kept); a clash is refused."""
    systems = Systems(tmp_path / "systems")
    stock = systems.ensure_stock()
    root = systems.root
    tree = (root / "specpilot_engine" / "tree.py").read_text()
    lines = tree.splitlines(keepends=True)
    first = _edit(root, "specpilot_engine/tree.py", "# first direction\n" + tree)
    second = _edit(root, "specpilot_engine/tree.py", "".join(lines[:-1]) + lines[-1] + "# second direction\n")
    best = systems.apply(stock, first, "first, promoted")
    merged = systems.integrate(best, stock, second, "second, onto the first")
    text = systems.git("show", f"{merged}:specpilot_engine/tree.py")
    assert text.startswith("# first direction\n") and text.endswith("# second direction")
    assert systems.integrate(best, best, "", "options only") != best  # its own commit, same tree
    assert systems.git("rev-parse", f"{systems.integrate(best, '', '', 'x')}^{{tree}}") == systems.git(
        "rev-parse", f"{best}^{{tree}}")
    clash = _edit(root, "specpilot_engine/tree.py", "# another first line\n" + tree)
    with pytest.raises(PatchDoesNotApply, match=r"conflicts with the best"):
        systems.integrate(best, stock, clash, "clashes with the first")


def test_stock_follows_a_changed_checkout_and_carries_the_best(tmp_path):
    """A data directory outlives an upgrade or an edit of the runtime: the next `ensure_stock` commits the
    checkout's runtime as the new stock, carries each best branch onto it (or restarts one whose change no
    longer applies) and leads the ledger's old commits to the carried ones; an unchanged checkout (caches
    aside) keeps its stock."""
    source = tmp_path / "checkout"
    for d in ("specpilot_engine", "specpilot_kernels"):
        shutil.copytree(REPO_ROOT / d, source / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pt"))
    systems = Systems(tmp_path / "systems")
    stock = systems.ensure_stock(source)
    (source / "specpilot_engine" / "__pycache__").mkdir(exist_ok=True)
    (source / "specpilot_engine" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert systems.ensure_stock(source) == stock  # caches are not the runtime

    tree = (source / "specpilot_engine" / "tree.py").read_text()
    carried_change = _edit(systems.root, "specpilot_engine/tree.py", "# a promoted change\n" + tree)
    systems.advance("tiny-cpu", promoted := systems.apply(stock, carried_change, "a code promotion"))
    decode = (source / "specpilot_engine" / "decode.py").read_text()
    clashing = _edit(systems.root, "specpilot_engine/decode.py", decode.replace('"""', '"""A promoted docstring. ', 1))
    systems.advance("smollm2-cpu", clash := systems.apply(stock, clashing, "a promotion the upgrade clashes with"))
    systems.advance("smollm2-h200", stock)  # options only

    (source / "specpilot_engine" / "decode.py").write_text(decode.replace('"""', '"""Upgraded. ', 1))
    new = systems.ensure_stock(source)
    assert new != stock and systems.git("rev-parse", f"{new}^") == stock
    assert systems.git("show", f"{new}:specpilot_engine/decode.py").startswith('"""Upgraded. ')
    assert systems.source_tree(source) == systems.git("rev-parse", f"{new}^{{tree}}")
    best = systems.best("tiny-cpu")
    assert systems.git("show", f"{best}:specpilot_engine/tree.py").startswith("# a promoted change\n")
    assert systems.git("show", f"{best}:specpilot_engine/decode.py").startswith('"""Upgraded. ')
    assert systems.resolve(promoted) == best and systems.resolve(stock) == new
    assert systems.best("smollm2-cpu") == new == systems.resolve(clash)  # restarted from the new stock
    assert systems.best("smollm2-h200") == new
    assert systems.ensure_stock(source) == new  # once
