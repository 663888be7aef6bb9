"""Bundles, TLS and identities on a real nats-server: what `specpilot init` writes, who the server lets
in, and the version handshake the master holds every service to."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import ssl
import subprocess
import sys
import time

import nats
import pytest
from cryptography import x509

from specpilot import bundles, bus, handshake, subjects, tls
from specpilot.bundles import Bundle, BundleError
from specpilot.schema import SERVICES
from tests.conftest import REPO, connect_as, spawn_service, wait_for_services


def test_init_writes_one_bundle_per_host_and_nothing_else(tmp_path):
    data = tmp_path / "init"
    res = subprocess.run([sys.executable, "-m", "specpilot.app.cli", "init", "--data", str(data), "--host", "10.9.0.1",
                          "--host", "nats.example", "--listen", "0.0.0.0:4333"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in bundles.bundles_dir(data).iterdir())
    assert names == sorted((*SERVICES, "admin", "server"))
    for name in names:
        folder = bundles.bundle_path(data, name)
        files = sorted(p.name for p in folder.iterdir())
        extra = ["split_seed"] if name == "controller" else []
        assert files == sorted(["bundle.json", "ca.pem", "cert.pem", "key.pem", *extra]), name
        assert oct((folder / "key.pem").stat().st_mode & 0o777) == "0o600"
        b = Bundle.load(folder, expect=name)
        assert b.nats == "tls://10.9.0.1:4333"
    # the CA's key never leaves the init host's pki folder
    assert not [p for p in bundles.bundles_dir(data).rglob("*")
                if p.is_file() and b"PRIVATE KEY" in p.read_bytes() and p.name != "key.pem"]
    assert (bundles.pki_dir(data) / "ca.key").exists()
    server = x509.load_pem_x509_certificate((bundles.bundle_path(data, "server") / "cert.pem").read_bytes())
    alt = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "nats.example" in alt.get_values_for_type(x509.DNSName)
    assert json.loads((bundles.bundle_path(data, "server") / "bundle.json").read_text())["listen"] == "0.0.0.0:4333"
    # idempotent: a second init keeps every bundle (and the split seed); --renew issues new certificates
    seed = (bundles.bundle_path(data, "controller") / "split_seed").read_text()
    cert = (bundles.bundle_path(data, "master") / "cert.pem").read_bytes()
    bundles.create(data, hosts=("10.9.0.1",))
    assert (bundles.bundle_path(data, "master") / "cert.pem").read_bytes() == cert
    old_master = tmp_path / "old-master"
    shutil.copytree(bundles.bundle_path(data, "master"), old_master)
    bundles.create(data, hosts=("10.9.0.1",), renew=True)
    assert (bundles.bundle_path(data, "master") / "cert.pem").read_bytes() != cert
    assert (bundles.bundle_path(data, "controller") / "split_seed").read_text() == seed
    # renewing makes a new CA: an old bundle is no longer trusted by the renewed installation
    new_ca = bundles.bundle_path(data, "server") / "ca.pem"
    assert new_ca.read_bytes() != (old_master / "ca.pem").read_bytes()
    shutil.copyfile(new_ca, old_master / "ca.pem")  # what the renewed server trusts
    with pytest.raises(tls.TlsError, match="not issued by the CA"):
        Bundle.load(old_master)


def test_bad_bundles_are_refused_before_anything_starts(tmp_path):
    data = tmp_path / "d"
    bundles.create(data)
    with pytest.raises(BundleError, match="belongs to 'forcer', not 'master'"):
        Bundle.load(bundles.bundle_path(data, "forcer"), expect="master")
    with pytest.raises(BundleError, match="no bundle at"):
        Bundle.load(tmp_path / "missing")
    keyless = tmp_path / "keyless"
    shutil.copytree(bundles.bundle_path(data, "forcer"), keyless)
    (keyless / "key.pem").unlink()
    with pytest.raises(BundleError, match="key.pem is missing"):
        Bundle.load(keyless)
    # an expired certificate, and one issued by another installation's CA
    expired = tmp_path / "expired"
    shutil.copytree(bundles.bundle_path(data, "master"), expired)
    tls.issue(bundles.pki_dir(data), expired, "master", days=30,
              valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=60))
    with pytest.raises(tls.TlsError, match="expired on .*specpilot init --renew"):
        Bundle.load(expired)
    other = tmp_path / "other"
    bundles.create(other)
    foreign = tmp_path / "foreign"
    shutil.copytree(bundles.bundle_path(data, "master"), foreign)
    shutil.copyfile(bundles.bundle_path(other, "master") / "cert.pem", foreign / "cert.pem")
    with pytest.raises(tls.TlsError, match="not issued by the CA"):
        Bundle.load(foreign)
    # a service given another's bundle says so and exits
    res = subprocess.run([sys.executable, "-m", "specpilot.services.master", "--bundle", str(bundles.bundle_path(data, "forcer")),
                          "--connect-timeout", "1"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode != 0 and "belongs to 'forcer', not 'master'" in res.stderr


def _refused(url: str, ctx: ssl.SSLContext | None) -> str:
    """Try to connect once; return what failed ('' if the server let the client in)."""
    errors: list[str] = []

    async def cb(exc: Exception) -> None:
        errors.append(repr(exc))

    async def go() -> str:
        try:
            nc = await asyncio.wait_for(nats.connect(url.replace("tls://", "nats://") if ctx is None else url, tls=ctx,
                                                     connect_timeout=2, allow_reconnect=False, error_cb=cb), 10)
        except Exception as exc:  # what the client sees differs by failure; any failure is a refusal
            return repr(exc) or "refused"
        await nc.close()
        return ""

    return asyncio.run(go())


def test_the_server_lets_in_only_certificates_of_its_ca(server, tmp_path):
    own = Bundle.load(bundles.bundle_path(server.data, "master"))
    assert _refused(server.url, own.context()) == ""
    # no TLS at all, and TLS without a client certificate
    assert _refused(server.url, None)
    bare = ssl.create_default_context(cafile=str(own.ca))
    assert _refused(server.url, bare)
    # a certificate from another installation's CA, presented to this server
    other = tmp_path / "other"
    bundles.create(other)
    stranger = bundles.bundle_path(other, "master")
    ctx = ssl.create_default_context(cafile=str(own.ca))
    ctx.load_cert_chain(str(stranger / "cert.pem"), str(stranger / "key.pem"))
    assert _refused(server.url, ctx)
    # the same through our own client: refused at once, and said so
    mixed = tmp_path / "mixed"
    shutil.copytree(bundles.bundle_path(server.data, "admin"), mixed)
    for name in ("cert.pem", "key.pem"):
        shutil.copyfile(bundles.bundle_path(other, "admin") / name, mixed / name)
    with pytest.raises(bus.BusError, match="refused the TLS handshake of 'admin'"):
        asyncio.run(bus.connect(server.url, Bundle(path=mixed, name="admin", nats="", version=""), connect_timeout_s=20))
    # a certificate of this CA whose subject maps to no user
    nobody = tmp_path / "nobody"
    tls.issue(bundles.pki_dir(server.data), nobody, "mallory")
    assert "Authorization" in _refused(server.url, tls.context(own.ca, nobody / "cert.pem", nobody / "key.pem"))


def test_a_connect_attempt_is_bounded_even_when_its_work_swallows_a_cancellation():
    """What hung CI for 600 s: nats-py's initial connect, cancelled as an inner ``wait_for`` completed,
    dropped the cancellation (Python 3.11) and kept retrying. ``bus.bounded`` cancels again until the
    work ends; ``asyncio.wait_for`` would wait here for the whole 30 s."""
    stopped: list[str] = []

    async def stubborn() -> str:
        swallowed = False
        for _ in range(300):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                if swallowed:
                    stopped.append("second cancellation")
                    raise
                swallowed = True
        return "ran to the end"

    async def quick() -> str:
        return "done"

    async def main() -> float:
        assert await bus.bounded(quick(), timeout=1.0) == "done"
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await bus.bounded(stubborn(), timeout=0.3)
        return time.monotonic() - began

    assert asyncio.run(main()) < 5.0 and stopped == ["second cancellation"]


def test_mismatches_name_the_service_its_host_and_what_differs():
    own = {"version": "0.5.0+aaa", "stock_tree": "s1", "host": "here"}
    same = {"name": "forcer", "metadata": {"version": "0.5.0+aaa", "stock_tree": "s1", "host": "gpu-2"}}
    other = {"name": "controller", "metadata": {"version": "0.5.0+bbb", "stock_tree": "s1", "host": "gpu-1"}}
    old = {"name": "subagent", "metadata": {}}
    assert handshake.mismatches(own, [same]) == []
    got = handshake.mismatches(own, [same, other, old])
    assert got[0] == "controller on host gpu-1 runs version 0.5.0+bbb (here 0.5.0+aaa)"
    assert got[1].startswith("subagent on host ? runs version unannounced (here 0.5.0+aaa), stock_tree unannounced")


def test_the_master_refuses_to_plan_with_a_service_of_another_checkout(server):
    master = spawn_service(server, "master")
    try:
        wait_for_services(server, {"master"})

        async def go() -> str:
            impostor = await connect_as(server, "forcer")
            meta = dict(handshake.identity(), stock_tree="0123456789abcdef", host="gpu-7")
            svc = await impostor.serve("forcer", "0.0.0", "a forcer of another checkout", {}, metadata=meta)
            admin = await connect_as(server, subjects.ADMIN)
            try:
                await admin.request(subjects.rpc("master", "round"), {"deployment": "tiny-cpu"}, timeout=30)
                return ""
            except Exception as exc:
                return str(exc)
            finally:
                await svc.stop()  # type: ignore[attr-defined]
                await impostor.close()
                await admin.close()

        err = asyncio.run(go())
        assert "refusing to plan" in err and "forcer on host gpu-7 runs stock_tree 0123456789abcdef" in err
    finally:
        master.terminate()
        master.wait(timeout=20)
