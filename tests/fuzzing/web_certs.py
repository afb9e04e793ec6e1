"""Fuzz target for client certificates: who a guest API caller is.

The guest API identifies its caller by the certificate presented in the TLS
handshake, alone: ``MutualServerTLS``'s verify callback decides at the
handshake (``certificate_authorizer``), and every request asks again
(``certificate_identifier`` over ``peer_certificate_pem``), 403 otherwise.
Inputs are certificates made once at import (generating keys per input
would be most of the run): an instance's registered one, one with the same
name never registered, an expired registered one, one of a deleted instance,
the daemon's own, then damaged: a DER byte flipped, the PEM text edited, cut,
doubled, re-wrapped, or noise.  What must hold: only the exact registered
certificate of a live instance, inside its validity period, identifies that
instance, the same way at the handshake and at each request; everything else
is refused (403 with the documented message); nothing raises.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import strategies as st
from OpenSSL import SSL, crypto

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.web_http import WORLDS
from tests.fuzzing.web_mutations import edited
from tests.fuzzing.wire_mutations import noise
from vmready.api.guest import (
    FORBIDDEN_MESSAGE,
    GuestAPI,
    certificate_authorizer,
    certificate_identifier,
    instance_for_certificate,
)
from vmready.domain.model import Forbidden
from vmready.store.sqlite import Store
from vmready.trust.certs import generate
from vmready.trust.tls import MutualServerTLS, peer_certificate_pem

_NOW = datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC)
_LIVE = generate("vmready-agent-web1", now=_NOW)
_STRANGER = generate("vmready-agent-web1", now=_NOW)
_EXPIRED = generate("vmready-agent-old1", days=1, now=_NOW - datetime.timedelta(days=30))
_FUTURE = generate("vmready-agent-new1", now=_NOW + datetime.timedelta(days=30))
_DELETED = generate("vmready-agent-gone1", now=_NOW)
_SERVER = generate("vmready", now=_NOW)

_STORE = Store.open(":memory:")
for _name, _pair in (("web1", _LIVE), ("old1", _EXPIRED), ("new1", _FUTURE), ("gone1", _DELETED)):
    _STORE.instances.create_instance(_name, {}, {})
    _STORE.certificates.set_agent_certificate(_name, _pair.fingerprint)
_STORE.instances.delete_instance("gone1")
_TLS = MutualServerTLS(_SERVER, certificate_authorizer(_STORE.certificates, lambda: _NOW))
_IDENTIFY = certificate_identifier(_STORE.certificates, lambda: _NOW)


def _der(pem: bytes) -> bytes:
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return base64.b64decode(body)


def _pem(der: bytes, label: bytes = b"CERTIFICATE") -> bytes:
    text = base64.encodebytes(der).replace(b"\n", b"")
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return (
        b"\n".join([b"-----BEGIN " + label + b"-----", *lines, b"-----END " + label + b"-----"])
        + b"\n"
    )


_PEMS = [
    _LIVE.cert_pem,
    _STRANGER.cert_pem,
    _EXPIRED.cert_pem,
    _FUTURE.cert_pem,
    _DELETED.cert_pem,
    _SERVER.cert_pem,
]
_BASE = st.sampled_from(_PEMS)


@st.composite
def _der_flipped(draw: st.DrawFn) -> bytes:
    der = bytearray(_der(draw(_BASE)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(der) - 1))
        der[at] ^= 1 << draw(st.integers(0, 7))
    return _pem(bytes(der))


_CERTIFICATES = st.one_of(
    _BASE,
    _der_flipped(),
    edited(_BASE, most=2),
    st.builds(lambda a, b: a + b, _BASE, _BASE),
    _BASE.map(lambda pem: _pem(_der(pem)[: len(_der(pem)) // 2])),
    _BASE.map(lambda pem: _pem(_der(pem), b"X509 CERTIFICATE")),
    _BASE.map(lambda pem: pem.replace(b"\n", b"\r\n")),
    _BASE.map(lambda pem: _der(pem)),
    noise(512),
)


class _Transport:
    """What a request's transport offers ``peer_certificate_pem``: the TLS connection."""

    def __init__(self, connection: SSL.Connection) -> None:
        self._connection = connection

    def getHandle(self) -> SSL.Connection:
        return self._connection


class _Request:
    def __init__(self, transport: Any) -> None:
        self.transport = transport


def check_client_certificate(pem: bytes) -> None:
    """Only the live instance's exact certificate identifies it, at the handshake and after."""
    record = instance_for_certificate(_STORE.certificates, pem, _NOW)
    if pem == _LIVE.cert_pem:
        assert record is not None and record.name == "web1", record
    if record is not None:
        # The same certificate as the live one (its DER), whatever the PEM text around it.
        assert record.name == "web1", record
        assert _der_of(pem) == _der(_LIVE.cert_pem), pem
    # The handshake: OpenSSL hands the callback whatever it parsed of the certificate.
    try:
        certificate = crypto.load_certificate(crypto.FILETYPE_PEM, pem)
    except crypto.Error:
        return
    connection = _TLS.serverConnectionForTLS(None)
    accepted = _TLS._verify(connection, certificate, 18, 0, 0)
    assert isinstance(accepted, bool), accepted
    canonical = crypto.dump_certificate(crypto.FILETYPE_PEM, certificate)
    expected = instance_for_certificate(_STORE.certificates, canonical, _NOW)
    assert accepted == (expected is not None), (accepted, expected)
    if accepted:
        assert crypto.dump_certificate(crypto.FILETYPE_ASN1, certificate) == _der(_LIVE.cert_pem)
    # Each request on that connection: the same verdict, or 403 with the documented message.
    request: Any = _Request(_Transport(connection))
    identified = _IDENTIFY(request)
    assert (identified is not None) == accepted, (identified, accepted)
    api = GuestAPI(WORLDS.current().lifecycle, _IDENTIFY)
    try:
        caller = api.caller(request)
    except Forbidden as e:
        assert not accepted and e.message == FORBIDDEN_MESSAGE and e.http_status == 403, e
    else:
        assert accepted and caller.name == "web1", caller
    if accepted:
        assert peer_certificate_pem(request.transport) == canonical


def _der_of(pem: bytes) -> bytes:
    """The DER of a PEM certificate as the store's reader sees it (``cryptography``, which
    takes text after the END line that OpenSSL refuses)."""
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


TARGETS = [
    FuzzTarget(
        name="client-certificate",
        description="certificates guest API clients present: the handshake's verify callback, "
        "each request's identification",
        inputs=_CERTIFICATES,
        check=check_client_certificate,
    ),
]
