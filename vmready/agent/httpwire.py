"""HTTP/1.1 on asyncio streams: messages read with ``httpcodec``'s rules, size-capped.

Both of the agent's asyncio ends read here: its devlxd server (``proxy``)
and its client of the host's guest API (``host``).  On asyncio streams every
read can be cancelled and timed out by the caller, and a held event stream
costs no thread.  What a message may be, and every limit, is ``httpcodec``'s;
its names are re-exported here for the two ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from vmready.agent.httpcodec import (
    LAST_CHUNK,
    MAX_LINE_BYTES,
    NO_BODY,
    READ_SIZE,
    BodyTooLarge,
    Framing,
    Headers,
    HeadLines,
    HTTPError,
    IncompleteMessage,
    RequestHead,
    ResponseHead,
    encode_chunk,
    encode_request,
    encode_response_head,
    parse_chunk_size,
    parse_request_line,
    parse_status_line,
    request_framing,
    response_framing,
)

__all__ = [
    "LAST_CHUNK",
    "MAX_LINE_BYTES",
    "NO_BODY",
    "READ_SIZE",
    "BodyTooLarge",
    "Framing",
    "HTTPError",
    "Headers",
    "IncompleteMessage",
    "RequestHead",
    "ResponseHead",
    "body_chunks",
    "encode_chunk",
    "encode_request",
    "encode_response_head",
    "read_body",
    "read_request_head",
    "read_response_head",
    "request_framing",
    "response_framing",
]


class _HeadReader:
    """Reads the lines of one message head, counting them against the limits."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.lines = HeadLines()

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
        return self.lines.take(raw)

    async def headers(self) -> Headers:
        """Header lines up to the empty line."""
        while True:
            line = await self.line()
            assert line is not None
            if not self.lines.field(line):
                return self.lines.headers


async def read_request_head(reader: asyncio.StreamReader) -> RequestHead | None:
    """The next request's head; None if the connection ended cleanly before it began."""
    lines = _HeadReader(reader)
    line = await lines.line(first=True)
    while line == b"":  # RFC 9112 2.2: a server should ignore empty lines before a request
        line = await lines.line(first=True)
    if line is None:
        return None
    head = parse_request_line(line)
    head.headers = await lines.headers()
    return head


async def read_response_head(reader: asyncio.StreamReader) -> ResponseHead:
    """The response's head (interim 1xx answers are skipped)."""
    while True:
        lines = _HeadReader(reader)
        line = await lines.line(first=True)
        if line is None:
            raise IncompleteMessage("the connection ended before an answer")
        head = parse_status_line(line)
        head.headers = await lines.headers()
        if not 100 <= head.status < 200:
            return head


async def _read_chunk_size(reader: asyncio.StreamReader) -> int:
    line = await _HeadReader(reader).line()
    assert line is not None
    return parse_chunk_size(line)


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
