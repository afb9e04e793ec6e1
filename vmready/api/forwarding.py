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

Connections are kept and reused (a TCP connection and a mutual-TLS handshake
cost several times what a relayed request does), in one pool per member
*identity*: its name, address and pinned fingerprint.  A member seen with
another address or certificate (it moved, it has a new certificate) gets a
new pool; the old one's idle connections are closed at once, and those still
carrying a request are closed when it is answered, so no request ever goes
over a connection made for an identity the member no longer has.  At most
``MAX_CACHED_PER_MEMBER`` idle connections are kept per member (more requests
at once open more, closed once answered), each for ``CACHED_CONNECTION_TIMEOUT``
seconds: a third of the owner's ``IDLE_TIMEOUT`` (``api.limits``), after which
the owner would close it.  Closing first, this side never sends a request on
a connection the owner has just closed for idleness.

A reused connection can still have been closed by the owner an instant
before a request went out on it (the owner restarted, and this side had not
yet read that).  What is retried then, and why:

- A request the connection refused to send (``RequestNotSent``: it was
  closed before anything was written) never reached the owner: it is sent
  once more, whatever its method.
- A ``GET`` or ``HEAD`` (no body) that got no answer at all is retried once
  on a new connection by Twisted's pool itself: reading twice changes nothing.
  (The pool would retry a ``DELETE`` too, but only one sent without a body
  producer, and every other method is sent with one, empty or not.)
- Anything else that was written and got no answer (``PUT``, ``POST``,
  ``PATCH``, ``DELETE``: they start operations, write config, rename) is NOT
  retried: the bytes left this host, and nothing tells whether the owner read
  them before the connection died (a closed socket looks the same whether the
  owner closed it before or after reading).  Sending it again could run an
  action twice (two snapshots, a second restart), so the caller gets the
  precise 502 ("lost the connection ... before it answered") and decides,
  knowing the instance's state can be read.  An answer that broke off midway
  (``ResponseFailed``) is never retried either: the owner did act.

``Forwarder.close()`` closes the kept connections (the daemon calls it when it
stops); requests under way then finish, and their connections are closed.  A
TLS close waits for the owner's own close alert: a member that does not send
it within ``CLOSE_GRACE`` seconds (it hangs) has every connection to it
aborted, so a daemon never waits on a frozen member to stop.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
from OpenSSL import SSL
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.python.failure import Failure
from twisted.web._newclient import RequestNotSent
from twisted.web.client import (
    URI,
    Agent,
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from vmready.api.limits import IDLE_TIMEOUT
from vmready.api.web import BytesProducer
from vmready.domain.members import MemberRecord
from vmready.domain.model import BadGateway, BadRequest, Unavailable
from vmready.domain.reactor import IVMReadyReactor
from vmready.trust.certs import CertificatePair
from vmready.trust.tls import PinnedServerTLS

__all__ = [
    "CACHED_CONNECTION_TIMEOUT",
    "CLOSE_GRACE",
    "CONNECT_TIMEOUT",
    "FORWARDED_BY",
    "MAX_CACHED_PER_MEMBER",
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
# Seconds an idle connection to a member is kept: well before the member closes it.
CACHED_CONNECTION_TIMEOUT = round(IDLE_TIMEOUT / 3)
# Idle connections kept per member.
MAX_CACHED_PER_MEMBER = 4
# Seconds ``Forwarder.close()`` lets members answer a TLS close before aborting.
CLOSE_GRACE = 5.0

# Connections to members that are open (or may be): for ``close()`` to abort.
_Connections = weakref.WeakSet[Any]


@attrs.frozen
class Relayed:
    """The owner's answer: its status, the relayed headers it sent, its body."""

    code: int
    headers: dict[bytes, bytes]
    body: bytes


@attrs.frozen
class _Identity:
    """What a connection to a member was made for: its name, address and pinned certificate."""

    name: str
    address: str
    fingerprint: str

    @classmethod
    def of(cls, member: MemberRecord) -> _Identity:
        """``member``'s identity as the members table shows it now."""
        return cls(member.name, member.address, member.fingerprint)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as host and port; BadRequest for anything else."""
    host, colon, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"not a member address (host:port): {address!r}")
    return host, int(port)


@implementer(IStreamClientEndpoint)
class _Tracked:
    """``endpoint``, each connection it makes noted in ``connections``."""

    def __init__(self, endpoint: IStreamClientEndpoint, connections: _Connections) -> None:
        self._endpoint = endpoint
        self._connections = connections

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        connecting: Deferred[Any] = self._endpoint.connect(protocolFactory)
        return connecting.addCallback(self._note)

    def _note(self, protocol: Any) -> Any:
        self._connections.add(protocol)
        return protocol


@implementer(IAgentEndpointFactory)
class _ToMember:
    """Every request to one member identity goes to its address, TLS pinned to it."""

    def __init__(
        self,
        reactor: IVMReadyReactor,
        host: str,
        port: int,
        tls: PinnedServerTLS,
        connections: _Connections,
    ):
        self._reactor = reactor
        self._host = host
        self._port = port
        self.tls = tls
        self._connections = connections

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        tcp = HostnameEndpoint(self._reactor, self._host, self._port, timeout=CONNECT_TIMEOUT)
        return _Tracked(wrapClientTLS(self.tls, tcp), self._connections)


class _Route:
    """The way to one member identity: its pinned TLS, its pool of connections, its agent.

    ``retired``: the member has another identity now (or the forwarder was
    closed); its connections are closed as soon as no request uses them.
    """

    def __init__(
        self,
        reactor: IVMReadyReactor,
        identity: _Identity,
        host: str,
        port: int,
        own: CertificatePair,
        connections: _Connections,
    ) -> None:
        self.identity = identity
        self.tls = PinnedServerTLS.for_fingerprint(own, identity.fingerprint)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.cachedConnectionTimeout = CACHED_CONNECTION_TIMEOUT
        self.pool.maxPersistentPerHost = MAX_CACHED_PER_MEMBER
        self.agent = Agent.usingEndpointFactory(
            reactor, _ToMember(reactor, host, port, self.tls, connections), pool=self.pool
        )
        # Requests under way through this route.
        self.active = 0
        self.retired = False


class Forwarder:
    """Sends requests to other members as member ``name``, presenting ``identity``."""

    def __init__(self, reactor: IVMReadyReactor, identity: CertificatePair, name: str) -> None:
        self._reactor = reactor
        self._identity = identity
        self.name = name
        # Each member's current route, by name.
        self._routes: dict[str, _Route] = {}
        # Closings of kept connections under way.
        self._closing: set[Deferred[None]] = set()
        self._connections: _Connections = weakref.WeakSet()
        self._closed = False

    async def forward(
        self,
        member: MemberRecord,
        method: bytes,
        uri: bytes,
        body: bytes,
        content_type: bytes | None,
    ) -> Relayed:
        """Send one request (``uri``: path and query) to ``member``; its answer as it came."""
        route = self._route(member)
        route.active += 1
        try:
            return await self._send(route, member, method, uri, body, content_type)
        finally:
            route.active -= 1
            if route.retired and not route.active:
                self._close_pool(route)

    def close(self) -> Deferred[None]:
        """Close every kept connection; fires once they (and any closing under way) are closed.

        Requests under way finish, and their connections are closed then; a
        request forwarded after this goes over a connection of its own, closed
        once answered.  Members that do not answer the TLS close within
        ``CLOSE_GRACE`` seconds have their connections aborted.
        """
        self._closed = True
        routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.retired = True
            if not route.active:
                self._close_pool(route)
        closed = gatherResults(list(self._closing))
        aborting = self._reactor.callLater(CLOSE_GRACE, self._abort_all)

        def done(_: object) -> None:
            if aborting.active():
                aborting.cancel()

        return closed.addCallback(done)

    def _abort_all(self) -> None:
        """A member did not close in time: every connection still open is aborted."""
        for connection in list(self._connections):
            transport: Any = connection.transport
            if connection.state != "CONNECTION_LOST" and transport is not None:
                transport.abortConnection()

    def _route(self, member: MemberRecord) -> _Route:
        """The route to ``member``'s identity now; a previous identity's is retired."""
        identity = _Identity.of(member)
        route = self._routes.get(member.name)
        if route is not None and route.identity == identity:
            return route
        if route is not None:
            del self._routes[member.name]
            route.retired = True
            if not route.active:
                self._close_pool(route)
        try:
            host, port = split_address(member.address)
        except BadRequest as e:
            raise BadGateway(f"cannot forward to cluster member {member.name}: {e}") from None
        route = _Route(self._reactor, identity, host, port, self._identity, self._connections)
        if self._closed:
            route.retired = True  # used by this request only
        else:
            self._routes[member.name] = route
        return route

    def _close_pool(self, route: _Route) -> None:
        closing: Deferred[None] = route.pool.closeCachedConnections()
        self._closing.add(closing)

        def closed(result: object) -> object:
            self._closing.discard(closing)
            return result

        closing.addBoth(closed)

    async def _send(
        self,
        route: _Route,
        member: MemberRecord,
        method: bytes,
        uri: bytes,
        body: bytes,
        content_type: bytes | None,
    ) -> Relayed:
        headers = Headers({b"User-Agent": [b"vmready-member"], FORWARDED_BY: [self.name.encode()]})
        if content_type is not None:
            headers.setRawHeaders(b"Content-Type", [content_type])
        producer = BytesProducer(body) if body or method not in (b"GET", b"HEAD") else None
        target = f"https://{member.name}".encode() + uri
        where = f"cluster member {member.name} at {member.address}"
        try:
            response = await _request(route.agent, method, target, headers, producer)
            answer: bytes = await readBody(response)
        except ConnectError as e:
            raise Unavailable(f"cannot reach {where}: {_connect_reason(e)}") from None
        except RequestNotSent:
            raise BadGateway(f"lost the connection to {where} before it answered") from None
        except (ResponseNeverReceived, ResponseFailed, RequestTransmissionFailed) as e:
            raise BadGateway(_broken(where, e.reasons, route.tls)) from None
        relayed = {}
        for name in RELAYED_HEADERS:
            values = response.headers.getRawHeaders(name)
            if values:
                relayed[name] = values[0]
        return Relayed(response.code, relayed, answer)


async def _request(
    agent: Agent,
    method: bytes,
    target: bytes,
    headers: Headers,
    producer: BytesProducer | None,
) -> IResponse:
    """``agent``'s request, sent once more if its connection had closed before sending it."""
    try:
        response: IResponse = await agent.request(method, target, headers, producer)
    except RequestNotSent:
        # Nothing was written: the owner never saw it (see the module).
        response = await agent.request(method, target, headers, producer)
    return response


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
