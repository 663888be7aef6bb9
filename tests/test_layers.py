"""The house's import rules, read from the code's AST (no imports run).

The top level is the design card's: the runtime in ``engine/`` and ``kernels/`` (``specpilot.engine``,
``specpilot.kernels``), the services in ``services/<name>/`` (``specpilot.services.<name>``), and in
``specpilot/`` the torch-free core (``specpilot/*.py``), the harness and the app. Layers point down: app →
services → harness → runtime, and every layer may use the core. The core imports no layer above it and no
torch; a service never imports another service's package; the runtime never imports the harness, services
or app; nothing imports a top-level ``engine``, ``kernels`` or ``services`` (other distributions' names);
and no two files import each other, directly or round a circle (imports inside functions count: they
still tie the files; ``if TYPE_CHECKING:`` imports do not).
"""

from __future__ import annotations

import ast
import graphlib
import tomllib
from pathlib import Path

import pytest

from specpilot.layout import FOLDERS
from specpilot.paths import REPO_ROOT

TOP = ("specpilot", *FOLDERS)  # the folders that hold the distribution's code
UPPER = ("specpilot.harness", "specpilot.services", "specpilot.app")
RUNTIME = ("specpilot.engine", "specpilot.kernels")
CLASHING = ("engine", "kernels", "services")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[0] in FOLDERS:
        parts = ["specpilot", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included, ``if TYPE_CHECKING:``
    blocks left out); relative imports resolved."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


SOURCES = sorted(p for top in TOP for p in (REPO_ROOT / top).rglob("*.py"))
CODE = SOURCES + sorted(p for d in ("tests", "bench") for p in (REPO_ROOT / d).rglob("*.py"))
MODULES = {_module(p): p for p in SOURCES}


def layer(module: str) -> str:
    if _under(module, RUNTIME):
        return "runtime"
    for upper in UPPER:
        if _under(module, (upper,)):
            return upper.split(".")[1]
    return "core"


def violations(module: str, imported: set[str]) -> list[str]:
    """What ``module`` may not import, of ``imported`` (pure: the rules in one place)."""
    where = layer(module)
    bad = []
    for name in sorted(imported):
        if _under(name, CLASHING):
            bad.append(f"{name}: a top-level name other distributions use")
        elif where == "core" and (_under(name, UPPER + RUNTIME) or _under(name, ("torch", "triton"))):
            bad.append(f"{name}: the core is torch-free and imports no layer above it")
        elif where == "runtime" and _under(name, UPPER):
            bad.append(f"{name}: the runtime never imports the harness, services or app")
        elif where == "harness" and _under(name, ("specpilot.services", "specpilot.app")):
            bad.append(f"{name}: the harness never imports services or the app")
        elif where == "services":
            own = ".".join(module.split(".")[:3])
            if _under(name, ("specpilot.app",)) or (_under(name, ("specpilot.services",))
                                                     and name.count(".") >= 2 and not _under(name, (own,))):
                bad.append(f"{name}: a service imports only its own package, the harness, runtime and core")
    return bad


def file_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours it imports (a package's name stands for its
    ``__init__.py``; ``from pkg import name`` names the module ``pkg.name`` where there is one)."""
    graph = {}
    for module, path in modules.items():
        graph[module] = {name for name in _imports(path) if name in modules and name != module}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph`` ([] when there is none)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_layers_point_down(path):
    assert violations(_module(path), _imports(path)) == []


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_code_imports_a_clashing_top_level_name(path):
    clashing = [n for n in _imports(path) if _under(n, CLASHING)]
    assert clashing == []


def test_no_files_import_each_other():
    assert circle(file_graph(MODULES)) == []


def test_the_rules_catch_what_they_name():
    assert violations("specpilot.schema", {"specpilot.services.master.planner"})
    assert violations("specpilot.ledger", {"torch"})
    assert violations("specpilot.engine.api", {"specpilot.harness.deployment"})
    assert violations("specpilot.harness.worker", {"specpilot.services.controller.workers"})
    assert violations("specpilot.services.controller.main", {"specpilot.services.master.costmodel"})
    assert violations("specpilot.services.master.main", {"specpilot.app.cli"})
    assert violations("specpilot.services.master.main", {"engine.model"})
    assert not violations("specpilot.services.master.main", {"specpilot.services.master.planner", "specpilot.schema",
                                                             "specpilot.harness.deployment", "specpilot.engine.model"})
    assert not violations("specpilot.app.cli", {"specpilot.services.memory.logic"})
    assert _module(REPO_ROOT / "services" / "memory" / "main.py") == "specpilot.services.memory.main"
    assert _module(REPO_ROOT / "kernels" / "w12" / "__init__.py") == "specpilot.kernels.w12"
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (["a", "c", "b", "a"], ["b", "a", "c", "b"],
                                                                      ["c", "b", "a", "c"])
    assert circle({"a": {"b"}, "b": set()}) == []


def test_relative_and_type_checking_imports_are_read_as_python_does(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.test_layers.REPO_ROOT", tmp_path)
    (tmp_path / "kernels" / "w12").mkdir(parents=True)
    init = tmp_path / "kernels" / "w12" / "__init__.py"
    init.write_text("from typing import TYPE_CHECKING\nfrom .format import pack\nfrom . import kernel\n"
                    "if TYPE_CHECKING:\n    from specpilot.engine import model\n")
    assert _imports(init) == {"typing", "typing.TYPE_CHECKING", "specpilot.kernels.w12.format",
                              "specpilot.kernels.w12.format.pack", "specpilot.kernels.w12",
                              "specpilot.kernels.w12.kernel"}


def test_the_design_cards_top_level():
    """services/<name>/ for the five services, engine/, kernels/, tests/, compose.yaml at the root; the three
    code folders without an __init__.py (so none is a top-level package), every package installed."""
    for name in ("master", "subagent", "controller", "forcer", "memory"):
        assert (REPO_ROOT / "services" / name / "main.py").is_file(), name
    assert (REPO_ROOT / "compose.yaml").is_file() and (REPO_ROOT / "tests").is_dir()
    assert not any((REPO_ROOT / f / "__init__.py").exists() for f in FOLDERS)
    found = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    assert found - {"tests"} == {"specpilot"}
    declared = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {_module(p.parent / "__init__.py") for p in SOURCES}
    packages |= {name.rsplit(".", 1)[0] for name in packages if "." in name}  # services/ holds only packages
    assert declared == packages
