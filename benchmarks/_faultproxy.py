"""A TCP proxy on loopback that a fault harness controls: partitions as real sockets going silent.

Cluster members reach PostgreSQL and each other through it
(``benchmarks/cluster_faults.py``): each *route* listens on a port of
127.0.0.1 of its own and relays every connection it accepts to its upstream
(PostgreSQL's unix socket, a member's mutual-TLS port), byte for byte; TLS
and PostgreSQL's protocol pass through untouched.  Every connection knows who
is at each end: the route's ``target`` (who serves it), and its ``source``,
either fixed for the route (a member's own way to PostgreSQL) or found for
each connection from the process holding its client socket (``socket_owner``:
``/proc/net/tcp`` and the process' file descriptors), since every member dials
another one at the one address the members table gives.

``partition(name)`` cuts ``name`` off: every connection with ``name`` at
either end stops relaying at once, in both directions (neither side's socket
is read, so what it sends stays in the kernel), a connection accepted
meanwhile is held without dialling its upstream, and a close on one side is
not passed to the other.  ``heal(name)`` lets everything through again: the
held connections dial, what was sent meanwhile arrives, the closes arrive.
The endpoints' sockets stay open throughout, as through a partition TCP
has not yet noticed: the proxy's own kernel acknowledges what a silent
endpoint sends, so TCP keepalives and ``tcp_user_timeout`` never break a
silenced connection; a partition shorter than those timeouts (25 to 30 s for
vmready's store connections) is what this tests.

Which connections a partition silences is decided by ``Partitions`` alone, a
plain object without I/O.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint, connectProtocol
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IPushProducer,
    IReactorTCP,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure

__all__ = ["FaultProxy", "Partitions", "Route", "socket_owner"]

LOOPBACK = "127.0.0.1"
# Who dialled, when the process holding the client socket is not one the proxy was told of.
UNKNOWN_SOURCE = "?"


class Partitions:
    """Which endpoints are cut off, and so which connections are silent."""

    def __init__(self) -> None:
        self._cut: set[str] = set()

    @property
    def cut(self) -> frozenset[str]:
        """The endpoints cut off now."""
        return frozenset(self._cut)

    def cut_off(self, name: str) -> None:
        """``name`` reaches nobody and nobody reaches it."""
        self._cut.add(name)

    def heal(self, name: str) -> None:
        """``name`` is reachable again."""
        self._cut.discard(name)

    def heal_all(self) -> None:
        """Nobody is cut off."""
        self._cut.clear()

    def silent(self, source: str, target: str) -> bool:
        """Whether a connection from ``source`` to ``target`` passes nothing now."""
        return source in self._cut or target in self._cut


def _hex_address(host: str, port: int) -> str:
    """How ``/proc/net/tcp`` writes an IPv4 address: the address' bytes reversed, in hex."""
    packed = bytes(int(part) for part in host.split("."))
    return f"{int.from_bytes(packed, 'little'):08X}:{port:04X}"


def socket_inode(local: tuple[str, int], remote: tuple[str, int], table: str) -> int | None:
    """The inode of the IPv4 TCP socket from ``local`` to ``remote`` in a ``/proc/net/tcp``
    text, or None."""
    wanted = (_hex_address(*local), _hex_address(*remote))
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and (fields[1], fields[2]) == wanted:
            return int(fields[9])
    return None


def socket_owner(
    local: tuple[str, int], remote: tuple[str, int], pids: Iterable[int]
) -> int | None:
    """Which of ``pids`` holds the TCP socket from ``local`` to ``remote`` (its client end,
    on this host), or None."""
    try:
        with open("/proc/net/tcp") as f:
            inode = socket_inode(local, remote, f.read())
    except OSError:
        return None
    if inode is None:
        return None
    link = f"socket:[{inode}]"
    for pid in pids:
        directory = f"/proc/{pid}/fd"
        try:
            descriptors = os.listdir(directory)
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(os.path.join(directory, descriptor)) == link:
                    return pid
            except OSError:
                continue
    return None


@attrs.define
class Route:
    """One listening port of the proxy and where its connections go.

    ``source``: who dials this route; None: whichever process holds the
    client's socket, by ``FaultProxy.processes`` (``UNKNOWN_SOURCE`` if none).
    """

    target: str
    upstream: IStreamClientEndpoint
    source: str | None
    port: IListeningPort | None = None
    connections: set[_Connection] = attrs.field(factory=set)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, where the route listens."""
        assert self.port is not None
        return f"{LOOPBACK}:{self.port.getHost().port}"  # type: ignore[attr-defined]  # a TCP port has a port


def _producer(side: Protocol | None) -> IPushProducer | None:
    """The transport of a side still connected, as the producer that it is."""
    if side is None or side.transport is None or not side.connected:
        return None
    return IPushProducer(side.transport)


class _Connection:
    """One accepted connection and the one it dialled upstream, relayed unless silent."""

    def __init__(self, proxy: FaultProxy, route: Route, inbound: _Inbound, source: str) -> None:
        self.proxy = proxy
        self.route = route
        self.inbound = inbound
        self.source = source
        self.outbound: _Outbound | None = None
        self.dialling = False
        self.silent = False
        # A side closed while silent: the other side learns of it once healed.
        self.closed = False
        self.ended = False

    def judge(self) -> None:
        """Silence or relay, as the partitions now say."""
        if self.ended:
            return
        self.silent = self.proxy.partitions.silent(self.source, self.route.target)
        if self.silent:
            self._flow(paused=True)
        elif self.closed:
            self.end()
        elif self.outbound is None:
            self._dial()
        else:
            self._flow(paused=False)

    def _flow(self, paused: bool) -> None:
        """Neither side's socket read (paused), or both read again."""
        for side in (self.inbound, self.outbound):
            producer = _producer(side)
            if producer is None:
                continue
            if paused:
                producer.pauseProducing()
            else:
                producer.resumeProducing()

    def _dial(self) -> None:
        if self.dialling:
            return
        self.dialling = True
        dialled: Deferred[Protocol] = connectProtocol(self.route.upstream, _Outbound(self))
        dialled.addErrback(lambda _: self.side_closed())

    def dialled(self, outbound: _Outbound) -> None:
        """The upstream connection is up."""
        self.outbound = outbound
        self.judge()

    def side_closed(self) -> None:
        """One side lost its connection (or never got one): the other follows unless silent."""
        self.closed = True
        if not self.silent:
            self.end()

    def end(self) -> None:
        """Close both sides and forget the connection."""
        if self.ended:
            return
        self.ended = True
        self.route.connections.discard(self)
        for side in (self.inbound, self.outbound):
            if side is not None and side.transport is not None and side.connected:
                side.transport.loseConnection()


class _Inbound(Protocol):
    """The accepted side: what the client sends goes upstream."""

    def __init__(self, proxy: FaultProxy, route: Route) -> None:
        self.proxy = proxy
        self.route = route
        self.connection: _Connection | None = None
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.proxy.sides.add(self)
        transport = self.transport
        assert transport is not None
        # Nothing is read until the upstream connection is up (and not silent).
        IPushProducer(transport).pauseProducing()
        who = self.route.source
        if who is None:
            who = self.proxy.dialled_by(transport.getPeer(), transport.getHost())
        connection = self.connection = _Connection(self.proxy, self.route, self, who)
        self.route.connections.add(connection)
        connection.judge()

    def dataReceived(self, data: bytes) -> None:
        connection = self.connection
        if connection is not None and connection.outbound is not None:
            upstream = connection.outbound.transport
            if upstream is not None:
                upstream.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.proxy.sides.discard(self)
        self.lost.callback(None)
        if self.connection is not None:
            self.connection.side_closed()


class _Outbound(Protocol):
    """The upstream side: what the server sends goes back to the client."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.connection.proxy.sides.add(self)
        self.connection.dialled(self)

    def dataReceived(self, data: bytes) -> None:
        downstream = self.connection.inbound.transport
        if downstream is not None:
            downstream.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.connection.proxy.sides.discard(self)
        self.lost.callback(None)
        self.connection.side_closed()


class FaultProxy:
    """Routes on 127.0.0.1, and the partitions that silence their connections."""

    def __init__(self, reactor: IReactorTCP) -> None:
        self.reactor = reactor
        self.partitions = Partitions()
        self.routes: list[Route] = []
        # Which process is which endpoint, for routes whose source is found by process.
        self.processes: dict[int, str] = {}
        # Every side of a connection still connected (``close`` waits until none is).
        self.sides: set[_Inbound | _Outbound] = set()

    async def add_route(
        self, target: str, upstream: IStreamClientEndpoint, source: str | None = None
    ) -> Route:
        """A new listening port relaying to ``upstream``; its connections go to ``target``."""
        route = Route(target, upstream, source)
        factory = Factory.forProtocol(lambda: _Inbound(self, route))
        endpoint = TCP4ServerEndpoint(self.reactor, 0, interface=LOOPBACK)
        route.port = await endpoint.listen(factory)
        self.routes.append(route)
        return route

    def dialled_by(self, client: IAddress, server: IAddress) -> str:
        """The endpoint whose process holds the client end of a connection, by ``processes``."""
        client_port, server_port = getattr(client, "port", None), getattr(server, "port", None)
        if not isinstance(client_port, int) or not isinstance(server_port, int):
            return UNKNOWN_SOURCE
        pid = socket_owner((LOOPBACK, client_port), (LOOPBACK, server_port), list(self.processes))
        return UNKNOWN_SOURCE if pid is None else self.processes[pid]

    def partition(self, name: str) -> None:
        """Cut ``name`` off: its connections fall silent, both ways."""
        self.partitions.cut_off(name)
        self._judge_all()

    def heal(self, name: str) -> None:
        """``name`` is reachable again."""
        self.partitions.heal(name)
        self._judge_all()

    def heal_all(self) -> None:
        """Every partition healed."""
        self.partitions.heal_all()
        self._judge_all()

    def _judge_all(self) -> None:
        for route in self.routes:
            for connection in list(route.connections):
                connection.judge()

    async def close(self) -> None:
        """Stop listening and close every connection; fires once every side is closed."""
        for route in self.routes:
            for connection in list(route.connections):
                connection.end()
            if route.port is not None:
                await maybeDeferred(route.port.stopListening)
        self.routes.clear()
        for side in list(self.sides):
            if side.transport is not None:
                side.transport.loseConnection()
        await gatherResults([side.lost for side in self.sides])
