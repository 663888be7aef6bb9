"""Shared fixtures: a real nats-server on a free port with its own data directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from specpilot import bundles, bus, natsd, subjects

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def proved_sandbox(tmp_path_factory):
    """The sandbox proved once in the test process, as a service proves it at start (`canary.require`):
    tests that build a `Sandbox` or run a controller in process need it (no proof, no agent code). Where
    bubblewrap is missing the proof fails and those tests fail with the service's own message."""
    from specpilot import canary, sandbox

    try:
        canary.require(tmp_path_factory.mktemp("canary"))
    except sandbox.SandboxUnavailable:
        pass  # tests that need a sandbox are skipped without bubblewrap, or fail with this message


@pytest.fixture(autouse=True)
def own_machine_cache(tmp_path_factory, monkeypatch):
    """Each test its own machine cache (services it starts inherit it): a noise figure one test's
    controller measured must not be reused by another's (`Evaluator.noise_cached`)."""
    monkeypatch.setenv("SPECPILOT_MACHINE_CACHE", str(tmp_path_factory.mktemp("machine-cache")))


@pytest.fixture
def outside_tmp():
    """A folder outside /tmp (sandboxes get a fresh /tmp, so only a path elsewhere proves a mount hides
    it), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="specpilot-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


@pytest.fixture
def server(data_dir: Path):
    """A provisioned local NATS server (stream + durable consumers) for one test."""
    srv = natsd.start(data_dir)
    asyncio.run(_provision(srv))
    yield srv
    srv.stop()


async def _provision(srv: natsd.LocalServer) -> None:
    b = await connect_as(srv, subjects.ADMIN)
    await bus.provision(b)
    await b.close()


async def connect_as(srv: natsd.LocalServer, user: str) -> bus.Bus:
    return await bus.connect(srv.url, bundles.bundle_path(srv.data, user), connect_timeout_s=10)


def spawn_service(srv: natsd.LocalServer, name: str, module: str | None = None,
                  extra: list[str] | None = None, env: dict[str, str] | None = None,
                  root: Path = REPO) -> subprocess.Popen:
    """Start a service as its own process, exactly as `specpilot up` does (``env``: extra variables;
    ``root``: the checkout it runs from, its stock)."""
    log = open(srv.data / f"{name}.log", "ab")  # noqa: SIM115
    env = dict(os.environ, PYTHONPATH=str(root), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", module or f"specpilot.services.{name}", "--data", str(srv.data), "--nats", srv.url,
         "--bundle", str(bundles.bundle_path(srv.data, name)), *(extra or [])],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
    )


def wait_for_services(srv: natsd.LocalServer, names: set[str], timeout: float = 30.0) -> None:
    """Block until every named service answers micro discovery."""

    async def go() -> None:
        b = await connect_as(srv, subjects.ADMIN)
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while {s["name"] for s in await b.discover(0.3)} < names:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"services {names} did not answer within {timeout} s")
        finally:
            await b.close()

    asyncio.run(go())
