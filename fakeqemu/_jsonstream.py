"""Split a QMP input byte stream into JSON texts the way QEMU's JSON streamer does.

QEMU does not need newlines between commands: it lexes tokens, counts brace and
bracket depth, and hands the collected tokens to its parser whenever the depth
returns to zero.  A lexical error (a stray byte, an unbalanced closing brace)
is reported at once; input is then skipped until a control character or a
bracket, where the streamer starts afresh.  A keyword or number at
depth zero is a complete (if useless) JSON text on its own.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

MAX_PENDING_BYTES = 64 * 1024 * 1024
MAX_NESTING = 1024

_STRUCTURAL = b"{}[]:,"
_WHITESPACE = b" \t\r\n"
_SCALAR_START = b"-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+."


@attrs.frozen
class ParsedObject:
    """A complete JSON text from the client, already decoded."""

    value: Any


@attrs.frozen
class ParseError:
    """A JSON text QEMU would refuse, with QEMU's description."""

    desc: str


StreamItem = ParsedObject | ParseError


class QMPInputSplitter:
    """Feed bytes, get decoded JSON values or parse errors, in order."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._scalar = False
        self._recovering = False

    def feed(self, data: bytes) -> list[StreamItem]:
        """Consume ``data`` and return every item it completed."""
        items: list[StreamItem] = []
        for byte in data:
            items.extend(self._consume(byte))
            if len(self._pending) > MAX_PENDING_BYTES:
                self._reset()
                items.append(ParseError("JSON parse error, token too large"))
        return items

    def _reset(self) -> None:
        self._pending.clear()
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._scalar = False

    def _emit(self) -> list[StreamItem]:
        text = bytes(self._pending)
        self._reset()
        return [_decode(text)]

    def _consume(self, byte: int) -> list[StreamItem]:
        if self._recovering:
            # After a lexical error QEMU skips input until a likely resynchronisation
            # point: a control character, a bracket or brace, or 0xFE/0xFF.
            if 0x20 <= byte <= 0xFD and byte not in b"{}[]":
                return []
            self._recovering = False
        if self._in_string:
            self._pending.append(byte)
            if self._escape:
                self._escape = False
            elif byte == 0x5C:  # backslash
                self._escape = True
            elif byte == 0x22:  # closing quote
                self._in_string = False
                if self._depth == 0:
                    return self._emit()
            return []
        out: list[StreamItem] = []
        if self._scalar and (byte in _WHITESPACE or byte in _STRUCTURAL or byte == 0x22):
            # A scalar token ended.
            self._scalar = False
            if self._depth == 0:
                out.extend(self._emit())
        if byte in _WHITESPACE:
            if self._pending:
                self._pending.append(byte)
            return out
        if byte == 0x22:
            self._in_string = True
            self._pending.append(byte)
            return out
        if byte in b"{[":
            self._depth += 1
            self._pending.append(byte)
            if self._depth > MAX_NESTING:
                self._reset()
                out.append(ParseError("JSON parse error, nesting too deep"))
            return out
        if byte in b"}]":
            if self._depth == 0:
                self._reset()
                out.append(ParseError("JSON parse error, expecting value"))
                return out
            self._depth -= 1
            self._pending.append(byte)
            if self._depth == 0:
                out.extend(self._emit())
            return out
        if byte in b":,":
            self._pending.append(byte)
            return out
        if byte in _SCALAR_START:
            self._scalar = True
            self._pending.append(byte)
            return out
        # Anything else is a lexical error: QEMU reports it and recovers.
        self._reset()
        self._recovering = True
        shown = chr(byte) if 0x20 <= byte < 0x7F else "\ufffd"
        out.append(ParseError(f"JSON parse error, stray '{shown}'"))
        return out

def _decode(text: bytes) -> StreamItem:
    try:
        return ParsedObject(json.loads(text))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ParseError(_describe(text))


def _describe(text: bytes) -> str:
    """Name the fault the way QEMU's parser words it, for the common cases."""
    for token in text.replace(b"{", b" ").replace(b"}", b" ").replace(b",", b" ").split():
        word = token.split(b":")[0].strip()
        if word and word[:1].isalpha() and word not in (b"true", b"false", b"null"):
            return f"JSON parse error, invalid keyword '{word.decode('utf-8', 'replace')}'"
    return "JSON parse error, expecting value"
