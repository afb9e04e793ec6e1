"""HTTP/1.1 messages without I/O: heads parsed and checked line by line, framing, encoding.

The agent speaks HTTP twice: as a server to guest programs on its unix socket,
and as a client to the host's guest API over TLS; ``vmready-agent notify`` is
a third, blocking client of the agent's socket.  Their messages are small,
known conversations (short JSON requests and answers, one event stream), so
the agent carries its own strict codec: this module turns lines into heads
and says how a body is framed, with no I/O at all, and ``httpwire`` reads
messages from asyncio streams with it.  ``notify`` uses it without asyncio,
whose import costs a second interpreter started at every boot.

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
before a message is complete raises ``IncompleteMessage``.  The value classes
are ``records.Record``s, not dataclasses: ``notify`` would import
``dataclasses`` for them.
"""

from __future__ import annotations

import re

from vmready.agent.records import Record

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


class Headers(Record):
    """Header fields in order, looked up without regard to case."""

    __slots__ = ("fields",)

    def __init__(self, fields: list[tuple[str, str]] | None = None) -> None:
        self.fields = [] if fields is None else fields

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name``, in order."""
        wanted = name.lower()
        return [value for key, value in self.fields if key.lower() == wanted]

    def get(self, name: str, default: str = "") -> str:
        """The value of ``name`` (several joined with commas), or ``default``."""
        values = self.get_all(name)
        return ", ".join(values) if values else default


class RequestHead(Record):
    """A request's start line and headers."""

    __slots__ = ("headers", "method", "target", "version")

    def __init__(
        self, method: str, target: str, version: tuple[int, int], headers: Headers
    ) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers

    @property
    def keeps_alive(self) -> bool:
        """Whether the client may send another request on the connection."""
        tokens = _tokens(self.headers.get("connection"))
        if self.version >= (1, 1):
            return "close" not in tokens
        return "keep-alive" in tokens


class ResponseHead(Record):
    """A response's status line and headers."""

    __slots__ = ("headers", "reason", "status", "version")

    def __init__(
        self, version: tuple[int, int], status: int, reason: str, headers: Headers
    ) -> None:
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = headers


class Framing(Record):
    """How a body is delimited: a length, chunks, the end of the connection, or nothing."""

    __slots__ = ("chunked", "length", "until_close")

    def __init__(
        self, length: int | None = None, chunked: bool = False, until_close: bool = False
    ) -> None:
        self.length = length
        self.chunked = chunked
        self.until_close = until_close

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


class HeadLines:
    """The lines of one message head, counted against the limits, and its header fields."""

    def __init__(self) -> None:
        self.total = 0
        self.headers = Headers()

    def take(self, raw: bytes) -> bytes:
        """``raw``, a line read up to its LF, without its line ending; HTTPError past a limit."""
        self.total += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            raise HTTPError(f"a head line longer than {MAX_LINE_BYTES} bytes", 431)
        if self.total > MAX_HEAD_BYTES:
            raise HTTPError(f"a head longer than {MAX_HEAD_BYTES} bytes", 431)
        line = raw[:-1]
        return line[:-1] if line.endswith(b"\r") else line

    def field(self, line: bytes) -> bool:
        """Add the header line ``line``; False for the empty line that ends the head."""
        if not line:
            return False
        if len(self.headers.fields) >= MAX_HEADERS:
            raise HTTPError(f"more than {MAX_HEADERS} header fields", 431)
        self.headers.fields.append(_header(line))
        return True


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


def parse_request_line(line: bytes) -> RequestHead:
    """A request line (without its line ending) as a head without headers yet."""
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
    return RequestHead(
        _text(method), target.decode("ascii"), _version(version, "the request line"), Headers()
    )


def parse_status_line(line: bytes) -> ResponseHead:
    """A status line (without its line ending) as a head without headers yet."""
    version, _, rest = line.partition(b" ")
    status, _, reason = rest.partition(b" ")
    if not _STATUS.fullmatch(status):
        raise HTTPError(f"a status line without a status code: {_text(line[:80])!r}")
    return ResponseHead(
        _version(version, "the status line"), int(status), _text(reason), Headers()
    )


def parse_chunk_size(line: bytes) -> int:
    """A chunk-size line (without its line ending): the size."""
    size = line.split(b";", 1)[0].strip(b" \t")  # chunk extensions are ignored
    if not _HEX.fullmatch(size):
        raise HTTPError(f"a chunk size that is not hexadecimal: {_text(line[:40])!r}")
    if len(size) > MAX_CHUNK_SIZE_DIGITS:
        raise HTTPError(f"a chunk size of more than {MAX_CHUNK_SIZE_DIGITS} hex digits")
    return int(size, 16)


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


def _head_lines(start: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [start, *(f"{name}: {value}" for name, value in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def encode_request(
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    version: tuple[int, int] = (1, 1),
) -> bytes:
    """A whole request: a body goes with its Content-Length."""
    fields = list(headers)
    if body is not None:
        fields.append(("Content-Length", str(len(body))))
    start = f"{method} {target} HTTP/{version[0]}.{version[1]}"
    return _head_lines(start, fields) + (body or b"")


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
