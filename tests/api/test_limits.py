"""vmready.api.limits: early 413, request deadline and idle timeout, connection bounds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from typing import Any

from klein import Klein
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHandshakeListener, IReactorTCP, IReactorUNIX
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.iweb import IRequest

from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.api.guest import GUEST_ERRORS, GuestAPI, guest_site
from vmready.api.limits import (
    IDLE_TIMEOUT,
    MAX_GUEST_CONNECTIONS,
    MAX_OPERATOR_CONNECTIONS,
    REQUEST_DEADLINE,
    LimitedChannel,
    LimitedSite,
)
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import OPERATOR_ERRORS, operator_site
from vmready.api.requestbody import MAX_BODY_BYTES, read_json_body
from vmready.api.web import local_site, sync_response

HUGE = 100 * 1024 * 1024
TOO_LARGE = f"Request body too large (limit {MAX_BODY_BYTES} bytes)"


class _App:
    """A small API: a JSON echo, a plain answer, and a stream that never ends."""

    app = Klein()

    def __init__(self) -> None:
        self.handled: list[bytes] = []

    @app.route("/echo", methods=["POST"])
    def echo(self, request: IRequest) -> bytes:
        self.handled.append(request.path)
        return sync_response(request, read_json_body(request))

    @app.route("/hello", methods=["GET"])
    def hello(self, request: IRequest) -> bytes:
        self.handled.append(request.path)
        return sync_response(request, "hello")

    @app.route("/stream", methods=["GET"])
    def stream(self, request: IRequest) -> Deferred[None]:
        self.handled.append(request.path)
        request.setHeader(b"Content-Type", b"application/x-ndjson")
        request.write(b"")
        return Deferred()


class _Connection:
    """One channel of ``site`` on a StringTransport."""

    def __init__(self, site: LimitedSite, host: str = "127.0.0.1") -> None:
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", host, 40000))
        self.channel: LimitedChannel = site.buildProtocol(self.transport.getPeer())
        self.channel.makeConnection(self.transport)

    def send(self, data: bytes) -> None:
        self.channel.dataReceived(data)

    @property
    def closing(self) -> bool:
        return bool(self.transport.disconnecting)

    def output(self) -> bytes:
        return bytes(self.transport.value())

    def close(self) -> None:
        self.channel.connectionLost(Failure(ConnectionError("gone")))


def _responses(raw: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Every complete (status, headers, body) in ``raw``, bodies by their Content-Length."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        length = int(headers.get(b"Content-Length", b"0"))
        found.append((int(lines[0].split(b" ")[1]), headers, rest[:length]))
        raw = rest[length:]
    return found


def _one_error(test: SynchronousTestCase, raw: bytes, code: int) -> Any:
    """The one response in ``raw``: ``code`` with ``Connection: close``; its JSON body."""
    [(status, headers, body)] = _responses(raw)
    test.assertEqual(status, code)
    test.assertEqual(headers[b"Connection"], b"close")
    test.assertEqual(headers[b"Content-Type"], b"application/json")
    return json.loads(body)


def _head(path: bytes, *headers: bytes, method: bytes = b"POST") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: v\r\n%s\r\n" % (
        method,
        path,
        b"".join(header + b"\r\n" for header in headers),
    )


class _OperatorSiteTestCase(SynchronousTestCase):
    """The operator API's site around a small test app, on a fake clock."""

    def setUp(self) -> None:
        self.api = _App()
        self.clock = Clock()
        self.site = operator_site(self.api.app.resource(), reactor=self.clock)


class _AccessLog:
    """An access log file that keeps its lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.closed = False

    def write(self, data: str) -> None:
        self.lines.extend(data.splitlines())

    def close(self) -> None:
        """The site stopped: it writes no more lines."""
        self.closed = True


class AccessLogTests(SynchronousTestCase):
    """The operator API logs changes and failures, not successful reads; other sites log all."""

    def logged(self, site: LimitedSite, *requests: bytes) -> list[str]:
        site.startFactory()
        self.addCleanup(site.stopFactory)
        log = _AccessLog()
        site.logFile = log
        for request in requests:
            connection = _Connection(site)
            connection.send(request)
            self.assertTrue(_responses(connection.output()), request)
        return [line.split('"')[3] for line in log.lines]

    def requests(self) -> tuple[bytes, ...]:
        return (
            _head(b"/hello", method=b"GET"),
            _head(b"/hello", method=b"HEAD"),
            _head(b"/echo", b"Content-Length: 2") + b"{}",
            _head(b"/nowhere", method=b"GET"),
            _head(b"/echo", method=b"GET"),
        )

    def test_theOperatorAPILogsChangesAndFailuresNotSuccessfulReads(self) -> None:
        site = operator_site(_App().app.resource(), reactor=Clock())
        self.assertEqual(
            self.logged(site, *self.requests()),
            ["POST /echo HTTP/1.1", "GET /nowhere HTTP/1.1", "GET /echo HTTP/1.1"],
        )

    def test_aSiteLogsEveryRequestUnlessToldNotToLogReads(self) -> None:
        site = local_site(_App().app.resource(), OPERATOR_ERRORS, label="t", reactor=Clock())
        self.assertEqual(len(self.logged(site, *self.requests())), 5)


class EarlyBodyRefusalTests(_OperatorSiteTestCase):
    """A body over the cap gets 413 before it is read, in the server's own envelope."""

    def test_aDeclaredLengthOverTheCapIsRefusedWithTheHeaders(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/echo", b"Content-Length: %d" % HUGE))
        body = _one_error(self, connection.output(), 413)
        self.assertEqual(body, {"type": "error", "error": TOO_LARGE, "error_code": 413})
        self.assertTrue(connection.closing)
        # What the client sends on is neither read into the request nor handled.
        connection.send(b"x" * 65536)
        [request] = connection.channel.requests
        self.assertIsNone(request.content)
        self.assertEqual(self.api.handled, [])
        self.assertEqual(len(_responses(connection.output())), 1)

    def test_noContinueIsSentForABodyThatWillBeRefused(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/echo", b"Content-Length: %d" % HUGE, b"Expect: 100-continue"))
        self.assertNotIn(b"100 Continue", connection.output())
        _one_error(self, connection.output(), 413)

    def test_theGuestAPIRefusesInItsOwnEnvelope(self) -> None:
        site = guest_site(self.api.app.resource(), reactor=self.clock)
        connection = _Connection(site)
        connection.send(_head(b"/echo", b"Content-Length: %d" % (MAX_BODY_BYTES + 1)))
        body = _one_error(self, connection.output(), 413)
        self.assertEqual(body, GUEST_ERRORS.envelope(413, TOO_LARGE))
        self.assertEqual(body["type"], "error")
        self.assertIsNone(body["metadata"])

    def test_aChunkedBodyIsRefusedOnceItPassesTheCap(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/echo", b"Transfer-Encoding: chunked"))
        half = MAX_BODY_BYTES // 2
        chunk = b"%x\r\n%s\r\n" % (half, b"x" * half)
        connection.send(chunk)
        connection.send(chunk)
        self.assertEqual(connection.output(), b"")  # exactly the cap: still welcome
        connection.send(b"1\r\nx\r\n")
        body = _one_error(self, connection.output(), 413)
        self.assertEqual(body["error"], TOO_LARGE)
        self.assertTrue(connection.closing)
        [request] = connection.channel.requests
        assert request.content is not None
        self.assertEqual(request.content.tell(), 0)  # what came was dropped, not kept
        connection.send(chunk + b"0\r\n\r\n")
        self.assertEqual(self.api.handled, [])
        self.assertEqual(len(_responses(connection.output())), 1)

    def test_aChunkedBodyEndingPastTheCapInOneReadIsRefusedOnce(self) -> None:
        connection = _Connection(self.site)
        size = MAX_BODY_BYTES + 1
        connection.send(
            _head(b"/echo", b"Transfer-Encoding: chunked")
            + b"%x\r\n%s\r\n0\r\n\r\n" % (size, b"x" * size)
        )
        self.assertEqual(_one_error(self, connection.output(), 413)["error"], TOO_LARGE)
        self.assertEqual(self.api.handled, [])

    def test_aBodyWithinTheCapIsServed(self) -> None:
        connection = _Connection(self.site)
        body = json.dumps({"a": "x" * 1000}).encode()
        connection.send(_head(b"/echo", b"Content-Length: %d" % len(body)) + body)
        [(status, _, answer)] = _responses(connection.output())
        self.assertEqual((status, json.loads(answer)["metadata"]), (200, {"a": "x" * 1000}))
        self.assertFalse(connection.closing)


class TimeoutTests(_OperatorSiteTestCase):
    """A request must arrive whole in time; an idle connection closes; a stream lasts."""

    def test_aTricklingClientIsCutAtTheDeadline(self) -> None:
        connection = _Connection(self.site)
        request = _head(b"/hello", method=b"GET")
        # One byte every 20 s: the idle timeout alone (reset by every byte) never fires.
        elapsed = 0.0
        for byte in request[:-1]:
            if elapsed + 20 >= REQUEST_DEADLINE:
                break
            connection.send(bytes([byte]))
            self.clock.advance(20)
            elapsed += 20
        self.assertEqual(connection.output(), b"")
        self.assertFalse(connection.closing)
        self.clock.advance(REQUEST_DEADLINE - elapsed)
        body = _one_error(self, connection.output(), 408)
        self.assertEqual(
            body,
            {
                "type": "error",
                "error": f"Request not received within {REQUEST_DEADLINE:g} seconds",
                "error_code": 408,
            },
        )
        self.assertTrue(connection.closing)
        self.assertEqual(self.api.handled, [])

    def test_aSlowBodyIsCutAtTheDeadlineToo(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/echo", b"Content-Length: 10") + b"{")
        self.clock.advance(REQUEST_DEADLINE - 1)
        connection.send(b'"a"')
        self.assertFalse(connection.closing)
        self.clock.advance(1)
        _one_error(self, connection.output(), 408)
        self.assertEqual(self.api.handled, [])

    def test_aRequestArrivingInPiecesInTimeIsServed(self) -> None:
        connection = _Connection(self.site)
        request = _head(b"/hello", method=b"GET")
        connection.send(request[:5])
        self.clock.advance(REQUEST_DEADLINE - 1)
        connection.send(request[5:])
        [(status, _, _body)] = _responses(connection.output())
        self.assertEqual(status, 200)
        # The deadline ended with the request: nothing more comes, the connection stays.
        self.clock.advance(REQUEST_DEADLINE)
        self.assertEqual(len(_responses(connection.output())), 1)
        self.assertFalse(connection.closing)

    def test_eachRequestOfAKeepAliveConnectionHasItsOwnDeadline(self) -> None:
        connection = _Connection(self.site)
        request = _head(b"/hello", method=b"GET")
        for _ in range(3):
            connection.send(request)
            self.clock.advance(REQUEST_DEADLINE - 1)
        self.assertEqual([status for status, _, _ in _responses(connection.output())], [200] * 3)
        connection.send(request[:3])
        self.clock.advance(REQUEST_DEADLINE)
        statuses = [status for status, _, _ in _responses(connection.output())]
        self.assertEqual(statuses, [200, 200, 200, 408])

    def test_anIdleKeepAliveConnectionIsClosedWithoutAnAnswer(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/hello", method=b"GET"))
        self.clock.advance(IDLE_TIMEOUT - 1)
        self.assertFalse(connection.closing)
        self.clock.advance(1)
        self.assertTrue(connection.closing)
        self.assertEqual([status for status, _, _ in _responses(connection.output())], [200])

    def test_aConnectionThatNeverSpeaksIsClosed(self) -> None:
        connection = _Connection(self.site)
        self.clock.advance(IDLE_TIMEOUT)
        self.assertTrue(connection.closing)
        self.assertEqual(connection.output(), b"")

    def test_aStreamedAnswerOutlivesBothTimers(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/stream", method=b"GET"))
        self.clock.advance(10 * IDLE_TIMEOUT + REQUEST_DEADLINE)
        self.assertFalse(connection.closing)
        self.assertTrue(connection.output().startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertNotIn(b" 408 ", connection.output())

    def test_bytesSentDuringAnAnswerStartNoDeadline(self) -> None:
        connection = _Connection(self.site)
        connection.send(_head(b"/stream", method=b"GET"))
        connection.send(b"GET /hel")  # the next request's first bytes, while the answer streams
        self.clock.advance(2 * REQUEST_DEADLINE)
        self.assertFalse(connection.closing)
        self.assertNotIn(b" 408 ", connection.output())

    def test_aRefusedClientThatDoesNotReadIsAborted(self) -> None:
        connection = _Connection(self.site)
        connection.send(b"G")
        self.clock.advance(REQUEST_DEADLINE)
        self.assertFalse(connection.transport.disconnected)
        self.clock.advance(connection.channel.abortTimeout)
        self.assertTrue(connection.transport.disconnected)


class EventStreamTimeoutTests(TestCase):
    """The real ``GET /1.0/events`` of both APIs is not cut by the limits' timers."""

    def assertEventStreamStaysOpen(self, site: LimitedSite, clock: Clock) -> None:
        connection = _Connection(site)
        connection.send(_head(b"/1.0/events", method=b"GET"))
        self.assertTrue(connection.output().startswith(b"HTTP/1.1 200 OK\r\n"))
        clock.advance(10 * IDLE_TIMEOUT + REQUEST_DEADLINE)
        self.assertFalse(connection.closing)
        self.assertNotIn(b" 408 ", connection.output())
        connection.close()

    def test_theEventStreamStaysOpen(self) -> None:
        clock = Clock()
        api = OperatorAPI(make_lifecycle(self), "fakeqemu")
        self.assertEventStreamStaysOpen(operator_site(api.app.resource(), reactor=clock), clock)

    def test_theGuestEventStreamStaysOpen(self) -> None:
        clock = Clock()
        lifecycle = make_lifecycle(self)
        store = lifecycle.store.engine
        store.instances.create_instance("web1", {}, {})
        api = GuestAPI(lifecycle, identify=lambda request: store.instances.find_instance("web1"))
        self.assertEventStreamStaysOpen(guest_site(api.app.resource(), reactor=clock), clock)


class ConnectionBoundTests(SynchronousTestCase):
    """Bounds on connections open at once: in total, and per peer."""

    def setUp(self) -> None:
        self.api = _App()
        self.clock = Clock()

    def site(self, **bounds: Any) -> LimitedSite:
        return local_site(
            self.api.app.resource(),
            OPERATOR_ERRORS,
            label="test API",
            peer_key=lambda transport: f"peer {transport.getPeer().host}",
            reactor=self.clock,
            **bounds,
        )

    def test_theOperatorSiteIsBounded(self) -> None:
        site = operator_site(self.api.app.resource(), reactor=self.clock)
        self.assertEqual(site.max_connections, MAX_OPERATOR_CONNECTIONS)
        self.assertEqual(guest_site(self.api.app.resource()).max_per_peer, MAX_GUEST_CONNECTIONS)

    def test_aConnectionOverTheTotalIsRefusedAndAFreedSlotIsReused(self) -> None:
        site = self.site(max_connections=2)
        first, second = _Connection(site), _Connection(site)
        with capturedLogs() as logs:
            third = _Connection(site)
        body = _one_error(self, third.output(), 503)
        self.assertEqual(body["error"], "Too many connections (limit 2)")
        self.assertTrue(third.closing)
        self.assertEqual([log["label"] for log in logs], ["test API"])
        third.close()
        self.assertEqual(site.connections, 2)  # the refused one never held a slot
        first.close()
        fourth = _Connection(site)
        fourth.send(_head(b"/hello", method=b"GET"))
        self.assertEqual([status for status, _, _ in _responses(fourth.output())], [200])
        self.assertFalse(second.closing)

    def test_aPeerOverItsBoundIsRefusedOthersAreNot(self) -> None:
        site = self.site(max_per_peer=2)
        request = _head(b"/hello", method=b"GET")
        ones = [_Connection(site, "10.0.0.1") for _ in range(3)]
        ones[0].send(request)
        ones[1].send(request)
        with capturedLogs() as logs:
            ones[2].send(request)
        body = _one_error(self, ones[2].output(), 429)
        self.assertEqual(body["error"], "Too many connections from this instance (limit 2)")
        self.assertTrue(ones[2].closing)
        self.assertEqual([log["peer"] for log in logs], ["peer 10.0.0.1"])
        self.assertEqual(self.api.handled, [b"/hello", b"/hello"])
        other = _Connection(site, "10.0.0.2")
        other.send(request)
        self.assertEqual([status for status, _, _ in _responses(other.output())], [200])
        # A slot freed by a closed connection is taken by the next one.
        ones[2].close()
        ones[0].close()
        again = _Connection(site, "10.0.0.1")
        again.send(request)
        self.assertEqual([status for status, _, _ in _responses(again.output())], [200])
        self.assertEqual(dict(site.per_peer), {"peer 10.0.0.1": 2, "peer 10.0.0.2": 1})


class HandshakeCountingTests(SynchronousTestCase):
    """Under TLS a connection counts against its peer's bound once its handshake is done."""

    def setUp(self) -> None:
        self.api = _App()
        self.site = local_site(
            self.api.app.resource(),
            OPERATOR_ERRORS,
            label="test API",
            peer_key=lambda transport: f"peer {transport.getPeer().host}",
            max_per_peer=2,
            reactor=Clock(),
        )

    def test_silentConnectionsCountFromTheirHandshake(self) -> None:
        """Connections that finish their handshake and say nothing fill the bound; the next
        one is answered 429 at once, without a request, and closed."""
        self.assertTrue(IHandshakeListener.providedBy(self.site.buildProtocol(None)))
        silent = [_Connection(self.site, "10.0.0.1") for _ in range(3)]
        silent[0].channel.handshakeCompleted()
        silent[1].channel.handshakeCompleted()
        self.assertEqual(self.site.per_peer["peer 10.0.0.1"], 2)
        silent[2].channel.handshakeCompleted()
        body = _one_error(self, silent[2].output(), 429)
        self.assertEqual(body["error"], "Too many connections from this instance (limit 2)")
        self.assertTrue(silent[2].closing)
        self.assertEqual(silent[0].output() + silent[1].output(), b"")
        # A request on a counted connection is not counted twice.
        silent[0].send(_head(b"/hello", method=b"GET"))
        self.assertEqual([status for status, _, _ in _responses(silent[0].output())], [200])
        self.assertEqual(self.site.per_peer["peer 10.0.0.1"], 2)
        silent[1].close()
        self.assertEqual(self.site.per_peer["peer 10.0.0.1"], 1)


def _raw_exchange(connect: Any, data: bytes) -> tuple[bytes, bool]:
    """Send ``data`` on a new socket and nothing more; all it answered, and whether it closed."""
    with connect() as client:
        client.settimeout(10)
        client.sendall(data)
        answer = b""
        try:
            while chunk := client.recv(65536):
                answer += chunk
        except TimeoutError:
            return answer, False
    return answer, True


class LoopbackTests(TestCase):
    """Real listening sockets: a client declaring 100 MiB gets 413 and a closed connection."""

    def setUp(self) -> None:
        self.api = _App()

    async def refused_on(self, connect: Any) -> None:
        answer, closed = await deferToThread(
            _raw_exchange, connect, _head(b"/echo", b"Content-Length: %d" % HUGE)
        )
        self.assertTrue(closed, answer)
        self.assertEqual(_one_error(self, answer, 413)["error"], TOO_LARGE)
        self.assertEqual(self.api.handled, [])

    async def test_overTCP(self) -> None:
        site: Any = operator_site(self.api.app.resource())
        port = IReactorTCP(reactor).listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        host = port.getHost()
        assert isinstance(host, IPv4Address)
        address = ("127.0.0.1", host.port)
        await self.refused_on(lambda: socket.create_connection(address))

    async def test_overAUnixSocket(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-limits-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "s")
        site: Any = guest_site(self.api.app.resource())
        port = IReactorUNIX(reactor).listenUNIX(path, site)
        self.addCleanup(port.stopListening)

        def connect() -> socket.socket:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(path)
            return client

        await self.refused_on(connect)
