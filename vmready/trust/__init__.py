"""Certificates and mutual TLS: the daemon's and each instance's identities."""

from vmready.trust.certs import (
    SERVER_CERT,
    SERVER_KEY,
    CertificateError,
    CertificatePair,
    ensure_certificate_pair,
    ensure_server_certificate,
    fingerprint,
    generate,
    is_valid_at,
    write_config_drive,
    write_private,
)
from vmready.trust.tls import (
    MutualServerTLS,
    PinnedServerTLS,
    ServerCertificateProbe,
    connect_reason,
    peer_certificate_pem,
    server_tls_factory,
    ssl_reason,
)
from vmready.trust.tokens import TokenError, TrustToken, hash_secret, normalize_fingerprint

__all__ = [
    "SERVER_CERT",
    "SERVER_KEY",
    "CertificateError",
    "CertificatePair",
    "MutualServerTLS",
    "PinnedServerTLS",
    "ServerCertificateProbe",
    "TokenError",
    "TrustToken",
    "connect_reason",
    "ensure_certificate_pair",
    "ensure_server_certificate",
    "fingerprint",
    "generate",
    "hash_secret",
    "is_valid_at",
    "normalize_fingerprint",
    "peer_certificate_pem",
    "server_tls_factory",
    "ssl_reason",
    "write_config_drive",
    "write_private",
]
