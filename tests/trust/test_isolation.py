"""Certificate isolation: an instance's client certificate reaches that instance and no other.

Two instances, ``alpha`` and ``bravo``, each certified by the daemon's own
code.  With alpha's certificate (read from alpha's config drive, over real
mutual TLS) every guest API route answers about alpha alone, whatever the
request names (paths, query strings, the Host header, SNI, extra headers);
bravo's data never appears in an answer and bravo's state never changes.
Certificates that are not alpha's current one (another CA's, another name on
alpha's key, a deleted or re-created instance's, an expired or not yet valid
one) are refused with a TLS alert at the handshake, or with 403 on a
connection opened before the change; never with a traceback (trial fails a
test on any logged error).  Every check runs on every transport the daemon
serves the guest API on.

``GuestAPIHost`` is the daemon's side as ``vmready.daemon.service`` builds
it: the store on its own database thread (its identity decisions read the
committed rows in memory, as in the daemon), a ``Lifecycle`` on fakeqemu, the
daemon's certificate made by ``ensure_server_certificate``, each instance's
certificate issued by ``Lifecycle.issue_agent_identity`` into its config
drive, and ``guest_tls_factory(server, store, guest_site(GuestAPI(...)))``
listening on an endpoint string the daemon listens on.

``TRANSPORTS`` are the ways a guest reaches that listener:

- ``hvsock``: the daemon's default, ``hvsock:path=…`` (unix sockets
  ``<path>_<port>``), dialled as a fakeqemu guest dials it;
- ``forward``: the daemon's forward socket (``unix:…:mode=600``), reached
  through the very command QEMU's ``guestfwd`` runs per guest connection
  (``GuestForward.guestfwd()``: ``socat - UNIX-CONNECT:…``), the guest's
  bytes on its stdin and stdout;
- ``vsock``: ``vsock:port=0`` (AF_VSOCK), dialled at the local CID; skipped
  where the kernel has no vsock loopback;
- ``tcp``: a loopback TCP listener with the same factory, standing in for
  vsock where it cannot loop back (vsock's endpoints are Twisted's TCP
  socket transport with another address family).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import SSL, crypto
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import (
    TCP4ClientEndpoint,
    connectProtocol,
    serverFromString,
    wrapClientTLS,
)
from twisted.internet.interfaces import (
    IListeningPort,
    IOpenSSLClientConnectionCreator,
    IProtocol,
    IProtocolFactory,
    IReactorSocket,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import ServerFactory
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web._newclient import HTTP11ClientProtocol, Request
from twisted.web.client import FileBodyProducer, ResponseFailed, ResponseNeverReceived, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from zope.interface import implementer

from tests.envelopes import error_envelope, sync_envelope
from tests.fixtures import TrackingReactor, stop_lifecycle
from tests.reactor import reactor
from tests.received import Received
from vmready.agentlink.hvsock import HybridVSockClientEndpoint
from vmready.agentlink.transport import forward_mac
from vmready.agentlink.vsock import VSockClientEndpoint, vsock_unavailable_reason
from vmready.agentlink.vsockaddress import VMADDR_CID_LOCAL
from vmready.api.guest import (
    FORBIDDEN_MESSAGE,
    GuestAPI,
    certificate_identifier,
    guest_site,
    guest_tls_factory,
)
from vmready.domain.model import InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.cmdline import GuestForward
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestlink import GuestLink
from vmready.store.asyncstore import AsyncStore
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair, ensure_server_certificate, generate
from vmready.trust.tls import MutualServerTLS, PinnedServerTLS

Clock = Callable[[], datetime.datetime]
_NOW = datetime.datetime.now(datetime.UTC)


# -- transports ----------------------------------------------------------------


@attrs.frozen
class Transport:
    """One way a guest reaches the guest API: the daemon's endpoint string, the guest's dial."""

    name: str
    # The server endpoint string, given a short scratch directory.
    server: Callable[[str], str]
    # The guest's endpoint to the listening port.
    client: Callable[[IListeningPort], IStreamClientEndpoint]
    skip: str | None = None


def _hvsock_client(port: IListeningPort) -> IStreamClientEndpoint:
    address = port.getHost()
    return HybridVSockClientEndpoint(reactor, address.path, address.port)  # type: ignore[attr-defined]


@implementer(IStreamClientEndpoint)
@attrs.define
class GuestForwardEndpoint:
    """A guest's connection through QEMU's ``guestfwd`` rule, as libslirp makes it.

    The rule's command (``GuestForward.guestfwd()``, split as QEMU splits it)
    runs in a new session with one end of a socketpair as its stdin, stdout
    and stderr; the guest's bytes travel on the other end.
    """

    rule: GuestForward
    children: list[subprocess.Popen[bytes]]

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        """Run the command for this connection; the protocol speaks to its stdio."""
        command = shlex.split(self.rule.guestfwd().split("-cmd:", 1)[1])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self.children.append(
                subprocess.Popen(
                    command,
                    stdin=theirs.fileno(),
                    stdout=theirs.fileno(),
                    stderr=theirs.fileno(),
                    start_new_session=True,
                )
            )
        protocol = protocolFactory.buildProtocol(UNIXAddress(None))
        assert protocol is not None
        with ours:
            ours.setblocking(False)
            cast(IReactorSocket, reactor).adoptStreamConnection(
                ours.fileno(), socket.AF_UNIX, _Given(protocol)
            )
        return succeed(protocol)


class _Given(ServerFactory):
    """A factory for the one protocol that already exists."""

    def __init__(self, protocol: IProtocol) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: object) -> Any:
        return self._protocol


FORWARD_CHILDREN: list[subprocess.Popen[bytes]] = []


def _forward_client(port: IListeningPort) -> IStreamClientEndpoint:
    """The guest's end of the forward to the daemon's forward socket."""
    mac = forward_mac("00000000-0000-0000-0000-000000abcdef")
    rule = GuestForward(os.fsdecode(port.getHost().name), mac)  # type: ignore[attr-defined]
    return GuestForwardEndpoint(rule, FORWARD_CHILDREN)


def _vsock_client(port: IListeningPort) -> IStreamClientEndpoint:
    return VSockClientEndpoint(reactor, VMADDR_CID_LOCAL, port.getHost().port)  # type: ignore[attr-defined]


def _tcp_client(port: IListeningPort) -> IStreamClientEndpoint:
    return TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)  # type: ignore[attr-defined]


TRANSPORTS = {
    "hvsock": Transport(
        "hvsock", lambda directory: f"hvsock:path={directory}/guest-api.sock", _hvsock_client
    ),
    "forward": Transport(
        "forward",
        lambda directory: f"unix:{directory}/guest-fwd.sock:mode=600",
        _forward_client,
        None if shutil.which("socat") else "socat is not installed (the forward runs it)",
    ),
    "vsock": Transport(
        "vsock", lambda _: "vsock:port=0", _vsock_client, vsock_unavailable_reason()
    ),
    "tcp": Transport("tcp", lambda _: "tcp:0:interface=127.0.0.1", _tcp_client),
}


# -- certificates an attacker can make -------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pair(certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertificatePair:
    return CertificatePair(
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def issue(
    common_name: str,
    issuer: CertificatePair | None = None,
    key_pem: bytes | None = None,
    ca: bool = False,
) -> CertificatePair:
    """A certificate whose CN and DNS name are ``common_name``.

    Signed by ``issuer`` (self-signed without one), for the key ``key_pem``
    (a fresh one without).
    """
    key: Any = (
        serialization.load_pem_private_key(key_pem, password=None)
        if key_pem is not None
        else ec.generate_private_key(ec.SECP384R1())
    )
    signer, issuer_name = key, _name(common_name)
    if issuer is not None:
        signer = serialization.load_pem_private_key(issuer.key_pem, password=None)
        issuer_name = x509.load_pem_x509_certificate(issuer.cert_pem).subject
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(signer, hashes.SHA384())
    )
    return _pair(certificate, key)


@implementer(IOpenSSLClientConnectionCreator)
class PresentingTLS:
    """A client that presents ``identity`` (and ``chain``), names ``server_name``, trusts anyone.

    What an attacker dials with: it does not care who answers.
    """

    def __init__(
        self,
        identity: CertificatePair,
        chain: tuple[CertificatePair, ...] = (),
        server_name: bytes | None = None,
    ) -> None:
        context = SSL.Context(SSL.TLS_METHOD)
        context.use_certificate(crypto.X509.from_cryptography(_load(identity.cert_pem)))
        key = serialization.load_pem_private_key(identity.key_pem, password=None)
        context.use_privatekey(key)  # type: ignore[arg-type]
        for extra in chain:
            context.add_extra_chain_cert(crypto.X509.from_cryptography(_load(extra.cert_pem)))
        context.set_verify(SSL.VERIFY_NONE)
        self._context = context
        self._server_name = server_name

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        """A connection that asks for ``server_name`` (SNI) if given."""
        connection = SSL.Connection(self._context, None)
        if self._server_name is not None:
            connection.set_tlsext_host_name(self._server_name)
        connection.set_connect_state()
        return connection


def _load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


class NamingTLS(PinnedServerTLS):
    """The agent's TLS (pinning the daemon), asking for another server name by SNI."""

    def __init__(
        self, client: CertificatePair, server_cert_pem: bytes, server_name: bytes
    ) -> None:
        super().__init__(client, server_cert_pem)
        self._server_name = server_name

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        """The agent's connection, with SNI."""
        connection = super().clientConnectionForTLS(tlsProtocol)
        connection.set_tlsext_host_name(self._server_name)
        return connection


# -- an HTTP client with every byte of the request in the test's hands -----------


class Client(HTTP11ClientProtocol):
    """One guest API connection; ``lost`` fires once it is closed (a forward's command reaped)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        super().connectionLost(reason)
        if not self.lost.called:
            self.lost.callback(None)


@attrs.frozen
class Reply:
    """A response: its status and its body (JSON decoded when it is JSON)."""

    code: int
    body: Any
    raw: bytes


# -- the daemon's side -----------------------------------------------------------


class GuestAPIHost(TestCase):
    """The daemon's guest API on ``transport``, instances made and certified as the daemon does."""

    timeout = 60
    transport: Transport

    def setUp(self) -> None:
        if self.transport.skip is not None:
            raise SkipTest(self.transport.skip)
        # Short: unix socket paths must stay under 108 bytes.
        self.base = tempfile.mkdtemp(prefix="vmr-iso-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.server = ensure_server_certificate(self.base)
        engine = Store.open(os.path.join(self.base, "vmready.sqlite"))
        self.store = AsyncStore.threaded(reactor, engine)
        self.tracking = TrackingReactor(reactor)
        self.lifecycle = Lifecycle(
            self.tracking,
            self.store,
            HypervisorDriver(reactor, "fakeqemu"),
            EventBus(reactor.seconds),
            os.path.join(self.base, "run"),
            stop_timeout=0.3,
        )
        self.lifecycle.reach.listening(
            GuestLink(1024, self.server.cert_pem, "hvsock:/nonexistent")
        )
        self.addCleanup(self._tear_down_lifecycle)
        self.clients: list[Client] = []
        self.port: IListeningPort | None = None

    async def _tear_down_lifecycle(self) -> None:
        await stop_lifecycle(self.lifecycle, self.tracking)
        await self.store.close()

    async def listen(self, clock: Clock | None = None) -> None:
        """Serve the guest API as the daemon does (``clock``: when certificates are judged)."""
        api = GuestAPI(self.lifecycle)
        factory = guest_tls_factory(self.server, self.store.view, guest_site(api.app.resource()))
        if clock is not None:
            api.identify = certificate_identifier(self.store.view, clock)
            factory = guest_tls_factory(
                self.server, self.store.view, guest_site(api.app.resource()), clock
            )
        endpoint = serverFromString(reactor, self.transport.server(self.base))
        self.port = await endpoint.listen(factory)
        self.addCleanup(self._stop)

    async def _stop(self) -> None:
        for client in self.clients:
            if client.transport is not None:
                client.transport.loseConnection()
            await client.lost
        assert self.port is not None
        await maybeDeferred(self.port.stopListening)
        # The forward's commands end with their connections (as socat does under QEMU).
        while any(child.poll() is None for child in FORWARD_CHILDREN):
            await deferLater(reactor, 0.01, lambda: None)
        FORWARD_CHILDREN.clear()

    # -- instances ----------------------------------------------------------

    async def add(
        self, name: str, config: dict[str, str], devices: dict[str, dict[str, str]] | None = None
    ) -> tuple[InstanceRecord, CertificatePair]:
        """An idle instance with its identity issued as ``create`` issues it; its drive's pair."""
        await self.store.instances.create_instance(name, config, devices or {})
        record = await self.store.instances.finish_task(
            name, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        await self.lifecycle.guestside.issue_agent_identity(record)
        return record, self.drive_pair(record)

    async def launch(
        self, name: str, config: dict[str, str]
    ) -> tuple[InstanceRecord, CertificatePair]:
        """An instance created with a running fakeqemu VM, as ``vmready launch`` makes one."""
        operation = await (await self.lifecycle.create(name, config)).when_done()
        await deferLater(reactor, 0, lambda: None)
        self.assertEqual(operation.error, "")
        record = self.store.view.get_instance(name)
        return record, self.drive_pair(record)

    def drive_pair(self, record: InstanceRecord) -> CertificatePair:
        """The client certificate and key in the instance's config drive (what its guest reads)."""
        drive = self.lifecycle.specs.config_drive(record)
        with (
            open(os.path.join(drive, "agent.crt"), "rb") as c,
            open(os.path.join(drive, "agent.key"), "rb") as k,
        ):
            return CertificatePair(c.read(), k.read())

    # -- requests -----------------------------------------------------------

    def agent(self, identity: CertificatePair) -> PinnedServerTLS:
        """The agent's TLS: present ``identity``, pin the daemon's certificate."""
        return PinnedServerTLS(identity, self.server.cert_pem)

    async def connect(self, tls: IOpenSSLClientConnectionCreator) -> Client:
        """A new connection to the listener over this transport."""
        assert self.port is not None
        client = Client()
        endpoint = wrapClientTLS(tls, self.transport.client(self.port))
        await connectProtocol(endpoint, client)
        self.clients.append(client)
        return client

    async def send(
        self,
        client: Client,
        method: bytes,
        path: bytes,
        body: bytes | None = None,
        host: bytes = b"guest",
        headers: dict[bytes, list[bytes]] | None = None,
        persistent: bool = False,
    ) -> IResponse:
        """One request, exactly these bytes: no Host but ``host``, the path as given."""
        all_headers = Headers({b"host": [host], **(headers or {})})
        producer = FileBodyProducer(io.BytesIO(body)) if body is not None else None
        return await client.request(Request(method, path, all_headers, producer, persistent))

    async def call(
        self,
        tls: IOpenSSLClientConnectionCreator,
        method: bytes,
        path: bytes,
        **options: Any,
    ) -> Reply:
        """One request (``options`` as send's) on a connection of its own; the whole
        response once it is closed."""
        client = await self.connect(tls)
        response = await self.send(client, method, path, **options)
        reply = await self.read(response)
        await client.lost
        return reply

    async def read(self, response: IResponse) -> Reply:
        raw = await readBody(response)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        return Reply(response.code, body, raw)


# -- the two instances -------------------------------------------------------------

# bravo's data: none of these may ever appear in an answer to alpha.
SECRET = "BRAVO-SECRET"
ALPHA_CONFIG = {
    "user.owner": "alpha",
    "user.alpha-only": "a1",
    "user.meta-data": "alpha-meta: 1",
    "cloud-init.user-data": "#cloud-config\nhostname: alpha\n",
    "limits.memory": "256",
}
BRAVO_CONFIG = {
    "user.owner": f"{SECRET}-owner",
    "user.bravo-only": f"{SECRET}-only",
    "user.meta-data": f"{SECRET}-meta: 1",
    "cloud-init.user-data": f"#cloud-config\nhostname: {SECRET}\n",
    "limits.memory": "256",
}
ALPHA_DEVICES = {"root": {"type": "disk", "path": "/", "pool": "alpha-pool"}}
BRAVO_DEVICES = {"root": {"type": "disk", "path": "/", "pool": f"{SECRET}-pool"}}


def alpha_answers(alpha: InstanceRecord) -> dict[bytes, tuple[int, Any]]:
    """What each GET route must answer alpha, written from alpha's record, not from the API."""
    return {
        b"/": (200, sync_envelope(["/1.0"])),
        b"/1.0": (
            200,
            sync_envelope(
                {
                    "api_version": "1.0",
                    "instance_type": "virtual-machine",
                    "location": "none",
                    "state": "Started",
                }
            ),
        ),
        b"/1.0/config": (
            200,
            sync_envelope(
                [
                    "/1.0/config/cloud-init.user-data",
                    "/1.0/config/user.alpha-only",
                    "/1.0/config/user.meta-data",
                    "/1.0/config/user.owner",
                ]
            ),
        ),
        b"/1.0/config/user.owner": (200, sync_envelope("alpha")),
        b"/1.0/config/cloud-init.user-data": (
            200,
            sync_envelope(ALPHA_CONFIG["cloud-init.user-data"]),
        ),
        b"/1.0/meta-data": (
            200,
            sync_envelope(f"instance-id: {alpha.uuid}\nlocal-hostname: alpha\nalpha-meta: 1"),
        ),
        b"/1.0/devices": (200, sync_envelope(ALPHA_DEVICES)),
    }


# Ways a request might hope to be taken as bravo's: (query, Host, extra headers).
NAMINGS: list[tuple[bytes, bytes, dict[bytes, list[bytes]]]] = [
    (b"", b"guest", {}),
    (b"instance=bravo", b"guest", {}),
    (b"name=bravo&project=bravo&target=bravo&instance=bravo", b"guest", {}),
    (b"", b"bravo", {}),
    (b"", b"bravo.vmready:8443", {}),
    (
        b"",
        b"guest",
        {
            b"x-forwarded-host": [b"bravo"],
            b"x-forwarded-for": [b"bravo"],
            b"x-lxd-instance": [b"bravo"],
            b"x-test-caller": [b"bravo"],
        },
    ),
]

# Paths that name bravo: none is a route, none reaches bravo.
PATHS_NAMING_BRAVO = [
    b"/1.0/instances/bravo",
    b"/1.0/instances/bravo/state",
    b"/1.0/bravo",
    b"/bravo/1.0",
    b"/1.0/meta-data/bravo",
    b"/1.0/devices/bravo",
    b"/1.0/events/bravo",
    b"/1.0/config/user.bravo-only",
    b"/1.0/config/user.owner/../../../1.0/instances/bravo",
    b"/1.0/config/..%2F..%2Finstances%2Fbravo",
    b"/1.0/config/user.%2E%2E%2F%2E%2E%2Finstances%2Fbravo",
]


def _with_query(path: bytes, query: bytes) -> bytes:
    if not query:
        return path
    return path + (b"&" if b"?" in path else b"?") + query


if TYPE_CHECKING:
    _ChecksBase = GuestAPIHost
else:
    _ChecksBase = object


class IsolationChecks(_ChecksBase):
    """The isolation properties, run against ``self.transport``."""

    async def two(self) -> None:
        """alpha and bravo, idle, each with its own certificate; the API listening."""
        self.alpha, self.alpha_pair = await self.add("alpha", ALPHA_CONFIG, ALPHA_DEVICES)
        self.bravo, self.bravo_pair = await self.add("bravo", BRAVO_CONFIG, BRAVO_DEVICES)
        await self.listen()

    def assertNothingOfBravo(self, reply: Reply | bytes) -> None:
        """No trace of bravo (name, uuid, certificate, data) in what alpha received."""
        raw = reply.raw if isinstance(reply, Reply) else reply
        text = raw.decode("utf-8", "replace")
        for marker in (SECRET, "bravo", self.bravo.uuid, self.bravo_pair.fingerprint):
            self.assertNotIn(marker, text)

    async def assertRefusedAtHandshake(self, tls: IOpenSSLClientConnectionCreator) -> str:
        """The connection gets no answer: the daemon ended the handshake with an alert.

        Returns the alert as the client's OpenSSL words it.
        """
        client = await self.connect(tls)
        with self.assertRaises((ResponseNeverReceived, ResponseFailed)) as caught:
            await self.send(client, b"GET", b"/1.0")
        await client.lost
        reason = caught.exception.reasons[0].value
        self.assertIsInstance(reason, SSL.Error)
        return str(reason)

    # -- alpha sees alpha, whatever it names ----------------------------------

    async def test_everyRouteAnswersAboutTheCallerWhateverTheRequestNames(self) -> None:
        await self.two()
        for tls in (
            self.agent(self.alpha_pair),
            NamingTLS(self.alpha_pair, self.server.cert_pem, b"bravo"),
        ):
            for path, expected in alpha_answers(self.alpha).items():
                for query, host, headers in NAMINGS:
                    asked = _with_query(path, query)
                    reply = await self.call(tls, b"GET", asked, host=host, headers=headers)
                    self.assertEqual((reply.code, reply.body), expected, (asked, host, headers))
                    self.assertNothingOfBravo(reply)

    async def test_pathsNamingAnotherInstanceReachNothing(self) -> None:
        await self.two()
        for path in PATHS_NAMING_BRAVO:
            for method in (b"GET", b"PATCH"):
                body = b'{"state": "Ready"}' if method == b"PATCH" else None
                reply = await self.call(self.agent(self.alpha_pair), method, path, body=body)
                self.assertIn(reply.code, (403, 404, 405), path)
                self.assertEqual(reply.body["metadata"], None, path)
                self.assertEqual(reply.body["type"], "error", path)
                self.assertNothingOfBravo(reply)
        self.assertEqual(self.store.view.get_instance("bravo"), self.bravo)

    async def test_aKeyOnlyTheOtherInstanceHasIsNotFound(self) -> None:
        await self.two()
        reply = await self.call(
            self.agent(self.alpha_pair), b"GET", b"/1.0/config/user.bravo-only", host=b"bravo"
        )
        self.assertEqual((reply.code, reply.body), (404, error_envelope(404, "not found")))

    async def test_eachCertificateIsItsOwnInstance(self) -> None:
        # The control: the same requests with bravo's own certificate answer about bravo.
        await self.two()
        reply = await self.call(self.agent(self.bravo_pair), b"GET", b"/1.0/meta-data")
        self.assertEqual(
            reply.body["metadata"],
            f"instance-id: {self.bravo.uuid}\nlocal-hostname: bravo\n{SECRET}-meta: 1",
        )

    async def test_patchChangesOnlyTheCaller(self) -> None:
        # Ready needs a running VM: both are launched as the operator launches them.
        self.alpha, self.alpha_pair = await self.launch("alpha", ALPHA_CONFIG)
        self.bravo, self.bravo_pair = await self.launch("bravo", BRAVO_CONFIG)
        await self.listen()
        bravo_before = self.store.view.get_instance("bravo")
        ready: list[str] = []
        self.lifecycle.events.subscribe(
            lambda event: (
                ready.append(event.metadata["source"])
                if event.metadata.get("action") == "instance-ready"
                else None
            ),
            frozenset({"lifecycle"}),
        )
        tls = NamingTLS(self.alpha_pair, self.server.cert_pem, b"bravo")
        for query, host, headers in NAMINGS:
            for state in (b"Ready", b"Started"):
                body = b'{"state": "%s", "instance": "bravo", "name": "bravo"}' % state
                reply = await self.call(
                    tls,
                    b"PATCH",
                    _with_query(b"/1.0", query),
                    body=body,
                    host=host,
                    headers=headers,
                )
                self.assertEqual((reply.code, reply.body), (200, sync_envelope({})))
                self.assertEqual(
                    self.store.view.get_instance("alpha").ready, state == b"Ready", (query, host)
                )
                self.assertEqual(self.store.view.get_instance("bravo"), bravo_before)
        self.assertEqual(set(ready), {"/1.0/instances/alpha"})

    async def test_eventsCarryOnlyTheCallersChanges(self) -> None:
        await self.two()
        streams = []
        for query, host, headers in NAMINGS:
            client = await self.connect(NamingTLS(self.alpha_pair, self.server.cert_pem, b"bravo"))
            path = _with_query(b"/1.0/events", query)
            response = await self.send(client, b"GET", path, host=host, headers=headers)
            self.assertEqual(response.code, 200)
            lines = Received()
            response.deliverBody(lines)
            streams.append(lines)
        await self.lifecycle.configuring.update_config(
            "bravo", {"user.owner": f"{SECRET}-2", "user.new": SECRET}
        )
        await self.lifecycle.configuring.update_config("alpha", {"user.owner": "alpha-2"})
        for lines in streams:
            for _ in range(500):
                if lines.received:
                    break
                await deferLater(reactor, 0.01, lambda: None)
            # Delivered in order: a leaked bravo event would have come first.
            self.assertEqual(
                [event["metadata"] for event in lines.events],
                [{"key": "user.owner", "old_value": "alpha", "value": "alpha-2"}],
            )
            self.assertNothingOfBravo(lines.received)

    # -- certificates that are not the caller's current one ---------------------

    async def test_certificateNamingAnotherInstanceIsRefused(self) -> None:
        await self.two()
        said = self.refusals()
        stranger = issue("vmready-agent-bravo")
        alert = await self.assertRefusedAtHandshake(self.agent(stranger))
        self.assertIn("alert unknown ca", alert)
        self.assertEqual(said, [stranger.fingerprint])

    async def test_certificateSignedByAnotherCAIsRefused(self) -> None:
        await self.two()
        said = self.refusals()
        ca = issue("vmready-ca", ca=True)
        leaf = issue("vmready-agent-bravo", issuer=ca)
        alert = await self.assertRefusedAtHandshake(PresentingTLS(leaf, chain=(ca,)))
        self.assertIn("alert unknown ca", alert)
        # OpenSSL stops at the untrusted issuer, before the leaf: the log names the issuer.
        self.assertEqual(said, [ca.fingerprint])

    async def test_certificateSignedWithTheDaemonsOwnKeyIsRefused(self) -> None:
        # Even the daemon's key is no CA: only the fingerprints it issued identify anyone.
        await self.two()
        leaf = issue("vmready-agent-bravo", issuer=self.server)
        alert = await self.assertRefusedAtHandshake(PresentingTLS(leaf, chain=(self.server,)))
        self.assertIn("alert unknown ca", alert)

    async def test_callersOwnKeyUnderAnotherNameIsRefused(self) -> None:
        await self.two()
        renamed = issue("vmready-agent-bravo", key_pem=self.alpha_pair.key_pem)
        alert = await self.assertRefusedAtHandshake(self.agent(renamed))
        self.assertIn("alert unknown ca", alert)

    async def test_deletedInstancesCertificateIsRefused(self) -> None:
        await self.two()
        self.assertEqual((await self.call(self.agent(self.alpha_pair), b"GET", b"/1.0")).code, 200)
        operation = await (await self.lifecycle.act("alpha", "delete")).when_done()
        self.assertEqual(operation.error, "")
        said = self.refusals()
        alert = await self.assertRefusedAtHandshake(self.agent(self.alpha_pair))
        self.assertIn("alert unknown ca", alert)
        self.assertEqual(said, [self.alpha_pair.fingerprint])
        self.assertEqual(self.store.view.get_instance("bravo"), self.bravo)

    async def test_recreatedInstanceRefusesTheOldCertificate(self) -> None:
        await self.two()
        operation = await (await self.lifecycle.act("alpha", "delete")).when_done()
        self.assertEqual(operation.error, "")
        new, new_pair = await self.add("alpha", ALPHA_CONFIG)
        self.assertNotEqual(new_pair.fingerprint, self.alpha_pair.fingerprint)
        alert = await self.assertRefusedAtHandshake(self.agent(self.alpha_pair))
        self.assertIn("alert unknown ca", alert)
        reply = await self.call(self.agent(new_pair), b"GET", b"/1.0/meta-data")
        self.assertTrue(reply.body["metadata"].startswith(f"instance-id: {new.uuid}\n"))

    async def test_connectionOpenAcrossDeleteAndRecreateIsRefused(self) -> None:
        await self.two()
        client = await self.connect(self.agent(self.alpha_pair))
        first = await self.read(await self.send(client, b"GET", b"/1.0", persistent=True))
        self.assertEqual(first.code, 200)
        operation = await (await self.lifecycle.act("alpha", "delete")).when_done()
        self.assertEqual(operation.error, "")
        await self.add("alpha", ALPHA_CONFIG)
        for path in (b"/1.0", b"/1.0/meta-data", b"/1.0/config/user.owner"):
            reply = await self.read(await self.send(client, b"GET", path, persistent=True))
            self.assertEqual(
                (reply.code, reply.body), (403, error_envelope(403, FORBIDDEN_MESSAGE))
            )

    async def test_eventStreamOfADeletedInstanceEndsBeforeItsSuccessorSpeaks(self) -> None:
        await self.two()
        client = await self.connect(self.agent(self.alpha_pair))
        response = await self.send(client, b"GET", b"/1.0/events")
        lines = Received()
        response.deliverBody(lines)
        operation = await (await self.lifecycle.act("alpha", "delete")).when_done()
        self.assertEqual(operation.error, "")
        await lines.closed
        await self.add("alpha", ALPHA_CONFIG)
        await self.lifecycle.configuring.update_config("alpha", {"user.owner": "the new alpha"})
        self.assertEqual(lines.received, b"")

    async def test_expiredCertificateIsRefused(self) -> None:
        await self.two()
        month = datetime.timedelta(days=30)
        expired = generate("vmready-agent-alpha", days=1, now=_NOW - month)
        await self.store.certificates.set_agent_certificate("alpha", expired.fingerprint)
        said = self.refusals()
        alert = await self.assertRefusedAtHandshake(self.agent(expired))
        self.assertIn("alert unknown ca", alert)
        self.assertEqual(said, [expired.fingerprint])

    async def test_notYetValidCertificateIsRefused(self) -> None:
        await self.two()
        future = generate("vmready-agent-alpha", now=_NOW + datetime.timedelta(days=30))
        await self.store.certificates.set_agent_certificate("alpha", future.fingerprint)
        alert = await self.assertRefusedAtHandshake(self.agent(future))
        self.assertIn("alert unknown ca", alert)

    async def test_certificateExpiringOnAnOpenConnectionIsRefusedWith403(self) -> None:
        now = [_NOW]
        self.alpha, self.alpha_pair = await self.add("alpha", ALPHA_CONFIG)
        self.bravo, self.bravo_pair = await self.add("bravo", BRAVO_CONFIG)
        await self.listen(clock=lambda: now[0])
        client = await self.connect(self.agent(self.alpha_pair))
        first = await self.read(await self.send(client, b"GET", b"/1.0", persistent=True))
        self.assertEqual(first.code, 200)
        now[0] = _NOW + datetime.timedelta(days=11 * 365)  # past the 10 years it is valid for
        reply = await self.read(await self.send(client, b"GET", b"/1.0", persistent=True))
        self.assertEqual((reply.code, reply.body), (403, error_envelope(403, FORBIDDEN_MESSAGE)))
        # And a new connection does not get past the handshake.
        alert = await self.assertRefusedAtHandshake(self.agent(self.alpha_pair))
        self.assertIn("alert unknown ca", alert)

    def refusals(self) -> list[str]:
        """The fingerprints the daemon logs as refused from now on."""
        said: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if "refused a guest API client certificate" in str(event.get("log_format")):
                said.append(str(event["fingerprint"]))

        self.patch(MutualServerTLS, "log", Logger(observer=cast(ILogObserver, observe)))
        return said


class HybridVSockIsolationTests(IsolationChecks, GuestAPIHost):
    """hvsock (the daemon's default; fakeqemu guests)."""

    transport = TRANSPORTS["hvsock"]


class ForwardIsolationTests(IsolationChecks, GuestAPIHost):
    """The forward (QEMU's guestfwd running socat to the daemon's forward socket)."""

    transport = TRANSPORTS["forward"]


class VSockIsolationTests(IsolationChecks, GuestAPIHost):
    """Kernel vsock, where this kernel loops it back."""

    transport = TRANSPORTS["vsock"]


class TCPLoopbackIsolationTests(IsolationChecks, GuestAPIHost):
    """The same factory on loopback TCP: vsock's socket transport where vsock cannot loop back."""

    transport = TRANSPORTS["tcp"]
