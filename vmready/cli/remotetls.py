"""Reaching a remote daemon: TCP, then TLS presenting our certificate and pinning the server's.

``PinnedRemote`` is the endpoint factory the ``Client``'s Agent dials for a
remote, so every command works over it unchanged.  ``probe_server_certificate``
fetches a server's certificate once, for ``vmready remote add`` to show its
fingerprint before anything is trusted; nothing is sent over that connection.
"""

from __future__ import annotations

from collections.abc import Iterable

from OpenSSL import SSL
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IHandshakeListener, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.web.client import URI
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from vmready.cli.errors import EXIT_FAILED, CommandError
from vmready.domain import IVMReadyReactor
from vmready.trust import (
    CertificatePair,
    PinnedServerTLS,
    ServerCertificateProbe,
    connect_reason,
    ssl_reason,
)

CONNECT_TIMEOUT = 30.0


@implementer(IAgentEndpointFactory)
class PinnedRemote:
    """Every request goes to ``host:port`` over TLS pinned to ``fingerprint``."""

    def __init__(
        self,
        reactor: IVMReadyReactor,
        host: str,
        port: int,
        client: CertificatePair,
        fingerprint: str,
    ) -> None:
        self._reactor = reactor
        self._host = host
        self._port = port
        self.tls = PinnedServerTLS.for_fingerprint(client, fingerprint)

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        """The remote's TLS endpoint, whatever the URL says."""
        tcp = HostnameEndpoint(self._reactor, self._host, self._port, timeout=CONNECT_TIMEOUT)
        return wrapClientTLS(self.tls, tcp)


def tls_failure(reasons: Iterable[Failure], pinned: PinnedServerTLS | None) -> str | None:
    """Why TLS broke off, if that is what ended a request; None when it was not TLS."""
    for reason in reasons:
        if reason.check(SSL.Error):
            if pinned is not None and pinned.refused is not None:
                return f"refused the server's certificate: {pinned.refused}"
            error = reason.value
            return f"the TLS handshake failed: {ssl_reason(error) if error else 'TLS error'}"
    return None


@implementer(IHandshakeListener)
class _Handshake(Protocol):
    """Ends the connection as soon as the handshake is done."""

    def __init__(self) -> None:
        self.done: Deferred[None] = Deferred()

    def handshakeCompleted(self) -> None:
        """Done: close without sending anything."""
        if not self.done.called:
            self.done.callback(None)
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        """Before the handshake completed: that is the failure."""
        if not self.done.called:
            self.done.errback(reason)


async def probe_server_certificate(
    reactor: IVMReadyReactor, host: str, port: int, client: CertificatePair, url: str
) -> bytes:
    """The certificate the server at ``host:port`` presents (trusting nothing yet)."""
    probe = ServerCertificateProbe(client)
    endpoint = wrapClientTLS(probe, HostnameEndpoint(reactor, host, port, timeout=CONNECT_TIMEOUT))
    handshake = _Handshake()
    try:
        await endpoint.connect(Factory.forProtocol(lambda: handshake))
        await handshake.done
    except ConnectError as e:
        raise CommandError(f"cannot reach {url}: {connect_reason(e)}", EXIT_FAILED) from None
    except SSL.Error as e:
        if probe.presented is None:
            raise CommandError(
                f"cannot reach {url}: the TLS handshake failed: {ssl_reason(e)}", EXIT_FAILED
            ) from None
    except Exception as e:
        if probe.presented is None:
            raise CommandError(f"cannot reach {url}: {e}", EXIT_FAILED) from None
    if probe.presented is None:
        raise CommandError(f"{url} presented no certificate", EXIT_FAILED)
    return probe.presented
