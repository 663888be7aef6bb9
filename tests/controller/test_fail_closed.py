"""Agent code runs only in a proved sandbox (issue 53, items 1-2): without bubblewrap nothing starts and the
line says what to install; a canary that reaches anything fails the proof; the development override is
recorded; what a sandbox wrote is copied without following links; worker text is scrubbed of secrets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot import canary, sandbox
from specpilot.paths import REPO_ROOT
from specpilot.sandbox import Sandbox, SandboxUnavailable, copy_untrusted

needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")


@pytest.fixture
def fresh_state(monkeypatch):
    """This process as a service before its start-up proof (restored afterwards)."""
    monkeypatch.setattr(sandbox, "_state", {"proof": None, "secrets": [], "hidden": []})
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)


def _no_bwrap_path(tmp_path: Path) -> str:
    """A PATH with git but no bwrap (the interpreter is called by its full path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("git", "tar"):
        os.symlink(subprocess.check_output(["which", tool], text=True).strip(), bin_dir / tool)
    return str(bin_dir)


def test_without_a_proof_no_sandbox_starts(fresh_state, tmp_path):
    with pytest.raises(SandboxUnavailable, match="no sandbox was proved in this process"):
        Sandbox(src=tmp_path, models=tmp_path / "none")


def test_without_bubblewrap_the_proof_fails_and_says_what_to_install(fresh_state, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_available", lambda: False)
    with pytest.raises(SandboxUnavailable, match=r"refusing to run x: bubblewrap \(`bwrap`\) is not installed: "
                                                 r"`apt-get install bubblewrap`"):
        canary.require(tmp_path / "data", what="x")
    with pytest.raises(SandboxUnavailable):
        Sandbox(src=tmp_path, models=tmp_path / "none")


def test_the_override_is_explicit_and_recorded(fresh_state, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_available", lambda: False)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    record = canary.require(tmp_path / "data")
    assert record["proved"] is False and record["override"] == sandbox.UNSAFE_ENV
    with Sandbox(src=tmp_path, models=tmp_path / "none") as sbx:
        described = sbx.describe()
    assert described["bubblewrap"] is False and described["proved"] is False
    assert described["override"] == sandbox.UNSAFE_ENV and described["network"] == "host"


@needs_bwrap
def test_a_canary_that_reaches_anything_fails_the_proof(fresh_state, outside_tmp, monkeypatch):
    data = outside_tmp / "data"  # outside /tmp: the sandbox's own tmpfs would hide it anyway
    data.mkdir()
    for d in (outside_tmp, data):  # open to all: the cover, not the sandbox user's rights, is what is tested
        d.chmod(0o755)
    assert canary.prove(data).ok
    argv = Sandbox.argv

    def leaky(self, cmd):  # a sandbox that forgets the network namespace and the data directory's cover
        out = argv(self, cmd)
        out.remove("--unshare-net")
        i = out.index(str(data.resolve()))
        del out[i - 1:i + 1]
        return out

    monkeypatch.setattr(Sandbox, "argv", leaky)
    proof = canary.prove(data)
    assert not proof.ok and proof.problem.startswith("the sandbox let agent code reach the network")
    assert any(".sandbox-canary-" in r for r in proof.reached), proof.reached


READ_EVERY_ENVIRON = """
import os
def environ(pid):
    try:
        return open(f"/proc/{pid}/environ", "rb").read()
    except OSError:  # another user's (bubblewrap's, where the sandbox user is not root)
        return b""
print(any(b"sk-ant-never" in environ(p) for p in os.listdir("/proc") if p.isdigit()), "sk-ant" in str(os.environ))
"""


@needs_bwrap
def test_bubblewrap_gets_no_environment_of_the_service(fresh_state, tmp_path, monkeypatch):
    """bubblewrap's own /proc/<pid>/environ is readable from inside: it must hold nothing of the service's."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-never-seen-inside")
    canary.require(tmp_path / "data")
    with Sandbox(src=tmp_path, models=tmp_path / "none") as sbx:
        res = sbx.run([sys.executable, "-I", "-c", READ_EVERY_ENVIRON])
    assert res["output"].split() == ["False", "False"], res


def _service_without_bwrap(tmp_path, server, name: str) -> subprocess.CompletedProcess:
    env = {"PATH": _no_bwrap_path(tmp_path), "HOME": str(tmp_path), "SPECPILOT_MACHINE_CACHE": str(tmp_path / "mc")}
    return subprocess.run([sys.executable, "-m", f"specpilot.services.{name}", "--data", str(server.data),
                           "--nats", server.url], capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)


@needs_bwrap
@pytest.mark.parametrize("name", ["controller", "subagent"])
def test_services_that_run_agent_code_refuse_to_start_without_a_sandbox(tmp_path, server, name):
    res = _service_without_bwrap(tmp_path, server, name)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{name}: refusing to run ") and "bubblewrap (`bwrap`) is not installed" in last, res.stderr


def test_specpilot_time_exits_2_without_a_sandbox(tmp_path):
    env = {"PATH": _no_bwrap_path(tmp_path), "HOME": str(tmp_path), "SPECPILOT_MACHINE_CACHE": str(tmp_path / "mc")}
    res = subprocess.run([sys.executable, "-m", "specpilot.app.cli", "time", "/dev/null", "--deployment", "tiny-cpu",
                          "--options", '{"block_size": 2}', "--data", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bubblewrap (`bwrap`) is not installed" in lines[0], res.stderr


def test_a_tree_a_sandbox_wrote_is_copied_without_following_links(tmp_path):
    secret = tmp_path / "key.pem"
    secret.write_text("-----BEGIN PRIVATE KEY-----\nsecret body\n")
    src = tmp_path / "cache"
    (src / "triton" / "abc").mkdir(parents=True)
    (src / "triton" / "abc" / "kernel.cubin").write_bytes(b"\x7fELF")
    os.utime(src / "triton" / "abc" / "kernel.cubin", ns=(1_000_000_000, 2_000_000_000))
    os.symlink(secret, src / "leak")  # a link to a file
    os.symlink(tmp_path, src / "triton" / "up")  # a link to a folder
    os.mkfifo(src / "fifo")  # a special file: reading it would block the controller
    got = copy_untrusted(src, tmp_path / "copy")
    copied = sorted(p.relative_to(tmp_path / "copy").as_posix() for p in (tmp_path / "copy").rglob("*"))
    assert copied == ["triton", "triton/abc", "triton/abc/kernel.cubin"]
    assert got == {"files": 1, "bytes": 4, "skipped": 3}
    # its times kept: ninja rebuilds an output whose time differs from what its log recorded
    assert (tmp_path / "copy" / "triton" / "abc" / "kernel.cubin").stat().st_mtime_ns == 2_000_000_000
    with pytest.raises(sandbox.SandboxError, match="more than 0 files"):
        copy_untrusted(src, tmp_path / "small", max_files=0)
    assert not (tmp_path / "small").exists()


def test_worker_text_is_scrubbed_of_every_secret_held(fresh_state, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n")
    (bundle / "split_seed").write_text("4242424242\n")
    sandbox.add_secrets(canary.secret_values(bundle, {"OPENAI_API_KEY": "sk-test-123456", "HOME": "/root"}))
    text = "Traceback: found MIIEvQIBADANBgkqhkiG9w0BAQEFAASC and seed 4242424242 and key sk-test-123456 at /root"
    assert sandbox.scrub(text) == "Traceback: found [secret] and seed [secret] and key [secret] at /root"
    assert len(sandbox.scrub("x" * 10_000)) == sandbox.TEXT_LIMIT


def test_the_round_table_says_how_agent_code_ran():
    from specpilot import schema
    from specpilot.services.master.main import sandbox_of

    proved = schema.PatchTested(patch_id="a", passed=True, sandbox={"bubblewrap": True, "proved": True})
    unsafe = schema.PatchTested(patch_id="b", passed=True,
                                sandbox={"bubblewrap": False, "proved": False, "override": sandbox.UNSAFE_ENV})
    assert sandbox_of([proved]).startswith("proved (bubblewrap")
    assert sandbox_of([proved, unsafe]).startswith(f"NONE: {sandbox.UNSAFE_ENV} (development only")
    assert sandbox_of([]) == ""


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root service changes users for sandboxed code")
def test_sandboxed_code_of_a_root_service_runs_as_nobody_and_reads_no_owner_only_file(fresh_state, tmp_path,
                                                                                       monkeypatch):
    """A file only root may read, where the sandbox shows it (the checkout), stays unread: the proof asks it
    at every start, and fails where sandboxed code would keep root's uid."""
    assert canary.prove(tmp_path / "data").ok
    src, models = tmp_path / "src", tmp_path / "models" / "smollm2-135m"
    src.mkdir(mode=0o700)  # as `mkdtemp` makes a workspace
    models.mkdir(parents=True)
    (models / "weights").write_text("w")
    (src / "code.py").write_text("c")
    read = "import os; print(os.getuid(), os.getgid(), open('code.py').read(), open(os.environ['W']).read())"
    with Sandbox(src=src, models=tmp_path / "models", proof_run=True,
                 env={"W": f"{sandbox.SANDBOX_DATA}/models/smollm2-135m/weights"}) as sbx:
        assert sbx.describe()["user"] == f"nobody ({sandbox.SANDBOX_UID})"
        res = sbx.run([sys.executable, "-I", "-c", read])
        assert res["output"].split() == [str(sandbox.SANDBOX_UID)] * 2 + ["c", "w"], res
    monkeypatch.setattr(Sandbox, "drops_to_sandbox_user", property(lambda self: False))
    proof = canary.prove(tmp_path / "data")
    assert not proof.ok and any(".sandbox-canary-owner-" in r for r in proof.reached), proof
