"""Forwarding a request to the cluster member that runs its instance, over mutual TLS.

The daemon presents its own server certificate as the client certificate
(the members' remote APIs trust the certificates of current members) and
accepts only the certificate the members table pins for the owner, by its
SHA-256 fingerprint.  The method, path and query, body and content type go
as they came, marked with ``X-VMReady-Forwarded-By: <this member>`` so the
owner never forwards it again; the owner's status, body and content type
(and ``Location``) come back unchanged: a 409 stays a 409.

What goes wrong on the way is one line naming the member: 503 when it cannot
be reached (refused, timed out, no route), 502 when it was reached but did
not answer properly (its certificate is not the pinned one, the connection
broke off before the answer).
"""

from __future__ import annotations

import attrs
from OpenSSL import SSL
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from vmready.api.web import BytesProducer
from vmready.domain.members import MemberRecord
from vmready.domain.model import BadGateway, BadRequest, Unavailable
from vmready.domain.reactor import IVMReadyReactor
from vmready.trust.certs import CertificatePair
from vmready.trust.tls import PinnedServerTLS

__all__ = [
    "CONNECT_TIMEOUT",
    "FORWARDED_BY",
    "RELAYED_HEADERS",
    "Forwarder",
    "Relayed",
    "split_address",
]

# The header a forwarded request carries: the member that forwarded it.
FORWARDED_BY = b"X-VMReady-Forwarded-By"
# The headers relayed each way besides the body.
RELAYED_HEADERS = (b"Content-Type", b"Location", b"Allow")
CONNECT_TIMEOUT = 10.0


@attrs.frozen
class Relayed:
    """The owner's answer: its status, the relayed headers it sent, its body."""

    code: int
    headers: dict[bytes, bytes]
    body: bytes


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as host and port; BadRequest for anything else."""
    host, colon, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"not a member address (host:port): {address!r}")
    return host, int(port)


@implementer(IAgentEndpointFactory)
class _ToMember:
    """Every request of one forward goes to the member's address, TLS pinned to it."""

    def __init__(self, reactor: IVMReadyReactor, host: str, port: int, tls: PinnedServerTLS):
        self._reactor = reactor
        self._host = host
        self._port = port
        self.tls = tls

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        tcp = HostnameEndpoint(self._reactor, self._host, self._port, timeout=CONNECT_TIMEOUT)
        return wrapClientTLS(self.tls, tcp)


class Forwarder:
    """Sends requests to other members as member ``name``, presenting ``identity``."""

    def __init__(self, reactor: IVMReadyReactor, identity: CertificatePair, name: str) -> None:
        self._reactor = reactor
        self._identity = identity
        self.name = name

    async def forward(
        self,
        member: MemberRecord,
        method: bytes,
        uri: bytes,
        body: bytes,
        content_type: bytes | None,
    ) -> Relayed:
        """Send one request (``uri``: path and query) to ``member``; its answer as it came."""
        try:
            host, port = split_address(member.address)
        except BadRequest as e:
            raise BadGateway(f"cannot forward to cluster member {member.name}: {e}") from None
        tls = PinnedServerTLS.for_fingerprint(self._identity, member.fingerprint)
        agent = Agent.usingEndpointFactory(
            self._reactor, _ToMember(self._reactor, host, port, tls)
        )
        headers = Headers({b"User-Agent": [b"vmready-member"], FORWARDED_BY: [self.name.encode()]})
        if content_type is not None:
            headers.setRawHeaders(b"Content-Type", [content_type])
        producer = BytesProducer(body) if body or method not in (b"GET", b"HEAD") else None
        target = f"https://{member.name}".encode() + uri
        where = f"cluster member {member.name} at {member.address}"
        try:
            response = await agent.request(method, target, headers, producer)
            answer: bytes = await readBody(response)
        except ConnectError as e:
            raise Unavailable(f"cannot reach {where}: {_connect_reason(e)}") from None
        except (ResponseNeverReceived, ResponseFailed, RequestTransmissionFailed) as e:
            raise BadGateway(_broken(where, e.reasons, tls)) from None
        relayed = {}
        for name in RELAYED_HEADERS:
            values = response.headers.getRawHeaders(name)
            if values:
                relayed[name] = values[0]
        return Relayed(response.code, relayed, answer)


def _broken(where: str, reasons: list[Failure], tls: PinnedServerTLS) -> str:
    """Why a forwarded request broke off, in one line."""
    for reason in reasons:
        if reason.check(SSL.Error):
            if tls.refused is not None:
                return f"refused the certificate of {where}: {tls.refused}"
            error = reason.value
            why = _ssl_reason(error) if error is not None else "TLS error"
            return f"the TLS handshake with {where} failed: {why}"
    return f"lost the connection to {where} before it answered"


def _ssl_reason(error: BaseException) -> str:
    details = error.args[0] if error.args else None
    if isinstance(details, list):
        words = [str(item[2]) for item in details if isinstance(item, tuple) and len(item) == 3]
        if words:
            return "; ".join(words)
    return str(error) or type(error).__name__


def _connect_reason(error: ConnectError) -> str:
    if error.osError is not None and not isinstance(error.osError, int):
        return str(error.osError)
    text = str(error.args[0]) if error.args and error.args[0] else (error.__doc__ or str(error))
    return text.strip().rstrip(".")
