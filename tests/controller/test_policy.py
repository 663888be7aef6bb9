import pytest

from specpilot import policy
from tests.controller.patches import diff, worker_patch


def test_engine_patch_is_allowed():
    assert policy.check(worker_patch(before_ready="pass\n"), {"verify": "tree"}) is None
    assert policy.check("", {"verify": "tree"}) is None  # options only


@pytest.mark.parametrize("path", ["tests/engine/test_x.py", "specpilot/services/controller/main.py", "specpilot/schema.py",
                                  "deployments/smollm2-cpu.toml", "deployments/chat_prompts.json", "pyproject.toml",
                                  ".ci/run", "specpilot_engine/tests/test_speed.py", "specpilot_engine/../specpilot/cli.py",
                                  "/etc/passwd", "specpilot_kernels/test_w12.py"])
def test_paths_outside_engine_and_kernels_are_refused(path):
    d = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-x\n+y\n"
    r = policy.check(d, {})
    assert r is not None and r.rule == "paths"


def test_renames_out_of_engine_are_refused():
    d = ("diff --git a/specpilot_engine/api.py b/specpilot/services/x.py\nsimilarity index 100%\n"
         "rename from specpilot_engine/api.py\nrename to specpilot/services/x.py\n")
    assert policy.check(d, {}).rule == "paths"


def test_symlinks_binaries_size_and_options():
    link = "diff --git a/specpilot_engine/l b/specpilot_engine/l\nnew file mode 120000\n--- /dev/null\n+++ b/specpilot_engine/l\n@@ -0,0 +1 @@\n+/etc\n"
    assert policy.check(link, {}).rule == "mode"
    binary = "diff --git a/specpilot_engine/x.bin b/specpilot_engine/x.bin\nGIT binary patch\nliteral 3\n"
    assert policy.check(binary, {}).rule == "binary"
    big = diff("specpilot_engine/api.py", (policy.ALLOWED_ROOTS[0] + "x\n") * 30000)
    assert policy.check(big, {}).rule == "size"
    assert policy.check("", {"Bad-Name": 1}).rule == "options"
    assert policy.check("", {"x": [1, 2]}).rule == "options"
    assert policy.check("just some text\n", {}).rule == "format"
