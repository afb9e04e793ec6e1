"""The server the guest API is measured against: a plain twisted.web Site answering the same
bytes to every GET, behind the daemon's own ``MutualServerTLS``, and nothing else."""

from __future__ import annotations

import os

from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from vmready.trust import SERVER_CERT, SERVER_KEY, CertificatePair, MutualServerTLS, fingerprint


class FixedAnswer(Resource):
    """Every GET answers the same JSON bytes."""

    isLeaf = True

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.body = body

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        return self.body


def bare_site(data_dir: str, client_cert_path: str, body: bytes) -> TLSMemoryBIOFactory:
    """``body`` for every GET, over mutual TLS with the daemon's certificate (in ``data_dir``),
    accepting exactly the client certificate in ``client_cert_path``."""
    with open(os.path.join(data_dir, SERVER_CERT), "rb") as c:
        cert_pem = c.read()
    with open(os.path.join(data_dir, SERVER_KEY), "rb") as k:
        key_pem = k.read()
    with open(client_cert_path, "rb") as f:
        allowed = fingerprint(f.read())
    tls = MutualServerTLS(
        CertificatePair(cert_pem, key_pem), lambda pem: fingerprint(pem) == allowed
    )
    return TLSMemoryBIOFactory(tls, False, Site(FixedAnswer(body)))
