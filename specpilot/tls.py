"""The certificates of one SpecPilot installation, made with the `cryptography` library.

Contract:
- `create_ca(dir)` writes ``ca.pem`` and ``ca.key`` (mode 0600): an EC P-256 certificate authority
  valid for ``CA_DAYS``. Its key stays on the host that ran ``specpilot init``; no bundle holds it.
- `issue(ca_dir, dest, name, hosts=())` writes ``dest/cert.pem`` and ``dest/key.pem`` (0600), signed
  by that CA and valid for ``LEAF_DAYS``. With ``hosts`` it is a server certificate (every host name
  or IP address a client may dial is a subject alternative name); without, a client certificate whose
  subject is ``CN=<name>,O=SpecPilot`` (`user_of`): the NATS server maps that subject to the user
  (``verify_and_map``), so a service's identity is its key, never a password on the wire.
- `check(cert, ca)` raises `TlsError` (what is wrong, with what to do) for a certificate that is
  missing, expired, not yet valid or not signed by ``ca``; `subject_name(cert)` reads the CN.
- `context(ca, cert, key)` is the client's `ssl.SSLContext`: it trusts only ``ca`` and presents the
  certificate.

Nothing here opens a connection or knows about NATS subjects.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specpilot.errors import UserError

ORGANISATION = "SpecPilot"
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest leaf lifetime common TLS clients accept


class TlsError(UserError):
    pass


def user_of(name: str) -> str:
    """The RFC 2253 subject of ``name``'s client certificate: the NATS user it maps to."""
    return f"CN={name},O={ORGANISATION}"


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only (the mode is set before any byte lands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def create_ca(ca_dir: Path, days: int = CA_DAYS) -> Path:
    """A new certificate authority in ``ca_dir`` (``ca.pem``, ``ca.key``); returns ``ca.pem``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANISATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"{ORGANISATION} CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    write_private(ca_dir / "ca.key", _key_pem(key))
    (ca_dir / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ca_dir / "ca.pem"


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise TlsError(f"no certificate authority in {ca_dir} ({exc.filename} is missing): run `specpilot init` "
                       "on the host that keeps the CA") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{ca_dir / 'ca.key'} is not an EC key made by `specpilot init`")
    return cert, key


def issue(ca_dir: Path, dest: Path, name: str, hosts: tuple[str, ...] = (), days: int = LEAF_DAYS,
          valid_from: dt.datetime | None = None) -> Path:
    """A certificate for ``name`` signed by the CA in ``ca_dir``, written to ``dest/{cert,key}.pem``.

    ``hosts``: a server certificate for these DNS names and IP addresses; empty: a client
    certificate. ``valid_from`` (default now) lets tests make expired ones."""
    ca_cert, ca_key = _load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    start = valid_from or _now() - dt.timedelta(minutes=5)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANISATION),
                                        x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if hosts:
        alt: list[x509.GeneralName] = []
        for h in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        builder = (builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    dest.mkdir(parents=True, exist_ok=True)
    write_private(dest / "key.pem", _key_pem(key))
    (dest / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return dest / "cert.pem"


def subject_name(cert_path: Path) -> str:
    """The common name of the certificate at ``cert_path``."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def check(cert_path: Path, ca_path: Path) -> x509.Certificate:
    """The certificate at ``cert_path``, if it is in force and signed by the CA at ``ca_path``."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        ca = x509.load_pem_x509_certificate(Path(ca_path).read_bytes())
    except FileNotFoundError as exc:
        raise TlsError(f"{exc.filename} is missing: copy this host's whole bundle made by `specpilot init`") from None
    except ValueError as exc:
        raise TlsError(f"{cert_path} or {ca_path} is not a PEM certificate ({exc})") from None
    now = _now()
    if now > cert.not_valid_after_utc:
        raise TlsError(f"certificate {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}: issue new bundles "
                       "with `specpilot init --renew` on the CA's host and copy each host its own")
    if now < cert.not_valid_before_utc:
        raise TlsError(f"certificate {cert_path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: "
                       "is this host's clock right?")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise TlsError(f"certificate {cert_path} was not issued by the CA in {ca_path} (a bundle of another "
                       "installation?): use the bundles `specpilot init` made for this server") from None
    return cert


def context(ca_path: Path, cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """A client context that trusts only ``ca_path`` and presents ``cert_path``/``key_path``."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert_path), str(key_path))
    return ctx
