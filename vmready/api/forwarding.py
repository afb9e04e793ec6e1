"""Forwarding a request to the cluster member that runs its instance, over mutual TLS.

The daemon presents its own server certificate as the client certificate
(the members' remote APIs trust the certificates of current members) and
accepts only the certificate the members table pins for the owner, by its
SHA-256 fingerprint.  The method, path and query, body and content type go
as they came, marked with ``X-VMReady-Forwarded-By: <this member>`` so the
owner never forwards it again; the owner's status, body and content type
(and ``Location``) come back unchanged: a 409 stays a 409.

What goes wrong on the way is one line naming the member: 503 when it cannot
be reached (refused, timed out, no route) or does not answer in time, 502
when it was reached but did not answer properly (its certificate is not the
pinned one, the connection broke off before the answer).

No forwarded request waits for ever.  A member can accept TCP and then say
nothing: its process frozen (SIGSTOP, a wedged reactor), or its host gone
while a kept connection to it looks open (TCP then retransmits for many
minutes).  So each request has a *deadline*, ``DEADLINE`` seconds from asking
for a connection to the last byte of the answer (the connect, the TLS
handshake, the request, the answer's headers and body), plus the ``wait`` the
request asks the owner for by design (an operation's ``/wait?timeout=N``; a
wait with no limit has no deadline).  Past it the connection the request
uses is aborted (or its connecting cancelled) and the request is a 503
``cluster member M at A did not answer within N s``.  While a request is
under way, ``unreachable`` (the membership: has the member's lease run
out?) is asked every ``WATCH_INTERVAL`` seconds: a member that lost its
lease has its request aborted then, with a 503 saying so, instead of at the
deadline (the only end a wait with no limit has).  A request that may change
something (any method but ``GET`` and ``HEAD``) cut off that way may have
reached the owner and been carried out: its message says so
(``UNKNOWN_OUTCOME``), and it is never sent again.

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
- A ``GET`` or ``HEAD`` (no body) that got no answer at all on a kept
  connection is sent once more, on another: reading twice changes nothing.
- Anything else that was written and got no answer (``PUT``, ``POST``,
  ``PATCH``, ``DELETE``: they start operations, write config, rename) is NOT
  retried: the bytes left this host, and nothing tells whether the owner read
  them before the connection died (a closed socket looks the same whether the
  owner closed it before or after reading).  Sending it again could run an
  action twice (two snapshots, a second restart), so the caller gets the
  precise 502 ("lost the connection ... before it answered") and decides,
  knowing the instance's state can be read.  An answer that broke off midway
  (``ResponseFailed``) is never retried either: the owner did act.  Nor is
  a request cut off by its deadline, whatever its method.

Requests are sent over the pool's connections directly (not through an
``Agent``) so that this side knows which connection each request uses: the
one its deadline aborts.

``Forwarder.close()`` closes the kept connections (the daemon calls it when it
stops); requests under way then finish, and their connections are closed.  A
TLS close waits for the owner's own close alert: a member that does not send
it within ``CLOSE_GRACE`` seconds (it hangs) has every connection to it
aborted, so a daemon never waits on a frozen member to stop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
from OpenSSL import SSL
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IDelayedCall, IProtocolFactory, IStreamClientEndpoint
from twisted.python.failure import Failure
from twisted.web._newclient import HTTP11ClientProtocol, Request, RequestNotSent
from twisted.web.client import (
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from zope.interface import implementer

from vmready.api.limits import IDLE_TIMEOUT
from vmready.api.web import BytesProducer
from vmready.domain.members import MemberRecord
from vmready.domain.model import BadGateway, BadRequest, Unavailable
from vmready.domain.reactor import IVMReadyReactor
from vmready.trust.certs import CertificatePair
from vmready.trust.tls import PinnedServerTLS, connect_reason, ssl_reason

__all__ = [
    "CACHED_CONNECTION_TIMEOUT",
    "CLOSE_GRACE",
    "CONNECT_TIMEOUT",
    "DEADLINE",
    "FORWARDED_BY",
    "MAX_CACHED_PER_MEMBER",
    "READS",
    "RELAYED_HEADERS",
    "UNKNOWN_OUTCOME",
    "WATCH_INTERVAL",
    "Forwarder",
    "Relayed",
    "split_address",
]

# The header a forwarded request carries: the member that forwarded it.
FORWARDED_BY = b"X-VMReady-Forwarded-By"
# The headers relayed each way besides the body.
RELAYED_HEADERS = (b"Content-Type", b"Location", b"Allow")
CONNECT_TIMEOUT = 10.0
# Seconds a forwarded request may take, connect to last byte, beyond the wait it asks for.
DEADLINE = 30.0
# Seconds between two looks at whether the member a request is under way to is still online.
WATCH_INTERVAL = 1.0
# The methods that change nothing: sent again when a kept connection died under them, and
# safe to have cut off.
READS = (b"GET", b"HEAD")
# What a request that may change something is told when it was cut off before its answer.
UNKNOWN_OUTCOME = "the request may have been carried out: check with vmready info"
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
    """``endpoint``, each connection it makes noted in ``connections`` and in ``made``."""

    def __init__(
        self, endpoint: IStreamClientEndpoint, connections: _Connections, made: list[Any]
    ) -> None:
        self._endpoint = endpoint
        self._connections = connections
        self._made = made

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        connecting: Deferred[Any] = self._endpoint.connect(protocolFactory)
        return connecting.addCallback(self._note)

    def _note(self, protocol: Any) -> Any:
        self._connections.add(protocol)
        self._made.append(protocol)
        return protocol


class _Route:
    """The way to one member identity: its pinned TLS, its pool of connections.

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
        # Retries are this module's (``_Exchange``): the pool's would use connections unseen.
        self.pool.retryAutomatically = False
        self._reactor = reactor
        self._host = host
        self._port = port
        self._connections = connections
        # Requests under way through this route.
        self.active = 0
        self.retired = False

    def connection(self, made: list[Any]) -> Deferred[HTTP11ClientProtocol]:
        """A kept connection, or a new one (then also noted in ``made``)."""
        tcp = HostnameEndpoint(self._reactor, self._host, self._port, timeout=CONNECT_TIMEOUT)
        endpoint = _Tracked(wrapClientTLS(self.tls, tcp), self._connections, made)
        return self.pool.getConnection(self.identity, endpoint)


class _Exchange:
    """One forwarded request's way through the pool: the connection it uses, to abort.

    ``give_up(why)``: cancel the connecting under way, or abort the
    connection the request is on; ``ended`` then says why, and whatever the
    request fails with is reported as that.
    """

    def __init__(self, route: _Route, method: bytes, path: bytes, headers: Headers) -> None:
        self._route = route
        self._method = method
        self._path = path
        self._headers = headers
        self._connecting: Deferred[HTTP11ClientProtocol] | None = None
        self._connection: HTTP11ClientProtocol | None = None
        self.ended: str | None = None

    def give_up(self, why: str) -> None:
        """The request is over (``why``): nothing more is read or sent for it."""
        if self.ended is not None:
            return
        self.ended = why
        connecting, connection = self._connecting, self._connection
        if connecting is not None and not connecting.called:
            connecting.cancel()
        elif connection is not None:
            transport: Any = connection.transport
            if transport is not None:
                transport.abortConnection()

    async def run(self, producer: BytesProducer | None) -> tuple[IResponse, bytes]:
        """The answer and its body; sent once more if that is safe (see the module)."""
        made: list[Any] = []
        try:
            return await self._once(producer, made)
        except RequestNotSent:
            # Nothing was written: the owner never saw it.
            pass
        except (ResponseNeverReceived, RequestTransmissionFailed):
            # A read without a body, on a kept connection (a new one failing says it all).
            reused = self._connection is not None and self._connection not in made
            if not (self._method in READS and producer is None and reused):
                raise
        if self.ended is not None:
            raise RequestNotSent()
        return await self._once(producer, made)

    async def _once(
        self, producer: BytesProducer | None, made: list[Any]
    ) -> tuple[IResponse, bytes]:
        self._connection = None
        self._connecting = self._route.connection(made)
        self._connection = connection = await self._connecting
        self._connecting = None
        request = Request(self._method, self._path, self._headers, producer, persistent=True)
        response: IResponse = await connection.request(request)
        answer: bytes = await readBody(response)
        return response, answer


class Forwarder:
    """Sends requests to other members as member ``name``, presenting ``identity``.

    ``deadline``: seconds each request may take beyond the wait it asks for
    (``DEADLINE``); ``watch_interval``: seconds between two looks at whether
    its member is still reachable (``WATCH_INTERVAL``).  Both may be changed
    between requests.
    """

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
        self._connections: _Connections = weakref.WeakSet()
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
        route.active += 1
        try:
            return await self._send(
                route, member, method, uri, body, content_type, wait, unreachable
            )
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
        wait: float | None,
        unreachable: Callable[[], str | None] | None,
    ) -> Relayed:
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
        exchange = _Exchange(route, method, uri, headers)
        timers = _Timers(self._reactor, exchange, where, unreachable, self.watch_interval)
        if wait is not None:
            timers.give_up_after(self.deadline + wait)
        try:
            response, answer = await exchange.run(producer)
        except Exception as e:
            if exchange.ended is None:
                raise _failure(e, where, route.tls) from None
            unknown = "" if method in READS else f"; {UNKNOWN_OUTCOME}"
            raise Unavailable(f"{exchange.ended}{unknown}") from None
        finally:
            timers.stop()
        relayed = {}
        for name in RELAYED_HEADERS:
            values = response.headers.getRawHeaders(name)
            if values:
                relayed[name] = values[0]
        return Relayed(response.code, relayed, answer)


class _Timers:
    """A request's deadline and its watch on its member, each giving it up when due."""

    def __init__(
        self,
        reactor: IVMReadyReactor,
        exchange: _Exchange,
        where: str,
        unreachable: Callable[[], str | None] | None,
        interval: float,
    ) -> None:
        self._reactor = reactor
        self._exchange = exchange
        self._where = where
        self._unreachable = unreachable
        self._interval = interval
        self._deadline: IDelayedCall | None = None
        self._watch: IDelayedCall | None = None
        if unreachable is not None:
            self._watch = reactor.callLater(interval, self._look)

    def give_up_after(self, seconds: float) -> None:
        """The request is given up if not answered in ``seconds``."""
        why = f"{self._where} did not answer within {seconds:g} s"
        self._deadline = self._reactor.callLater(seconds, self._exchange.give_up, why)

    def _look(self) -> None:
        assert self._unreachable is not None
        reason = self._unreachable()
        if reason is None:
            self._watch = self._reactor.callLater(self._interval, self._look)
            return
        self._watch = None
        self._exchange.give_up(f"{self._where} became unreachable before it answered: {reason}")

    def stop(self) -> None:
        """The request is over: nothing is given up any more."""
        for call in (self._deadline, self._watch):
            if call is not None and call.active():
                call.cancel()
        self._deadline = self._watch = None


def _failure(error: Exception, where: str, tls: PinnedServerTLS) -> Exception:
    """The one-line error a request that failed with ``error`` is."""
    if isinstance(error, ConnectError):
        return Unavailable(f"cannot reach {where}: {connect_reason(error)}")
    if isinstance(error, RequestNotSent):
        return BadGateway(f"lost the connection to {where} before it answered")
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
