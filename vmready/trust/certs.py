"""Certificates for the guest API: the daemon's server certificate and one per instance.

The daemon's certificate and key are created at first start and kept in the
data dir (``server.crt``, ``server.key`` with mode 0600).  Every instance gets
its own self-signed client certificate at creation; the daemon remembers its
SHA-256 fingerprint and identifies a caller by that alone, as LXD does.  The
agent pins the daemon's certificate the same way.

The guest API asks who a certificate is and whether it is valid now at every
handshake and every request; ``certificate_facts`` parses each certificate
once and remembers the answer (a pure function of the bytes: nothing to
invalidate).
"""

from __future__ import annotations

import datetime
import functools
import os
import tempfile

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"
DEFAULT_DAYS = 3650
# Certificates whose facts are remembered: one per instance is plenty for thousands.
FACTS_CACHE_SIZE = 4096


@attrs.frozen
class CertificatePair:
    """A PEM certificate, its PEM private key, and the certificate's fingerprint."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the DER certificate, lower-case hex."""
        return fingerprint(self.cert_pem)


@attrs.frozen
class CertificateFacts:
    """What the guest API asks of a certificate: who it is, and when it is valid."""

    fingerprint: str
    not_valid_before: datetime.datetime
    not_valid_after: datetime.datetime

    def is_valid_at(self, when: datetime.datetime) -> bool:
        """Whether ``when`` falls inside the validity period."""
        return self.not_valid_before <= when <= self.not_valid_after


@functools.lru_cache(maxsize=FACTS_CACHE_SIZE)
def certificate_facts(cert_pem: bytes) -> CertificateFacts:
    """A PEM certificate's fingerprint and validity period, parsed once per distinct certificate.

    ValueError for bytes that are not a PEM certificate (never remembered), a
    version X.509 does not have included (``cryptography`` raises its own
    ``InvalidVersion`` for that, which OpenSSL lets through a handshake).
    The same bytes always mean the same facts, so the cache needs no
    invalidation: revoking a certificate is the store's business, not this.
    """
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except x509.InvalidVersion as e:
        raise ValueError(f"not a certificate X.509 knows: {e}") from None
    return CertificateFacts(
        certificate.fingerprint(hashes.SHA256()).hex(),
        certificate.not_valid_before_utc,
        certificate.not_valid_after_utc,
    )


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of a PEM certificate's DER form, lower-case hex (how callers are identified)."""
    return certificate_facts(cert_pem).fingerprint


def generate(
    common_name: str, days: int = DEFAULT_DAYS, now: datetime.datetime | None = None
) -> CertificatePair:
    """A fresh self-signed ECDSA P-384 certificate valid for ``days`` from ``now``."""
    if days <= 0:
        raise ValueError("a certificate must be valid for at least one day")
    now = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA384())
    )
    return CertificatePair(
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def is_valid_at(cert_pem: bytes, when: datetime.datetime) -> bool:
    """Whether ``when`` falls inside the certificate's validity period."""
    return certificate_facts(cert_pem).is_valid_at(when)


def write_private(path: str, data: bytes) -> None:
    """Write a secret atomically, readable by the owner only (0600) from the first byte."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


class CertificateError(Exception):
    """The daemon's certificate files cannot be used; the message says what to do."""


def _load_pair(cert_path: str, key_path: str) -> CertificatePair:
    """The pair in the data dir, checked: readable, PEM, and the key is the certificate's."""
    try:
        with open(cert_path, "rb") as c, open(key_path, "rb") as k:
            pair = CertificatePair(c.read(), k.read())
        certificate = x509.load_pem_x509_certificate(pair.cert_pem)
        key = serialization.load_pem_private_key(pair.key_pem, password=None)
    except OSError as e:
        raise CertificateError(f"cannot read {e.filename}: {e.strerror}") from e
    except ValueError as e:
        raise CertificateError(
            f"{cert_path} or {key_path} is not a PEM certificate and key: {e}"
        ) from e
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, raw) != (
        certificate.public_key().public_bytes(serialization.Encoding.DER, raw)
    ):
        raise CertificateError(f"{key_path} is not the key of {cert_path}")
    return pair


def ensure_server_certificate(data_dir: str, common_name: str = "vmready") -> CertificatePair:
    """The daemon's certificate: loaded from the data dir, or created there at first start.

    Half a pair is refused (CertificateError), never replaced: every agent pins
    ``server.crt``, so a new pair must be a deliberate choice (remove both files).
    """
    return ensure_certificate_pair(
        os.path.join(data_dir, SERVER_CERT),
        os.path.join(data_dir, SERVER_KEY),
        common_name,
        "every agent pins this certificate",
    )


def ensure_certificate_pair(
    cert_path: str, key_path: str, common_name: str, why_keep: str
) -> CertificatePair:
    """The pair at these paths, or a new one made there; the key is kept 0600.

    Half a pair is refused (CertificateError naming ``why_keep``, the reason
    the certificate matters), never replaced.
    """
    have_cert, have_key = os.path.exists(cert_path), os.path.exists(key_path)
    if have_cert and have_key:
        pair = _load_pair(cert_path, key_path)
        os.chmod(key_path, 0o600)
        return pair
    if have_cert or have_key:
        present, missing = (cert_path, key_path) if have_cert else (key_path, cert_path)
        raise CertificateError(
            f"{present} exists but {missing} is missing: restore it ({why_keep}), "
            f"or remove {present} too to issue a new pair"
        )
    pair = generate(common_name)
    write_private(key_path, pair.key_pem)
    write_private(cert_path, pair.cert_pem)
    os.chmod(cert_path, 0o644)
    return pair


def write_config_drive(directory: str, client: CertificatePair, server_cert_pem: bytes) -> None:
    """What the guest's agent needs, laid out as a config drive would hand it over.

    ``agent.crt`` and ``agent.key`` (0600) are the instance's client identity;
    ``server.crt`` is the daemon's certificate, which the agent pins.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_private(os.path.join(directory, "agent.key"), client.key_pem)
    write_private(os.path.join(directory, "agent.crt"), client.cert_pem)
    write_private(os.path.join(directory, "server.crt"), server_cert_pem)
