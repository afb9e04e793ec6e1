"""vmready.api.promptio: a connection read as it is accepted, an answer written as it is finished.

Each test adopts one end of a real UNIX socket pair into the real reactor
(``IReactorSocket.adoptStreamConnection``, which builds the same
``twisted.internet.tcp`` connection a listening port does) and looks at the
other end without letting the reactor turn: what is there was done *now*.
"""

from __future__ import annotations

import json
import socket
from typing import Any, cast

from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IReactorSocket
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request

from tests.reactor import reactor
from vmready.api.limits import LimitedSite
from vmready.api.promptio import read_now, socket_connection, write_now

_DONE = Failure(ConnectionDone())


class _Recorder(Protocol):
    """Keeps what it is told; ``read_at_once``: reads in ``connectionMade``, as LimitedChannel."""

    def __init__(self, read_at_once: bool = False) -> None:
        self.read_at_once = read_at_once
        self.received: list[bytes] = []
        self.lost: list[Failure] = []

    def connectionMade(self) -> None:
        if self.read_at_once:
            read_now(self.transport)

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        self.lost.append(reason)


class _One(ServerFactory):
    def __init__(self, protocol: Protocol) -> None:
        self.protocol_made = protocol

    def buildProtocol(self, addr: object) -> Any:
        return self.protocol_made


class _Hello(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"hello"


def _envelope(code: int, message: str) -> dict[str, Any]:
    return {"error_code": code, "error": message}


def _waiting(peer: socket.socket) -> bytes:
    """What ``peer`` can read right now, without waiting (b"" once closed)."""
    try:
        return peer.recv(1 << 20, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b"<nothing yet>"


class _Adopting(TestCase):
    def pair(self) -> tuple[socket.socket, socket.socket]:
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(peer.close)
        ours.setblocking(False)
        return ours, peer

    def adopt(self, ours: socket.socket, factory: ServerFactory[Any]) -> None:
        with ours:  # the reactor keeps its own duplicate of the descriptor
            cast(IReactorSocket, reactor).adoptStreamConnection(
                ours.fileno(), socket.AF_UNIX, factory
            )

    def closing(self, protocol: _Recorder) -> None:
        def close() -> None:
            if protocol.transport is not None and not protocol.lost:  # still open
                protocol.transport.abortConnection()  # type: ignore[attr-defined]

        self.addCleanup(close)

    def connected(self, protocol: _Recorder, sent: bytes = b"") -> socket.socket:
        """``protocol`` on one end of a new pair, after the peer ``sent``; the peer's end."""
        ours, peer = self.pair()
        if sent:
            peer.sendall(sent)
        self.closing(protocol)
        self.adopt(ours, _One(protocol))
        return peer

    async def turn(self) -> None:
        """Let the reactor turn twice: what was put off to its next turn, then its poll."""
        await deferLater(reactor, 0, lambda: None)
        await deferLater(reactor, 0, lambda: None)


class ReadNowTests(_Adopting):
    async def test_whatThePeerSentIsReadAsTheConnectionIsMade(self) -> None:
        protocol = _Recorder(read_at_once=True)
        self.connected(protocol, sent=b"GET / HTTP/1.1\r\n\r\n")
        self.assertEqual(protocol.received, [b"GET / HTTP/1.1\r\n\r\n"])

    async def test_withoutItTheReactorReadsOnlyAtItsNextTurn(self) -> None:
        protocol = _Recorder(read_at_once=False)
        self.connected(protocol, sent=b"hello")
        self.assertEqual(protocol.received, [])
        await self.turn()
        self.assertEqual(protocol.received, [b"hello"])

    async def test_nothingSentYetLeavesTheConnectionToTheReactor(self) -> None:
        protocol = _Recorder(read_at_once=True)
        peer = self.connected(protocol)
        self.assertEqual((protocol.received, protocol.lost), ([], []))
        peer.sendall(b"later")
        await self.turn()
        self.assertEqual(protocol.received, [b"later"])

    async def test_aPeerThatHungUpEndsTheConnectionAtOnce(self) -> None:
        ours, peer = self.pair()
        peer.close()
        protocol = _Recorder(read_at_once=True)
        self.adopt(ours, _One(protocol))
        [reason] = protocol.lost
        reason.trap(ConnectionDone)
        assert protocol.transport is not None
        self.assertFalse(protocol.transport.connected)  # type: ignore[attr-defined]

    async def test_aProtocolThatRaisesLosesItsConnectionNotTheListener(self) -> None:
        ours, peer = self.pair()
        peer.sendall(b"boom")

        class Raising(_Recorder):
            def dataReceived(self, data: bytes) -> None:
                raise ValueError("cannot parse " + data.decode())

        protocol = Raising(read_at_once=True)
        self.adopt(ours, _One(protocol))  # returns: the error stays with this connection
        [reason] = protocol.lost
        reason.trap(ValueError)
        self.assertEqual(str(reason.value), "cannot parse boom")
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        await self.turn()
        self.assertEqual(_waiting(peer), b"")


class WriteNowTests(_Adopting):
    def made(self) -> tuple[_Recorder, socket.socket]:
        protocol = _Recorder()
        return protocol, self.connected(protocol)

    async def test_whatWasWrittenIsOnTheSocketWhenItReturns(self) -> None:
        protocol, peer = self.made()
        assert protocol.transport is not None
        protocol.transport.write(b"the answer")
        self.assertEqual(_waiting(peer), b"<nothing yet>")  # Twisted alone: the next turn
        write_now(protocol.transport)
        self.assertEqual(_waiting(peer), b"the answer")
        self.assertEqual(protocol.lost, [])

    async def test_aCloseThatWaitedForTheAnswerHappensAtTheNextTurn(self) -> None:
        protocol, peer = self.made()
        assert protocol.transport is not None
        protocol.transport.write(b"bye")
        protocol.transport.loseConnection()
        write_now(protocol.transport)
        self.assertEqual((_waiting(peer), protocol.lost), (b"bye", []))
        await self.turn()
        [reason] = protocol.lost
        reason.trap(ConnectionDone)
        self.assertEqual(_waiting(peer), b"")

    async def test_aPeerGoneEndsTheConnection(self) -> None:
        protocol, peer = self.made()
        peer.close()
        assert protocol.transport is not None
        protocol.transport.write(b"nobody reads this")
        write_now(protocol.transport)
        await self.turn()
        [reason] = protocol.lost
        reason.trap(ConnectionLost, ConnectionDone)

    def test_aTransportThatIsNoSocketIsLeftAlone(self) -> None:
        transport = StringTransport()
        transport.write(b"kept")
        write_now(transport)
        read_now(transport)
        self.assertEqual(transport.value(), b"kept")

    async def test_theSocketIsFoundUnderWrappers(self) -> None:
        protocol, _ = self.made()

        class Wrapper:
            def __init__(self, inner: object) -> None:
                self.transport = inner

        self.assertIs(socket_connection(Wrapper(Wrapper(protocol.transport))), protocol.transport)
        deep: object = protocol.transport
        for _ in range(6):
            deep = Wrapper(deep)
        self.assertIsNone(socket_connection(deep))
        self.assertIsNone(socket_connection(Wrapper(None)))


class LimitedChannelTests(_Adopting):
    """vmready's HTTP channel answers a request in the turn that accepted its connection."""

    async def answered(self, site: LimitedSite, request: bytes) -> tuple[bytes, bytes]:
        ours, peer = self.pair()
        if request:
            peer.sendall(request)
        self.adopt(ours, site)
        at_once = _waiting(peer)
        await self.turn()
        return at_once, _waiting(peer)

    async def test_aRequestAlreadySentIsAnsweredBeforeTheReactorTurns(self) -> None:
        site = LimitedSite(_Hello(), _envelope, label="test")
        at_once, then = await self.answered(
            site, b"GET / HTTP/1.1\r\nHost: v\r\nConnection: close\r\n\r\n"
        )
        self.assertTrue(at_once.startswith(b"HTTP/1.1 200 OK\r\n"), at_once)
        self.assertTrue(at_once.endswith(b"\r\n\r\nhello"), at_once)
        self.assertEqual(then, b"")  # and closed at the next turn
        self.assertEqual(site.connections, 0)

    async def test_aRefusalIsWrittenAtOnce(self) -> None:
        site = LimitedSite(_Hello(), _envelope, label="test", max_connections=0)
        at_once, then = await self.answered(site, b"")  # refused before it reads anything
        head, _, body = at_once.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 503 "), at_once)
        self.assertEqual(json.loads(body)["error"], "Too many connections (limit 0)")
        self.assertEqual(then, b"")
