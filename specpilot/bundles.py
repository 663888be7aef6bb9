"""One bundle per host: what a service (or the server, or the admin) needs to join, and nothing more.

A bundle is a folder that ``specpilot init`` writes under ``DATA/bundles/<name>/``:

- ``bundle.json``: ``{"name", "nats", "version"}``: whose bundle it is, the server URL to dial (a
  ``--nats`` flag overrides it) and the SpecPilot version that made it;
- ``ca.pem``: the installation's certificate authority, the only one this host trusts;
- ``cert.pem`` and ``key.pem`` (0600): this host's certificate. A client's subject is its identity on
  the server (`tls.user_of`); the server's names every host or address in ``--host``;
- the controller's alone: ``split_seed`` (0600), the secret seed of the dev/sealed split.

The CA's key stays in ``DATA/pki`` on the host that ran ``init``; no bundle carries it, so no host but
that one can issue an identity. `create` is idempotent (existing bundles are kept); ``renew`` makes a new
CA and issues every bundle from it (keeping the split seed), so every old bundle stops working at once: the
server of the renewed installation trusts no certificate the old CA issued (a leaked key is revoked). `Bundle.load` checks a folder before anything
starts: the files, whose bundle it is, and that its certificate is in force and from its CA.
"""

from __future__ import annotations

import json
import secrets
import shutil
import ssl
from dataclasses import dataclass
from pathlib import Path

from specpilot import __version__, subjects, tls
from specpilot.errors import UserError
from specpilot.schema import SERVICES

SERVER = "server"
CLIENTS: tuple[str, ...] = (*SERVICES, subjects.ADMIN)
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
SPLIT_SEED = "split_seed"


class BundleError(UserError):
    pass


def bundles_dir(data: Path) -> Path:
    return Path(data) / "bundles"


def bundle_path(data: Path, name: str) -> Path:
    return bundles_dir(data) / name


def pki_dir(data: Path) -> Path:
    return Path(data) / "pki"


@dataclass(frozen=True)
class Bundle:
    path: Path
    name: str
    nats: str
    version: str
    listen: str = ""  # the server's bundle: HOST:PORT it listens on

    @property
    def ca(self) -> Path:
        return self.path / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.path / "cert.pem"

    @property
    def key(self) -> Path:
        return self.path / "key.pem"

    @property
    def user(self) -> str:
        """The NATS user this bundle's certificate maps to."""
        return tls.user_of(self.name)

    @property
    def split_seed(self) -> Path:
        return self.path / SPLIT_SEED

    def context(self) -> ssl.SSLContext:
        return tls.context(self.ca, self.cert, self.key)

    @classmethod
    def load(cls, path: Path | str, expect: str | None = None) -> Bundle:
        """The bundle in ``path``, checked; ``expect``: the name it must carry (a service's own)."""
        path = Path(path)
        meta = path / "bundle.json"
        try:
            raw = json.loads(meta.read_text())
            bundle = cls(path=path, name=str(raw["name"]), nats=str(raw.get("nats", "")),
                         version=str(raw.get("version", "")), listen=str(raw.get("listen", "")))
        except FileNotFoundError:
            raise BundleError(f"no bundle at {path} ({meta} is missing): run `specpilot init --data DIR` and copy "
                              "this host its own DIR/bundles/<name> folder, or `specpilot up` for one machine") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise BundleError(f"{meta} is not a bundle made by `specpilot init` ({exc})") from None
        if expect is not None and bundle.name != expect:
            raise BundleError(f"the bundle at {path} belongs to {bundle.name!r}, not {expect!r}: give each service "
                              f"its own bundle (DIR/bundles/{expect})")
        if not bundle.key.exists():
            raise BundleError(f"{bundle.key} is missing: copy this host's whole bundle folder made by `specpilot init`")
        tls.check(bundle.cert, bundle.ca)
        if bundle.name != SERVER and tls.subject_name(bundle.cert) != bundle.name:
            raise BundleError(f"the certificate in {path} is {tls.subject_name(bundle.cert)!r}'s, not {bundle.name!r}'s")
        if bundle.name == "controller" and not bundle.split_seed.exists():
            raise BundleError(f"the controller's bundle {path} has no {SPLIT_SEED}: copy the whole folder `specpilot "
                              "init` made (without it the sealed split would change)")
        return bundle


def _write_bundle(dest: Path, name: str, nats: str, listen: str = "") -> None:
    meta = {"name": name, "nats": nats, "version": __version__} | ({"listen": listen} if listen else {})
    (dest / "bundle.json").write_text(json.dumps(meta, indent=2))


def create(data: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS, port: int = 4222, renew: bool = False,
           listen: str = "0.0.0.0") -> Path:
    """The CA (``DATA/pki``) and every bundle (``DATA/bundles/<name>``) of one installation.

    ``hosts``: the names and addresses clients dial the server by (its certificate names them all;
    the first is the URL in every client bundle); ``listen``: the address the server binds. Existing
    bundles are kept unless ``renew``, which makes a new CA first (every old bundle is then refused) and
    issues every bundle from it. A controller bundle takes an existing ``DATA/controller/split_seed`` (a data
    directory from before bundles), so the split stays."""
    data = Path(data)
    hosts = tuple(dict.fromkeys(hosts)) or DEFAULT_HOSTS
    pki = pki_dir(data)
    if renew or not (pki / "ca.pem").exists():
        tls.create_ca(pki)
    url = f"tls://{hosts[0]}:{port}"
    for name in (SERVER, *CLIENTS):
        dest = bundle_path(data, name)
        if (dest / "bundle.json").exists() and not renew:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pki / "ca.pem", dest / "ca.pem")
        tls.issue(pki, dest, name, hosts=hosts if name == SERVER else ())
        if name == "controller" and not (dest / SPLIT_SEED).exists():
            legacy = data / "controller" / SPLIT_SEED
            seed = legacy.read_text().strip() if legacy.exists() else str(secrets.randbits(62))
            tls.write_private(dest / SPLIT_SEED, seed.encode())
        _write_bundle(dest, name, url, listen=f"{listen}:{port}" if name == SERVER else "")
    return bundles_dir(data)
