"""Where `specpilot.engine`, `specpilot.kernels` and `specpilot.services` are read from.

The repository's top level is the design card's (docs/DESIGN.md §1): the runtime in ``engine/`` and
``kernels/``, the five services in ``services/<name>/``, beside ``specpilot/`` (core, harness, app). Their
import names are ours alone, ``specpilot.engine``, ``specpilot.kernels`` and ``specpilot.services``: nothing
we ship is importable as a top-level ``engine``, ``kernels`` (Hugging Face's, which transformers imports)
or ``services``. The three folders have no ``__init__.py`` for the same reason: a process started in the
repository's root, whose path begins there, still finds the installed ``kernels`` (a regular package is
found before a folder without one).

An import hook (`install`, called once by ``specpilot/__init__.py``) maps each name onto its folder: in a
checkout (the editable install, a device's ``PYTHONPATH``) the folders beside ``specpilot/``; in an
installed wheel the copies inside the package (`home`). ``SPECPILOT_RUNTIME`` names another tree whose
``engine/`` and ``kernels/`` are the runtime instead: the candidate system a sandboxed worker times, a
subagent's workspace whose tests run (`specpilot.sandbox.Sandbox` sets it). Torch-free, like the core.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path

RUNTIME_ENV = "SPECPILOT_RUNTIME"
RUNTIME_FOLDERS = ("engine", "kernels")  # the patchable runtime: what a system is (`policy.ALLOWED_ROOTS`)
FOLDERS = (*RUNTIME_FOLDERS, "services")
_PACKAGE = Path(__file__).resolve().parent


def home() -> Path:
    """The folder that holds ``engine/``, ``kernels/`` and ``services/``: this package (an installed wheel),
    else the checkout around it."""
    return _PACKAGE if (_PACKAGE / "engine").is_dir() else _PACKAGE.parent


def folder(name: str) -> Path:
    """Where ``specpilot.<name>`` is read from now (``name`` one of `FOLDERS`)."""
    runtime = os.environ.get(RUNTIME_ENV)
    return (Path(runtime) if runtime and name in RUNTIME_FOLDERS else home()) / name


class _Folders(MetaPathFinder):
    """Finds ``specpilot.engine``, ``specpilot.kernels`` and ``specpilot.services`` (packages without an
    ``__init__.py``: their modules are found through the ``__path__`` given here)."""

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        parent, _, name = fullname.partition(".")
        if parent != __package__ or name not in FOLDERS:
            return None
        spec = ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(folder(name))]
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once): before setuptools' editable finder, which cannot map
    a package without an ``__init__.py``."""
    if not any(isinstance(f, _Folders) for f in sys.meta_path):
        sys.meta_path.insert(0, _Folders())
