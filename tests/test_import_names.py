"""Our import names never shadow another distribution's: Hugging Face's `kernels` (a dependency of
transformers ≥ 5.25, installed by the dev extras on purpose), our runtime kernels and transformers'
Llama all import side by side, in a fresh interpreter started from the repository root (where a
top-level `kernels/` folder would win)."""

from __future__ import annotations

import json
import subprocess
import sys

from specpilot.paths import REPO_ROOT

PROBE = """
import json, kernels, specpilot_kernels
from transformers import LlamaForCausalLM
from importlib.metadata import version
print(json.dumps({"kernels": kernels.__file__, "ours": specpilot_kernels.__file__,
                  "kernels_version": version("kernels"), "llama": LlamaForCausalLM.__name__}))
"""


def test_hugging_face_kernels_ours_and_transformers_import_together():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["kernels"].startswith(str(REPO_ROOT) + "/kernels"), got  # theirs, from site-packages
    assert got["ours"].startswith(str(REPO_ROOT / "specpilot_kernels")), got
    assert got["llama"] == "LlamaForCausalLM"
