"""``/1.0/events`` over real unix sockets: the WebSocket (LXD's form) and JSON lines, bounded.

A consumer that stops reading while 10,000 events are published is held to
its feed's limit and then disconnected with a logged reason; the daemon
never writes to its transport while the transport says it is full.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any, cast

from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.test.requesthelper import DummyRequest

from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.api.eventstream import BoundedFeed, EventStream
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.lifecycle import Event

EVENTS = 10_000
LIMIT = 256 * 1024
PAYLOAD = "x" * 1000


class EncodedOnceTests(SynchronousTestCase):
    """An event handed to many consumers in turn is encoded once, and each gets its own line."""

    def test_anEventIsEncodedOnceForAllItsConsumers(self) -> None:
        encoded: list[int] = []
        to_json = Event.to_json

        def counted(event: Event) -> dict[str, Any]:
            encoded.append(id(event))
            return to_json(event)

        self.patch(Event, "to_json", counted)
        requests = [DummyRequest([b""]) for _ in range(3)]
        streams = [EventStream(cast(Any, request)) for request in requests]
        first = Event("lifecycle", 1.5, {"action": "instance-started", "source": "/1.0/x"})
        second = Event("lifecycle", 2.25, {"action": "instance-stopped", "source": "/1.0/x"})
        for event in (first, second, first):
            for stream in streams:
                stream.deliver(event)
        self.assertEqual(encoded, [id(first), id(second), id(first)])
        lines = [json.dumps(to_json(event)).encode("utf-8") + b"\n" for event in (first, second)]
        for request in requests:
            self.assertEqual(request.written, [lines[0], lines[1], lines[0]])


class StalledConsumerTests(TestCase):
    """A real daemon-side site on a unix socket, a client that stops reading."""

    timeout = 120

    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-ev-", dir="/tmp")
        self.path = os.path.join(directory, "api.sock")
        self.lifecycle = make_lifecycle(self)
        self.api = OperatorAPI(self.lifecycle, "fakeqemu")
        self.api.event_buffer_limit = LIMIT
        site: Any = operator_site(self.api.app.resource())
        port = reactor.listenUNIX(self.path, site)
        self.addCleanup(port.stopListening)
        self.logged: list[dict[str, Any]] = []
        observer = cast(ILogObserver, self.logged.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    async def connect(self, request: bytes, answer: bytes) -> tuple[socket.socket, BoundedFeed]:
        """Send ``request``; once the head with ``answer`` is in, the client and its feed."""
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(client.close)
        client.setblocking(False)
        client.connect(self.path)
        client.sendall(request)
        head = b""
        for _ in range(400):
            await deferLater(reactor, 0.01, lambda: None)
            with contextlib.suppress(BlockingIOError):
                head += client.recv(65536)
            if b"\r\n\r\n" in head and self.api.event_feeds:
                break
        self.assertIn(answer, head.split(b"\r\n", 1)[0])
        [feed] = self.api.event_feeds
        return client, feed

    async def stall(self, feed: BoundedFeed, client: socket.socket) -> list[int]:
        """Publish EVENTS events the client does not read; the feed's holdings after each."""
        held = []
        bus = self.lifecycle.events
        for number in range(EVENTS):
            bus.lifecycle("instance-updated", "web1", {"n": number, "padding": PAYLOAD})
            held.append(feed.pending_bytes)
            if number % 50 == 0:
                await deferLater(reactor, 0, lambda: None)
        await deferLater(reactor, 0.05, lambda: None)
        return held

    def assertCutOffWithReason(
        self, feed: BoundedFeed, client: socket.socket, held: list[int]
    ) -> None:
        self.assertLessEqual(max(held), LIMIT)
        self.assertGreater(max(held), 0, "the consumer never made the daemon hold anything")
        self.assertTrue(feed.closed)
        self.assertEqual(self.api.event_feeds, set())
        # What the daemon handed its transport fits in the sockets' buffers and one transport
        # buffer: it wrote nothing while the transport said it was full.
        kernel = client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + client.getsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF
        )
        self.assertLess(feed.written_bytes, 2 * kernel + 64 * 1024 + 2 * len(PAYLOAD) + 4096)
        reasons = [e for e in self.logged if "closing the event stream" in e.get("log_format", "")]
        self.assertEqual(len(reasons), 1)
        self.assertIn("it stopped reading", reasons[0]["reason"])

    async def test_stalledWebSocketConsumerIsCutOffWithinItsLimit(self) -> None:
        client, feed = await self.connect(upgrade_request(b"localhost"), b" 101 ")
        self.assertCutOffWithReason(feed, client, await self.stall(feed, client))

    async def test_stalledJSONLinesConsumerIsCutOffWithinItsLimit(self) -> None:
        client, feed = await self.connect(
            b"GET /1.0/events?type=lifecycle HTTP/1.1\r\nHost: localhost\r\n\r\n", b" 200 "
        )
        self.assertCutOffWithReason(feed, client, await self.stall(feed, client))

    async def test_aReadingWebSocketConsumerGetsEveryEventAsAMessage(self) -> None:
        # pylxd's ws4py says "localhost:None" on a unix socket.
        client, _feed = await self.connect(upgrade_request(b"localhost:None"), b" 101 ")
        self.lifecycle.events.lifecycle("instance-ready", "web1")
        event = await first_event(client)
        self.assertEqual(event["metadata"]["action"], "instance-ready")
        self.assertEqual(event["type"], "lifecycle")

    async def test_theTypeFilterHoldsOnTheWebSocket(self) -> None:
        # The consumer asked for type=lifecycle: an operation event never reaches it.
        client, _feed = await self.connect(upgrade_request(b"localhost"), b" 101 ")
        self.lifecycle.events.publish("operation", {"id": "x", "status": "Running"})
        self.lifecycle.events.lifecycle("instance-ready", "web1")
        event = await first_event(client)
        self.assertEqual(
            (event["type"], event["metadata"]["action"]), ("lifecycle", "instance-ready")
        )


async def first_event(client: socket.socket) -> Any:
    """The event in the first text frame ``client`` receives (None if none comes in 2 s)."""
    data = b""
    for _ in range(200):
        await deferLater(reactor, 0.01, lambda: None)
        with contextlib.suppress(BlockingIOError):
            data += client.recv(65536)
        if text_frame(data) is not None:
            break
    return json.loads(text_frame(data) or b"null")


def upgrade_request(host: bytes) -> bytes:
    """A ``GET /1.0/events?type=lifecycle`` asking to become a WebSocket (``Host: host``)."""
    key = base64.b64encode(os.urandom(16))
    return (
        b"GET /1.0/events?type=lifecycle HTTP/1.1\r\nHost: " + host + b"\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\n\r\n"
    )


def text_frame(data: bytes) -> bytes | None:
    """The payload of the one unmasked text frame (FIN, opcode 1) ``data`` starts with.

    None while the frame is not all there; AssertionError for another frame.
    """
    if len(data) < 2:
        return None
    if data[0] != 0x81 or data[1] & 0x80:
        raise AssertionError(f"not an unmasked text frame: {data[:8]!r}")
    length, offset = data[1] & 0x7F, 2
    if length == 126:
        if len(data) < 4:
            return None
        length, offset = int.from_bytes(data[2:4], "big"), 4
    if len(data) < offset + length:
        return None
    return data[offset : offset + length]


class StartUpTests(SynchronousTestCase):
    def test_theDaemonStartsWithoutTheWebSocketLibrary(self) -> None:
        # autobahn costs 0.4 s of imports: the first WebSocket client loads it, not every start.
        checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        probe = (
            "import sys, vmready.daemon.tap; "
            "print(sorted(m for m in sys.modules if 'autobahn' in m))"
        )
        loaded = subprocess.run(
            [sys.executable, "-c", probe], cwd=checkout, capture_output=True, text=True, check=True
        )
        self.assertEqual(loaded.stdout.strip(), "[]")
