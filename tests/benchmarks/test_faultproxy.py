"""``benchmarks._faultproxy``: who a partition silences, and real sockets going silent."""

from __future__ import annotations

import os
import socket

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from benchmarks._faultproxy import (
    LOOPBACK,
    UNKNOWN_SOURCE,
    FaultProxy,
    Partitions,
    Route,
    socket_inode,
    socket_owner,
)
from tests.reactor import reactor
from tests.received import Received

# Long enough for bytes on loopback to arrive many times over: what has not arrived by
# then was held back.
QUIET = 0.3


class PartitionsTests(SynchronousTestCase):
    """A connection is silent when either of its ends is cut off."""

    def test_nothingIsSilentWithoutAPartition(self) -> None:
        self.assertFalse(Partitions().silent("m1", "postgres"))

    def test_aCutSourceIsSilent(self) -> None:
        partitions = Partitions()
        partitions.cut_off("m1")
        self.assertTrue(partitions.silent("m1", "postgres"))

    def test_aCutTargetIsSilent(self) -> None:
        partitions = Partitions()
        partitions.cut_off("m2")
        self.assertTrue(partitions.silent("m1", "m2"))

    def test_othersStillTalk(self) -> None:
        partitions = Partitions()
        partitions.cut_off("m3")
        self.assertFalse(partitions.silent("m1", "m2"))

    def test_healedIsNotSilent(self) -> None:
        partitions = Partitions()
        partitions.cut_off("m1")
        partitions.heal("m1")
        self.assertFalse(partitions.silent("m1", "postgres"))
        self.assertEqual(partitions.cut, frozenset())


_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1538 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:D431 0100007F:1538 01 00000000:00000000 00:00000000 00000000     0        0 222 1
"""


class SocketOwnerTests(SynchronousTestCase):
    """Who holds the client end of a loopback connection, read from /proc."""

    def test_theInodeOfAConnectionIsRead(self) -> None:
        found = socket_inode((LOOPBACK, 0xD431), (LOOPBACK, 0x1538), _TABLE)
        self.assertEqual(found, 222)

    def test_noSuchConnectionHasNoInode(self) -> None:
        self.assertIsNone(socket_inode((LOOPBACK, 0xD432), (LOOPBACK, 0x1538), _TABLE))

    def test_thisProcessHoldsItsOwnClientSocket(self) -> None:
        with socket.create_server((LOOPBACK, 0)) as server, socket.socket() as client:
            client.connect(server.getsockname())
            local, remote = client.getsockname(), client.getpeername()
            self.assertEqual(socket_owner(local, remote, [1, os.getpid()]), os.getpid())

    def test_aSocketOfNoneOfThePidsHasNoOwner(self) -> None:
        with socket.create_server((LOOPBACK, 0)) as server, socket.socket() as client:
            client.connect(server.getsockname())
            self.assertIsNone(socket_owner(client.getsockname(), client.getpeername(), [1]))


class _Echo(Protocol):
    def __init__(self) -> None:
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(None)


class _Upstream:
    """An echo server on loopback that keeps the connections it accepted."""

    def __init__(self) -> None:
        self.served: list[_Echo] = []

    @property
    def accepted(self) -> int:
        return len(self.served)

    def build(self) -> Protocol:
        echo = _Echo()
        self.served.append(echo)
        return echo

    def closed(self) -> Deferred[list[None]]:
        """Once every connection it accepted is closed."""
        for echo in self.served:
            if echo.transport is not None and echo.connected:
                echo.transport.loseConnection()
        return gatherResults([echo.lost for echo in self.served])


class ProxyTests(TestCase):
    """Real loopback sockets through the proxy: relayed, silenced, healed."""

    async def start(self, source: str | None = "client") -> tuple[FaultProxy, Route, _Upstream]:
        upstream = _Upstream()
        port = await TCP4ServerEndpoint(reactor, 0, interface=LOOPBACK).listen(
            Factory.forProtocol(upstream.build)
        )
        self.addCleanup(port.stopListening)
        self.addCleanup(upstream.closed)
        proxy = FaultProxy(reactor)
        self.addCleanup(lambda: Deferred.fromCoroutine(proxy.close()))
        upstream_port = port.getHost().port
        route = await proxy.add_route(
            "server", TCP4ClientEndpoint(reactor, LOOPBACK, upstream_port), source
        )
        return proxy, route, upstream

    async def dial(self, route: Route) -> Received:
        client = Received()
        host, port = route.address.split(":")
        await connectProtocol(TCP4ClientEndpoint(reactor, host, int(port)), client)
        self.addCleanup(self.hang_up, client)
        return client

    def hang_up(self, client: Received) -> Deferred[None]:
        if client.transport is not None and client.connected:
            client.transport.loseConnection()
        return client.closed

    async def received(self, client: Received, expected: bytes) -> None:
        """Until ``client`` has received ``expected`` (the test's timeout bounds it)."""
        while client.received != expected:
            await deferLater(reactor, 0.01, lambda: None)

    async def quiet(self) -> None:
        await deferLater(reactor, QUIET, lambda: None)

    async def test_bytesAreRelayedBothWays(self) -> None:
        _, route, _ = await self.start()
        client = await self.dial(route)
        assert client.transport is not None
        client.transport.write(b"hello")
        await self.received(client, b"hello")

    async def test_aPartitionedTargetPassesNothingUntilHealed(self) -> None:
        proxy, route, _ = await self.start()
        client = await self.dial(route)
        assert client.transport is not None
        client.transport.write(b"one")
        await self.received(client, b"one")
        proxy.partition("server")
        client.transport.write(b"two")
        await self.quiet()
        self.assertEqual(client.received, b"one")
        proxy.heal("server")
        await self.received(client, b"onetwo")

    async def test_aPartitionedSourcePassesNothingUntilHealed(self) -> None:
        proxy, route, _ = await self.start()
        client = await self.dial(route)
        proxy.partition("client")
        assert client.transport is not None
        client.transport.write(b"held")
        await self.quiet()
        self.assertEqual(client.received, b"")
        proxy.heal_all()
        await self.received(client, b"held")

    async def test_aConnectionAcceptedDuringAPartitionDialsOnlyOnceHealed(self) -> None:
        proxy, route, upstream = await self.start()
        proxy.partition("server")
        client = await self.dial(route)
        assert client.transport is not None
        client.transport.write(b"late")
        await self.quiet()
        self.assertEqual((upstream.accepted, client.received), (0, b""))
        proxy.heal("server")
        await self.received(client, b"late")
        self.assertEqual(upstream.accepted, 1)

    async def test_aCloseDuringAPartitionArrivesOnlyOnceHealed(self) -> None:
        proxy, route, _ = await self.start()
        client = await self.dial(route)
        assert client.transport is not None
        client.transport.write(b"x")
        await self.received(client, b"x")
        proxy.partition("server")
        for connection in list(route.connections):
            outbound = connection.outbound
            assert outbound is not None and outbound.transport is not None
            outbound.transport.loseConnection()
        await self.quiet()
        self.assertFalse(client.closed.called)
        proxy.heal("server")
        await client.closed

    async def test_anUnreachableUpstreamClosesTheClient(self) -> None:
        proxy = FaultProxy(reactor)
        self.addCleanup(lambda: Deferred.fromCoroutine(proxy.close()))
        with socket.create_server((LOOPBACK, 0)) as taken:
            unused = taken.getsockname()[1]
        route = await proxy.add_route(
            "server", TCP4ClientEndpoint(reactor, LOOPBACK, unused), "client"
        )
        client = await self.dial(route)
        await client.closed

    async def test_theSourceIsFoundByTheProcessThatDialled(self) -> None:
        proxy, route, _ = await self.start(source=None)
        proxy.processes[os.getpid()] = "me"
        client = await self.dial(route)
        while not route.connections:
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual([c.source for c in route.connections], ["me"])
        proxy.partition("me")
        assert client.transport is not None
        client.transport.write(b"mine")
        await self.quiet()
        self.assertEqual(client.received, b"")
        proxy.heal("me")
        await self.received(client, b"mine")

    async def test_aProcessNotKnownIsAnUnknownSource(self) -> None:
        _, route, _ = await self.start(source=None)
        await self.dial(route)
        while not route.connections:
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual([c.source for c in route.connections], [UNKNOWN_SOURCE])
