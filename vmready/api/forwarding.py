"""Forwarding a request to the cluster member that runs its instance, over mutual TLS.

The daemon presents its own server certificate as the client certificate
and accepts only the certificate the members table pins for the owner.  The
method, path and query, body and content type go as they came, marked with
``X-VMReady-Forwarded-By: <this member>`` so the owner never forwards it
again; the owner's status, body and relayed headers come back unchanged.
What goes wrong on the way is one line naming the member: 503 when it cannot
be reached or does not answer in time, 502 when it was reached but did not
answer properly (not the pinned certificate, the connection broke off).

No forwarded request waits for ever: it has a deadline, ``DEADLINE`` seconds
from asking for a connection to the last byte of the answer, plus the wait
it asks the owner for (none for a wait with no limit), and ``unreachable``
(has the member's lease run out?) is asked every ``WATCH_INTERVAL`` seconds
meanwhile.  Either ends it by cancelling its ``Agent.request``/``readBody``,
which aborts its connection, as a 503; a request that may change something
(not ``GET``/``HEAD``) then says that it may have been carried out
(``UNKNOWN_OUTCOME``), and is never sent again.

Connections are kept (an ``HTTPConnectionPool``) per member *identity*: its
name, address and pinned fingerprint; a member seen with another has the old
identity's kept connections closed, once no request uses them.  Up to
``MAX_CACHED_PER_MEMBER`` idle ones are kept per member: a member under load
has many requests under way to another at once, and each connection not
kept is a new TCP connection and TLS handshake on both members at the next
request.  Idle ones are closed after ``CACHED_CONNECTION_TIMEOUT``, well
before the owner's own idle timeout.  The pool sends a ``GET`` or ``HEAD``
without a body once more on a new connection when a kept one died under it
unanswered; anything else that left this host unanswered is a 502 ("lost
the connection"), never sent again: the owner may have acted on it.
``Forwarder.close()`` closes the kept connections, aborting those whose
member does not answer the TLS close in time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import quote_from_bytes

import attrs
from OpenSSL import SSL
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import LoopingCall
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
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
from vmready.domain import BadGateway, BadRequest, IVMReadyReactor, MemberRecord, Unavailable
from vmready.trust import CertificatePair, PinnedServerTLS, connect_reason, ssl_reason

# The header a forwarded request carries: the member that forwarded it.
FORWARDED_BY = b"X-VMReady-Forwarded-By"
# The headers relayed each way besides the body.
RELAYED_HEADERS = (b"Content-Type", b"Location", b"Allow")
CONNECT_TIMEOUT = 10.0
# Seconds a forwarded request may take, connect to last byte, beyond the wait it asks for.
DEADLINE = 30.0
# Seconds between two looks at whether the member a request is under way to is still online.
WATCH_INTERVAL = 1.0
# The methods that change nothing, safe to have cut off.
READS = (b"GET", b"HEAD")
# What a request that may change something is told when it was cut off before its answer.
UNKNOWN_OUTCOME = "the request may have been carried out: check with vmready info"
# Seconds an idle connection to a member is kept: well before the member closes it.
CACHED_CONNECTION_TIMEOUT = round(IDLE_TIMEOUT / 3)
# Idle connections kept per member: as many as a busy member has under way to it at once
# (each one not kept is a new TCP connection and TLS handshake on both members next time).
MAX_CACHED_PER_MEMBER = 32
# Seconds ``Forwarder.close()`` lets members answer a TLS close before aborting.
CLOSE_GRACE = 5.0
_PRINTABLE = bytes(range(0x21, 0x7F)).decode("ascii")


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


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as host and port; BadRequest for anything else."""
    host, colon, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"not a member address (host:port): {address!r}")
    return host, int(port)


@implementer(IStreamClientEndpoint)
class _Noted:
    """``endpoint``, each connection it makes kept in ``opened`` (for an abort) while open."""

    def __init__(
        self, endpoint: IStreamClientEndpoint, opened: weakref.WeakSet[WrappingFactory]
    ) -> None:
        self._endpoint = endpoint
        self._opened = opened

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        wrapping = WrappingFactory(protocolFactory)
        self._opened.add(wrapping)  # its ``protocols``: the connection, until it is lost
        connecting: Deferred[Any] = self._endpoint.connect(wrapping)
        return connecting.addCallback(lambda wrapper: wrapper.wrappedProtocol)


@implementer(IAgentEndpointFactory)
class _Route:
    """The way to one member identity: its pinned TLS, its pool of kept connections.

    ``retired``: the member has another identity now (or the forwarder was
    closed); its connections are closed as soon as no request uses them.
    """

    def __init__(
        self,
        reactor: IVMReadyReactor,
        identity: _Identity,
        own: CertificatePair,
        opened: weakref.WeakSet[WrappingFactory],
    ) -> None:
        self.identity = identity
        self.tls = PinnedServerTLS.for_fingerprint(own, identity.fingerprint)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.cachedConnectionTimeout = CACHED_CONNECTION_TIMEOUT
        self.pool.maxPersistentPerHost = MAX_CACHED_PER_MEMBER
        self.agent = Agent.usingEndpointFactory(reactor, self, self.pool)
        self._reactor = reactor
        self._host, self._port = split_address(identity.address)
        self._opened = opened
        # Requests under way through this route.
        self.active = 0
        self.retired = False

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        """The member's address, whatever the URI says: mutual TLS pinned to its certificate."""
        tcp = HostnameEndpoint(self._reactor, self._host, self._port, timeout=CONNECT_TIMEOUT)
        return _Noted(wrapClientTLS(self.tls, tcp), self._opened)


class Forwarder:
    """Sends requests to other members as member ``name``, presenting ``identity``.

    ``deadline``: seconds each request may take beyond the wait it asks for
    (``DEADLINE``); ``watch_interval``: seconds between two looks at whether
    its member is still reachable (``WATCH_INTERVAL``).  Both may be changed
    between requests, and ``close_grace`` before ``close()``.
    """

    close_grace = CLOSE_GRACE

    def __init__(
        self,
        reactor: IVMReadyReactor,
        identity: CertificatePair,
        name: str,
        deadline: float = DEADLINE,
        watch_interval: float = WATCH_INTERVAL,
    ) -> None:
        self._reactor = reactor
        self._identity = identity
        self.name = name
        self.deadline = deadline
        self.watch_interval = watch_interval
        # Each member's current route, by name.
        self._routes: dict[str, _Route] = {}
        # Closings of kept connections under way.
        self._closing: set[Deferred[None]] = set()
        self._opened: weakref.WeakSet[WrappingFactory] = weakref.WeakSet()
        self._closed = False

    async def forward(
        self,
        member: MemberRecord,
        method: bytes,
        uri: bytes,
        body: bytes,
        content_type: bytes | None,
        wait: float | None = 0.0,
        unreachable: Callable[[], str | None] | None = None,
    ) -> Relayed:
        """Send one request (``uri``: path and query) to ``member``; its answer as it came.

        ``wait``: seconds the request asks the owner to wait before answering
        (an operation's ``/wait?timeout=``), added to the deadline; None: no
        limit, and no deadline.  ``unreachable``: asked every
        ``watch_interval`` seconds while the request is under way; a reason
        (``its lease ran out at …``) ends it with a 503.
        """
        route = self._route(member)
        headers = Headers(
            {
                b"Host": [member.name.encode()],
                b"User-Agent": [b"vmready-member"],
                FORWARDED_BY: [self.name.encode()],
            }
        )
        if content_type is not None:
            headers.setRawHeaders(b"Content-Type", [content_type])
        producer = BytesProducer(body) if body or method not in READS else None
        where = f"cluster member {member.name} at {member.address}"
        limit = None if wait is None else self.deadline + wait
        exchange = _Exchange(self._reactor, route, where, limit, unreachable, self.watch_interval)
        route.active += 1
        try:
            response, answer = await exchange.run(method, uri, headers, producer)
        finally:
            route.active -= 1
            if route.retired and not route.active:
                self._close_pool(route)
        relayed = {}
        for name in RELAYED_HEADERS:
            values = response.headers.getRawHeaders(name)
            if values:
                relayed[name] = values[0]
        return Relayed(response.code, relayed, answer)

    def close(self) -> Deferred[None]:
        """Close every kept connection; fires once they (and any closing under way) are closed.

        Requests under way finish, and their connections are closed then; a
        request forwarded after this goes over a connection of its own, closed
        once answered.  Members that do not answer the TLS close within
        ``close_grace`` seconds have their connections aborted.
        """
        self._closed = True
        routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.retired = True
            if not route.active:
                self._close_pool(route)
        closed = gatherResults(list(self._closing))
        aborting = self._reactor.callLater(self.close_grace, self._abort_all)

        def done(_: object) -> None:
            if aborting.active():
                aborting.cancel()

        return closed.addCallback(done)

    def _abort_all(self) -> None:
        """A member did not close in time: every connection still open is aborted."""
        for wrapping in list(self._opened):
            for wrapper in list(wrapping.protocols):
                wrapper.transport.abortConnection()

    def _route(self, member: MemberRecord) -> _Route:
        """The route to ``member``'s identity now; a previous identity's is retired."""
        identity = _Identity(member.name, member.address, member.fingerprint)
        route = self._routes.get(member.name)
        if route is not None and route.identity == identity:
            return route
        if route is not None:
            del self._routes[member.name]
            route.retired = True
            if not route.active:
                self._close_pool(route)
        try:
            route = _Route(self._reactor, identity, self._identity, self._opened)
        except BadRequest as e:
            raise BadGateway(f"cannot forward to cluster member {member.name}: {e}") from None
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


class _Exchange:
    """One forwarded request to ``where`` through ``route``, cancelled when its ``limit``
    (seconds; None: none) is up or ``unreachable``, asked every ``interval``, gives a reason."""

    def __init__(
        self,
        reactor: IVMReadyReactor,
        route: _Route,
        where: str,
        limit: float | None,
        unreachable: Callable[[], str | None] | None,
        interval: float,
    ) -> None:
        self._reactor = reactor
        self._route = route
        self._where = where
        self._limit = limit
        self._unreachable = unreachable
        self._interval = interval
        self._request: Deferred[tuple[IResponse, bytes]] | None = None
        # Why it was given up, once it was.
        self.ended: str | None = None

    async def run(
        self, method: bytes, uri: bytes, headers: Headers, producer: BytesProducer | None
    ) -> tuple[IResponse, bytes]:
        """The answer and its body, or the one-line error the request ended with."""
        self._request = Deferred.fromCoroutine(self._send(method, uri, headers, producer))
        deadline = watch = None
        if self._limit is not None:
            why = f"{self._where} did not answer within {self._limit:g} s"
            deadline = self._reactor.callLater(self._limit, self._give_up, why)
        if self._unreachable is not None:
            watch = LoopingCall(self._look, self._unreachable)
            watch.clock = self._reactor
            watch.start(self._interval, now=False)
        try:
            return await self._request
        except Exception as e:
            if self.ended is None:
                raise _failure(e, self._where, self._route.tls) from None
            unknown = "" if method in READS else f"; {UNKNOWN_OUTCOME}"
            raise Unavailable(f"{self.ended}{unknown}") from None
        finally:
            if deadline is not None and deadline.active():
                deadline.cancel()
            if watch is not None and watch.running:
                watch.stop()

    async def _send(
        self, method: bytes, uri: bytes, headers: Headers, producer: BytesProducer | None
    ) -> tuple[IResponse, bytes]:
        # The route's endpoint is the member's address, whatever host the URI names; Agent
        # takes printable ASCII only, and the owner decodes an escaped byte as the byte.
        target = b"https://member" + quote_from_bytes(uri, _PRINTABLE).encode()
        response = await self._route.agent.request(method, target, headers, producer)
        answer: bytes = await readBody(response)
        return response, answer

    def _look(self, unreachable: Callable[[], str | None]) -> None:
        reason = unreachable()
        if reason is not None:
            self._give_up(f"{self._where} became unreachable before it answered: {reason}")

    def _give_up(self, why: str) -> None:
        """Cancel the request: its connecting, or its connection, is aborted."""
        if self.ended is None and self._request is not None and not self._request.called:
            self.ended = why
            self._request.cancel()


def _failure(error: Exception, where: str, tls: PinnedServerTLS) -> Exception:
    """The one-line error a request that failed with ``error`` is."""
    if isinstance(error, ConnectError):
        return Unavailable(f"cannot reach {where}: {connect_reason(error)}")
    if isinstance(error, ResponseNeverReceived | ResponseFailed | RequestTransmissionFailed):
        return BadGateway(_broken(where, error.reasons, tls))
    return error


def _broken(where: str, reasons: list[Failure], tls: PinnedServerTLS) -> str:
    """Why a forwarded request broke off, in one line."""
    for reason in reasons:
        if reason.check(SSL.Error):
            if tls.refused is not None:
                return f"refused the certificate of {where}: {tls.refused}"
            error = reason.value
            why = ssl_reason(error) if error is not None else "TLS error"
            return f"the TLS handshake with {where} failed: {why}"
    return f"lost the connection to {where} before it answered"
