"""Mutual TLS for the guest API: who may connect, decided from certificates alone.

The daemon presents its certificate and accepts the caller's exactly when
``authorize`` says so; the agent accepts the daemon only if it presents the
pinned certificate.  No CA: every certificate is self-signed and identified by
its SHA-256 fingerprint, as LXD does for its VMs.

Each factory configures its OpenSSL context once, when built (pyOpenSSL
refuses to change a used context).  No session is ever resumed (a resumed
session skips the certificate check); the server decides once per connection
(``_PeerVerdict``) and keeps the peer's PEM for each request on it
(``peer_certificate_pem``).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IProtocolFactory,
)
from twisted.logger import Logger
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory
from zope.interface import implementer, providedBy
from zope.interface.declarations import Provides

from vmready.trust.certs import CertificatePair, fingerprint, is_valid_at

Authorize = Callable[[bytes], bool]
Clock = Callable[[], datetime.datetime]
_SESSION_CONTEXT = b"vmready-guest-api"


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem(certificate: crypto.X509 | x509.Certificate) -> bytes:
    if isinstance(certificate, crypto.X509):
        certificate = certificate.to_cryptography()
    return certificate.public_bytes(serialization.Encoding.PEM)


def _base_context(own: CertificatePair) -> SSL.Context:
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_2_VERSION)
    context.use_certificate(
        crypto.X509.from_cryptography(x509.load_pem_x509_certificate(own.cert_pem))
    )
    key = serialization.load_pem_private_key(own.key_pem, password=None)
    context.use_privatekey(key)  # type: ignore[arg-type]  # ours is never a DH or X25519 key
    context.check_privatekey()
    return context


@attrs.define
class _PeerVerdict:
    """What one server connection's handshake decided about the client certificate (DER)."""

    der: bytes = b""
    pem: bytes = b""
    accepted: bool = False


@implementer(IOpenSSLServerConnectionCreator)
class MutualServerTLS:
    """The daemon's side: present ``server``; require a client certificate ``authorize`` likes.

    ``require_certificate=False``: a client that presents none still connects
    (the remote API then answers it as untrusted); one it presents must please
    ``authorize`` all the same.
    """

    log = Logger()

    def __init__(
        self,
        server: CertificatePair,
        authorize: Authorize,
        purpose: str = "guest API",
        require_certificate: bool = True,
    ) -> None:
        self.authorize = authorize
        # What the log lines call the clients: "guest API", "remote operator API".
        self.purpose = purpose
        context = _base_context(server)
        mode = SSL.VERIFY_PEER
        if require_certificate:
            mode |= SSL.VERIFY_FAIL_IF_NO_PEER_CERT
        context.set_verify(mode, self._verify)
        context.set_session_id(_SESSION_CONTEXT)
        # A resumed session skips verification: a revoked certificate would slip back in.
        context.set_session_cache_mode(SSL.SESS_CACHE_OFF)
        # One handshake per connection (OpenSSL 3's default, said here): the verdict kept
        # for a connection is that of its only handshake.
        no_renegotiation: int = SSL.OP_NO_RENEGOTIATION  # type: ignore[attr-defined]  # not in the stubs
        context.set_options(SSL.OP_NO_TICKET | no_renegotiation)
        self._context = context

    def _verify(
        self, connection: SSL.Connection, certificate: crypto.X509, error: int, depth: int, ok: int
    ) -> bool:
        # Self-signed client certificates fail OpenSSL's chain check (error 18): the
        # decision is ours, on the leaf alone.
        verdict = connection.get_app_data()
        if not isinstance(verdict, _PeerVerdict):
            verdict = _PeerVerdict()
            connection.set_app_data(verdict)
        der = crypto.dump_certificate(crypto.FILETYPE_ASN1, certificate)
        if der == verdict.der:
            # OpenSSL asking again about the same certificate within this handshake.
            return verdict.accepted
        if depth != 0:
            # A chain: no CA is trusted, and OpenSSL stops here, before the leaf.
            verdict.der, verdict.pem, verdict.accepted = der, b"", False
            self.log.warn(
                "refused a " + self.purpose + " client certificate chain: {fingerprint} "
                "(depth {depth}) is an issuer's, and only self-signed certificates identify "
                "its clients",
                fingerprint=hashlib.sha256(der).hexdigest(),
                depth=depth,
            )
            return False
        try:
            pem = _pem(x509.load_der_x509_certificate(der))
        except (ValueError, x509.InvalidVersion) as e:
            # OpenSSL parsed what cryptography refuses (a malformed validity time, a version
            # X.509 does not have): no certificate the daemon issued or trusts, and raising
            # here would abort the handshake badly.
            verdict.der, verdict.pem, verdict.accepted = der, b"", False
            self.log.warn(
                "refused a " + self.purpose + " client certificate {fingerprint}: not a valid "
                "certificate ({error})",
                fingerprint=hashlib.sha256(der).hexdigest(),
                error=e,
            )
            return False
        verdict.der, verdict.pem, verdict.accepted = der, pem, self.authorize(pem)
        if not verdict.accepted:
            self.log.warn(
                "refused a " + self.purpose + " client certificate {fingerprint} "
                "(unknown, revoked or outside its validity period)",
                fingerprint=fingerprint(pem),
            )
        return verdict.accepted

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        """A connection using the one configured context, with room for its verdict."""
        connection = SSL.Connection(self._context, None)
        connection.set_app_data(_PeerVerdict())
        return connection


class _TLSServerProtocol(BufferingTLSTransport):
    """Twisted's TLS protocol (buffering small writes), its interface declarations built once.

    Its ``makeConnection`` declares, one at a time, each interface its
    transport provides.  zope.interface shares such a declaration only while
    it is alive, and declarations sit in reference cycles that the garbage
    collector frees: in a process as busy as the daemon (whose requests
    allocate enough to run it often) each new connection rebuilt most of
    them, resolution orders included.  Kept here, one set per kind of
    transport (unix, vsock), they are built once.
    """

    _kept: ClassVar[dict[object, list[object]]] = {}

    def makeConnection(self, transport: Any) -> None:
        """Keep the declarations this transport's kind leads to, then connect as Twisted does."""
        provided = providedBy(transport)
        if provided not in self._kept:
            self._kept[provided] = [Provides(type(self), interface) for interface in provided]
        super().makeConnection(transport)


def server_tls_factory(tls: MutualServerTLS, factory: IProtocolFactory) -> TLSMemoryBIOFactory:
    """``factory``'s connections behind ``tls``: what the daemon listens with for agents."""
    wrapped = TLSMemoryBIOFactory(tls, False, factory)
    wrapped.protocol = _TLSServerProtocol
    return wrapped


@implementer(IOpenSSLClientConnectionCreator)
class PinnedServerTLS:
    """The agent's and the remote CLI's side: present ``client``, accept only the pinned server.

    The server is pinned by its certificate (the agent's config drive holds
    it) or by its fingerprint (``for_fingerprint``: a CLI remote).  A refused
    server certificate is remembered (``refused``) so the caller can say why.
    """

    def __init__(
        self, client: CertificatePair, server_cert_pem: bytes, clock: Clock = _utcnow
    ) -> None:
        self._setup(client, fingerprint(server_cert_pem), clock)

    @classmethod
    def for_fingerprint(
        cls, client: CertificatePair, pinned: str, clock: Clock = _utcnow
    ) -> PinnedServerTLS:
        """Accept only the server certificate whose SHA-256 fingerprint is ``pinned``."""
        self = cls.__new__(cls)
        self._setup(client, pinned, clock)
        return self

    def _setup(self, client: CertificatePair, pinned: str, clock: Clock) -> None:
        self.pinned = pinned
        self.clock = clock
        # Why the last refused server certificate was refused; None while none was.
        self.refused: str | None = None
        context = _base_context(client)
        context.set_verify(SSL.VERIFY_PEER, self._verify)
        self._context = context

    def _verify(
        self, connection: SSL.Connection, certificate: crypto.X509, error: int, depth: int, ok: int
    ) -> bool:
        if depth != 0:
            self.refused = "the server presented a certificate chain, not its own certificate"
            return False
        pem = _pem(certificate)
        presented = fingerprint(pem)
        if presented != self.pinned:
            self.refused = (
                f"the server's certificate has fingerprint {presented}, "
                f"not the pinned {self.pinned}"
            )
            return False
        if not is_valid_at(pem, self.clock()):
            self.refused = "the server's certificate is outside its validity period"
            return False
        return True

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        """A connection using the one configured context."""
        connection = SSL.Connection(self._context, None)
        connection.set_connect_state()
        return connection


@implementer(IOpenSSLClientConnectionCreator)
class ServerCertificateProbe:
    """Present ``client``, accept whatever certificate the server shows, and keep it.

    Only for showing an operator the fingerprint of a server they are about to
    pin (``vmready remote add`` without a token): nothing may be sent over
    such a connection.
    """

    def __init__(self, client: CertificatePair) -> None:
        self.presented: bytes | None = None
        context = _base_context(client)
        context.set_verify(SSL.VERIFY_PEER, self._verify)
        self._context = context

    def _verify(
        self, connection: SSL.Connection, certificate: crypto.X509, error: int, depth: int, ok: int
    ) -> bool:
        if depth == 0:
            self.presented = _pem(certificate)
        return True

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        """A connection using the one configured context."""
        connection = SSL.Connection(self._context, None)
        connection.set_connect_state()
        return connection


def peer_certificate_pem(transport: Any) -> bytes | None:
    """The PEM certificate the peer of a TLS ``transport`` presented, or None.

    On a ``MutualServerTLS`` connection, the one its handshake accepted (kept then).
    """
    handle = getattr(transport, "getHandle", None)
    connection = handle() if handle is not None else None
    if isinstance(connection, SSL.Connection):
        verdict = connection.get_app_data()
        if isinstance(verdict, _PeerVerdict) and verdict.accepted:
            return verdict.pem
    get = getattr(transport, "getPeerCertificate", None)
    if get is None:
        return None
    certificate = get()
    if certificate is None:
        return None
    return _pem(certificate)


def ssl_reason(error: BaseException) -> str:
    """OpenSSL's reason strings (``tlsv13 alert certificate required``), else the error."""
    details = error.args[0] if error.args else None
    if isinstance(details, list):
        words = [str(item[2]) for item in details if isinstance(item, tuple) and len(item) == 3]
        if words:
            return "; ".join(words)
    return str(error) or type(error).__name__


def connect_reason(error: ConnectError) -> str:
    """A connect failure in the OS's words where there are some, without a closing period."""
    if error.osError is not None and not isinstance(error.osError, int):
        return str(error.osError)
    text = str(error.args[0]) if error.args and error.args[0] else (error.__doc__ or str(error))
    return text.strip().rstrip(".")
