"""Host-side fakes for testing the agent against real sockets: a guest API and a serial peer.

``FakeGuestHost`` answers the guest API as the daemon does (LXD envelopes,
``GET /1.0/events`` held open) behind real mutual TLS on a hybrid vsock port
(the unix socket ``<path>_<port>``), accepting exactly one client certificate.
``stop`` cuts every connection, as a daemon that exits does.

``FakeSerialPeer`` stands in for fakeqemu's guest end of a virtio port
(``<dir>/com.canonical.lxd``, a unix socket): it records the agent's lines,
sends it the host's, holds one client at a time, and can drop it (a VM reset).

Both run on Twisted in the test process (the agent itself knows no Twisted):
tests run the agent beside them, in a thread or as a process.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any, cast

from klein import Klein
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import IDelayedCall, IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.server import Request, Site

from vmready.agent import httpwire
from vmready.agent.core import VsockAddress
from vmready.agent.host import HostResponse, LinkWatch
from vmready.agent.ports import CONNECT_PORT_NAME, PORT_NAME
from vmready.agentlink.hvsock import HybridVSockServerEndpoint
from vmready.agentlink.vsockaddress import HybridVSockAddress
from vmready.trust.certs import CertificatePair, fingerprint
from vmready.trust.tls import MutualServerTLS

__all__ = ["FakeGuestHost", "FakeSerialPeer", "MemoryLink", "memory_response"]

WAIT_TIMEOUT = 10.0


def _envelope(request: IRequest, code: int, metadata: Any = None, error: str = "") -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    if error:
        body = {"type": "error", "error": error, "error_code": code, "metadata": None}
    else:
        body = {"type": "sync", "status": "Success", "status_code": 200, "metadata": metadata}
    return json.dumps(body).encode("utf-8") + b"\n"


class _Tracked(ProtocolWrapper):
    """A server connection whose end the host can wait for."""

    def __init__(self, factory: WrappingFactory[_Tracked], wrapped: Protocol) -> None:
        super().__init__(factory, wrapped)
        self.gone: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        super().connectionLost(reason)
        self.gone.callback(None)


class _Tracking(WrappingFactory[_Tracked]):
    protocol = _Tracked
    noisy = False


class FakeGuestHost:
    """A host's guest API for one instance, over mutual TLS on hybrid vsock."""

    app = Klein()

    def __init__(
        self,
        reactor: Any,
        server: CertificatePair | None = None,
        client_cert_pem: bytes | None = None,
        path: str = "",
        config: dict[str, str] | None = None,
    ) -> None:
        """Without certificates or a path it serves in memory only (``app.resource()``)."""
        self.reactor = reactor
        self.server = server
        self.client_fingerprint = fingerprint(client_cert_pem) if client_cert_pem else ""
        self.path = path
        self.config = dict(config or {})
        self.state = "Started"
        self.patches: list[str] = []
        self._patched: list[tuple[str, Deferred[None]]] = []
        self._streams: list[tuple[Request, Deferred[None]]] = []
        self._listening: IListeningPort | None = None
        self._factory: _Tracking | None = None
        self.port = 0

    @property
    def address(self) -> VsockAddress:
        """What the host would advertise: ``CONNECT 2:<port>``."""
        return VsockAddress(2, self.port)

    @property
    def connect_line(self) -> bytes:
        """The ``CONNECT`` line for this host."""
        return f"CONNECT 2:{self.port}\n".encode("ascii")

    async def start(self, port: int = 0) -> int:
        """Listen on ``<path>_<port>`` (a random port for 0); the port."""
        assert self.server is not None and self.client_fingerprint, "no certificates given"
        site = Site(self.app.resource())
        site.noisy = False
        tls = TLSMemoryBIOFactory(
            MutualServerTLS(self.server, lambda pem: fingerprint(pem) == self.client_fingerprint),
            False,
            site,
        )
        self._factory = _Tracking(tls)
        endpoint = HybridVSockServerEndpoint(self.reactor, self.path, port)
        self._listening = await endpoint.listen(self._factory)
        address = self._listening.getHost()
        assert isinstance(address, HybridVSockAddress)
        self.port = address.port
        return self.port

    def stop(self) -> Deferred[None]:
        """Stop listening and cut every connection, as an exiting daemon does."""
        waits: list[Deferred[Any]] = []
        if self._listening is not None:
            stopping = self._listening.stopListening()
            if stopping is not None:
                waits.append(stopping)
            self._listening = None
        if self._factory is not None:
            for tracked in list(self._factory.protocols):
                waits.append(tracked.gone)
                assert tracked.transport is not None
                tracked.transport.abortConnection()
        self._streams.clear()
        return gatherResults(waits).addCallback(lambda _: None)

    @property
    def event_streams(self) -> int:
        """How many ``GET /1.0/events`` streams are open."""
        return len(self._streams)

    def send_event(self, event: dict[str, Any]) -> None:
        """Write ``event`` to every open event stream."""
        line = json.dumps(event).encode("utf-8") + b"\n"
        for request, _ in self._streams:
            request.write(line)

    def end_event_streams(self) -> None:
        """End every event stream cleanly (the response finishes)."""
        streams, self._streams = self._streams, []
        for _, done in streams:
            done.callback(None)

    def when_patched(self, state: str) -> Deferred[None]:
        """Fires when a ``PATCH /1.0`` to ``state`` arrives."""
        waiter: Deferred[None] = Deferred()
        self._patched.append((state, waiter))
        return waiter.addTimeout(WAIT_TIMEOUT, self.reactor)

    @app.route("/", methods=["GET"])
    def root(self, request: IRequest) -> bytes:
        return _envelope(request, 200, ["/1.0"])

    @app.route("/1.0", methods=["GET"])
    def get_state(self, request: IRequest) -> bytes:
        return _envelope(
            request,
            200,
            {
                "api_version": "1.0",
                "instance_type": "virtual-machine",
                "location": "fake",
                "state": self.state,
            },
        )

    @app.route("/1.0", methods=["PATCH"])
    def patch_state(self, request: IRequest) -> bytes:
        try:
            state = json.loads(request.content.read()).get("state")
        except (ValueError, AttributeError) as e:
            return _envelope(request, 400, error=f"Invalid request body: {e}")
        if state not in ("Ready", "Started"):
            return _envelope(request, 400, error=f'Invalid state "{state}"')
        self.state = state
        self.patches.append(state)
        waiters, self._patched = self._patched, []
        for wanted, waiter in waiters:
            if wanted == state:
                waiter.callback(None)
            else:
                self._patched.append((wanted, waiter))
        return _envelope(request, 200, {})

    @app.route("/1.0/config/<key>", methods=["GET"])
    def get_config(self, request: IRequest, key: str) -> bytes:
        if not key.startswith(("user.", "cloud-init.")):
            return _envelope(request, 403, error="not authorized")
        value = self.config.get(key)
        if not value:
            return _envelope(request, 404, error="not found")
        return _envelope(request, 200, value)

    @app.route("/1.0/events", methods=["GET"])
    def events(self, request: IRequest) -> Deferred[None]:
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/x-ndjson")
        web_request = cast(Request, request)
        done: Deferred[None] = Deferred(lambda _: self._forget(web_request))
        self._streams.append((web_request, done))
        request.write(b"")
        return done

    def _forget(self, request: Request) -> None:
        self._streams = [(r, d) for r, d in self._streams if r is not request]


class _PeerProtocol(Protocol):
    def __init__(self, peer: FakeSerialPeer) -> None:
        self.peer = peer
        self.gone: Deferred[None] = Deferred()
        self._refusal: IDelayedCall | None = None

    def connectionMade(self) -> None:
        if self.peer.client is not None:
            # An agent's pulse (close, then open at once) may be accepted before the old
            # connection's end is read; a virtio port's close is over before the open. So
            # wait a moment for the holder to go, as fakeqemu does, before refusing.
            self.peer._waiting.append(self)
            self._refusal = self.peer.reactor.callLater(1.0, self._refuse)
            return
        self._take()

    def _refuse(self) -> None:
        self._refusal = None
        self.peer._waiting.remove(self)
        self.peer.refused += 1
        assert self.transport is not None
        self.transport.loseConnection()  # one holder at a time, as a virtio port

    def _take(self) -> None:
        if self._refusal is not None:
            self._refusal.cancel()
            self._refusal = None
        assert self.transport is not None
        self.peer.client = self
        self.peer.connections += 1
        pending, self.peer._pending = self.peer._pending, b""
        if pending:
            self.transport.write(pending)
        waiting, self.peer._attach_waiters = self.peer._attach_waiters, []
        for waiter in waiting:
            waiter.callback(None)

    def dataReceived(self, data: bytes) -> None:
        self.peer._received(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if self._refusal is not None:
            self._refusal.cancel()
            self._refusal = None
            self.peer._waiting.remove(self)
        if self.peer.client is self:
            self.peer.client = None
            if self.peer._waiting:
                self.peer._waiting.pop(0)._take()
        self.gone.callback(None)


class FakeSerialPeer:
    """The host's end of the agent's serial port, as a unix socket the agent connects to."""

    def __init__(self, reactor: Any, path: str) -> None:
        self.reactor = reactor
        self.path = path
        self.lines: list[bytes] = []
        self.client: _PeerProtocol | None = None
        self.connections = 0
        self.refused = 0
        self._partial = b""
        self._pending = b""
        self._waiting: list[_PeerProtocol] = []
        self._waiters: list[tuple[bytes, int, Deferred[int]]] = []
        self._attach_waiters: list[Deferred[None]] = []
        self._listening: IListeningPort | None = None

    def start(self) -> None:
        """Listen at ``path`` (its directory is made)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        factory = Factory.forProtocol(lambda: _PeerProtocol(self))
        factory.noisy = False
        self._listening = self.reactor.listenUNIX(self.path, factory)

    def send(self, data: bytes) -> None:
        """Bytes from the host for the agent; kept for its next opening while none holds it.

        (A virtio port's host side keeps what it could not deliver, as fakeqemu does.)
        """
        if self.client is None or self.client.transport is None:
            self._pending += data
            return
        self.client.transport.write(data)

    def attached(self) -> Deferred[None]:
        """Fires once an agent holds the port (at once if one does)."""
        if self.client is not None:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._attach_waiters.append(waiter)
        return waiter.addTimeout(WAIT_TIMEOUT, self.reactor)

    def wait_for(self, line: bytes, since: int | None = None) -> Deferred[int]:
        """Fires with the index of the first ``line`` (no newline) at or after ``since``.

        ``since`` defaults to the number of lines seen so far: only a new line counts.
        """
        start = len(self.lines) if since is None else since
        for index in range(start, len(self.lines)):
            if self.lines[index] == line:
                return succeed(index)
        waiter: Deferred[int] = Deferred()
        self._waiters.append((line, start, waiter))
        return waiter.addTimeout(WAIT_TIMEOUT, self.reactor)

    def drop_client(self) -> Deferred[None]:
        """Close the agent's connection (a VM reset); fires once it is gone."""
        client = self.client
        if client is None or client.transport is None:
            return succeed(None)
        client.transport.loseConnection()
        return client.gone

    def stop(self) -> Deferred[None]:
        """Stop listening and drop the agent (the VM stopped)."""
        waits: list[Deferred[Any]] = [self.drop_client()]
        if self._listening is not None:
            stopping = self._listening.stopListening()
            if stopping is not None:
                waits.append(stopping)
            self._listening = None
        return gatherResults(waits).addCallback(lambda _: None)

    def _received(self, data: bytes) -> None:
        self._partial += data
        *complete, self._partial = self._partial.split(b"\n")
        for line in complete:
            self.lines.append(line)
            index = len(self.lines) - 1
            waiting, self._waiters = self._waiters, []
            for wanted, start, waiter in waiting:
                if wanted == line and index >= start and not waiter.called:
                    waiter.callback(index)
                elif not waiter.called:
                    self._waiters.append((wanted, start, waiter))


def agent_ports(
    reactor: Any, directory: str, cleanups: Callable[[Callable[[], object]], None]
) -> tuple[FakeSerialPeer, FakeSerialPeer]:
    """An agent's two ports in ``directory`` (its virtio-ports), listening, stopped at cleanup.

    The status port (``com.canonical.lxd``), where the agent says its status,
    and ``vmready.connect``, where a vmready daemon's CONNECT lines arrive.
    """
    ports = []
    for name in (PORT_NAME, CONNECT_PORT_NAME):
        port = FakeSerialPeer(reactor, os.path.join(directory, name))
        port.start()
        cleanups(port.stop)
        ports.append(port)
    return ports[0], ports[1]


# -- asyncio fakes for the agent's own tests ------------------------------------------


class MemoryTransport:
    """Just enough of a transport for a HostResponse read from memory: closing is noted."""

    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.closed = True


class _MemoryWriter:
    def __init__(self) -> None:
        self.transport = MemoryTransport()


def memory_response(
    status: int = 200,
    body: bytes = b"",
    content_type: str = "application/json",
    stream: bool = False,
) -> tuple[HostResponse, asyncio.StreamReader, MemoryTransport]:
    """An answer from the host, in memory (call inside a running loop).

    Its body is ``body``, complete; or, with ``stream``, whatever the test feeds
    the returned reader until it feeds EOF (an event stream).
    """
    reader = asyncio.StreamReader()
    if stream:
        framing = httpwire.Framing(until_close=True)
    else:
        framing = httpwire.Framing(length=len(body))
        reader.feed_data(body)
        reader.feed_eof()
    writer = _MemoryWriter()
    head = httpwire.ResponseHead(
        (1, 1), status, "", httpwire.Headers([("Content-Type", content_type)])
    )
    response = HostResponse(head, framing, reader, cast(asyncio.StreamWriter, writer))
    return response, reader, writer.transport


class MemoryLink:
    """A held link watch over an event stream in memory: the test ends it or reads its state."""

    def __init__(self) -> None:
        response, self.stream, self.transport = memory_response(stream=True)
        self.watch = LinkWatch(response)

    def host_ends(self) -> None:
        """The host ends the event stream (a daemon that exits)."""
        self.stream.feed_eof()

    def host_breaks(self) -> None:
        """The connection breaks."""
        self.stream.set_exception(ConnectionResetError())
