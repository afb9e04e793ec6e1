"""Tests for vmready.agent.httpwire: the agent's strict, size-capped HTTP/1.1 codec."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent import httpwire
from vmready.agent.httpwire import (
    BodyTooLarge,
    Framing,
    Headers,
    HTTPError,
    IncompleteMessage,
    RequestHead,
    ResponseHead,
)

T = TypeVar("T")


def run(data: bytes, parse: Callable[[asyncio.StreamReader], Awaitable[T]]) -> T:
    """``parse`` over a stream holding exactly ``data``."""

    async def parsed() -> T:
        reader = asyncio.StreamReader(limit=2 * httpwire.MAX_LINE_BYTES)
        reader.feed_data(data)
        reader.feed_eof()
        return await parse(reader)

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(parsed())
    finally:
        loop.close()


def request(data: bytes) -> RequestHead | None:
    return run(data, httpwire.read_request_head)


def response(data: bytes) -> ResponseHead:
    return run(data, httpwire.read_response_head)


def body(data: bytes, framing: Framing, limit: int = 1000) -> bytes:
    return run(data, lambda reader: httpwire.read_body(reader, framing, limit))


class RequestHeadTests(SynchronousTestCase):
    def test_aRequestIsParsed(self) -> None:
        head = request(b"PATCH /1.0?x=1 HTTP/1.1\r\nHost: lxd\r\nContent-Length:  2 \r\n\r\n")
        self.assertEqual(
            head,
            RequestHead(
                "PATCH", "/1.0?x=1", (1, 1), Headers([("Host", "lxd"), ("Content-Length", "2")])
            ),
        )

    def test_headersAreLookedUpWithoutCase(self) -> None:
        head = request(b"GET / HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
        assert head is not None
        self.assertEqual((head.headers.get("X-a"), head.headers.get("missing")), ("1, 2", ""))

    def test_aCleanEndBeforeAnyRequestIsNone(self) -> None:
        self.assertIsNone(request(b""))

    def test_emptyLinesBeforeARequestAreSkipped(self) -> None:
        head = request(b"\r\n\r\nGET / HTTP/1.0\r\n\r\n")
        assert head is not None
        self.assertEqual((head.method, head.version), ("GET", (1, 0)))

    def test_anEndInTheMiddleOfTheHeadIsIncomplete(self) -> None:
        error = self.assertRaises(IncompleteMessage, request, b"GET / HTTP/1.1\r\nHost: x")
        self.assertEqual(str(error), "the connection ended in the middle of the head")

    def test_keepAliveFollowsTheVersionAndConnectionHeader(self) -> None:
        cases = [
            (b"GET / HTTP/1.1\r\n\r\n", True),
            (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", False),
            (b"GET / HTTP/1.0\r\n\r\n", False),
            (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", True),
        ]
        for data, keeps in cases:
            head = request(data)
            assert head is not None
            self.assertEqual(head.keeps_alive, keeps, data)

    def test_refusals(self) -> None:
        cases = [
            (
                b"GET /\r\n\r\n",
                400,
                "a request line that is not 'METHOD TARGET HTTP/1.1': 'GET /'",
            ),
            (b"GET  / HTTP/1.1\r\n\r\n", 400, "a request line that is not"),
            (b"G(T / HTTP/1.1\r\n\r\n", 400, "a method that is not a token: 'G(T'"),
            (b"GET /\xff HTTP/1.1\r\n\r\n", 400, "a request target with a control, space"),
            (b"GET / HTTPS/1.1\r\n\r\n", 400, "the request line has no HTTP version: 'HTTPS/1.1'"),
            (b"GET / HTTP/3.0\r\n\r\n", 505, "HTTP version 3.0 is not supported"),
            (b"GET / HTTP/1.1\r\n: x\r\n\r\n", 400, "a header name that is not a token: ''"),
            (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400, "a control character in the value"),
            (b"GET / HTTP/1.1\r\n\tX: a\r\n\r\n", 400, "a folded header line"),
            (b"GET / HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 431, "a head line longer"),
            (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000, 431, "a head line longer than 8192 bytes"),
        ]
        for data, status, message in cases:
            error = self.assertRaises(HTTPError, request, data)
            self.assertEqual(error.status, status, data[:40])
            self.assertIn(message, str(error))


class ResponseHeadTests(SynchronousTestCase):
    def test_aResponseIsParsed(self) -> None:
        head = response(b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n\r\n")
        self.assertEqual(
            (head.status, head.reason, head.headers.get("content-type")),
            (404, "Not Found", "text/plain"),
        )

    def test_aReasonIsOptional(self) -> None:
        self.assertEqual(response(b"HTTP/1.1 200\r\n\r\n").status, 200)

    def test_interimAnswersAreSkipped(self) -> None:
        head = response(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        self.assertEqual(head.status, 204)

    def test_noAnswerAtAll(self) -> None:
        error = self.assertRaises(IncompleteMessage, response, b"")
        self.assertEqual(str(error), "the connection ended before an answer")

    def test_garbage(self) -> None:
        error = self.assertRaises(HTTPError, response, b"<html>\r\n\r\n")
        self.assertEqual(str(error), "a status line without a status code: '<html>'")


class FramingTests(SynchronousTestCase):
    def framing(self, headers: list[tuple[str, str]]) -> Framing:
        return httpwire.request_framing(RequestHead("POST", "/", (1, 1), Headers(headers)))

    def test_contentLength(self) -> None:
        self.assertEqual(self.framing([("Content-Length", "12")]), Framing(length=12))

    def test_chunked(self) -> None:
        self.assertEqual(self.framing([("Transfer-Encoding", "Chunked")]), Framing(chunked=True))

    def test_aRequestWithoutEitherHasNoBody(self) -> None:
        self.assertTrue(self.framing([]).empty)

    def test_anAnswerWithoutEitherRunsToTheEnd(self) -> None:
        head = ResponseHead((1, 1), 200, "OK", Headers())
        self.assertEqual(httpwire.response_framing(head, "GET"), Framing(until_close=True))

    def test_answersThatHaveNoBody(self) -> None:
        length = Headers([("Content-Length", "5")])
        for status, method in [(204, "GET"), (304, "GET"), (200, "HEAD")]:
            head = ResponseHead((1, 1), status, "", length)
            self.assertTrue(httpwire.response_framing(head, method).empty)

    def test_refusals(self) -> None:
        cases = [
            ([("Content-Length", "1"), ("Content-Length", "1")], "must be one decimal number"),
            ([("Content-Length", "1, 1")], "must be one decimal number"),
            ([("Content-Length", "+1")], "must be one decimal number"),
            ([("Content-Length", "9" * 19)], "is absurdly large"),
            ([("Transfer-Encoding", "gzip, chunked")], "is not supported (only 'chunked')"),
            (
                [("Transfer-Encoding", "chunked"), ("Content-Length", "1")],
                "has both Transfer-Encoding and Content-Length",
            ),
        ]
        for headers, message in cases:
            error = self.assertRaises(HTTPError, self.framing, headers)
            self.assertIn(message, str(error))


class BodyTests(SynchronousTestCase):
    def test_aBodyOfKnownLength(self) -> None:
        self.assertEqual(body(b"hello, and more", Framing(length=5)), b"hello")

    def test_aShortBodyIsIncomplete(self) -> None:
        error = self.assertRaises(IncompleteMessage, body, b"hel", Framing(length=5))
        self.assertEqual(str(error), "the connection ended in the middle of the body")

    def test_aBodyToTheEnd(self) -> None:
        self.assertEqual(body(b"all of it", Framing(until_close=True)), b"all of it")

    def test_chunksWithExtensionsAndTrailers(self) -> None:
        data = b"5;name=value\r\nhello\r\n1\r\n!\r\n0\r\nX-Trailer: yes\r\n\r\n"
        self.assertEqual(body(data, Framing(chunked=True)), b"hello!")

    def test_chunkRefusals(self) -> None:
        cases = [
            (b"g\r\n", "a chunk size that is not hexadecimal: 'g'"),
            (b"123456789\r\n", "a chunk size of more than 8 hex digits"),
            (b"2\r\nabc\r\n0\r\n\r\n", "a chunk longer than its size"),
        ]
        for data, message in cases:
            error = self.assertRaises(HTTPError, body, data, Framing(chunked=True))
            self.assertIn(message, str(error))

    def test_aChunkedBodyCutShortIsIncomplete(self) -> None:
        self.assertRaises(IncompleteMessage, body, b"5\r\nhel", Framing(chunked=True))

    def test_overTheLimitIsTooLarge(self) -> None:
        for data, framing in [
            (b"x" * 11, Framing(length=11)),
            (b"x" * 11, Framing(until_close=True)),
            (b"b\r\n" + b"x" * 11 + b"\r\n0\r\n\r\n", Framing(chunked=True)),
        ]:
            error = self.assertRaises(BodyTooLarge, body, data, framing, 10)
            self.assertEqual((error.status, str(error)), (413, "body larger than 10 bytes"))

    def test_atTheLimitIsRead(self) -> None:
        self.assertEqual(body(b"x" * 10, Framing(length=10), 10), b"x" * 10)


class EncodingTests(SynchronousTestCase):
    def test_aRequestWithABody(self) -> None:
        self.assertEqual(
            httpwire.encode_request("PATCH", "/1.0", [("Host", "h")], b"{}"),
            b"PATCH /1.0 HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
        )

    def test_aRequestWithoutABody(self) -> None:
        self.assertEqual(httpwire.encode_request("GET", "/", [], None), b"GET / HTTP/1.1\r\n\r\n")

    def test_aResponseHeadForAnHTTP10Client(self) -> None:
        self.assertEqual(
            httpwire.encode_response_head(503, [("A", "b")], (1, 0)),
            b"HTTP/1.0 503 Service Unavailable\r\nA: b\r\n\r\n",
        )

    def test_chunks(self) -> None:
        self.assertEqual(httpwire.encode_chunk(b"x" * 17), b"11\r\n" + b"x" * 17 + b"\r\n")
        self.assertEqual(httpwire.encode_chunk(b""), b"")

    def test_whatIsEncodedParsesBack(self) -> None:
        data = httpwire.encode_request("PATCH", "/1.0", [("Content-Type", "a/b")], b"body")
        head = request(data)
        assert head is not None
        self.assertEqual(
            (head.method, head.target, head.headers.get("content-type")), ("PATCH", "/1.0", "a/b")
        )
        self.assertEqual(run(data, self._body_after_head), b"body")

    @staticmethod
    async def _body_after_head(reader: asyncio.StreamReader) -> bytes:
        head = await httpwire.read_request_head(reader)
        assert head is not None
        return await httpwire.read_body(reader, httpwire.request_framing(head), 100)
