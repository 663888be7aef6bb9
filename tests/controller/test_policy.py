import pytest

from specpilot import policy
from specpilot.paths import REPO_ROOT
from tests.controller.patches import diff, worker_patch


def test_engine_patch_is_allowed():
    assert policy.check(worker_patch(before_ready="pass\n"), {"verify": "tree"}) is None
    assert policy.check("", {"verify": "tree"}) is None  # options only


@pytest.mark.parametrize("path", ["tests/engine/test_x.py", "services/controller/main.py", "specpilot/schema.py",
                                  "deployments/smollm2-cpu.toml", "deployments/chat_prompts.json", "pyproject.toml",
                                  ".ci/run", "engine/tests/test_speed.py", "engine/../specpilot/cli.py",
                                  "/etc/passwd", "kernels/test_w12.py"])
def test_paths_outside_engine_and_kernels_are_refused(path):
    d = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-x\n+y\n"
    r = policy.check(d, {})
    assert r is not None and r.rule == "paths"


def test_renames_out_of_engine_are_refused():
    d = ("diff --git a/engine/api.py b/services/x.py\nsimilarity index 100%\n"
         "rename from engine/api.py\nrename to services/x.py\n")
    assert policy.check(d, {}).rule == "paths"


def test_symlinks_binaries_size_and_options():
    link = "diff --git a/engine/l b/engine/l\nnew file mode 120000\n--- /dev/null\n+++ b/engine/l\n@@ -0,0 +1 @@\n+/etc\n"
    assert policy.check(link, {}).rule == "mode"
    binary = "diff --git a/engine/x.bin b/engine/x.bin\nGIT binary patch\nliteral 3\n"
    assert policy.check(binary, {}).rule == "binary"
    big = diff("engine/api.py", (policy.ALLOWED_ROOTS[0] + "x\n") * 30000)
    assert policy.check(big, {}).rule == "size"
    assert policy.check("", {"Bad-Name": 1}).rule == "options"
    assert policy.check("", {"x": [1, 2]}).rule == "options"
    assert policy.check("just some text\n", {}).rule == "format"


HARNESS = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "specpilot" / "harness").glob("*.py"))


@pytest.mark.parametrize("path", HARNESS + ["deployments/chat_prompts.json", "deployments/smollm2-cpu.toml"])
def test_a_patch_to_the_harness_request_sets_or_split_is_refused_naming_the_rule(path):
    """Every harness module (the worker, replay, request sets and their dev/sealed split in requests.py,
    deployments, profiler, forcing, training) and the request data: a real edit of the real file is refused."""
    from specpilot import schema

    text = (REPO_ROOT / path).read_text()
    patch = schema.PatchProposed(direction_id="d", patch_id="p", diff=diff(path, text + "\n# changed\n"),
                                 options={}, source="subagent")
    refusal = policy.refused(patch)
    assert isinstance(refusal, schema.PatchRefused) and refusal.patch_id == "p"
    assert refusal.rule == "paths" and path in refusal.reason and "outside engine/" in refusal.reason
    assert "specpilot/harness/requests.py" in HARNESS and "specpilot/harness/worker.py" in HARNESS
