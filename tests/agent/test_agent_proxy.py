"""Tests for vmready.agent.proxy: the devlxd socket's answers, as a guest program sees them.

The proxy serves a real unix socket on a virtual-time loop; the host behind it
is scripted (``ScriptedEndpoint``): each test says what the host answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.agentfakes import MemoryTransport, memory_response
from tests.asynciotesting import run_virtual
from vmready.agent import httpwire
from vmready.agent.answers import Answer, devlxd_answer
from vmready.agent.bootdata import BootData
from vmready.agent.host import HostEndpoint, HostError, HostResponse
from vmready.agent.proxy import MAX_REQUEST_BODY, GuestAPIProxy, HostRoute, HostUnreachable

LABEL = "vsock 2:49152"


def envelope(metadata: Any) -> bytes:
    return json.dumps({"type": "sync", "status": "Success", "metadata": metadata}).encode()


def error_envelope(code: int, error: str) -> bytes:
    return json.dumps({"type": "error", "error": error, "error_code": code}).encode()


class DevlxdAnswerTests(SynchronousTestCase):
    """The host's envelope, unwrapped into what LXD's devlxd socket sends."""

    def test_objectMetadataIsJsonWithANewline(self) -> None:
        self.assertEqual(
            devlxd_answer(200, envelope({"state": "Ready"})),
            Answer(200, "application/json", b'{"state": "Ready"}\n'),
        )

    def test_stringMetadataIsRaw(self) -> None:
        self.assertEqual(
            devlxd_answer(200, envelope("instance-id: x\n")),
            Answer(200, "application/octet-stream", b"instance-id: x\n"),
        )

    def test_errorIsPlainTextWithTheStatus(self) -> None:
        self.assertEqual(
            devlxd_answer(404, error_envelope(404, "not found")),
            Answer(404, "text/plain; charset=utf-8", b"not found\n"),
        )

    def test_answerWithoutEnvelopeIs502(self) -> None:
        answer = devlxd_answer(200, b"<html>")
        self.assertEqual(
            (answer.code, answer.body),
            (502, b"host sent an invalid answer (HTTP 200, not an LXD envelope)\n"),
        )


@dataclass
class Sent:
    """A request the host got."""

    method: str
    target: str
    body: bytes | None
    content_type: str


Script = Callable[[Sent], Awaitable[tuple[int, str, bytes]]]


class ScriptedEndpoint(HostEndpoint):
    """The host's guest API, scripted: ``script`` answers each request (or raises)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.label = LABEL
        self.sent: list[Sent] = []
        # The transport of each answer: closing it is noted.
        self.transports: list[MemoryTransport] = []
        self.stream: asyncio.StreamReader | None = None

    async def send(
        self, method: str, target: str, body: bytes | None = None, content_type: str = ""
    ) -> HostResponse:
        request = Sent(method, target, body, content_type)
        self.sent.append(request)
        status, answer_type, raw = await self.script(request)
        stream = target.startswith("/1.0/events") and status == 200
        response, reader, transport = memory_response(status, raw, answer_type, stream=stream)
        if stream:
            self.stream = reader
        self.transports.append(transport)
        return response


def answers(status: int, raw: bytes, content_type: str = "application/json") -> Script:
    async def script(request: Sent) -> tuple[int, str, bytes]:
        return status, content_type, raw

    return script


def fails(error: BaseException) -> Script:
    async def script(request: Sent) -> tuple[int, str, bytes]:
        raise error

    return script


async def never(request: Sent) -> tuple[int, str, bytes]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@dataclass
class Reply:
    """What the guest program got back."""

    status: int
    headers: httpwire.Headers
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type")


class ProxyHarness:
    """The proxy on a unix socket, in front of a scripted host, and a guest to call it."""

    def __init__(
        self,
        test: SynchronousTestCase,
        script: Script | None = None,
        local: Callable[[str, str], Answer | None] | None = None,
    ) -> None:
        base = tempfile.mkdtemp(prefix="vra-")
        test.addCleanup(shutil.rmtree, base, True)
        self.test = test
        self.path = os.path.join(base, "sock")
        self.endpoint = ScriptedEndpoint(script or answers(200, envelope({})))
        self.connected = True
        self.remembered: list[str] = []
        self.proxy = GuestAPIProxy(self.route, self.remembered.append, timeout=30, local=local)

    def route(self) -> HostRoute:
        if not self.connected:
            raise HostUnreachable("the host has not sent CONNECT yet")
        return HostRoute(self.endpoint, LABEL)

    def run(self, scenario: Callable[[], Awaitable[Any]]) -> Any:
        async def served() -> Any:
            server = await asyncio.start_unix_server(self.proxy.handle, self.path)
            try:
                return await scenario()
            finally:
                server.close()
                self.proxy.close_connections()
                await server.wait_closed()

        return run_virtual(self.test, served)

    async def raw(self, data: bytes, eof: bool = False) -> bytes:
        """Send ``data`` as it is; everything the proxy answers until it closes."""
        reader, writer = await asyncio.open_unix_connection(self.path)
        writer.write(data)
        if eof:
            writer.write_eof()
        answer = await reader.read()
        writer.close()
        return answer

    async def request(
        self, method: str, target: str, body: bytes | None = None, headers: Any = ()
    ) -> Reply:
        fields = [("Host", "lxd"), *headers]
        answer = await self.raw(httpwire.encode_request(method, target, fields, body))
        return await read_reply(answer)

    def call(self, method: str, target: str, body: bytes | None = None) -> Reply:
        reply: Reply = self.run(lambda: self.request(method, target, body))
        return reply


async def read_reply(answer: bytes) -> Reply:
    """A whole answer as the guest read it (the proxy always closes after one)."""
    reader = asyncio.StreamReader()
    reader.feed_data(answer)
    reader.feed_eof()
    head = await httpwire.read_response_head(reader)
    framing = httpwire.response_framing(head, "GET")
    body = await httpwire.read_body(reader, framing, 1 << 20)
    return Reply(head.status, head.headers, body)


def parse_reply(answer: bytes) -> Reply:
    """``read_reply``, outside any loop."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(read_reply(answer))
    finally:
        loop.close()


BOOT = BootData("instance-id: x\nlocal-hostname: vm1\n", {"user.role": "web"}, {})


class BootDataTests(SynchronousTestCase):
    """While the link is down, this boot's data answers what it holds; the host, once up."""

    def test_metaDataIsAnsweredBeforeTheLink(self) -> None:
        harness = ProxyHarness(self, local=BOOT.answer)
        harness.connected = False
        reply = harness.call("GET", "/1.0/meta-data")
        self.assertEqual(
            (reply.status, reply.content_type, reply.body),
            (200, "application/octet-stream", b"instance-id: x\nlocal-hostname: vm1\n"),
        )
        self.assertEqual(harness.endpoint.sent, [])

    def test_configKeyIsAnsweredBeforeTheLink(self) -> None:
        harness = ProxyHarness(self, local=BOOT.answer)
        harness.connected = False
        reply = harness.call("GET", "/1.0/config/user.role")
        self.assertEqual((reply.status, reply.body), (200, b"web"))

    def test_stateStillWaitsForTheLink(self) -> None:
        harness = ProxyHarness(self, local=BOOT.answer)
        harness.connected = False
        reply = harness.call("GET", "/1.0")
        self.assertEqual(
            (reply.status, reply.body),
            (503, b"host not reachable: the host has not sent CONNECT yet\n"),
        )

    def test_theHostAnswersOnceLinked(self) -> None:
        harness = ProxyHarness(self, answers(200, envelope("instance-id: newer\n")), BOOT.answer)
        reply = harness.call("GET", "/1.0/meta-data")
        self.assertEqual(reply.body, b"instance-id: newer\n")
        self.assertEqual([sent.target for sent in harness.endpoint.sent], ["/1.0/meta-data"])


class ProxyTests(SynchronousTestCase):
    def test_stateIsTheHostsMetadataAsJson(self) -> None:
        harness = ProxyHarness(self, answers(200, envelope({"state": "Started"})))
        reply = harness.call("GET", "/1.0")
        self.assertEqual((reply.status, reply.content_type), (200, "application/json"))
        self.assertEqual(reply.body, b'{"state": "Started"}\n')

    def test_configValueIsRaw(self) -> None:
        reply = ProxyHarness(self, answers(200, envelope("bar"))).call(
            "GET", "/1.0/config/user.foo"
        )
        self.assertEqual(
            (reply.status, reply.content_type, reply.body),
            (200, "application/octet-stream", b"bar"),
        )

    def test_hostErrorIsPlainTextWithItsStatus(self) -> None:
        harness = ProxyHarness(self, answers(404, error_envelope(404, "not found")))
        reply = harness.call("GET", "/1.0/config/user.missing")
        self.assertEqual(
            (reply.status, reply.content_type, reply.body),
            (404, "text/plain; charset=utf-8", b"not found\n"),
        )

    def test_answersSayNosniffAndClose(self) -> None:
        reply = ProxyHarness(self).call("GET", "/1.0")
        self.assertEqual(
            (reply.headers.get("x-content-type-options"), reply.headers.get("connection")),
            ("nosniff", "close"),
        )

    def test_readyPatchReachesTheHostAndIsRemembered(self) -> None:
        harness = ProxyHarness(self)
        reply = harness.run(
            lambda: harness.request(
                "PATCH", "/1.0", b'{"state": "Ready"}', [("Content-Type", "application/json")]
            )
        )
        self.assertEqual((reply.status, reply.body), (200, b"{}\n"))
        self.assertEqual(
            harness.endpoint.sent,
            [Sent("PATCH", "/1.0", b'{"state": "Ready"}', "application/json")],
        )
        self.assertEqual(harness.remembered, ["Ready"])

    def test_startedPatchIsRemembered(self) -> None:
        harness = ProxyHarness(self)
        harness.call("PATCH", "/1.0", b'{"state": "Started"}')
        self.assertEqual(harness.remembered, ["Started"])

    def test_refusedPatchIsNotRemembered(self) -> None:
        harness = ProxyHarness(self, answers(400, error_envelope(400, 'Invalid state "Running"')))
        reply = harness.call("PATCH", "/1.0", b'{"state": "Running"}')
        self.assertEqual((reply.status, reply.body), (400, b'Invalid state "Running"\n'))
        self.assertEqual(harness.remembered, [])

    def test_aGetIsForwardedWithoutABody(self) -> None:
        harness = ProxyHarness(self)
        harness.call("GET", "/1.0")
        self.assertEqual(harness.endpoint.sent, [Sent("GET", "/1.0", None, "")])

    def test_pathAndQueryAreForwarded(self) -> None:
        harness = ProxyHarness(self)
        harness.call("GET", "/1.0/config?recursion=1")
        self.assertEqual(harness.endpoint.sent[0].target, "/1.0/config?recursion=1")

    def test_absoluteFormTargetIsForwardedAsAPath(self) -> None:
        harness = ProxyHarness(self)
        harness.call("GET", "http://lxd/1.0/meta-data?x=1")
        self.assertEqual(harness.endpoint.sent[0].target, "/1.0/meta-data?x=1")

    def test_linkDownIs503WithTheReason(self) -> None:
        harness = ProxyHarness(self)
        harness.connected = False
        reply = harness.call("GET", "/1.0")
        self.assertEqual(
            (reply.status, reply.content_type, reply.body),
            (
                503,
                "text/plain; charset=utf-8",
                b"host not reachable: the host has not sent CONNECT yet\n",
            ),
        )

    def test_aStateDeclaredWhileTheLinkIsDownIsKeptAnd202(self) -> None:
        harness = ProxyHarness(self)
        held: list[str] = []
        harness.proxy.hold_state = held.append
        harness.connected = False
        reply = harness.call("PATCH", "/1.0", b'{"state": "Ready"}')
        self.assertEqual(
            (reply.status, reply.body),
            (
                202,
                b"host not reachable: the host has not sent CONNECT yet; "
                b"the agent will tell it Ready when the link returns\n",
            ),
        )
        self.assertEqual((held, harness.remembered), (["Ready"], []))

    def test_whileTheLinkIsDownOnlyAWellFormedStateIsKept(self) -> None:
        harness = ProxyHarness(self)
        held: list[str] = []
        harness.proxy.hold_state = held.append
        harness.connected = False
        for method, target, body in (
            ("PATCH", "/1.0", b'{"state": "Readyish"}'),
            ("PATCH", "/1.0", b"not json"),
            ("GET", "/1.0", None),
            ("PATCH", "/1.0/config", b'{"state": "Ready"}'),
        ):
            self.assertEqual(harness.call(method, target, body).status, 503)
        self.assertEqual(held, [])

    def test_aStateThatCannotBeKeptIs503(self) -> None:
        harness = ProxyHarness(self)

        def disk_full(state: str) -> None:
            raise OSError(28, "No space left on device")

        harness.proxy.hold_state = disk_full
        harness.connected = False
        self.assertEqual(harness.call("PATCH", "/1.0", b'{"state": "Ready"}').status, 503)

    def test_hostDroppingTheRequestIs503(self) -> None:
        harness = ProxyHarness(self, fails(HostError("the connection to the host was lost")))
        reply = harness.call("GET", "/1.0")
        self.assertEqual(
            (reply.status, reply.body),
            (503, b"host not reachable: vsock 2:49152: the connection to the host was lost\n"),
        )

    def test_agentBugIs500WithOneLine(self) -> None:
        harness = ProxyHarness(self, fails(ZeroDivisionError("division by zero")))
        with self.assertLogs("vmready.agent.proxy", logging.ERROR) as logged:
            reply = harness.call("GET", "/1.0")
        self.assertEqual(
            (reply.status, reply.body), (500, b"vmready-agent internal error: division by zero\n")
        )
        [line] = [record.getMessage() for record in logged.records]
        self.assertTrue(
            line.startswith(
                "forwarding GET /1.0 failed: internal error ZeroDivisionError: division by zero "
                "(at "
            ),
            line,
        )
        self.assertNotIn("\n", line)

    def test_silentHostIs503AfterTheTimeout(self) -> None:
        harness = ProxyHarness(self, never)

        async def scenario() -> tuple[Reply, float]:
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await harness.request("GET", "/1.0")
            return reply, loop.time() - started

        reply, waited = harness.run(scenario)
        self.assertEqual(
            (reply.status, reply.body, waited),
            (503, b"host not reachable: no answer from vsock 2:49152 within 30s\n", 30.0),
        )

    def test_answerTooLargeIs502(self) -> None:
        harness = ProxyHarness(self, answers(200, b" " * (16 * 1024 * 1024 + 1)))
        reply = harness.call("GET", "/1.0")
        self.assertEqual(
            (reply.status, reply.body),
            (
                502,
                b"host sent an answer too large to relay (answer larger than 16777216 bytes)\n",
            ),
        )

    def test_theHostsConnectionIsClosedAfterItsAnswer(self) -> None:
        harness = ProxyHarness(self)
        harness.call("GET", "/1.0")
        self.assertTrue(harness.endpoint.transports[0].closed)


class EventStreamTests(SynchronousTestCase):
    """``GET /1.0/events``: the host's stream relayed as it arrives."""

    def setUp(self) -> None:
        self.harness = ProxyHarness(self, answers(200, b"", "application/x-ndjson"))

    async def open_stream(
        self, version: str = "HTTP/1.1"
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, httpwire.ResponseHead]:
        reader, writer = await asyncio.open_unix_connection(self.harness.path)
        writer.write(f"GET /1.0/events?type=config {version}\r\nHost: lxd\r\n\r\n".encode())
        head = await httpwire.read_response_head(reader)
        return reader, writer, head

    def host_sends(self, data: bytes) -> None:
        assert self.harness.endpoint.stream is not None
        self.harness.endpoint.stream.feed_data(data)

    def test_eventsAreRelayedInChunksAsTheyArrive(self) -> None:
        async def scenario() -> tuple[httpwire.ResponseHead, bytes, bytes]:
            reader, writer, head = await self.open_stream()
            self.host_sends(b'{"type": "config"}\n')
            first = await reader.readexactly(len(b'13\r\n{"type": "config"}\n\r\n'))
            assert self.harness.endpoint.stream is not None
            self.harness.endpoint.stream.feed_eof()  # the host ends its stream
            rest = await reader.read()
            writer.close()
            return head, first, rest

        head, first, rest = self.harness.run(scenario)
        self.assertEqual(
            (head.status, head.headers.get("content-type"), head.headers.get("transfer-encoding")),
            (200, "application/x-ndjson", "chunked"),
        )
        self.assertEqual(first, b'13\r\n{"type": "config"}\n\r\n')
        self.assertEqual(rest, b"0\r\n\r\n")
        self.assertEqual(self.harness.endpoint.sent[0].target, "/1.0/events?type=config")

    def test_anHTTP10ClientGetsTheRawStream(self) -> None:
        async def scenario() -> tuple[httpwire.ResponseHead, bytes]:
            reader, writer, head = await self.open_stream("HTTP/1.0")
            self.host_sends(b'{"type": "config"}\n')
            assert self.harness.endpoint.stream is not None
            self.harness.endpoint.stream.feed_eof()
            body = await reader.read()
            writer.close()
            return head, body

        head, body = self.harness.run(scenario)
        self.assertEqual((head.version, head.headers.get("transfer-encoding")), ((1, 0), ""))
        self.assertEqual(body, b'{"type": "config"}\n')

    def test_guestLeavingClosesTheHostsStream(self) -> None:
        async def scenario() -> None:
            _, writer, _ = await self.open_stream()
            writer.close()
            transport = self.harness.endpoint.transports[0]
            while not transport.closed:
                await asyncio.sleep(0.01)

        self.harness.run(scenario)  # returns only once the host's stream was closed

    def test_hostStreamBreakingEndsTheGuestsWithoutTheLastChunk(self) -> None:
        async def scenario() -> bytes:
            reader, writer, _ = await self.open_stream()
            assert self.harness.endpoint.stream is not None
            self.harness.endpoint.stream.set_exception(ConnectionResetError())
            rest = await reader.read()
            writer.close()
            return rest

        self.assertEqual(self.harness.run(scenario), b"")


class BadRequestTests(SynchronousTestCase):
    """Whatever a guest program sends, it gets a precise answer, never a hang or a crash."""

    def setUp(self) -> None:
        self.harness = ProxyHarness(self)

    def raw(self, data: bytes, eof: bool = False) -> bytes:
        answer: bytes = self.harness.run(lambda: self.harness.raw(data, eof))
        return answer

    def reply(self, data: bytes) -> tuple[int, bytes]:
        reply = parse_reply(self.raw(data))
        return reply.status, reply.body

    def test_garbageRequestLine(self) -> None:
        self.assertEqual(
            self.reply(b"hello\r\n\r\n"),
            (400, b"Bad request: a request line that is not 'METHOD TARGET HTTP/1.1': 'hello'\n"),
        )

    def test_headerWithoutAColon(self) -> None:
        self.assertEqual(
            self.reply(b"GET /1.0 HTTP/1.1\r\nHost lxd\r\n\r\n"),
            (400, b"Bad request: a header line without a colon: 'Host lxd'\n"),
        )

    def test_spaceBeforeTheColon(self) -> None:
        self.assertEqual(
            self.reply(b"GET /1.0 HTTP/1.1\r\nHost : lxd\r\n\r\n"),
            (400, b"Bad request: a header name that is not a token: 'Host '\n"),
        )

    def test_foldedHeader(self) -> None:
        status, _ = self.reply(b"GET /1.0 HTTP/1.1\r\nX: a\r\n b\r\n\r\n")
        self.assertEqual(status, 400)

    def test_unknownHTTPVersion(self) -> None:
        self.assertEqual(
            self.reply(b"GET /1.0 HTTP/2.0\r\n\r\n"),
            (505, b"Bad request: HTTP version 2.0 is not supported\n"),
        )

    def test_headTooLarge(self) -> None:
        headers = b"".join(b"X-%d: %s\r\n" % (i, b"y" * 4000) for i in range(20))
        status, body = self.reply(b"GET /1.0 HTTP/1.1\r\n" + headers + b"\r\n")
        self.assertEqual((status, body), (431, b"Bad request: a head longer than 65536 bytes\n"))

    def test_tooManyHeaders(self) -> None:
        headers = b"".join(b"X-%d: y\r\n" % i for i in range(101))
        self.assertEqual(
            self.reply(b"GET /1.0 HTTP/1.1\r\n" + headers + b"\r\n"),
            (431, b"Bad request: more than 100 header fields\n"),
        )

    def test_targetThatIsNotAPath(self) -> None:
        self.assertEqual(
            self.reply(b"GET * HTTP/1.1\r\n\r\n"),
            (400, b"Bad request: a request target that is not a path: '*'\n"),
        )

    def test_bothContentLengthAndTransferEncoding(self) -> None:
        self.assertEqual(
            self.reply(
                b"PATCH /1.0 HTTP/1.1\r\nContent-Length: 2\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            ),
            (400, b"Bad request: the request has both Transfer-Encoding and Content-Length\n"),
        )

    def test_unsupportedTransferEncoding(self) -> None:
        self.assertEqual(
            self.reply(b"PATCH /1.0 HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"),
            (501, b"Bad request: Transfer-Encoding 'gzip' is not supported (only 'chunked')\n"),
        )

    def test_contentLengthThatIsNotANumber(self) -> None:
        self.assertEqual(
            self.reply(b"PATCH /1.0 HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
            (400, b"Bad request: Content-Length must be one decimal number, not '-1'\n"),
        )

    def test_badChunkSize(self) -> None:
        self.assertEqual(
            self.reply(b"PATCH /1.0 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            (400, b"Bad request: a chunk size that is not hexadecimal: 'zz'\n"),
        )

    def test_bodyCutShortGetsNoAnswer(self) -> None:
        self.assertEqual(
            self.raw(b"PATCH /1.0 HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", eof=True), b""
        )

    def test_connectionClosedBeforeARequestGetsNoAnswer(self) -> None:
        self.assertEqual(self.raw(b"", eof=True), b"")

    def test_chunkedBodyIsForwardedWhole(self) -> None:
        status, _ = self.reply(
            b"PATCH /1.0 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'5\r\n{"sta\r\n0d\r\nte": "Ready"}\r\n0\r\n\r\n'
        )
        self.assertEqual(status, 200)
        self.assertEqual(self.harness.endpoint.sent[0].body, b'{"state": "Ready"}')
        self.assertEqual(self.harness.remembered, ["Ready"])

    def test_chunkLongerThanItsSize(self) -> None:
        self.assertEqual(
            self.reply(b"PATCH /1.0 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n"),
            (400, b"Bad request: a chunk longer than its size (no CRLF after its data)\n"),
        )

    def test_bareLineFeedsAreTolerated(self) -> None:
        status, _ = self.reply(b"GET /1.0 HTTP/1.1\nHost: lxd\n\n")
        self.assertEqual(status, 200)

    def test_silentClientGets408(self) -> None:
        self.assertEqual(
            self.reply(b"GET /1.0 HTTP/1.1\r\n"),
            (408, b"no whole request within 60s\n"),
        )


class BodyLimitTests(SynchronousTestCase):
    """Request bodies over 1 MiB are refused with 413 before anything reaches the host."""

    def setUp(self) -> None:
        self.harness = ProxyHarness(self)

    def patch_body(self, body: bytes, headers: Any = ()) -> Reply:
        reply: Reply = self.harness.run(
            lambda: self.harness.request("PATCH", "/1.0", body, headers)
        )
        return reply

    def test_bodyOverTheLimitIs413(self) -> None:
        reply = self.patch_body(b" " * (MAX_REQUEST_BODY + 1))
        self.assertEqual(
            (reply.status, reply.body), (413, b"Request body too large (limit 1048576 bytes)\n")
        )
        self.assertEqual(self.harness.endpoint.sent, [])

    def test_bodyAtTheLimitGoesOnToTheHost(self) -> None:
        self.assertEqual(self.patch_body(b" " * MAX_REQUEST_BODY).status, 200)
        self.assertEqual(len(self.harness.endpoint.sent[0].body or b""), MAX_REQUEST_BODY)

    def test_chunkedBodyOverTheLimitIs413(self) -> None:
        chunk = b" " * 65536
        body = b"".join(b"10000\r\n" + chunk + b"\r\n" for _ in range(17)) + b"0\r\n\r\n"
        request = b"PATCH /1.0 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body
        reply = parse_reply(self.harness.run(lambda: self.harness.raw(request)))
        self.assertEqual(
            (reply.status, reply.body), (413, b"Request body too large (limit 1048576 bytes)\n")
        )
        self.assertEqual(self.harness.endpoint.sent, [])

    def test_expectContinueOverTheLimitIsRefusedBeforeTheBody(self) -> None:
        head = (
            b"PATCH /1.0 HTTP/1.1\r\nExpect: 100-continue\r\n"
            + b"Content-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        reply = parse_reply(self.harness.run(lambda: self.harness.raw(head)))
        self.assertEqual(reply.status, 413)

    def test_expectContinueWithinTheLimitIsContinued(self) -> None:
        request = (
            b"PATCH /1.0 HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 18\r\n\r\n"
            b'{"state": "Ready"}'
        )
        answer = self.harness.run(lambda: self.harness.raw(request))
        self.assertTrue(answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"))
        self.assertEqual(parse_reply(answer).status, 200)  # the reader skips the interim 100
