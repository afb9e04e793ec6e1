"""Tests for vmready.trust.tls: real mutual TLS over a loopback unix socket."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import Any, cast

from OpenSSL import SSL
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol, wrapClientTLS
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.testing import StringTransport
from twisted.logger import ILogObserver, Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import providedBy
from zope.interface.declarations import Provides

from tests.reactor import reactor
from vmready.api.guest import certificate_authorizer
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair, fingerprint, generate
from vmready.trust.tls import (
    MutualServerTLS,
    PinnedServerTLS,
    peer_certificate_pem,
    server_tls_factory,
)

_NOW = datetime.datetime.now(datetime.UTC)
# Generating P-384 keys is the slow part: one set for the whole module.
_SERVER = generate("vmready")
_OTHER_SERVER = generate("vmready")
_AGENT = generate("web1")
_STRANGER = generate("web1")
_EXPIRED_AGENT = generate("web1", days=1, now=_NOW - datetime.timedelta(days=2))


class _Server(Protocol):
    """Records what reached the application and the peer certificate; echoes."""

    def __init__(self) -> None:
        self.received = b""
        self.peer: bytes | None = None
        self.reason: Failure | None = None
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        self.peer = peer_certificate_pem(self.transport)
        assert self.transport is not None
        self.transport.write(b"echo:" + data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.reason = reason
        self.lost.callback(None)


class _Client(Protocol):
    """Says hello, hangs up after the first answer; records what came back."""

    def __init__(self) -> None:
        self.received = b""
        self.reason: Failure | None = None
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"hello")

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        assert self.transport is not None
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.reason = reason
        self.lost.callback(None)


class LoopbackTLSTests(TestCase):
    """A MutualServerTLS listener and PinnedServerTLS (or other) clients on a unix socket."""

    timeout = 20

    def setUp(self) -> None:
        # Unix socket paths must stay under 107 bytes: not trial's deep temp dir.
        directory = tempfile.mkdtemp(prefix="vmr-tls-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "s")
        self.servers: list[_Server] = []
        self.asked: list[bytes] = []

    def known(self, *agents: CertificatePair) -> Callable[[bytes], bool]:
        """An authorize that accepts exactly these certificates, remembering what it was asked."""
        fingerprints = {agent.fingerprint for agent in agents}

        def authorize(cert_pem: bytes) -> bool:
            self.asked.append(cert_pem)
            return fingerprint(cert_pem) in fingerprints

        return authorize

    def listen(
        self, authorize: Callable[[bytes], bool], server: CertificatePair = _SERVER
    ) -> None:
        """Serve mutual TLS on the socket until the test ends."""

        def build() -> _Server:
            protocol = _Server()
            self.servers.append(protocol)
            return protocol

        port = reactor.listenUNIX(
            self.path,
            TLSMemoryBIOFactory(  # type: ignore[arg-type]  # any IProtocolFactory listens
                MutualServerTLS(server, authorize), False, Factory.forProtocol(build)
            ),
        )
        self.addCleanup(port.stopListening)

    async def connect(self, creator: IOpenSSLClientConnectionCreator) -> _Client:
        """One client connection, once both ends of it have closed."""
        client = _Client()
        endpoint = wrapClientTLS(creator, UNIXClientEndpoint(reactor, self.path))
        await connectProtocol(endpoint, client)
        await client.lost
        for server in self.servers:
            await server.lost
        return client

    def assertRefused(self, client: _Client) -> None:
        """The connection ended in a TLS error before any application data passed."""
        self.assertEqual(client.received, b"")
        self.assertEqual([server.received for server in self.servers], [b""])
        assert client.reason is not None
        self.assertIsInstance(client.reason.value, SSL.Error)

    async def test_knownClientIsAcceptedAndServerSeesItsCertificate(self) -> None:
        self.listen(self.known(_AGENT))
        client = await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem))
        self.assertEqual(client.received, b"echo:hello")
        self.assertEqual(self.servers[0].peer, _AGENT.cert_pem)

    async def test_authorizeIsAskedAboutTheClientCertificate(self) -> None:
        self.listen(self.known(_AGENT))
        await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem))
        self.assertEqual(set(self.asked), {_AGENT.cert_pem})

    async def test_authorizeIsAskedOncePerHandshake(self) -> None:
        # OpenSSL asks about a self-signed leaf more than once; the answer is the first one.
        self.listen(self.known(_AGENT))
        for _ in range(3):
            await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem))
        self.assertEqual(self.asked, [_AGENT.cert_pem] * 3)

    async def test_aVerdictIsNeverReusedByAnotherConnection(self) -> None:
        allowed = [True]

        def authorize(cert_pem: bytes) -> bool:
            return allowed[0]

        self.listen(authorize)
        first = await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem))
        self.assertEqual(first.received, b"echo:hello")
        allowed[0] = False  # revoked: the very next handshake is refused
        self.servers.clear()
        self.assertRefused(await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem)))

    async def test_theContextServesConnectionAfterConnection(self) -> None:
        # pyOpenSSL refuses to change a context once used: it must be configured once.
        self.listen(self.known(_AGENT))
        for _ in range(3):
            client = await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem))
            self.assertEqual(client.received, b"echo:hello")
            self.servers.clear()

    async def test_unknownClientCertificateIsRefused(self) -> None:
        self.listen(self.known(_AGENT))
        self.assertRefused(await self.connect(PinnedServerTLS(_STRANGER, _SERVER.cert_pem)))

    async def test_refusedCertificateIsLoggedWithItsFingerprint(self) -> None:
        said: list[dict[str, object]] = []
        self.patch(MutualServerTLS, "log", Logger(observer=cast(ILogObserver, said.append)))
        self.listen(self.known(_AGENT))
        self.assertRefused(await self.connect(PinnedServerTLS(_STRANGER, _SERVER.cert_pem)))
        self.assertEqual([event["fingerprint"] for event in said], [_STRANGER.fingerprint])
        self.assertIn("refused a guest API client certificate", str(said[0]["log_format"]))

    async def test_clientWithoutCertificateIsRefused(self) -> None:
        self.listen(self.known(_AGENT))
        self.assertRefused(await self.connect(CertificateOptions()))
        self.assertEqual(self.asked, [])

    async def test_expiredClientCertificateIsRefused(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-tls-store-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        store = Store.open(os.path.join(directory, "vmready.sqlite"))
        self.addCleanup(store.close)
        store.instances.create_instance("web1", {}, {})
        store.certificates.set_agent_certificate("web1", _EXPIRED_AGENT.fingerprint)
        self.listen(certificate_authorizer(store.certificates))
        self.assertRefused(await self.connect(PinnedServerTLS(_EXPIRED_AGENT, _SERVER.cert_pem)))

    async def test_agentRefusesAServerThatIsNotThePinnedOne(self) -> None:
        self.listen(self.known(_AGENT), server=_OTHER_SERVER)
        self.assertRefused(await self.connect(PinnedServerTLS(_AGENT, _SERVER.cert_pem)))

    async def test_agentRefusesThePinnedServerOutsideItsValidity(self) -> None:
        self.listen(self.known(_AGENT))
        years_later = _NOW + datetime.timedelta(days=20 * 365)
        agent = PinnedServerTLS(_AGENT, _SERVER.cert_pem, clock=lambda: years_later)
        self.assertRefused(await self.connect(agent))


class _MemoryPair:
    """A server and a client TLS connection joined by memory BIOs (no sockets, no reactor)."""

    def __init__(self, server: SSL.Connection, client: SSL.Connection) -> None:
        self.server = server
        self.client = client
        server.set_accept_state()

    def pump(self) -> None:
        """Move bytes both ways until neither side has anything to say."""
        moved = True
        while moved:
            moved = False
            for source, target in ((self.client, self.server), (self.server, self.client)):
                try:
                    data = source.bio_read(65536)
                except SSL.WantReadError:
                    continue
                if data:
                    target.bio_write(data)
                    moved = True

    def exchange(self) -> bytes:
        """Handshake, then one message each way (the client gets its session tickets)."""
        for _ in range(10):
            for connection in (self.client, self.server):
                with contextlib.suppress(SSL.WantReadError):
                    connection.do_handshake()
            self.pump()
        self.client.send(b"ping")
        self.pump()
        received: bytes = self.server.recv(4)
        self.server.send(b"pong")
        self.pump()
        self.client.recv(4)
        return received


class SessionResumptionTests(SynchronousTestCase):
    """A client resuming an earlier TLS session must still face ``authorize``."""

    def test_resumedSessionOfARevokedClientIsRefused(self) -> None:
        allowed = [True]
        server = MutualServerTLS(_SERVER, lambda cert_pem: allowed[0])
        agent = PinnedServerTLS(_AGENT, _SERVER.cert_pem)
        first = _MemoryPair(
            server.serverConnectionForTLS(None), agent.clientConnectionForTLS(None)
        )
        self.assertEqual(first.exchange(), b"ping")
        session = first.client.get_session()
        assert session is not None

        allowed[0] = False
        client = agent.clientConnectionForTLS(None)
        client.set_session(session)
        second = _MemoryPair(server.serverConnectionForTLS(None), client)
        self.assertRaises(SSL.Error, second.exchange)


class RenegotiationTests(SynchronousTestCase):
    """A connection has one handshake: its kept verdict can never outlive a revocation."""

    def test_renegotiationIsRefusedAndAuthorizeAskedOnce(self) -> None:
        asked: list[bytes] = []

        def authorize(cert_pem: bytes) -> bool:
            asked.append(cert_pem)
            return True

        server = MutualServerTLS(_SERVER, authorize)
        agent = PinnedServerTLS(_AGENT, _SERVER.cert_pem)
        agent._context.set_max_proto_version(SSL.TLS1_2_VERSION)  # TLS 1.3 cannot renegotiate
        pair = _MemoryPair(server.serverConnectionForTLS(None), agent.clientConnectionForTLS(None))
        self.assertEqual(pair.exchange(), b"ping")
        pair.client.renegotiate()
        with self.assertRaises(SSL.Error):
            for _ in range(10):
                for connection in (pair.client, pair.server):
                    with contextlib.suppress(SSL.WantReadError):
                        connection.do_handshake()
                pair.pump()
                # Reading is where the server sees the new hello and the client the refusal.
                for connection in (pair.server, pair.client):
                    with contextlib.suppress(SSL.WantReadError):
                        connection.recv(1)
                pair.pump()
        self.assertEqual((asked, pair.server.total_renegotiations()), ([_AGENT.cert_pem], 0))


class PeerCertificateTests(SynchronousTestCase):
    """``peer_certificate_pem`` on transports that are not TLS."""

    def test_plainTransportHasNoPeerCertificate(self) -> None:
        self.assertIsNone(peer_certificate_pem(object()))

    def test_noTransportHasNoPeerCertificate(self) -> None:
        self.assertIsNone(peer_certificate_pem(None))

    def test_acceptedCertificateIsTheOneTheHandshakeKept(self) -> None:
        server = MutualServerTLS(_SERVER, lambda cert_pem: cert_pem == _AGENT.cert_pem)
        pair = _MemoryPair(
            server.serverConnectionForTLS(None),
            PinnedServerTLS(_AGENT, _SERVER.cert_pem).clientConnectionForTLS(None),
        )
        self.assertEqual(pair.exchange(), b"ping")
        # Read back from the handshake's verdict, not converted again from OpenSSL's copy.
        transport: Any = type(
            "T", (), {"getHandle": lambda self: pair.server, "getPeerCertificate": None}
        )()
        self.assertEqual(peer_certificate_pem(transport), _AGENT.cert_pem)

    def test_refusedCertificateIsNotKept(self) -> None:
        server = MutualServerTLS(_SERVER, lambda cert_pem: False)
        pair = _MemoryPair(
            server.serverConnectionForTLS(None),
            PinnedServerTLS(_AGENT, _SERVER.cert_pem).clientConnectionForTLS(None),
        )
        self.assertRaises(SSL.Error, pair.exchange)
        transport: Any = type("T", (), {"getHandle": lambda self: pair.server})()
        self.assertIsNone(peer_certificate_pem(transport))

    def test_transportWithoutPeerCertificateHasNone(self) -> None:
        transport: Any = type("T", (), {"getPeerCertificate": lambda self: None})()
        self.assertIsNone(peer_certificate_pem(transport))


class ServerTLSFactoryTests(SynchronousTestCase):
    """``server_tls_factory``: Twisted's TLS wrapping, its interface declarations built once."""

    def connect(self, factory: TLSMemoryBIOFactory) -> tuple[Any, StringTransport]:
        transport = StringTransport()
        protocol = factory.buildProtocol(None)
        assert protocol is not None
        protocol.makeConnection(transport)
        return protocol, transport

    def test_connectionProvidesWhatTwistedsDoes(self) -> None:
        tls = MutualServerTLS(_SERVER, lambda cert_pem: True)
        ours, _ = self.connect(server_tls_factory(tls, Factory.forProtocol(Protocol)))
        twisteds, _ = self.connect(TLSMemoryBIOFactory(tls, False, Factory.forProtocol(Protocol)))
        self.assertIsInstance(ours, type(twisteds))
        self.assertEqual(set(providedBy(ours)), set(providedBy(twisteds)))

    def test_declarationsSurviveTheGarbageCollector(self) -> None:
        factory = server_tls_factory(
            MutualServerTLS(_SERVER, lambda cert_pem: True), Factory.forProtocol(Protocol)
        )
        protocol, transport = self.connect(factory)
        kind = type(protocol)
        declared = [weakref.ref(Provides(kind, i)) for i in providedBy(transport)]
        del protocol
        gc.collect()
        self.assertEqual([ref() is not None for ref in declared], [True] * len(declared))
        # The next connection is declared with the very same objects.
        self.connect(factory)
        self.assertEqual(
            [ref() for ref in declared], [Provides(kind, i) for i in providedBy(transport)]
        )
