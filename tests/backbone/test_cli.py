"""The specpilot CLI and service processes: up/status/down, bad input with clear errors, compose."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specpilot import bundles, ledger, natsd
from specpilot.schema import SERVICES
from tests.backbone.helpers import directions, publish_all, wait_for_rows
from tests.conftest import REPO, connect_as, spawn_service

CLI = [sys.executable, "-m", "specpilot.app.cli"]


def run(*args: str, data: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.run([*CLI, *args, "--data", str(data)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


def test_up_status_down(tmp_path):
    data = tmp_path / "d"
    up = run("up", data=data)
    try:
        assert up.returncode == 0, up.stderr
        status = run("status", "--json", data=data)
        found = json.loads(status.stdout)
        assert sorted(s["name"] for s in found) == sorted(SERVICES)
        assert all(s["version"] for s in found)
        # keys are private and per data directory
        for user in (*SERVICES, "admin", "server"):
            assert oct((bundles.bundle_path(data, user) / "key.pem").stat().st_mode & 0o777) == "0o600"
        assert oct((data / "nats" / "nats.conf").stat().st_mode & 0o777) == "0o600"
        # a second `up` finds everything running and starts nothing new
        again = run("up", data=data)
        assert again.returncode == 0
        assert len(json.loads(run("status", "--json", data=data).stdout)) == len(SERVICES)
    finally:
        down = run("down", data=data)
    assert down.returncode == 0
    pids = [int(p.read_text()) for p in (data / "run").glob("*.pid")]
    assert pids == []
    assert natsd.running(data) is None
    assert "no NATS server is running" in run("status", data=data).stderr


def test_dead_nats_server_gets_a_clear_error(tmp_path):
    data = tmp_path / "d"
    bundles.create(data)
    port = natsd.free_port()
    admin = str(bundles.bundle_path(data, "admin"))
    t0 = time.monotonic()
    res = run("status", "--nats", f"tls://127.0.0.1:{port}", "--bundle", admin, "--connect-timeout", "2", data=data)
    assert res.returncode == 2
    assert "no NATS server answers" in res.stderr and "specpilot up" in res.stderr
    assert time.monotonic() - t0 < 30
    svc = subprocess.run([sys.executable, "-m", "specpilot.services.master", "--nats", f"tls://127.0.0.1:{port}",
                          "--bundle", str(bundles.bundle_path(data, "master")), "--connect-timeout", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert svc.returncode != 0 and "no NATS server answers" in svc.stderr


def test_wrong_or_missing_bundle(tmp_path, server):
    res = run("status", "--nats", server.url, "--bundle", str(tmp_path / "nope"), data=tmp_path)
    assert res.returncode == 2 and "no bundle at" in res.stderr and "specpilot init" in res.stderr
    # another installation's admin: its certificate is from another CA, so the server is not its server
    other = tmp_path / "other"
    bundles.create(other)
    res = run("status", "--nats", server.url, "--bundle", str(bundles.bundle_path(other, "admin")),
              "--connect-timeout", "3", data=tmp_path)
    assert res.returncode == 2 and "not certified by this bundle's CA" in res.stderr


def test_missing_data_directory(tmp_path):
    res = run("sql", "SELECT 1", data=tmp_path / "never-made")
    assert res.returncode == 2 and "no ledger at" in res.stderr and "specpilot up" in res.stderr


def test_corrupted_ledger_is_reported_and_rebuilt_from_the_stream(server, tmp_path):
    proc = spawn_service(server, "memory")

    async def publish(n):
        b = await connect_as(server, "master")
        ids = await publish_all(b, directions(n))
        await b.close()
        return ids

    ids = asyncio.run(publish(30))
    asyncio.run(wait_for_rows(server, "SELECT count(*) FROM events", 30))
    proc.terminate()
    proc.wait(timeout=20)
    path = ledger.path_in(server.data)
    path.write_bytes(b"this is not a duckdb file" * 100)
    for wal in server.data.glob("ledger.duckdb.wal"):
        wal.unlink()
    crashed = spawn_service(server, "memory")
    assert crashed.wait(timeout=30) != 0
    log = (server.data / "memory.log").read_text()
    assert "corrupted" in log and "replay --rebuild" in log
    res = run("replay", "--rebuild", "--nats", server.url, data=server.data)
    assert res.returncode == 0, res.stderr
    assert list(server.data.glob("ledger.broken-*")), "the broken file is kept aside, not deleted"
    led = ledger.Ledger(server.data, read_only=True)
    assert sorted(r[0] for r in led.con.execute("SELECT event_id FROM events").fetchall()) == sorted(ids)
    assert ledger.verify(led).ok
    led.close()
    res = run("replay", "--stream", "--json", "--nats", server.url, data=server.data)  # from the file: memory is down
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stream"] == {"ok": True, "messages": 30, "recorded": 30, "dead": 0, "missing": [],
                                                "repeated": [], "strays": []}


def test_every_command_has_help():
    for cmd in ([], ["up"], ["status"], ["down"], ["sql"], ["audit"], ["replay"], ["export"], ["init"], ["provision"],
                ["server"]):
        res = subprocess.run([*CLI, *cmd, "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert res.returncode == 0 and "usage:" in res.stdout
    for name in SERVICES:
        res = subprocess.run([sys.executable, "-m", f"specpilot.services.{name}", "--help"], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert res.returncode == 0 and "--nats" in res.stdout and "--bundle" in res.stdout


def test_audit_and_export(server, tmp_path):
    proc = spawn_service(server, "memory")

    async def go():
        b = await connect_as(server, "master")
        root, _ = await b.publish(directions(1)[0])
        sub = await connect_as(server, "subagent")
        from specpilot import schema

        child, _ = await sub.publish(schema.PatchProposed(direction_id="d-0", patch_id="p-9", diff=""), cause=root)
        await b.close()
        await sub.close()
        await wait_for_rows(server, "SELECT count(*) FROM events", 2)
        return root, child

    root, child = asyncio.run(go())
    res = run("audit", child.event_id, "--json", "--nats", server.url, data=server.data)
    assert res.returncode == 0, res.stderr
    trail = json.loads(res.stdout)
    assert [e["event_id"] for e in trail] == [root.event_id, child.event_id]
    assert trail[1]["causation_id"] == root.event_id
    res = run("export", "--parquet", str(tmp_path / "pq"), "--nats", server.url, data=server.data)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "pq" / "events.parquet").stat().st_size > 0
    proc.terminate()
    proc.wait(timeout=20)


def test_compose_gives_each_container_only_its_own_bundle_and_volume():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    svcs = compose["services"]
    assert svcs["nats"]["command"][:2] == ["specpilot", "server"]
    sources: dict[str, list[str]] = {}
    for name, svc in svcs.items():
        for vol in svc.get("volumes", []):
            source, target, *mode = vol.split(":")
            sources.setdefault(source, []).append(name)
            if target == "/run/specpilot/bundle":
                owner = {"nats": "server", "provision": "admin"}.get(name, name)
                assert source == f"./specpilot-init/bundles/{owner}" and mode == ["ro"], (name, vol)
    shared = {src: users for src, users in sources.items() if len(users) > 1}
    assert shared == {}, f"mounted into two containers: {shared}"
    assert not any("pki" in src for src in sources), "the CA's key must stay on the operator's host"
    for name in SERVICES:
        cmd = svcs[name]["command"]
        assert cmd[:3] == ["python", "-m", f"specpilot.services.{name}"]
        assert cmd[cmd.index("--bundle") + 1] == "/run/specpilot/bundle"
        assert cmd[cmd.index("--nats") + 1].startswith("tls://nats:")
        # the command really parses: the module exists and takes these flags
        help_ = subprocess.run([sys.executable, *cmd[1:3], "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert help_.returncode == 0
    # agent code runs only in bubblewrap: the image ships it, and only the two containers that run agent code
    # get the namespaces it needs (each proves its sandbox at start and refuses to start without one)
    assert "bubblewrap" in (REPO / "Dockerfile").read_text()
    confined = {name for name, svc in svcs.items() if "seccomp=unconfined" not in svc.get("security_opt", [])}
    assert set(svcs) - confined == {"controller", "subagent"}


@pytest.mark.parametrize("user", SERVICES)
def test_services_start_alone_with_nats_and_bundle(server, user):
    proc = spawn_service(server, user)

    async def find():
        b = await connect_as(server, "admin")
        for _ in range(100):
            found = [s for s in await b.discover(0.3) if s["name"] == user]
            if found:
                await b.close()
                return found
        await b.close()
        return []

    found = asyncio.run(find())
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert found and found[0]["version"]
