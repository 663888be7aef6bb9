"""A lab of separate hosts on one machine: one network namespace per host, wired to a bridge that lives
in a hub namespace of its own, and one mount view per host process.

Everything the lab makes (namespaces, veth pairs, the bridge, every address) lives inside namespaces it
creates and removes itself; the machine's own network is never touched. A host process runs under
``nsenter --net`` (only the network namespace changes: the cgroup hierarchy stays visible, so sandboxes
keep their limits) and ``bwrap`` with the machine bound read-write, a fresh ``/tmp``, and the host's own
folder at ``/tmp/host`` (its data directory at ``/tmp/host/data``, its bundle read-only at
``/tmp/host/bundle``): no host can see another's files. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN),
``ip``, ``nsenter`` and ``bwrap``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

VIEW = Path("/tmp/host")  # where a host process finds its own folder
REPO = Path(__file__).resolve().parent.parent


def available() -> str:
    """'' when the lab can run here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nsenter", "bwrap") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else ""


CLI = [sys.executable, "-m", "specpilot.app.cli"]
BUNDLE, DATA = str(VIEW / "bundle"), str(VIEW / "data")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Lab:
    """Hosts ``names`` on the subnet ``10.<net>.0.0/24``; the first name gets ``.1``, and so on."""

    def __init__(self, root: Path, names: list[str]):
        self.root, self.names = Path(root), list(names)
        self.tag = f"sp{secrets.token_hex(2)}"
        self.net = 200 + secrets.randbelow(50)
        self.hub = f"{self.tag}-hub"

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"10.{self.net}.0.{self.names.index(name) + 1}"

    def folder(self, name: str) -> Path:
        return self.root / name

    def _veth(self, name: str) -> str:
        return f"{self.tag}h{self.names.index(name)}"  # the hub's end (15 characters at most)

    def __enter__(self) -> Lab:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns, hub_end, host_end = self.ns(name), self._veth(name), f"{self.tag}v{i}"
                _ip("netns", "add", ns)
                _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", host_end, "netns", ns)
                _ip("-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
                _ip("-n", ns, "link", "set", host_end, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                (self.folder(name) / "data").mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [self.ns(n) for n in self.names] + [self.hub]:  # a namespace takes its veth ends with it
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)

    def cut(self, name: str) -> None:
        """Unplug ``name`` from the bridge (its processes live on; nothing reaches them)."""
        _ip("-n", self.hub, "link", "set", self._veth(name), "down")

    def mend(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self._veth(name), "up")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` as host ``name`` runs it: its network, its own folder, nobody else's files."""
        view = ["bwrap", "--bind", "/", "/", "--dev-bind", "/dev", "/dev", "--tmpfs", "/tmp"]
        # the interpreter, its environment and the checkout may live under /tmp (a CI clone)
        for keep in sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), REPO}):
            if str(keep).startswith("/tmp/"):
                view += ["--ro-bind", str(keep), str(keep)]
        view += ["--bind", str(self.folder(name) / "data"), str(VIEW / "data")]
        if (self.folder(name) / "bundle").exists():
            view += ["--ro-bind", str(self.folder(name) / "bundle"), str(VIEW / "bundle")]
        view += ["--die-with-parent", "--chdir", str(REPO)]
        return ["nsenter", f"--net=/var/run/netns/{self.ns(name)}", *view, *argv]

    @staticmethod
    def env(extra: dict[str, str] | None = None) -> dict[str, str]:
        """A host process's environment: its home and caches inside its own fresh /tmp."""
        return dict(os.environ, PYTHONPATH=str(REPO), HOME=str(VIEW / "home"), XDG_CACHE_HOME=str(VIEW / "home" / ".cache"),
                    SPECPILOT_MACHINE_CACHE=str(VIEW / "home" / "machine-cache"), COLUMNS="200", **(extra or {}))

    def popen(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(self.command(name, argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env(env))
        log.close()
        return proc

    def run(self, name: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), capture_output=True, text=True, timeout=timeout, env=self.env())


class Installation:
    """SpecPilot on a `Lab`: the operator (``specpilot init``, the admin bundle), the NATS server and one
    host per service, each started with only its own bundle; what docs/SEPARATE_HOSTS.md tells a user to do."""

    def __init__(self, lab: Lab, services: tuple[str, ...], flags: dict[str, list[str]] | None = None):
        self.lab, self.services, self.flags = lab, services, flags or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = f"tls://{lab.address('server')}:4222"

    def init(self) -> None:
        """The operator makes the CA and the bundles and copies each host its own folder."""
        res = self.lab.run("operator", [*CLI, "init", "--data", DATA, "--host", self.lab.address("server")])
        if res.returncode != 0:
            raise RuntimeError(f"specpilot init: {res.stderr}")
        made = self.lab.folder("operator") / "data" / "bundles"
        for name in ("server", *self.services, "operator"):
            shutil.copytree(made / ("admin" if name == "operator" else name), self.lab.folder(name) / "bundle")

    def argv(self, name: str) -> list[str]:
        if name == "server":
            return [*CLI, "server", "--bundle", BUNDLE, "--store", DATA]
        return [sys.executable, "-m", f"specpilot.services.{name}", "--bundle", BUNDLE, "--data", DATA,
                "--nats", self.url, "--connect-timeout", "120", *self.flags.get(name, [])]

    def start(self, name: str) -> subprocess.Popen:
        self.procs[name] = self.lab.popen(name, self.argv(name))
        return self.procs[name]

    def operator(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.lab.run("operator", [*CLI, *args, "--bundle", BUNDLE, "--data", DATA, "--nats", self.url],
                            timeout=timeout)

    def operator_popen(self, *args: str) -> subprocess.Popen:
        return self.lab.popen("operator", [*CLI, *args, "--bundle", BUNDLE, "--data", DATA, "--nats", self.url])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
