"""The systems repository: stock follows the checkout's runtime, a data directory made by an earlier
SpecPilot (0.1: the runtime in engine/ and kernels/ with the worker inside; 0.2: in specpilot_engine/ and
specpilot_kernels/) is carried to today's layout, each best branch with it, and a patch integrates onto a
best that moved on."""

from __future__ import annotations

import shutil

import pytest

from specpilot.paths import REPO_ROOT
from specpilot.services.controller.systems import PatchDoesNotApply, Systems, export_system, migrate

ANCHOR = "class DraftTree"


def _old_data_dir(tmp_path, engine: str, kernels: str, worker: bool):
    """An earlier version's systems repository: the runtime under ``engine``/ and ``kernels``/ (0.1 also had
    its worker inside) and best branches: one that changes the drafting tree, one (0.1) that changed the
    worker, which is harness now."""
    root = tmp_path / "data" / "controller" / "systems"
    root.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "engine", root / engine, ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    shutil.copytree(REPO_ROOT / "kernels", root / kernels, ignore=shutil.ignore_patterns("__pycache__"))
    old = Systems(root)
    old.git("init", "-q", "-b", "stock")
    if worker:
        (root / engine / "worker.py").write_text("print('ready')\n")
    old.git("add", "-A")
    old.git("commit", "-q", "-m", "stock (an earlier version)")
    stock = old.git("rev-parse", "HEAD")
    tree = (root / engine / "tree.py").read_text()
    assert ANCHOR in tree
    diff = _edit(root, f"{engine}/tree.py", tree.replace(ANCHOR, "# carried over\n" + ANCHOR, 1))
    old.advance("tiny-cpu", _commit(old, stock, diff, "a code promotion"))
    if worker:
        diff = _edit(root, f"{engine}/worker.py", "print('ready!')\n")
        old.advance("smollm2-cpu", _commit(old, stock, diff, "a worker promotion"))
    old.advance("smollm2-h200", stock)  # options only
    return tmp_path / "data"


def _commit(systems: Systems, base: str, diff: str, message: str) -> str:
    """``diff`` committed on ``base`` as the earlier version did (its own folder names)."""
    systems.git("checkout", "-q", "--detach", base)
    systems.git("apply", "-", input=diff)
    systems.git("commit", "-qam", message)
    commit = systems.git("rev-parse", "HEAD")
    systems.git("checkout", "-q", "stock")
    return commit


def _edit(root, path: str, text: str) -> str:
    before = (root / path).read_text()
    (root / path).write_text(text)
    diff = Systems(root).git("diff", "--", path, strip=False)
    (root / path).write_text(before)
    return diff


@pytest.mark.parametrize("engine,kernels,worker", [("engine", "kernels", True),
                                                   ("specpilot_engine", "specpilot_kernels", False)],
                         ids=["0.1", "0.2"])
def test_an_earlier_data_directory_opens_and_is_carried_over(tmp_path, engine, kernels, worker):
    data = _old_data_dir(tmp_path, engine, kernels, worker)
    systems = Systems(data / "controller" / "systems")
    old_stock, old_best = systems.git("rev-parse", "stock"), systems.best("tiny-cpu")
    done = migrate(data)
    assert done[0].startswith("committed stock"), done
    assert "best/tiny-cpu: carried over" in "\n".join(done) and "best/smollm2-h200: no code change" in "\n".join(done)
    if worker:
        assert any(d.startswith("best/smollm2-cpu: its code change does not apply") for d in done), done
    res = export_system(data, "tiny-cpu", tmp_path / "out", lambda commit: {"verify": "tree"})
    assert res["options"] == {"verify": "tree"}
    assert "# carried over" in (tmp_path / "out" / "engine" / "tree.py").read_text()
    assert not (tmp_path / "out" / engine / "worker.py").exists() and not (tmp_path / "out" / "specpilot_engine").exists()
    assert "a/engine/tree.py" in (tmp_path / "out" / "final.patch").read_text()
    assert res["commit"] != res["stock"] and systems.git("rev-parse", f"{res['stock']}^") == old_stock  # history kept
    assert systems.best("smollm2-h200") == res["stock"]
    assert systems.resolve(old_best) == res["commit"]  # the ledger's old commit leads to the carried one
    assert systems.resolve(old_stock) == res["stock"] and systems.resolve("0" * 40) is None
    assert migrate(data) == [f"nothing to migrate: {data / 'controller' / 'systems'} already holds this version's runtime"]


def test_a_patch_written_on_an_earlier_best_is_integrated_onto_the_latest(tmp_path):
    """Two directions of one wave start from the same best; the first is promoted. The second's diff,
    written on the old best, is merged onto the new one (both changes kept); a clash is refused."""
    systems = Systems(tmp_path / "systems")
    stock = systems.ensure_stock()
    root = systems.root
    tree = (root / "engine" / "tree.py").read_text()
    lines = tree.splitlines(keepends=True)
    first = _edit(root, "engine/tree.py", "# first direction\n" + tree)
    second = _edit(root, "engine/tree.py", "".join(lines[:-1]) + lines[-1] + "# second direction\n")
    best = systems.apply(stock, first, "first, promoted")
    merged = systems.integrate(best, stock, second, "second, onto the first")
    text = systems.git("show", f"{merged}:engine/tree.py")
    assert text.startswith("# first direction\n") and text.endswith("# second direction")
    assert systems.integrate(best, best, "", "options only") != best  # its own commit, same tree
    assert systems.git("rev-parse", f"{systems.integrate(best, '', '', 'x')}^{{tree}}") == systems.git(
        "rev-parse", f"{best}^{{tree}}")
    clash = _edit(root, "engine/tree.py", "# another first line\n" + tree)
    with pytest.raises(PatchDoesNotApply, match=r"conflicts with the best"):
        systems.integrate(best, stock, clash, "clashes with the first")


def test_stock_follows_a_changed_checkout_and_carries_the_best(tmp_path):
    """A data directory outlives an upgrade or an edit of the runtime: the next `ensure_stock` commits the
    checkout's runtime as the new stock, carries each best branch onto it (or restarts one whose change no
    longer applies) and leads the ledger's old commits to the carried ones; an unchanged checkout (caches
    aside) keeps its stock."""
    source = tmp_path / "checkout"
    for d in ("engine", "kernels"):
        shutil.copytree(REPO_ROOT / d, source / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pt"))
    systems = Systems(tmp_path / "systems")
    stock = systems.ensure_stock(source)
    (source / "engine" / "__pycache__").mkdir(exist_ok=True)
    (source / "engine" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert systems.ensure_stock(source) == stock  # caches are not the runtime

    tree = (source / "engine" / "tree.py").read_text()
    carried_change = _edit(systems.root, "engine/tree.py", "# a promoted change\n" + tree)
    systems.advance("tiny-cpu", promoted := systems.apply(stock, carried_change, "a code promotion"))
    decode = (source / "engine" / "decode.py").read_text()
    clashing = _edit(systems.root, "engine/decode.py", decode.replace('"""', '"""A promoted docstring. ', 1))
    systems.advance("smollm2-cpu", clash := systems.apply(stock, clashing, "a promotion the upgrade clashes with"))
    systems.advance("smollm2-h200", stock)  # options only

    (source / "engine" / "decode.py").write_text(decode.replace('"""', '"""Upgraded. ', 1))
    new = systems.ensure_stock(source)
    assert new != stock and systems.git("rev-parse", f"{new}^") == stock
    assert systems.git("show", f"{new}:engine/decode.py").startswith('"""Upgraded. ')
    assert systems.source_tree(source) == systems.git("rev-parse", f"{new}^{{tree}}")
    best = systems.best("tiny-cpu")
    assert systems.git("show", f"{best}:engine/tree.py").startswith("# a promoted change\n")
    assert systems.git("show", f"{best}:engine/decode.py").startswith('"""Upgraded. ')
    assert systems.resolve(promoted) == best and systems.resolve(stock) == new
    assert systems.best("smollm2-cpu") == new == systems.resolve(clash)  # restarted from the new stock
    assert systems.best("smollm2-h200") == new
    assert systems.ensure_stock(source) == new  # once
