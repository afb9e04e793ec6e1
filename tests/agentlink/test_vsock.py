"""vmready.agentlink.vsock, hvsock, vsockaddress, endpointstrings: the vsock and hybrid vsock
endpoints and their endpoint strings."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import attrs
from twisted.internet.address import IPv4Address, UNIXAddress
from twisted.internet.defer import Deferred, DeferredQueue, gatherResults
from twisted.internet.endpoints import clientFromString, quoteStringArgument, serverFromString
from twisted.internet.error import (
    CannotListenError,
    ConnectError,
    ConnectingCancelledError,
    ConnectionAborted,
    ConnectionDone,
    ConnectionRefusedError,
    TimeoutError,
)
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from tests.reactor import reactor
from vmready.agentlink import hvsock, vsock
from vmready.agentlink.hvsock import HybridVSockClientEndpoint, HybridVSockServerEndpoint
from vmready.agentlink.vsock import (
    VSockClientEndpoint,
    VSockServerEndpoint,
    vsock_unavailable_reason,
)
from vmready.agentlink.vsockaddress import (
    AF_VSOCK,
    VMADDR_CID_ANY,
    VMADDR_CID_HOST,
    VMADDR_CID_LOCAL,
    VMADDR_PORT_ANY,
    HybridVSockAddress,
    VSockAddress,
)

PAYLOAD = b"GET /1.0 HTTP/1.1\r\n\r\n"


def _vsock_listen_unavailable_reason() -> str | None:
    """Why this kernel cannot even listen on AF_VSOCK (no loopback needed), or None."""
    try:
        with socket.socket(AF_VSOCK, socket.SOCK_STREAM) as listener:
            listener.bind((VMADDR_CID_ANY, VMADDR_PORT_ANY))
            listener.listen(1)
    except OSError as e:
        return f"cannot listen on AF_VSOCK here: {e}"
    return None


VSOCK_LOOPBACK_SKIP = vsock_unavailable_reason()
VSOCK_LISTEN_SKIP = _vsock_listen_unavailable_reason()


class _Echo(Protocol):
    """Server side: echoes everything."""

    factory: _EchoFactory

    def __init__(self) -> None:
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.factory.made.put(self)

    def dataReceived(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(None)
        self.factory.lost.put(self)


class _EchoFactory(Factory[_Echo]):
    """Builds _Echo protocols; queues each one as it connects and as it goes."""

    protocol = _Echo

    def __init__(self) -> None:
        self.made: DeferredQueue[_Echo] = DeferredQueue()
        self.lost: DeferredQueue[_Echo] = DeferredQueue()


class _Collector(Protocol):
    """Client side: collects bytes until it has as many as it waits for."""

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[None] = Deferred()
        self._waiting: tuple[int, Deferred[bytes]] | None = None

    def receive(self, count: int) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        self._waiting = (count, d)
        self._check()
        return d

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        self._check()

    def _check(self) -> None:
        if self._waiting is not None and len(self.received) >= self._waiting[0]:
            d = self._waiting[1]
            self._waiting = None
            d.callback(self.received)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(None)


@attrs.frozen
class _Pair:
    """A listening port with one client connected to it, both ends known."""

    port: IListeningPort
    client: _Collector
    server: _Echo


async def _listen(
    test: TestCase, endpoint: IStreamServerEndpoint, factory: _EchoFactory | None = None
) -> IListeningPort:
    """Listen with an echo factory; the test stops listening when it ends."""
    port: IListeningPort = await endpoint.listen(factory or _EchoFactory())
    test.addCleanup(port.stopListening)
    return port


async def _connect_pair(
    test: TestCase,
    server_endpoint: IStreamServerEndpoint,
    client_endpoint_for: Callable[[Any], IStreamClientEndpoint],
) -> _Pair:
    """Listen, connect one client to the chosen address; cleanup closes both ends."""
    factory = _EchoFactory()
    port = await _listen(test, server_endpoint, factory)
    client = _Collector()
    await client_endpoint_for(port.getHost()).connect(Factory.forProtocol(lambda: client))
    server = await factory.made.get()

    def close() -> Deferred[list[None]]:
        assert client.transport is not None
        client.transport.loseConnection()
        return gatherResults([client.closed, server.closed])

    test.addCleanup(close)
    return _Pair(port, client, server)


def _vsock_host(port: IListeningPort) -> VSockAddress:
    host = port.getHost()
    assert isinstance(host, VSockAddress), host
    return host


def _hybrid_host(port: IListeningPort) -> HybridVSockAddress:
    host = port.getHost()
    assert isinstance(host, HybridVSockAddress), host
    return host


async def _stop(port: IListeningPort) -> None:
    stopping = port.stopListening()
    if stopping is not None:
        await stopping


async def _round_trip(pair: _Pair, payload: bytes = PAYLOAD) -> bytes:
    """Send payload from the client; what it reads back."""
    assert pair.client.transport is not None
    pair.client.transport.write(payload)
    return await pair.client.receive(len(payload))


def _short_temp_dir(test: SynchronousTestCase) -> str:
    """A fresh directory whose unix socket paths stay far below the 107-byte limit."""
    directory = tempfile.mkdtemp(prefix="vmr-vsock-", dir="/tmp")
    test.addCleanup(shutil.rmtree, directory, True)
    return directory


def _stale_socket(path: str) -> None:
    """Leave a unix socket file at path that nothing listens on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)


def _raise_no_vsock() -> socket.socket:
    raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))


class AddressTests(SynchronousTestCase):
    """The address objects getHost and getPeer return."""

    def test_vsockAddressIsAnIAddress(self) -> None:
        self.assertTrue(IAddress.providedBy(VSockAddress(3, 1024)))

    def test_vsockAddressesWithTheSameCidAndPortAreEqual(self) -> None:
        self.assertEqual(VSockAddress(3, 1024), VSockAddress(3, 1024))
        self.assertEqual(len({VSockAddress(3, 1024), VSockAddress(3, 1024)}), 1)
        self.assertNotEqual(VSockAddress(3, 1024), VSockAddress(4, 1024))

    def test_hybridAddressIsAnIAddress(self) -> None:
        self.assertTrue(IAddress.providedBy(HybridVSockAddress("/run/vm/v.sock", 52)))

    def test_hybridSocketPathIsPathUnderscorePort(self) -> None:
        address = HybridVSockAddress("/run/vm/v.sock", 52)
        self.assertEqual(address.socket_path, "/run/vm/v.sock_52")

    def test_wellKnownCidsAndPorts(self) -> None:
        self.assertEqual(VMADDR_CID_HOST, 2)
        self.assertEqual(VMADDR_CID_LOCAL, 1)
        self.assertEqual(VMADDR_CID_ANY, 2**32 - 1)
        self.assertEqual(VMADDR_PORT_ANY, 2**32 - 1)


class EndpointArgumentTests(SynchronousTestCase):
    """Endpoint constructors refuse values no vsock address can have."""

    def test_endpointsProvideTheEndpointInterfaces(self) -> None:
        fake = MemoryReactorClock()
        self.assertTrue(IStreamServerEndpoint.providedBy(VSockServerEndpoint(fake)))
        self.assertTrue(IStreamClientEndpoint.providedBy(VSockClientEndpoint(fake, 2, 5)))
        self.assertTrue(IStreamServerEndpoint.providedBy(HybridVSockServerEndpoint(fake, "/b")))
        self.assertTrue(IStreamClientEndpoint.providedBy(HybridVSockClientEndpoint(fake, "/b", 5)))

    def test_serverPortAbove32BitsIsRefused(self) -> None:
        error = self.assertRaises(ValueError, VSockServerEndpoint, MemoryReactorClock(), 2**32)
        self.assertIn("port", str(error))

    def test_clientCidBelowZeroIsRefused(self) -> None:
        error = self.assertRaises(ValueError, VSockClientEndpoint, MemoryReactorClock(), -1, 5)
        self.assertIn("cid", str(error))

    def test_hybridServerNeedsAPath(self) -> None:
        error = self.assertRaises(ValueError, HybridVSockServerEndpoint, MemoryReactorClock(), "")
        self.assertIn("path", str(error))

    def test_hybridModeMustBePermissionBits(self) -> None:
        error = self.assertRaises(
            ValueError, HybridVSockServerEndpoint, MemoryReactorClock(), "/b", mode=0o10000
        )
        self.assertIn("mode", str(error))


class VSockWithoutKernelSupportTests(TestCase):
    """Where AF_VSOCK sockets cannot be made, listen and connect fail loudly and say why."""

    def setUp(self) -> None:
        self.patch(vsock, "_new_vsock_socket", _raise_no_vsock)

    async def test_listenFailsWithCannotListenErrorNamingVsockAndTheOSError(self) -> None:
        endpoint = VSockServerEndpoint(reactor, port=0)
        with self.assertRaises(CannotListenError) as raised:
            await endpoint.listen(_EchoFactory())
        self.assertEqual(raised.exception.socketError.errno, errno.EAFNOSUPPORT)
        self.assertIn("vsock", str(raised.exception))
        self.assertIn(os.strerror(errno.EAFNOSUPPORT), str(raised.exception))

    async def test_connectFailsWithConnectErrorCarryingTheOSError(self) -> None:
        endpoint = VSockClientEndpoint(reactor, VMADDR_CID_HOST, 1024)
        with self.assertRaises(ConnectError) as raised:
            await endpoint.connect(Factory.forProtocol(_Collector))
        self.assertEqual(raised.exception.osError.errno, errno.EAFNOSUPPORT)
        self.assertIn("AF_VSOCK", str(raised.exception))

    def test_unavailableReasonNamesAFVsockAndTheOSError(self) -> None:
        reason = vsock_unavailable_reason()
        assert reason is not None
        self.assertIn("AF_VSOCK", reason)
        self.assertIn(os.strerror(errno.EAFNOSUPPORT), reason)


class VSockAnyKernelTests(TestCase):
    """Kernel vsock behaviour that holds whatever vsock support this kernel has."""

    async def test_listenOnACidThatIsNotOursFailsWithCannotListenError(self) -> None:
        endpoint = VSockServerEndpoint(reactor, port=0, cid=4_000_000_000)
        with self.assertRaises(CannotListenError) as raised:
            await endpoint.listen(_EchoFactory())
        self.assertIn("vsock:4000000000", str(raised.exception))

    async def test_cancellingAConnectAttemptFailsItWithConnectingCancelled(self) -> None:
        attempt = VSockClientEndpoint(reactor, VMADDR_CID_LOCAL, 1024).connect(
            Factory.forProtocol(_Collector)
        )
        attempt.cancel()
        with self.assertRaises(ConnectingCancelledError) as raised:
            await attempt
        self.assertEqual(raised.exception.address, VSockAddress(VMADDR_CID_LOCAL, 1024))
        # Let the abandoned attempt's scheduled first step run and find nothing to do.
        await deferLater(reactor, 0, lambda: None)


class VSockListenTests(TestCase):
    """Listening on real AF_VSOCK (needs vsock in the kernel, not loopback)."""

    skip = VSOCK_LISTEN_SKIP

    async def test_listenOnPortZeroGetsAKernelChosenPort(self) -> None:
        port = await _listen(self, VSockServerEndpoint(reactor, port=0))
        host = _vsock_host(port)
        self.assertIsInstance(host, VSockAddress)
        self.assertEqual(host.cid, VMADDR_CID_ANY)
        self.assertNotIn(host.port, (0, VMADDR_PORT_ANY))

    async def test_listenOnATakenPortFailsWithAddressInUse(self) -> None:
        taken = _vsock_host(await _listen(self, VSockServerEndpoint(reactor, port=0))).port
        with self.assertRaises(CannotListenError) as raised:
            await VSockServerEndpoint(reactor, port=taken).listen(_EchoFactory())
        self.assertEqual(raised.exception.socketError.errno, errno.EADDRINUSE)

    async def test_stopListeningFreesThePort(self) -> None:
        first = await VSockServerEndpoint(reactor, port=0).listen(_EchoFactory())
        chosen = _vsock_host(first).port
        await _stop(first)
        again = await _listen(self, VSockServerEndpoint(reactor, port=chosen))
        self.assertEqual(_vsock_host(again).port, chosen)


def _vsock_client_for(address: VSockAddress) -> VSockClientEndpoint:
    return VSockClientEndpoint(reactor, VMADDR_CID_LOCAL, address.port, timeout=5)


class VSockLoopbackTests(TestCase):
    """Real AF_VSOCK connections through the kernel's loopback transport."""

    skip = VSOCK_LOOPBACK_SKIP

    async def test_clientAndServerRoundTripBytes(self) -> None:
        pair = await _connect_pair(self, VSockServerEndpoint(reactor), _vsock_client_for)
        self.assertEqual(await _round_trip(pair), PAYLOAD)

    async def test_clientPeerIsTheAddressItDialled(self) -> None:
        pair = await _connect_pair(self, VSockServerEndpoint(reactor), _vsock_client_for)
        assert pair.client.transport is not None
        self.assertEqual(
            pair.client.transport.getPeer(),
            VSockAddress(VMADDR_CID_LOCAL, _vsock_host(pair.port).port),
        )

    async def test_acceptedConnectionPeerIsTheClientsVSockAddress(self) -> None:
        pair = await _connect_pair(self, VSockServerEndpoint(reactor), _vsock_client_for)
        assert pair.client.transport is not None and pair.server.transport is not None
        client_host = pair.client.transport.getHost()
        assert isinstance(client_host, VSockAddress), client_host
        self.assertEqual(
            pair.server.transport.getPeer(), VSockAddress(VMADDR_CID_LOCAL, client_host.port)
        )

    async def test_acceptedConnectionHostIsTheListeningPort(self) -> None:
        pair = await _connect_pair(self, VSockServerEndpoint(reactor), _vsock_client_for)
        assert pair.server.transport is not None
        host = pair.server.transport.getHost()
        assert isinstance(host, VSockAddress), host
        self.assertEqual(host.port, _vsock_host(pair.port).port)

    async def test_connectingToAPortWithNoListenerIsRefused(self) -> None:
        chosen = await VSockServerEndpoint(reactor).listen(_EchoFactory())
        free_port = _vsock_host(chosen).port
        await _stop(chosen)
        endpoint = VSockClientEndpoint(reactor, VMADDR_CID_LOCAL, free_port, timeout=5)
        with self.assertRaises(ConnectionRefusedError):
            await endpoint.connect(Factory.forProtocol(_Collector))

    async def test_endpointStringsListenAndConnect(self) -> None:
        def client_for(address: VSockAddress) -> IStreamClientEndpoint:
            description = f"vsock:cid=local:port={address.port}:timeout=5"
            endpoint: IStreamClientEndpoint = clientFromString(reactor, description)
            return endpoint

        pair = await _connect_pair(self, serverFromString(reactor, "vsock:0"), client_for)
        self.assertEqual(await _round_trip(pair), PAYLOAD)


class HybridVSockTests(TestCase):
    """Hybrid vsock over real unix sockets in a short temporary directory."""

    def setUp(self) -> None:
        self.base = os.path.join(_short_temp_dir(self), "v.sock")

    def client_for(self, address: HybridVSockAddress) -> HybridVSockClientEndpoint:
        return HybridVSockClientEndpoint(reactor, address.path, address.port, timeout=5)

    async def test_listenOnPortZeroChoosesARandomPort(self) -> None:
        port = await _listen(self, HybridVSockServerEndpoint(reactor, self.base))
        host = _hybrid_host(port)
        self.assertIsInstance(host, HybridVSockAddress)
        self.assertEqual(host.path, self.base)
        self.assertTrue(1024 <= host.port < 2**31, host.port)

    async def test_listenCreatesTheSocketFileWithMode0600(self) -> None:
        port = await _listen(self, HybridVSockServerEndpoint(reactor, self.base))
        mode = os.stat(_hybrid_host(port).socket_path).st_mode
        self.assertTrue(stat.S_ISSOCK(mode))
        self.assertEqual(stat.S_IMODE(mode), 0o600)

    async def test_listenGivesTheSocketFileTheRequestedMode(self) -> None:
        port = await _listen(self, HybridVSockServerEndpoint(reactor, self.base, mode=0o660))
        self.assertEqual(stat.S_IMODE(os.stat(_hybrid_host(port).socket_path).st_mode), 0o660)

    async def test_listenOnAGivenPortUsesPathUnderscorePort(self) -> None:
        port = await _listen(self, HybridVSockServerEndpoint(reactor, self.base, port=5000))
        self.assertEqual(_hybrid_host(port), HybridVSockAddress(self.base, 5000))
        self.assertTrue(os.path.exists(f"{self.base}_5000"))

    async def test_clientAndServerRoundTripBytes(self) -> None:
        server = HybridVSockServerEndpoint(reactor, self.base)
        pair = await _connect_pair(self, server, self.client_for)
        self.assertEqual(await _round_trip(pair), PAYLOAD)

    async def test_twoListensGetDifferentPorts(self) -> None:
        first = await _listen(self, HybridVSockServerEndpoint(reactor, self.base))
        second = await _listen(self, HybridVSockServerEndpoint(reactor, self.base))
        self.assertNotEqual(_hybrid_host(first).port, _hybrid_host(second).port)

    async def test_stopListeningRemovesTheSocketFile(self) -> None:
        port = await HybridVSockServerEndpoint(reactor, self.base).listen(_EchoFactory())
        socket_path = _hybrid_host(port).socket_path
        await _stop(port)
        self.assertFalse(os.path.exists(socket_path))

    async def test_staleSocketFileIsReplaced(self) -> None:
        _stale_socket(f"{self.base}_4321")
        server = HybridVSockServerEndpoint(reactor, self.base, port=4321)
        pair = await _connect_pair(self, server, self.client_for)
        self.assertEqual(_hybrid_host(pair.port).port, 4321)
        self.assertEqual(await _round_trip(pair), PAYLOAD)

    async def test_listenOnAPortSomeoneListensOnFailsWithAddressInUse(self) -> None:
        first = _EchoFactory()
        await _listen(self, HybridVSockServerEndpoint(reactor, self.base, port=4321), first)
        with self.assertRaises(CannotListenError) as raised:
            await HybridVSockServerEndpoint(reactor, self.base, port=4321).listen(_EchoFactory())
        self.assertEqual(raised.exception.socketError.errno, errno.EADDRINUSE)
        self.assertIn(f"hvsock:{self.base}_4321", str(raised.exception))
        # The liveness probe was a connection; let the first listener see it end.
        await first.lost.get()

    async def test_portZeroSkipsRandomPortsWhoseFileExists(self) -> None:
        _stale_socket(f"{self.base}_4321")
        open(f"{self.base}_4322", "w").close()
        candidates: Iterator[int] = iter([4321, 4322, 4323])
        self.patch(hvsock, "_random_hybrid_port", lambda: next(candidates))
        port = await _listen(self, HybridVSockServerEndpoint(reactor, self.base))
        self.assertEqual(_hybrid_host(port).port, 4323)

    async def test_listenInAMissingDirectoryFailsWithCannotListenError(self) -> None:
        base = os.path.join(self.base + ".missing", "v.sock")
        with self.assertRaises(CannotListenError) as raised:
            await HybridVSockServerEndpoint(reactor, base, port=7).listen(_EchoFactory())
        self.assertEqual(raised.exception.socketError.errno, errno.ENOENT)
        self.assertIn(f"{base}_7", str(raised.exception))

    async def test_connectingToAPortWithNoListenerFailsWithConnectError(self) -> None:
        endpoint = HybridVSockClientEndpoint(reactor, self.base, 4321, timeout=5)
        with self.assertRaises(ConnectError) as raised:
            await endpoint.connect(Factory.forProtocol(_Collector))
        self.assertEqual(raised.exception.osError, errno.ENOENT)

    async def test_connectingToAStaleSocketIsRefused(self) -> None:
        _stale_socket(f"{self.base}_4321")
        endpoint = HybridVSockClientEndpoint(reactor, self.base, 4321, timeout=5)
        with self.assertRaises(ConnectionRefusedError):
            await endpoint.connect(Factory.forProtocol(_Collector))

    async def test_endpointStringsListenAndConnect(self) -> None:
        quoted = quoteStringArgument(self.base)

        def client_for(address: HybridVSockAddress) -> IStreamClientEndpoint:
            description = f"hvsock:path={quoted}:port={address.port}"
            endpoint: IStreamClientEndpoint = clientFromString(reactor, description)
            return endpoint

        server = serverFromString(reactor, f"hvsock:{quoted}:mode=600")
        pair = await _connect_pair(self, server, client_for)
        self.assertEqual(await _round_trip(pair), PAYLOAD)
        self.assertEqual(stat.S_IMODE(os.stat(_hybrid_host(pair.port).socket_path).st_mode), 0o600)


def _unix_socket() -> socket.socket:
    skt = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    skt.setblocking(False)
    return skt


def _tcp_socket() -> socket.socket:
    skt = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    skt.setblocking(False)
    return skt


# The vsock transport's classes over other families: what this kernel can connect.
_UNIX = vsock._Family("AF_UNIX", _unix_socket, lambda name: UNIXAddress(name or None))
_TCP = vsock._Family("AF_INET", _tcp_socket, lambda pair: IPv4Address("TCP", *pair))


@implementer(IStreamServerEndpoint)
@attrs.frozen
class _FamilyServer:
    family: Any
    address: Any

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        return vsock._listen(self.family, self.address, protocolFactory, 5, reactor)


@implementer(IStreamClientEndpoint)
@attrs.frozen
class _FamilyClient:
    family: Any
    address: Any
    reactor: Any = reactor
    timeout: float = 5.0

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        return vsock._connect(
            self.family, self.address, protocolFactory, self.timeout, self.reactor
        )


def _tcp_client_for(address: IAddress) -> _FamilyClient:
    assert isinstance(address, IPv4Address), address
    return _FamilyClient(_TCP, (address.host, address.port))


class _Ending(_Collector):
    """A collector that keeps why its connection ended."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: Failure | None = None

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason
        super().connectionLost(reason)


class _Refusing(_EchoFactory):
    """Serves no one while ``refusing``."""

    refusing = True

    def buildProtocol(self, addr: IAddress | None) -> _Echo | None:
        return None if self.refusing else super().buildProtocol(addr)


class SocketTransportTests(TestCase):
    """The vsock transport's classes (listening, connecting, the connection) over unix and TCP
    sockets, where this kernel connects: everything but the socket family is the same."""

    def setUp(self) -> None:
        self.path = os.path.join(_short_temp_dir(self), "t.sock")

    async def pair(self) -> _Pair:
        def client_for(address: UNIXAddress) -> _FamilyClient:
            return _FamilyClient(_UNIX, self.path)

        return await _connect_pair(self, _FamilyServer(_UNIX, self.path), client_for)

    async def ended(self, end: Callable[[_Ending, _Echo], None]) -> Failure:
        """Why a client's connection ended once ``end(client, server)`` was done to it."""
        client = _Ending()
        factory = _EchoFactory()
        await _listen(self, _FamilyServer(_UNIX, self.path), factory)
        await _FamilyClient(_UNIX, self.path).connect(Factory.forProtocol(lambda: client))
        server = await factory.made.get()
        end(client, server)
        await gatherResults([client.closed, server.closed])
        assert client.reason is not None
        return client.reason

    async def test_bytesGoBothWays(self) -> None:
        pair = await self.pair()
        self.assertEqual(await _round_trip(pair), PAYLOAD)

    async def test_aWriteLargerThanTheSocketTakesArrivesWhole(self) -> None:
        pair = await self.pair()
        payload = os.urandom(4 * 1024 * 1024)
        self.assertEqual(await _round_trip(pair, payload), payload)

    async def test_theAddressesAreTheSockets(self) -> None:
        pair = await _connect_pair(self, _FamilyServer(_TCP, ("127.0.0.1", 0)), _tcp_client_for)
        assert pair.client.transport is not None and pair.server.transport is not None
        self.assertEqual(pair.client.transport.getPeer(), pair.port.getHost())
        self.assertEqual(pair.server.transport.getPeer(), pair.client.transport.getHost())
        self.assertEqual(pair.server.transport.getHost(), pair.port.getHost())

    async def test_loseConnectionWritesWhatIsBufferedThenEndsCleanly(self) -> None:
        payload = os.urandom(1024 * 1024)

        def write_then_close(client: _Ending, server: _Echo) -> None:
            assert client.transport is not None
            client.transport.write(payload)
            client.transport.loseConnection()

        self.assertTrue((await self.ended(write_then_close)).check(ConnectionDone))

    async def test_abortConnectionEndsAtOnceAsAborted(self) -> None:
        def abort(client: _Ending, server: _Echo) -> None:
            transport: Any = client.transport
            transport.write(b"never mind")
            transport.abortConnection()
            transport.write(b"nor this")

        self.assertTrue((await self.ended(abort)).check(ConnectionAborted))

    async def test_thePeerClosingEndsTheConnection(self) -> None:
        def server_closes(client: _Ending, server: _Echo) -> None:
            assert server.transport is not None
            server.transport.loseConnection()

        self.assertTrue((await self.ended(server_closes)).check(ConnectionDone))

    async def test_aConnectionTheFactoryRefusesIsClosedAndTheListenerGoesOn(self) -> None:
        factory = _Refusing()
        await _listen(self, _FamilyServer(_UNIX, self.path), factory)
        turned_away = _Ending()
        await _FamilyClient(_UNIX, self.path).connect(Factory.forProtocol(lambda: turned_away))
        await turned_away.closed
        factory.refusing = False
        served = _Collector()
        await _FamilyClient(_UNIX, self.path).connect(Factory.forProtocol(lambda: served))
        assert served.transport is not None
        served.transport.write(PAYLOAD)
        self.assertEqual(await served.receive(len(PAYLOAD)), PAYLOAD)
        served.transport.loseConnection()
        await served.closed

    async def test_connectingToAClosedTCPPortIsRefused(self) -> None:
        port = await _listen(self, _FamilyServer(_TCP, ("127.0.0.1", 0)))
        address = port.getHost()
        await _stop(port)
        with self.assertRaises(ConnectionRefusedError):
            await _tcp_client_for(address).connect(Factory.forProtocol(_Collector))

    async def test_stopListeningClosesTheListeningSocket(self) -> None:
        port = await _FamilyServer(_UNIX, self.path).listen(_EchoFactory())
        await _stop(port)
        with self.assertRaises(ConnectionRefusedError):
            await _FamilyClient(_UNIX, self.path).connect(Factory.forProtocol(_Collector))

    def test_aConnectThatDoesNotCompleteTimesOut(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        clock = MemoryReactorClock()  # it never says the socket became writable
        client = _FamilyClient(_TCP, listener.getsockname(), clock, timeout=3)
        attempt = client.connect(Factory.forProtocol(_Collector))
        clock.advance(3)
        self.failureResultOf(attempt, TimeoutError)


class ServerStringTests(SynchronousTestCase):
    """``vsock:`` and ``hvsock:`` server descriptions, through serverFromString's plugins."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()

    def parse(self, description: str) -> Any:
        return serverFromString(self.reactor, description)

    def assertRefused(self, description: str, parameter: str) -> None:
        error = self.assertRaises(ValueError, self.parse, description)
        self.assertIn(parameter, str(error))

    def test_vsockDefaultsToARandomPortOnAnyCid(self) -> None:
        self.assertEqual(
            self.parse("vsock:"), VSockServerEndpoint(self.reactor, 0, VMADDR_CID_ANY)
        )

    def test_vsockTakesAPositionalPort(self) -> None:
        self.assertEqual(self.parse("vsock:0"), VSockServerEndpoint(self.reactor, 0))
        self.assertEqual(self.parse("vsock:1234"), VSockServerEndpoint(self.reactor, 1234))

    def test_vsockTakesKeywordPortCidAndBacklog(self) -> None:
        self.assertEqual(
            self.parse("vsock:port=1234:cid=3:backlog=5"),
            VSockServerEndpoint(self.reactor, port=1234, cid=3, backlog=5),
        )

    def test_vsockCidAcceptsAny(self) -> None:
        self.assertEqual(
            self.parse("vsock:port=0:cid=any"),
            VSockServerEndpoint(self.reactor, 0, VMADDR_CID_ANY),
        )

    def test_vsockRefusesANonIntegerPort(self) -> None:
        self.assertRefused("vsock:port=http", "port")

    def test_vsockRefusesAPortAbove32Bits(self) -> None:
        self.assertRefused("vsock:port=4294967296", "port")

    def test_vsockRefusesANegativePort(self) -> None:
        self.assertRefused("vsock:port=-1", "port")

    def test_vsockRefusesAnUnknownCidWord(self) -> None:
        self.assertRefused("vsock:cid=everywhere", "cid")

    def test_vsockRefusesAnUnknownParameter(self) -> None:
        self.assertRefused("vsock:interface=eth0", "interface")

    def test_vsockRefusesAZeroBacklog(self) -> None:
        self.assertRefused("vsock:backlog=0", "backlog")

    def test_hvsockTakesAPositionalPathAndDefaultsToARandomPortAndMode0600(self) -> None:
        self.assertEqual(
            self.parse("hvsock:/some/base"),
            HybridVSockServerEndpoint(self.reactor, "/some/base", port=0, mode=0o600),
        )

    def test_hvsockTakesKeywordPathPortAndOctalMode(self) -> None:
        self.assertEqual(
            self.parse("hvsock:path=/some/base:port=52:mode=660:backlog=7"),
            HybridVSockServerEndpoint(self.reactor, "/some/base", port=52, mode=0o660, backlog=7),
        )

    def test_hvsockRefusesAMissingPath(self) -> None:
        self.assertRefused("hvsock:port=52", "path")

    def test_hvsockRefusesANonOctalMode(self) -> None:
        self.assertRefused("hvsock:/some/base:mode=rw", "mode")

    def test_hvsockRefusesAPortAbove32Bits(self) -> None:
        self.assertRefused("hvsock:/some/base:port=99999999999", "port")


class ClientStringTests(SynchronousTestCase):
    """``vsock:`` and ``hvsock:`` client descriptions, through clientFromString's plugins."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()

    def parse(self, description: str) -> Any:
        return clientFromString(self.reactor, description)

    def assertRefused(self, description: str, parameter: str) -> None:
        error = self.assertRaises(ValueError, self.parse, description)
        self.assertIn(parameter, str(error))

    def test_vsockTakesKeywordCidAndPort(self) -> None:
        self.assertEqual(
            self.parse("vsock:cid=2:port=1234"), VSockClientEndpoint(self.reactor, 2, 1234, 30.0)
        )

    def test_vsockTakesPositionalCidAndPort(self) -> None:
        self.assertEqual(self.parse("vsock:2:1234"), VSockClientEndpoint(self.reactor, 2, 1234))

    def test_vsockTakesATimeout(self) -> None:
        self.assertEqual(
            self.parse("vsock:cid=2:port=1234:timeout=2.5"),
            VSockClientEndpoint(self.reactor, 2, 1234, timeout=2.5),
        )

    def test_vsockCidAcceptsHostAndLocal(self) -> None:
        self.assertEqual(self.parse("vsock:cid=host:port=5").cid, VMADDR_CID_HOST)
        self.assertEqual(self.parse("vsock:cid=local:port=5").cid, VMADDR_CID_LOCAL)

    def test_vsockRefusesAnyAsADestinationCid(self) -> None:
        self.assertRefused("vsock:cid=any:port=5", "cid")

    def test_vsockRefusesAMissingPort(self) -> None:
        self.assertRefused("vsock:cid=2", "port")

    def test_vsockRefusesAMissingCid(self) -> None:
        self.assertRefused("vsock:port=1234", "cid")

    def test_vsockRefusesAPortAbove32Bits(self) -> None:
        self.assertRefused("vsock:cid=2:port=4294967296", "port")

    def test_vsockRefusesANonNumericTimeout(self) -> None:
        self.assertRefused("vsock:cid=2:port=5:timeout=soon", "timeout")

    def test_hvsockTakesKeywordPathPortAndTimeout(self) -> None:
        self.assertEqual(
            self.parse("hvsock:path=/base:port=1234:timeout=5"),
            HybridVSockClientEndpoint(self.reactor, "/base", 1234, timeout=5.0),
        )

    def test_hvsockTakesPositionalPathAndPort(self) -> None:
        self.assertEqual(
            self.parse("hvsock:/base:1234"), HybridVSockClientEndpoint(self.reactor, "/base", 1234)
        )

    def test_hvsockRefusesAMissingPath(self) -> None:
        self.assertRefused("hvsock:port=1234", "path")

    def test_hvsockRefusesAMissingPort(self) -> None:
        self.assertRefused("hvsock:path=/base", "port")

    def test_hvsockRefusesANonIntegerPort(self) -> None:
        self.assertRefused("hvsock:path=/base:port=x", "port")
