"""Our import names never shadow another distribution's. The runtime and services sit in top-level folders
(`engine/`, `kernels/`, `services/`) but import as `specpilot.engine`, `specpilot.kernels` and
`specpilot.services` (`specpilot.layout`): Hugging Face's `kernels` (a dependency of transformers ≥ 5.25,
installed by the dev extras on purpose), our kernels and transformers' Llama import side by side, from the
repository's root (where a `kernels/` package would win) and from the project installed as a wheel into a
fresh environment, where no top-level `engine`, `kernels` or `services` of ours exists."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpilot.paths import REPO_ROOT

PROBE = """
import importlib.util, json, kernels, specpilot.kernels.cpu_gemm as ours
import specpilot.engine.options, specpilot.services.memory.logic
from transformers import LlamaForCausalLM
from importlib.metadata import version
print(json.dumps({"kernels": kernels.__file__, "ours": ours.__file__, "kernels_version": version("kernels"),
                  "llama": LlamaForCausalLM.__name__, "engine": specpilot.engine.options.__file__,
                  "services": specpilot.services.memory.logic.__file__,
                  "top_level": {n: importlib.util.find_spec(n) is not None for n in ("engine", "services")}}))
"""


def _probe(cwd, env=None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hugging_face_kernels_ours_and_transformers_import_together_from_the_root():
    got = _probe(REPO_ROOT)
    assert not got["kernels"].startswith(str(REPO_ROOT) + "/kernels"), got  # theirs, from site-packages
    assert got["ours"].startswith(str(REPO_ROOT / "kernels" / "cpu_gemm")), got
    assert got["engine"] == str(REPO_ROOT / "engine" / "options.py")
    assert got["llama"] == "LlamaForCausalLM"


@pytest.mark.slow
def test_an_installed_wheel_has_no_top_level_name_of_ours(tmp_path):
    """The wheel (built from this checkout, installed with --target into an empty folder that comes first on
    the path) holds the runtime and services inside `specpilot/`, with the drafters' weights and the kernels'
    C++ and CUDA sources; started elsewhere, nothing of it is importable as `engine`, `kernels` or
    `services`, and Hugging Face's `kernels` and transformers still import beside it."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(site), str(REPO_ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "specpilot"] or \
        sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["specpilot"]
    for data in ("engine/drafters/weights/smollm2_parallel.pt", "kernels/cpu_gemm/stream_gemm.cpp",
                 "kernels/w12/csrc/w12_mma.cu"):
        assert (site / "specpilot" / data).is_file(), data
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = _probe(elsewhere, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert got["ours"] == str(site / "specpilot" / "kernels" / "cpu_gemm" / "__init__.py"), got
    assert got["engine"] == str(site / "specpilot" / "engine" / "options.py")
    assert got["services"] == str(site / "specpilot" / "services" / "memory" / "logic.py")
    assert not got["kernels"].startswith(str(site)) and got["llama"] == "LlamaForCausalLM"
    assert got["top_level"] == {"engine": False, "services": False}
