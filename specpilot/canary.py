"""The sandbox's proof: before a service runs any agent-written code, a canary run inside the sandbox must
fail to reach what agent code must never reach. Without that proof no agent code starts (fail closed).

Contract:
- `prove(data_dir, secret_files)` starts `CANARY` (a few lines of Python, the service's own interpreter, no
  torch) in a `specpilot.sandbox.Sandbox` over an empty source tree, and reads what it reached: a TCP port
  this process listens on at 127.0.0.1 (the network), a file planted in ``data_dir`` (the ledger, systems,
  other bundles), each of ``secret_files`` (the service's bundle: its key, the controller's split seed), a
  random marker this process put in its own environment (found in the canary's environment or in any
  ``/proc/<pid>/environ`` or ``cmdline`` it can read: the parent's environment and its API keys), and a
  file written into a folder this process may write (the checkout, else its home: the host's files), and, where
  this process is root, a file only root may read in that folder, which the sandbox shows (sandboxed code runs
  as `sandbox.SANDBOX_UID`). Returns a `Proof`: ``ok`` when it reached nothing,
  else ``problem``, one line naming what it reached or what is missing and how to get it.
- `require(data_dir, bundle)` is what a service calls at start (controller, subagent, `specpilot time`): it
  proves the sandbox and marks this process (`sandbox.mark_proved`), so every later `Sandbox` isolates.
  Without a proof it raises `sandbox.SandboxUnavailable` (a `UserError`: one line, exit 2), unless the development
  override ``SPECPILOT_UNSAFE_NO_SANDBOX=1`` is set: agent code then runs unisolated, and that is recorded in
  every `Sandbox.describe()` (hence every ``PatchTested``) and printed on every round's table.
- `secret_values(bundle, environ)` is what the service holds that must never reach an event, a log or a
  file a worker can read: its bundle's files and the values of environment variables named like keys,
  tokens, passwords or secrets; `sandbox.scrub` removes them from worker text.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specpilot import sandbox
from specpilot.paths import REPO_ROOT
from specpilot.sandbox import SandboxUnavailable

log = logging.getLogger("sandbox")
MARKER_ENV = "SPECPILOT_CANARY_MARKER"  # set in this process only for the proof; the canary must not see it
_SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "SEED")
CANARY = r"""
import json, os, socket, sys
# the marker comes in two halves: whole, it would be in this process's own cmdline
port, marker, write_probe, paths = int(sys.argv[1]), (sys.argv[2] + sys.argv[3]).encode(), sys.argv[4], sys.argv[5:]
reached = []
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    reached.append("the network (a port the host listens on)")
except OSError:
    pass
for p in paths:
    try:
        with open(p, "rb") as f:
            f.read(1)
        reached.append(p)
    except OSError:
        pass
env = b"\0".join(f"{k}={v}".encode() for k, v in os.environ.items())
seen = marker in env
for pid in (d for d in os.listdir("/proc") if d.isdigit()):
    for name in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                seen = seen or marker in f.read()
        except OSError:
            pass
if seen:
    reached.append("the host's environment")
if write_probe:
    try:
        with open(write_probe, "w") as f:
            f.write("x")
        reached.append("the host's files (it wrote " + write_probe + ")")
    except OSError:
        pass
print(json.dumps({"reached": reached}))
"""


@dataclass(frozen=True)
class Proof:
    ok: bool
    problem: str = ""  # one line: what the canary reached, or what is missing and how to get it
    reached: list[str] = field(default_factory=list)


def _missing_bwrap() -> str:
    return ("bubblewrap (`bwrap`) is not installed: `apt-get install bubblewrap` (scripts/install.sh does it; the "
            f"Dockerfile ships it); {sandbox.UNSAFE_ENV}=1 runs agent code without isolation (development only)")


def prove(data_dir: Path, secret_files: list[Path] = (), timeout_s: float = 60.0) -> Proof:
    """Run the canary in a fresh sandbox that hides ``data_dir`` (see the module docstring)."""
    if not sandbox.bwrap_available():
        return Proof(False, _missing_bwrap())
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    marker = secrets.token_hex(16)
    planted = data_dir / f".sandbox-canary-{marker[:8]}"
    planted.write_text(marker)
    write_probe = _writable_host_dir() / f".sandbox-canary-{marker[:8]}" if _writable_host_dir() else None
    # Run by root, sandboxed code is another user: a file only root may read must stay unread where it is shown
    owner_only = write_probe.with_name(f".sandbox-canary-owner-{marker[:8]}") if write_probe and os.geteuid() == 0 \
        else None
    if owner_only is not None:
        owner_only.touch(mode=0o600)
        owner_only.write_text(marker)
    listener = socket.create_server(("127.0.0.1", 0))
    os.environ[MARKER_ENV] = marker
    try:
        with tempfile.TemporaryDirectory(prefix="sp-canary-") as tmp:
            src = Path(tmp) / "src"
            src.mkdir()
            paths = [str(planted), *([str(owner_only)] if owner_only else []),
                     *(str(p) for p in secret_files if Path(p).is_file())]
            with sandbox.Sandbox(src=src, models=Path(tmp) / "none", hide=[data_dir],
                                 limits=sandbox.Limits(wall_s=timeout_s), proof_run=True) as sbx:
                res = sbx.run([sys.executable, "-I", "-c", CANARY, str(listener.getsockname()[1]), marker[:16],
                               marker[16:], str(write_probe or ""), *paths], timeout=timeout_s)
    finally:
        os.environ.pop(MARKER_ENV, None)
        listener.close()
        planted.unlink(missing_ok=True)
        if owner_only is not None:
            owner_only.unlink(missing_ok=True)
        written = write_probe is not None and write_probe.exists()
        if written:
            write_probe.unlink()
    try:
        reached = json.loads(res["output"].strip().splitlines()[-1])["reached"]
    except (ValueError, KeyError, IndexError, TypeError):
        why = res["output"].strip().splitlines()[-1:] or ["no output"]
        return Proof(False, f"bubblewrap could not start a sandbox here ({why[0][:200]}): allow unprivileged "
                            "user namespaces (sysctl kernel.unprivileged_userns_clone=1), or in a container run "
                            "it as compose.yaml does (security_opt seccomp=unconfined, apparmor=unconfined)")
    if written and not any("host's files" in r for r in reached):
        reached.append(f"the host's files (it wrote {write_probe})")
    if reached:
        return Proof(False, "the sandbox let agent code reach " + "; ".join(reached), reached)
    return Proof(True)


def _writable_host_dir() -> Path | None:
    """A folder this process may write that a sandbox shows (read-only): the checkout, else the home folder;
    None where neither is writable here (a host whose checkout is read-only already), and under /tmp (a
    sandbox's own tmpfs covers it, so a write there would not reach the host)."""
    for folder in (REPO_ROOT, Path.home()):
        if os.access(folder, os.W_OK) and not str(folder.resolve()).startswith("/tmp/"):
            return folder
    return None


def secret_values(bundle: Path | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """What this service holds that no event, log or worker may see: each file of its bundle (text, as
    read) and the values of its environment variables named like a key, token, password or secret."""
    out: list[str] = []
    if bundle is not None and Path(bundle).is_dir():
        for p in sorted(Path(bundle).iterdir()):
            if p.is_file() and not p.is_symlink() and p.stat().st_size <= 1 << 16:
                out.append(p.read_text(errors="replace").strip())
    for name, value in (os.environ if environ is None else environ).items():
        if any(part in name.upper() for part in _SECRET_NAME_PARTS) and len(value) >= 6:
            out.append(value)
    return [v for v in out if v]


def require(data_dir: Path, bundle: Path | None = None, what: str = "agent code") -> dict:
    """Prove the sandbox at a service's start, or refuse (`SandboxUnavailable`) unless the development override
    is set; returns what was proved (`sandbox.describe_proof`). Idempotent within a process."""
    if sandbox.proof() is not None:
        return sandbox.proof()
    bundle = Path(bundle) if bundle else (Path(b) if (b := os.environ.get("SPECPILOT_BUNDLE")) else None)
    secret_files = sorted(p for p in bundle.iterdir() if p.is_file()) if bundle and bundle.is_dir() else []
    if bundle is not None:
        sandbox.hide_always(bundle)  # wherever it lies, as SPECPILOT_BUNDLE's is
    proof = prove(data_dir, secret_files)
    sandbox.add_secrets(secret_values(bundle))
    if proof.ok:
        return sandbox.mark_proved({"proved": True, "bubblewrap": shutil.which("bwrap")})
    if sandbox.unsafe_override():
        log.warning("NO SANDBOX: %s; %s=1 is set, so %s runs unisolated (development only)", proof.problem,
                    sandbox.UNSAFE_ENV, what)
        return sandbox.mark_proved({"proved": False, "override": sandbox.UNSAFE_ENV, "problem": proof.problem})
    raise SandboxUnavailable(f"refusing to run {what}: {proof.problem}")
