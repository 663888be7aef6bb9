"""The sandbox agent-written code runs in (candidates timed by the controller, an agent's own tests and
advice runs), and `Worker`, the driver of a timing worker (`specpilot.harness.worker`) inside one.

What is isolated (Linux with bubblewrap, as set up by ``scripts/install.sh``):
- **Files**: the whole machine is mounted read-only; ``/tmp`` is a fresh, empty tmpfs (the only
  writable place, gone when the sandbox ends); the SpecPilot data directory — ledger, NATS store,
  bundles, the controller's systems repository — and the running service's own bundle
  (``SPECPILOT_BUNDLE``, wherever it lies: its key, the controller's secret split seed) are covered by
  an empty tmpfs. The candidate's source is bound read-only at ``/tmp/src`` and the converted model
  cache read-only at ``/tmp/data/models``. ``compile_cache`` (a directory the controller made for
  this one sandbox) is bound writable at ``/tmp/compile-cache`` as Triton's cache and as the build
  directory of torch's C++ extensions (`specpilot.kernels.cpu_gemm`).
- **Environment**: cleared; only ``PATH``, ``HOME=/tmp`` and a few thread settings are set. No NATS
  URL or credentials, no API keys.
- **Network**: a new network namespace with only a loopback nobody listens on.
- **Processes**: a new PID namespace (the candidate cannot see or signal the controller), a new
  session, capabilities dropped, and the whole tree dies with the controller (``--die-with-parent``).
- **Resources**: a cgroup (v1 or v2) per sandbox caps processes (``pids.max``) and memory; the
  controller enforces wall-clock timeouts and kills the tree. ``cpus`` pins the whole tree to a set
  of cores (the controller pins GPU timing workers to one core beside the GPU:
  `specpilot.services.controller.pinning.timing_cpus`).
  Where cgroups are not writable, ``RLIMIT_AS`` caps memory on CPU runs (never on CUDA, whose
  address-space reservations it breaks) and the process cap is best effort.
- **The clock, the harness and the reference tokens** stay in the caller's process: a `Worker` only
  receives prompt ids and returns tokens, each request timed on the caller's clock.

What is not isolated: CPU time shares the machine's cores (the controller times one thing at a time
and records the load average beside each sample; when two workers are alive at once, the idle one is
stopped with ``SIGSTOP``, ``pause``, while the other is timed, but GPU work it queued before it was
stopped can still overlap: the carry-over test catches work that slows the requests right after it,
and an interleaved GPU timing that would promote is confirmed run by run, `stats.retime_reason`);
the candidate can read the rest of the machine's
files (read-only), including the public request sets; a GPU is shared when the device is CUDA. Only under
the development override below does agent code run without bubblewrap (a scrubbed environment, a temporary
working directory, rlimits and timeouts), and ``describe()`` says so (recorded in ``PatchTested``).

**Fail closed.** No `Sandbox` starts agent code in a process that has not proved one: a service that runs
agent code calls `specpilot.canary.require` at start (a canary that must fail to reach the network, the data
directory, the bundle, the parent's environment and the host's files), which marks the process
(`mark_proved`). Without the proof a `Sandbox` refuses to exist (`SandboxUnavailable`), unless the
development override ``SPECPILOT_UNSAFE_NO_SANDBOX=1`` was set at that start, which every `describe()`
records. bubblewrap itself starts with the same scrubbed environment its child gets, so not even its own
``/proc/<pid>/environ`` holds the service's. Text that comes out of a sandbox (a worker's stderr, its
error replies, a run's output) is bounded and has every secret the service holds removed (`scrub`) before
the caller sees it.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.errors import UserError
from specpilot.layout import RUNTIME_ENV
from specpilot.paths import REPO_ROOT

SANDBOX_SRC = "/tmp/src"
SANDBOX_DATA = "/tmp/data"
SANDBOX_COMPILE_CACHE = "/tmp/compile-cache"
UNSAFE_ENV = "SPECPILOT_UNSAFE_NO_SANDBOX"  # development only: agent code runs unisolated (recorded)
# A service that runs as root (the containers of compose.yaml) starts sandboxed code as this user, so files only
# root may read (keys, other bundles, the CA key) stay unreadable even where a mount shows them; a service that
# runs as another user cannot change users, and its sandboxed code keeps its uid (what it hides stays hidden).
SANDBOX_UID = 65534  # nobody
_DROP_TO_SANDBOX_USER = (f"import os, sys; os.setgroups([]); os.setgid({SANDBOX_UID}); os.setuid({SANDBOX_UID}); "
                         "os.execvp(sys.argv[1], sys.argv[1:])")
TEXT_LIMIT = 4000  # characters of a sandbox's text (stderr, output) a caller ever sees


class SandboxUnavailable(UserError):
    """No proved sandbox in this process: agent code may not run (the message says what is missing)."""


# What this process proved at start (`specpilot.canary.require`), the secrets it holds (`scrub`) and the
# paths every sandbox hides (its bundle): set once at a service's start, read by every Sandbox after.
_state: dict = {"proof": None, "secrets": [], "hidden": []}


def proof() -> dict | None:
    """What this process proved (``{"proved": True, ...}``, or the override's record), None before."""
    return _state["proof"]


def mark_proved(record: dict) -> dict:
    _state["proof"] = dict(record)
    return _state["proof"]


def unsafe_override() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


def add_secrets(values: list[str]) -> None:
    """Values `scrub` removes from every text that leaves a sandbox (a bundle's files, keys, seeds)."""
    _state["secrets"] = sorted({*_state["secrets"], *(v for v in values if len(v) >= 6)}, key=len, reverse=True)


def hide_always(path: Path) -> None:
    """A path every sandbox of this process covers with an empty tmpfs (the service's bundle)."""
    if Path(path) not in _state["hidden"]:
        _state["hidden"].append(Path(path))


def scrub(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` from a sandbox as it may reach an event or a log: each secret this process holds (and each
    long line of a multi-line one, a key's body) replaced by ``[secret]``, then cut to its last ``limit``
    characters."""
    for secret in _state["secrets"]:
        text = text.replace(secret, "[secret]")
        for line in secret.splitlines():
            if len(line.strip()) >= 16:
                text = text.replace(line.strip(), "[secret]")
    return text[-limit:]


@dataclass(frozen=True)
class Limits:
    wall_s: float = 600.0
    memory_bytes: int = 8 << 30
    pids: int = 256


class SandboxError(RuntimeError):
    pass


class _Cgroup:
    """A cgroup for one sandbox (v2 unified or v1 pids+memory), or nothing where not writable."""

    def __init__(self, limits: Limits):
        self.dirs: list[Path] = []
        name = f"specpilot-sbx-{uuid.uuid4().hex[:12]}"
        root = Path("/sys/fs/cgroup")
        try:
            if (root / "cgroup.controllers").exists():  # v2
                d = root / name
                d.mkdir()
                self.dirs.append(d)
                (d / "pids.max").write_text(str(limits.pids))
                (d / "memory.max").write_text(str(limits.memory_bytes))
            else:  # v1
                for ctrl, fname, value in (("pids", "pids.max", limits.pids),
                                           ("memory", "memory.limit_in_bytes", limits.memory_bytes)):
                    d = root / ctrl / name
                    d.mkdir()
                    self.dirs.append(d)
                    (d / fname).write_text(str(value))
        except OSError:
            self.remove()
            self.dirs = []

    @property
    def active(self) -> bool:
        return bool(self.dirs)

    def join_self(self) -> None:
        """Move the calling process into the cgroup (runs in the child before exec)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return out

    def _counter(self, name: str, files: tuple[str, ...]) -> int:
        """The first value found of a memory counter: a ``name value`` line of ``files`` (v2
        ``memory.events``, v1 ``memory.oom_control``), or a file holding one number named ``name``."""
        for d in self.dirs:
            if (d / name).exists():
                try:
                    return int((d / name).read_text() or 0)
                except (OSError, ValueError):
                    continue
            for f in files:
                try:
                    counters = dict(line.partition(" ")[::2] for line in (d / f).read_text().splitlines())
                except OSError:
                    continue
                if name in counters:
                    return int(counters[name] or 0)
        return 0

    def oom_killed(self) -> bool:
        return self._counter("oom_kill", ("memory.events", "memory.oom_control")) > 0

    def hit_memory_limit(self) -> bool:
        """Whether usage ever reached the limit (v1 ``memory.failcnt``, v2 ``memory.events`` max): a process
        thrashing there may pass the wall limit before the kernel's OOM killer fires. (Page cache
        reclaimed at the limit counts too; a sandbox whose reads alone fill its limit is rare.)"""
        return self._counter("memory.failcnt", ()) > 0 or self._counter("max", ("memory.events",)) > 0

    def kill_all(self) -> None:
        for _ in range(20):
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def copy_untrusted(src: Path, dest: Path, max_bytes: int = 4 << 30, max_files: int = 200_000) -> dict:
    """Copy a tree a sandboxed process wrote (a compile cache: hostile input) into ``dest`` (new): folders and
    regular files only, each opened relative to its already-opened folder without following any link, so a
    planted symbolic link (to a bundle, a seed) or a special file is left out, not followed; at most
    ``max_files`` files and ``max_bytes`` bytes (`SandboxError` past either, ``dest`` removed); each file keeps
    its access and modification times. Returns ``{"files", "bytes", "skipped"}`` (``skipped``: links and
    special files left out)."""
    counts = {"files": 0, "bytes": 0, "skipped": 0}
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

    def copy_dir(src_fd: int, out: Path) -> None:
        out.mkdir(mode=0o700)
        for entry in os.scandir(src_fd):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                fd = os.open(entry.name, nofollow | os.O_DIRECTORY, dir_fd=src_fd)
                try:
                    copy_dir(fd, out / entry.name)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                counts["files"] += 1
                counts["bytes"] += st.st_size
                if counts["files"] > max_files or counts["bytes"] > max_bytes:
                    raise SandboxError(f"{src} holds more than {max_files} files or {max_bytes >> 20} MiB: not copied")
                fd = os.open(entry.name, nofollow, dir_fd=src_fd)
                with os.fdopen(fd, "rb") as f, open(out / entry.name, "xb") as g:
                    shutil.copyfileobj(f, g)
                    g.flush()  # before the times are set: a later write would stamp its own
                    # the same times: a build tool reads them (ninja rebuilds an output whose time differs
                    # from the one its log recorded: every worker rebuilt a cached C++ extension, 17 s)
                    os.utime(g.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                counts["skipped"] += 1

    root = os.open(src, nofollow | os.O_DIRECTORY)
    Path(dest).parent.mkdir(parents=True, exist_ok=True)  # the controller's own folders, as copytree made them
    try:
        copy_dir(root, Path(dest))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        os.close(root)
    return counts


def _entries(tree: Path):
    """``(path, lstat)`` of ``tree`` and everything under it, without following a link (a sandboxed run may
    have left some)."""
    for root, dirs, files in os.walk(tree, followlinks=False):
        for name in [".", *dirs, *files]:
            path = os.path.join(root, name)
            yield path, os.lstat(path)


def _hand_over(folder: Path) -> None:
    """Make ``folder`` (a compile cache: host-made, sandbox-written) the sandbox user's to write."""
    folder.mkdir(parents=True, exist_ok=True)
    for path, _ in _entries(folder):
        os.chown(path, SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)


def _open_to_all(tree: Path) -> None:
    """Let every user read ``tree`` (the code and models a root service shows its sandbox): folders it made
    private (``mkdtemp``'s 0700) would stop the sandbox user at the mount."""
    if not tree.is_dir():
        return
    for path, st in _entries(tree):
        want = 0o005 if stat.S_ISDIR(st.st_mode) else 0o004
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & want != want:
            os.chmod(path, stat.S_IMODE(st.st_mode) | want)


def bwrap_available() -> bool:
    return shutil.which("bwrap") is not None


@dataclass
class Sandbox:
    """One isolated process tree over a candidate's source tree."""

    src: Path
    models: Path
    hide: list[Path] = field(default_factory=list)
    # Paths outside the checkout the system reads (a checkpoint folder, a drafter's weights, the
    # deployment's file: `Deployment.external_paths`), shown read-only where /tmp's tmpfs would hide them.
    visible: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # more environment (`Deployment.sandbox_env`)
    device: str = "cpu"
    limits: Limits = field(default_factory=Limits)
    threads: int | None = None
    cpus: tuple[int, ...] | None = None  # CPU affinity of every process in the sandbox (None: inherited)
    # Triton's cache and torch's C++ extension builds (specpilot.kernels.cpu_gemm), writable (None: an empty /tmp)
    compile_cache: Path | None = None
    proof_run: bool = False  # the canary's own run (`specpilot.canary.prove`), before anything is proved

    def __post_init__(self) -> None:
        proved = proof()
        if self.proof_run:
            self.isolated = bwrap_available()
        elif proved is None:
            raise SandboxUnavailable("no sandbox was proved in this process, so agent code may not run: a service "
                                     "proves one at start (specpilot.canary.require)")
        else:
            self.isolated = bool(proved.get("proved"))
        self._cgroup = _Cgroup(self.limits)
        self._procs: list[subprocess.Popen] = []

    def describe(self) -> dict:
        proved = proof() or {}
        return {"bubblewrap": self.isolated, "proved": bool(proved.get("proved")),
                **({"override": proved["override"]} if "override" in proved else {}),
                "user": f"nobody ({SANDBOX_UID})" if self.drops_to_sandbox_user else "the service's own",
                "cgroup": self._cgroup.active, "network": "none" if self.isolated else "host",
                "filesystem": "read-only, private /tmp" if self.isolated else "host (temporary cwd only)",
                "pids_max": self.limits.pids, "memory_bytes": self.limits.memory_bytes, "wall_s": self.limits.wall_s,
                "cpus": list(self.cpus) if self.cpus else "inherited"}

    def _env(self) -> dict[str, str]:
        # PYTHONPATH: the harness (`specpilot`) of the checkout this process runs from, whatever the
        # interpreter's install points at (services may run from another checkout, e.g. a stock copy);
        # SPECPILOT_RUNTIME: the runtime (`specpilot.engine`, `specpilot.kernels`) is the candidate's own
        # (`specpilot.layout`).
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO_ROOT.resolve()),
               RUNTIME_ENV: SANDBOX_SRC if self.isolated else str(Path(self.src).resolve())}
        env.update(self.env)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        if self.compile_cache:
            cache = SANDBOX_COMPILE_CACHE if self.isolated else str(self.compile_cache)
            env.update(TRITON_CACHE_DIR=cache, TORCH_EXTENSIONS_DIR=f"{cache}/torch_extensions")
        return env

    @property
    def drops_to_sandbox_user(self) -> bool:
        """Whether sandboxed code runs as `SANDBOX_UID` (an isolated sandbox started by root)."""
        return self.isolated and os.geteuid() == 0

    def argv(self, cmd: list[str]) -> list[str]:
        if not self.isolated:
            return cmd
        drop = self.drops_to_sandbox_user
        # by its full path: bubblewrap starts with the scrubbed environment, whose PATH may not hold it
        args = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/"]
        # /tmp is the sandbox's own (writable by its user); root's home is hidden whole when its user is not root
        covered = ("/tmp/", "/root/") if drop else ("/tmp/",)
        args += ["--perms", "01777", "--tmpfs", "/tmp"] + (["--tmpfs", "/root"] if drop else [])
        # The interpreter, its environment and the project (editable install) may live under /tmp (a CI clone)
        # or root's home (pyenv): show them again, read-only, before hiding the data directory.
        for keep in sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), REPO_ROOT.resolve(),
                            Path(sys.executable).resolve().parent,
                            *(Path(v).resolve() for v in self.visible if Path(v).exists())}):
            if str(keep).startswith(covered):
                # the folders above it in the tmpfs, made open to the sandbox user (bubblewrap makes them 0700)
                top = Path("/", keep.parts[1])
                for above in sorted(d for d in keep.parents if d.is_relative_to(top) and d != top):
                    args += ["--perms", "0755", "--dir", str(above)]
                args += ["--ro-bind", str(keep), str(keep)]
        # The host's own bundle (its certificate's key; the controller's split seed) wherever it lies;
        # a path inside one already hidden is left alone (its mount point would show its parents).
        own_bundle = [Path(b)] if (b := os.environ.get("SPECPILOT_BUNDLE")) else []
        hidden: list[Path] = []
        for h in sorted({Path(h).resolve() for h in [*self.hide, *own_bundle, *_state["hidden"]] if Path(h).exists()}):
            if not any(h.is_relative_to(outer) for outer in hidden):
                hidden.append(h)
                args += ["--tmpfs", str(h)]
        for v in self.visible:  # a hidden path inside a visible one stays hidden (its tmpfs comes after)
            if any(Path(v).resolve().is_relative_to(h) for h in hidden):
                raise ValueError(f"{v} lies inside {next(h for h in hidden if Path(v).resolve().is_relative_to(h))}, "
                                 "which sandboxes hide (a data directory or a bundle): move it elsewhere")
        args += ["--ro-bind", str(Path(self.src).resolve()), SANDBOX_SRC]
        if Path(self.models).exists():  # its mount point's parent, made open to the sandbox user (else 0700)
            args += ["--perms", "0755", "--dir", SANDBOX_DATA]
            args += ["--ro-bind", str(Path(self.models).resolve()), f"{SANDBOX_DATA}/models"]
        if self.compile_cache:
            args += ["--bind", str(Path(self.compile_cache).resolve()), SANDBOX_COMPILE_CACHE]
        args += ["--dev-bind", "/dev", "/dev"] if self.device.startswith("cuda") else ["--dev", "/dev"]
        args += ["--proc", "/proc", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                 "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--chdir", SANDBOX_SRC, "--clearenv"]
        if drop:  # only to change users: setuid to nobody clears every capability
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            cmd = [sys.executable, "-I", "-c", _DROP_TO_SANDBOX_USER, *cmd]
        for k, v in self._env().items():
            args += ["--setenv", k, v]
        return args + cmd

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        cgroup, limits, cuda, cpus = self._cgroup, self.limits, self.device.startswith("cuda"), self.cpus

        def preexec() -> None:
            cgroup.join_self()
            if cpus:  # inherited by every thread and child the worker starts
                os.sched_setaffinity(0, cpus)
            if not cgroup.active and not cuda:
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))

        if self.drops_to_sandbox_user:
            for tree in (self.src, self.models):  # what it runs and reads, shown read-only
                _open_to_all(Path(tree))
            if self.compile_cache:
                _hand_over(Path(self.compile_cache))
        cwd = None if self.isolated else str(self.src)
        # bubblewrap gets the scrubbed environment too: its own /proc/<pid>/environ is readable from inside
        proc = subprocess.Popen(self.argv(cmd), cwd=cwd, env=self._env(), preexec_fn=preexec, start_new_session=True,
                                **kw)
        self._procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float | None = None, tail: int = 4000) -> dict:
        """Run to completion; returns returncode, the last ``tail`` characters of its output, and whether
        it timed out or was OOM-killed."""
        proc = self.popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        note = ""
        try:
            out, _ = proc.communicate(timeout=timeout or self.limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            note = self.memory_note()
            self.kill()
            out, _ = proc.communicate()
            timed_out = True
        return {"returncode": proc.returncode, "output": scrub(out.decode(errors="replace"), tail), "timed_out": timed_out,
                "oom_killed": self.oom_killed(), "memory_note": note}

    def oom_killed(self) -> bool:
        """Whether the sandbox's cgroup killed a process for memory."""
        return self._cgroup.oom_killed()

    def memory_note(self) -> str:
        """Why a timed-out sandbox may have been slow, for its message: out of memory where the cgroup
        killed something or usage reached the limit (reclaim at the limit can outlast the wall limit)."""
        if self.oom_killed():
            return "; out of memory: the cgroup killed a process"
        if self._cgroup.hit_memory_limit():
            return f"; out of memory: it reached its {self.limits.memory_bytes >> 20} MiB limit"
        return ""

    def _signal_all(self, sig: int) -> None:
        """``sig`` to every process of the sandbox: its cgroup's (which no process can leave) and, where
        there is no cgroup, the process groups it started (a process that made its own session escapes)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in self._cgroup.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        """Stop every process of the sandbox (``SIGSTOP`` cannot be caught), so it takes no CPU while
        another system is timed. GPU work it queued before it was stopped can still run."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._cgroup.kill_all()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.kill()
        self._cgroup.remove()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """``python -m specpilot.harness.worker`` of one system inside a sandbox, driven over a pipe.

    The controller's clock measures each request from send to reply; the worker only returns tokens.
    """

    def __init__(self, sandbox: Sandbox, python: str, deployment: str, options: dict, device: str = "cpu",
                 ready_timeout_s: float = 300.0):
        cmd = [python, "-m", "specpilot.harness.worker", "--deployment", deployment, "--options", json.dumps(options),
               "--device", device, "--data-dir", SANDBOX_DATA if sandbox.isolated else str(Path(sandbox.models).parent)]
        if sandbox.threads:
            cmd += ["--threads", str(sandbox.threads)]
        self.sandbox = sandbox
        started = time.perf_counter()
        self.proc = sandbox.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        reply = self._read(ready_timeout_s)
        if not reply.get("ready"):
            raise WorkerFailed(f"worker did not start: {scrub(str(reply.get('error') or ''), 2000) or self.stderr_tail()}")
        # Untimed work before the first timed request (start-up, and the warm-up the caller adds): bounded
        # by the controller, since work moved here is work the timed requests no longer show.
        self.untimed_s = time.perf_counter() - started

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line.decode(errors="replace"))
            del self._stderr[:-50]

    def stderr_tail(self) -> str:
        return scrub("".join(self._stderr[-15:]).strip(), 2000) or f"exit code {self.proc.poll()}"

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            note = self.sandbox.memory_note()  # read before the kill, which may add an OOM event of its own
            self.sandbox.kill()
            raise WorkerFailed(f"worker gave no answer within {timeout:.0f} s (killed{note})") from None
        if line is None:
            oom = " (out of memory: the cgroup killed it)" if self.sandbox.oom_killed() else ""
            raise WorkerFailed(f"worker exited{oom}: {self.stderr_tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise WorkerFailed(f"worker broke the protocol: {scrub(repr(line), 200)}") from None
        if not isinstance(reply, dict):
            raise WorkerFailed(f"worker broke the protocol: {scrub(repr(line), 200)}")
        return reply

    def request(self, obj: dict, timeout: float = 300.0) -> tuple[dict, float]:
        """Send one protocol request; the reply and the seconds from send to reply (controller clock)."""
        msg = (json.dumps(obj) + "\n").encode()
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(msg)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(f"worker is gone: {self.stderr_tail()}") from None
        reply = self._read(timeout)
        elapsed = time.perf_counter() - t0
        if "error" in reply:
            raise WorkerFailed(f"worker error: {scrub(str(reply['error']), 2000)}")
        return reply, elapsed

    def generate(self, prompt_ids: list[int], max_new_tokens: int, timeout: float = 300.0) -> tuple[list[int], float]:
        """Tokens and seconds measured by the controller's clock, send to reply."""
        reply, elapsed = self.request({"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens}, timeout)
        tokens = reply.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise WorkerFailed("worker returned something other than a list of token ids")
        return tokens, elapsed

    def serve(self, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
              timeout: float = 300.0) -> tuple[list[list[int]], float]:
        """A closed-loop load at ``concurrency`` (a batched deployment's worker): each prompt's tokens, in
        order, and the seconds of the whole load by the controller's clock, send to reply."""
        reply, elapsed = self.request({"load": {"requests": prompts, "max_new_tokens": max_new_tokens,
                                                "concurrency": concurrency}}, timeout)
        outputs = reply.get("outputs")
        if (not isinstance(outputs, list) or len(outputs) != len(prompts)
                or not all(isinstance(o, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in o)
                           for o in outputs)):
            raise WorkerFailed(f"worker returned something other than {len(prompts)} lists of token ids")
        return outputs, elapsed

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sandbox.kill()
