"""The house's import rules, read from the code's AST (no imports run).

Layers point down: app → services → harness → runtime (`specpilot_engine`, `specpilot_kernels`), and every
layer may use the torch-free core (`specpilot/*.py`). The core imports no layer above it and no torch; a
service never imports another service's package; the runtime never imports the harness, services or app;
and nothing imports the old top-level names (`engine`, `kernels`, `services`) that other distributions
use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specpilot.paths import REPO_ROOT

PACKAGES = ("specpilot", "specpilot_engine", "specpilot_kernels")
UPPER = ("specpilot.harness", "specpilot.services", "specpilot.app")
RUNTIME = ("specpilot_engine", "specpilot_kernels")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


SOURCES = sorted(p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py"))
CODE = SOURCES + sorted(p for d in ("tests", "bench") for p in (REPO_ROOT / d).rglob("*.py"))


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
        if _under(name, ("engine", "kernels", "services")):
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


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_layers_point_down(path):
    assert violations(_module(path), _imports(path)) == []


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_code_imports_a_clashing_top_level_name(path):
    clashing = [n for n in _imports(path) if _under(n, ("engine", "kernels", "services"))]
    assert clashing == []


def test_the_rules_catch_what_they_name():
    assert violations("specpilot.schema", {"specpilot.services.master.planner"})
    assert violations("specpilot.ledger", {"torch"})
    assert violations("specpilot_engine.api", {"specpilot.harness.deployment"})
    assert violations("specpilot.harness.worker", {"specpilot.services.controller.workers"})
    assert violations("specpilot.services.controller.main", {"specpilot.services.master.costmodel"})
    assert violations("specpilot.services.master.main", {"specpilot.app.cli"})
    assert violations("specpilot.services.master.main", {"engine.model"})
    assert not violations("specpilot.services.master.main", {"specpilot.services.master.planner", "specpilot.schema",
                                                             "specpilot.harness.deployment", "specpilot_engine.model"})
    assert not violations("specpilot.app.cli", {"specpilot.services.memory.logic"})


def test_top_level_packages_are_ours_alone():
    found = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    assert found - {"tests"} == set(PACKAGES)
