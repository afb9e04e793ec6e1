"""HTTP/1.1 on asyncio streams: a small, strict, size-capped codec for both of the agent's ends.

The agent speaks HTTP twice: as a server to guest programs on its unix socket,
and as a client to the host's guest API over TLS.  Both are small, known
conversations (short JSON requests and answers, one event stream), so the
agent carries its own codec rather than ``http.server``/``http.client`` in
worker threads: on asyncio streams every read can be cancelled and timed out
by the caller, a held event stream costs no thread, and every limit is a
constant here that a test can reach.

What it accepts (RFC 9112, strictly):

- a start line and header lines ending in CRLF (a bare LF is tolerated, as
  the RFC allows), at most ``MAX_LINE_BYTES`` each, ``MAX_HEADERS`` headers and
  ``MAX_HEAD_BYTES`` in all;
- header names that are tokens, values without control characters; no
  whitespace before the colon and no folded lines (both are refused, not
  repaired);
- bodies framed by one ``Content-Length`` or by ``Transfer-Encoding: chunked``
  (never both), or, for an answer only, by the end of the connection;
- chunk sizes of at most ``MAX_CHUNK_SIZE_DIGITS`` hex digits; trailers are
  read and dropped (within the head limits).

Anything else raises ``HTTPError`` with a message that says exactly what was
wrong, and a status for a server to answer with.  A connection that ends
before a message is complete raises ``IncompleteMessage``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

MAX_LINE_BYTES = 8 * 1024
MAX_HEADERS = 100
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_SIZE_DIGITS = 8  # at most 4 GiB - 1 per chunk
# How much of a body is read from the stream at once.
READ_SIZE = 64 * 1024
LAST_CHUNK = b"0\r\n\r\n"

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_STATUS = re.compile(rb"\d{3}")
_HEX = re.compile(rb"[0-9A-Fa-f]+")
_DIGITS = re.compile(rb"[0-9]+")
_REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class HTTPError(Exception):
    """A message that breaks the rules; ``status`` is what a server answers it with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class IncompleteMessage(HTTPError):
    """The connection ended in the middle of a message."""


class BodyTooLarge(HTTPError):
    """A body longer than the reader's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes", 413)
        self.limit = limit


@dataclass
class Headers:
    """Header fields in order, looked up without regard to case."""

    fields: list[tuple[str, str]] = field(default_factory=list)

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name``, in order."""
        wanted = name.lower()
        return [value for key, value in self.fields if key.lower() == wanted]

    def get(self, name: str, default: str = "") -> str:
        """The value of ``name`` (several joined with commas), or ``default``."""
        values = self.get_all(name)
        return ", ".join(values) if values else default


@dataclass
class RequestHead:
    """A request's start line and headers."""

    method: str
    target: str
    version: tuple[int, int]
    headers: Headers

    @property
    def keeps_alive(self) -> bool:
        """Whether the client may send another request on the connection."""
        tokens = _tokens(self.headers.get("connection"))
        if self.version >= (1, 1):
            return "close" not in tokens
        return "keep-alive" in tokens


@dataclass
class ResponseHead:
    """A response's status line and headers."""

    version: tuple[int, int]
    status: int
    reason: str
    headers: Headers


@dataclass(frozen=True)
class Framing:
    """How a body is delimited: a length, chunks, the end of the connection, or nothing."""

    length: int | None = None
    chunked: bool = False
    until_close: bool = False

    @property
    def empty(self) -> bool:
        """No body at all."""
        return not self.chunked and not self.until_close and not self.length


NO_BODY = Framing(length=0)


def _tokens(value: str) -> list[str]:
    return [part.strip().lower() for part in value.split(",") if part.strip()]


def _text(raw: bytes) -> str:
    """Header bytes as text: Latin-1, as HTTP defines them."""
    return raw.decode("latin-1")


class _HeadReader:
    """Reads the lines of one message head, counting them against the limits."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.total = 0

    async def line(self, first: bool = False) -> bytes | None:
        """One line without its line ending; None if the stream ended before its first byte."""
        try:
            raw = await self.reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            if first and not e.partial:
                return None
            raise IncompleteMessage("the connection ended in the middle of the head") from None
        except asyncio.LimitOverrunError:
            raise HTTPError(f"a head line longer than {MAX_LINE_BYTES} bytes", 431) from None
        self.total += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            raise HTTPError(f"a head line longer than {MAX_LINE_BYTES} bytes", 431)
        if self.total > MAX_HEAD_BYTES:
            raise HTTPError(f"a head longer than {MAX_HEAD_BYTES} bytes", 431)
        line = raw[:-1]
        return line[:-1] if line.endswith(b"\r") else line

    async def headers(self) -> Headers:
        """Header lines up to the empty line."""
        headers = Headers()
        while True:
            line = await self.line()
            assert line is not None
            if not line:
                return headers
            if len(headers.fields) >= MAX_HEADERS:
                raise HTTPError(f"more than {MAX_HEADERS} header fields", 431)
            headers.fields.append(_header(line))


def _header(line: bytes) -> tuple[str, str]:
    if line[:1] in (b" ", b"\t"):
        raise HTTPError("a folded header line (obsolete line folding is not accepted)")
    name, colon, value = line.partition(b":")
    if not colon:
        raise HTTPError(f"a header line without a colon: {_text(line[:60])!r}")
    if not _TOKEN.fullmatch(name):
        raise HTTPError(f"a header name that is not a token: {_text(name[:60])!r}")
    value = value.strip(b" \t")
    if _BAD_VALUE.search(value):
        raise HTTPError(f"a control character in the value of header {_text(name)!r}")
    return _text(name), _text(value)


def _version(raw: bytes, what: str) -> tuple[int, int]:
    match = _VERSION.fullmatch(raw)
    if match is None:
        raise HTTPError(f"{what} has no HTTP version: {_text(raw[:20])!r}")
    version = (int(match.group(1)), int(match.group(2)))
    if version[0] != 1:
        raise HTTPError(f"HTTP version {version[0]}.{version[1]} is not supported", 505)
    return version


async def read_request_head(reader: asyncio.StreamReader) -> RequestHead | None:
    """The next request's head; None if the connection ended cleanly before it began."""
    lines = _HeadReader(reader)
    line = await lines.line(first=True)
    while line == b"":  # RFC 9112 2.2: a server should ignore empty lines before a request
        line = await lines.line(first=True)
    if line is None:
        return None
    parts = line.split(b" ")
    if len(parts) != 3:
        raise HTTPError(
            f"a request line that is not 'METHOD TARGET HTTP/1.1': {_text(line[:80])!r}"
        )
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise HTTPError(f"a method that is not a token: {_text(method[:20])!r}")
    if not target or any(byte <= 0x20 or byte >= 0x7F for byte in target):
        raise HTTPError(
            f"a request target with a control, space or non-ASCII byte: {target[:60]!r}"
        )
    head = RequestHead(
        _text(method), target.decode("ascii"), _version(version, "the request line"), Headers()
    )
    head.headers = await lines.headers()
    return head


async def read_response_head(reader: asyncio.StreamReader) -> ResponseHead:
    """The response's head (interim 1xx answers are skipped)."""
    while True:
        lines = _HeadReader(reader)
        line = await lines.line(first=True)
        if line is None:
            raise IncompleteMessage("the connection ended before an answer")
        version, _, rest = line.partition(b" ")
        status, _, reason = rest.partition(b" ")
        if not _STATUS.fullmatch(status):
            raise HTTPError(f"a status line without a status code: {_text(line[:80])!r}")
        head = ResponseHead(
            _version(version, "the status line"), int(status), _text(reason), Headers()
        )
        head.headers = await lines.headers()
        if not 100 <= head.status < 200:
            return head


def _content_length(headers: Headers) -> int | None:
    values = headers.get_all("content-length")
    if not values:
        return None
    if len(values) > 1 or not _DIGITS.fullmatch(values[0].encode("latin-1")):
        raise HTTPError(f"Content-Length must be one decimal number, not {', '.join(values)!r}")
    if len(values[0]) > 18:
        raise HTTPError(f"Content-Length {values[0]} is absurdly large")
    return int(values[0])


def _framing(headers: Headers, what: str) -> Framing | None:
    """The framing the headers declare; None if they declare none."""
    codings = _tokens(headers.get("transfer-encoding"))
    length = _content_length(headers)
    if codings:
        if length is not None:
            raise HTTPError(f"{what} has both Transfer-Encoding and Content-Length")
        if codings != ["chunked"]:
            raise HTTPError(
                f"Transfer-Encoding {headers.get('transfer-encoding')!r} is not supported "
                "(only 'chunked')",
                501,
            )
        return Framing(chunked=True)
    if length is not None:
        return Framing(length=length)
    return None


def request_framing(head: RequestHead) -> Framing:
    """How the body of ``head``'s request is delimited (none when nothing says)."""
    return _framing(head.headers, "the request") or NO_BODY


def response_framing(head: ResponseHead, method: str) -> Framing:
    """How the body of an answer to ``method`` is delimited."""
    if method == "HEAD" or head.status in (204, 304) or 100 <= head.status < 200:
        return NO_BODY
    return _framing(head.headers, "the answer") or Framing(until_close=True)


async def _read_chunk_size(reader: asyncio.StreamReader) -> int:
    lines = _HeadReader(reader)
    line = await lines.line()
    assert line is not None
    size = line.split(b";", 1)[0].strip(b" \t")  # chunk extensions are ignored
    if not _HEX.fullmatch(size):
        raise HTTPError(f"a chunk size that is not hexadecimal: {_text(line[:40])!r}")
    if len(size) > MAX_CHUNK_SIZE_DIGITS:
        raise HTTPError(f"a chunk size of more than {MAX_CHUNK_SIZE_DIGITS} hex digits")
    return int(size, 16)


async def _read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise IncompleteMessage("the connection ended in the middle of the body") from None


async def body_chunks(
    reader: asyncio.StreamReader, framing: Framing
) -> AsyncGenerator[bytes, None]:
    """The body's bytes as they arrive, in pieces of at most ``READ_SIZE`` bytes."""
    if framing.until_close:
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                return
            yield data
    elif framing.chunked:
        while True:
            size = await _read_chunk_size(reader)
            if size == 0:
                trailers = _HeadReader(reader)
                await trailers.headers()  # read and dropped
                return
            while size > 0:
                data = await _read_exactly(reader, min(size, READ_SIZE))
                size -= len(data)
                yield data
            if await _read_exactly(reader, 2) != b"\r\n":
                raise HTTPError("a chunk longer than its size (no CRLF after its data)")
    else:
        remaining = framing.length or 0
        while remaining > 0:
            data = await _read_exactly(reader, min(remaining, READ_SIZE))
            remaining -= len(data)
            yield data


async def read_body(reader: asyncio.StreamReader, framing: Framing, limit: int) -> bytes:
    """The whole body; BodyTooLarge once it passes ``limit`` bytes (nothing past it is kept)."""
    if framing.length is not None and framing.length > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    chunks = body_chunks(reader, framing)
    try:
        async for data in chunks:
            size += len(data)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(data)
    finally:
        await chunks.aclose()  # now, not whenever the collector finds it
    return b"".join(parts)


def _head_lines(start: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [start, *(f"{name}: {value}" for name, value in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def encode_request(
    method: str, target: str, headers: list[tuple[str, str]], body: bytes | None
) -> bytes:
    """A whole request: a body goes with its Content-Length."""
    fields = list(headers)
    if body is not None:
        fields.append(("Content-Length", str(len(body))))
    return _head_lines(f"{method} {target} HTTP/1.1", fields) + (body or b"")


def encode_response_head(
    status: int, headers: list[tuple[str, str]], version: tuple[int, int] = (1, 1)
) -> bytes:
    """A status line and headers, as the server answers a client of ``version``."""
    reason = _REASONS.get(status, "Unknown")
    return _head_lines(f"HTTP/{version[0]}.{version[1]} {status} {reason}", headers)


def encode_chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (empty data: nothing, the last chunk is ``LAST_CHUNK``)."""
    if not data:
        return b""
    return f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n"
