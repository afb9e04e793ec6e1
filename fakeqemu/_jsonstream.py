"""Split a QMP input byte stream into JSON texts the way QEMU's JSON streamer does.

QEMU does not need newlines between commands: it lexes tokens, counts brace and
bracket depth, and hands the collected tokens to its parser whenever the depth
returns to zero.  A lexical error (a stray byte, an unbalanced closing brace)
is reported at once, naming the offending token; input is then skipped
until a control character other than tab, a bracket or brace, or 0xFE/0xFF,
where the streamer starts afresh.  Any token at depth zero (a keyword, a
number, a string, even a lone ``:``) is a complete (if useless) JSON text on
its own.  Limits on size and nesting are the streamer's own errors, worded as
QEMU words them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import attrs

from fakeqemu._ringbuf import decode_modified_utf8

MAX_PENDING_BYTES = 64 * 1024 * 1024
MAX_NESTING = 1024

_WHITESPACE = b" \t\r\n"
# QEMU's lexer starts a keyword only with a lowercase letter, a number with '-' or a digit.
_SCALAR_START = b"-0123456789abcdefghijklmnopqrstuvwxyz"
_SCALAR_CONTINUE = _SCALAR_START + b"ABCDEFGHIJKLMNOPQRSTUVWXYZ+."
# Bytes skipped while recovering from a lexical error (json-lexer.c IN_RECOVERY).
_RECOVERY_SKIPPED = frozenset(b for b in range(0x20, 0xFE) if b not in b"{}[]") | {0x09}


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
        self._token_start = 0

    def feed(self, data: bytes) -> list[StreamItem]:
        """Consume ``data`` and return every item it completed."""
        items: list[StreamItem] = []
        for byte in data:
            items.extend(self._consume(byte))
            if len(self._pending) > MAX_PENDING_BYTES:
                self._reset()
                items.append(ParseError("JSON token size limit exceeded"))
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

    def _lexical_error(self, byte: int) -> list[StreamItem]:
        # QEMU reports the token lexed so far, this byte included, then skips ahead.
        token = bytes(self._pending[self._token_start :]) + bytes([byte])
        self._reset()
        self._recovering = True
        return [ParseError(f"JSON parse error, stray '{decode_modified_utf8(token)}'")]

    def _consume(self, byte: int) -> list[StreamItem]:
        if self._recovering:
            if byte in _RECOVERY_SKIPPED:
                return []
            self._recovering = False
        if self._in_string:
            return self._string_byte(byte)
        out: list[StreamItem] = []
        if self._scalar:
            if byte in _SCALAR_CONTINUE:
                self._pending.append(byte)
                return out
            # A keyword or number ended; the byte after it starts the next token.
            self._scalar = False
            if self._depth == 0:
                out.extend(self._emit())
        out.extend(self._token_byte(byte))
        return out

    def _string_byte(self, byte: int) -> list[StreamItem]:
        """A byte inside a string: kept, until the closing quote."""
        if byte < 0x20 or byte >= 0xFE:
            return self._lexical_error(byte)
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

    def _token_byte(self, byte: int) -> list[StreamItem]:
        """A byte between tokens: white space, or the start of a token."""
        if byte in _WHITESPACE:
            if self._pending:
                self._pending.append(byte)
            return []
        self._token_start = len(self._pending)
        if byte == 0x22:
            self._in_string = True
            self._pending.append(byte)
            return []
        if byte in b"{[":
            self._depth += 1
            self._pending.append(byte)
            if self._depth > MAX_NESTING:
                self._reset()
                return [ParseError("JSON nesting depth limit exceeded")]
            return []
        if byte in b"}]":
            if self._depth == 0:
                self._reset()
                return [ParseError("JSON parse error, expecting value")]
            self._depth -= 1
            self._pending.append(byte)
            return self._emit() if self._depth == 0 else []
        if byte in b":,":
            if self._depth == 0:
                # A lone separator is a whole JSON text, and not a value.
                self._reset()
                return [ParseError("JSON parse error, expecting value")]
            self._pending.append(byte)
            return []
        if byte in _SCALAR_START:
            self._scalar = True
            self._pending.append(byte)
            return []
        # Anything else is a lexical error: QEMU reports it and recovers.
        return self._lexical_error(byte)


def _decode(text: bytes) -> StreamItem:
    # Python's decoder recurses once per level; QEMU parses all MAX_NESTING of them.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + MAX_NESTING)
    try:
        return ParsedObject(json.loads(text, parse_int=_integer))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ParseError(_describe(text))
    finally:
        sys.setrecursionlimit(limit)


def _integer(digits: str) -> int | float:
    """A JSON integer; one too long for Python's int() is a double, as QEMU reads any too large."""
    try:
        return int(digits)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return float(digits)


def _describe(text: bytes) -> str:
    """Name the fault the way QEMU's parser words it, for the common cases."""
    for token in text.replace(b"{", b" ").replace(b"}", b" ").replace(b",", b" ").split():
        word = token.split(b":")[0].strip()
        if word and word[:1].isalpha() and word not in (b"true", b"false", b"null"):
            return f"JSON parse error, invalid keyword '{word.decode('utf-8', 'replace')}'"
    return "JSON parse error, expecting value"
