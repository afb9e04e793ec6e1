"""Inputs the wire targets share: mutations of valid messages, chunkings, JSON values.

Random bytes rarely get past a parser's first check, so most inputs start as
a real message and are then damaged the ways a wire damages them: a byte
flipped, a piece cut out or repeated, a NUL, a stray CR or LF, bytes that are
not UTF-8, a run long enough to cross a length cap.  JSON messages are also
damaged before they are serialised: a member given a value of another type,
a huge number, nesting deeper than a parser's recursion.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")

# Bytes that mean something to some wire parser here.
SPECIAL_BYTES: tuple[bytes, ...] = (
    b"\0",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\xff",
    b"\xfe",
    b"\xc0\x80",  # modified UTF-8's NUL
    b"\xed\xa0\x80",  # a UTF-8 encoded surrogate
    b"\xe2\x82",  # a truncated sequence
    b"\\",
    b'"',
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b" ",
    b"\t",
    b"\x1b",
    "\u0663".encode(),  # an Arabic-Indic digit: \d matches it
    b"-",
    b"0",
    b"9" * 12,
)


def between(low: int, high: int) -> st.SearchStrategy[int]:
    """``st.integers(low, high)``, built once per range and reused.

    Building a strategy inside a draw costs hypothesis a validation each time,
    many times the draw itself: every strategy a draw uses comes from here or
    from the module's constants.
    """
    return _between(low, high)


@functools.cache
def _between(low: int, high: int) -> st.SearchStrategy[int]:
    strategy = st.integers(low, high)
    strategy.validate()
    return strategy


def pick(draw: st.DrawFn, choices: Sequence[T]) -> T:
    """One of ``choices`` (not empty), drawn as an index: no strategy built per draw."""
    return choices[draw(between(0, len(choices) - 1))]


# A long run of one byte: crosses the line and token caps (256 B, 4 KiB…).
_RUN = st.builds(
    lambda byte, count: byte * count,
    st.sampled_from([b"A", b"9", b"[", b"\xff", b" ", b"\r"]),
    st.sampled_from([255, 256, 257, 1000, 4097, 5000]),
)
_INSERTED = st.sampled_from(SPECIAL_BYTES) | st.binary(min_size=1, max_size=4)
_EDITS = ("flip", "delete", "insert", "duplicate", "truncate", "run")


def mutate(draw: st.DrawFn, data: bytes, most: int = 4) -> bytes:
    """``data`` with up to ``most`` random edits (often none), drawn in ``draw``."""
    edited = bytearray(data)
    for _ in range(draw(between(0, most))):
        op = pick(draw, _EDITS)
        at = draw(between(0, len(edited)))
        if op == "flip" and edited:
            at = min(at, len(edited) - 1)
            edited[at] ^= 1 << draw(between(0, 7))
        elif op == "delete":
            del edited[at : at + draw(between(1, 8))]
        elif op == "insert":
            edited[at:at] = draw(_INSERTED)
        elif op == "duplicate":
            edited[at:at] = edited[at : at + draw(between(1, 32))]
        elif op == "truncate":
            del edited[at:]
        elif op == "run":
            edited[at:at] = draw(_RUN)
    return bytes(edited)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes], most: int = 4) -> bytes:
    """One valid message, then up to ``most`` random edits (often none)."""
    return mutate(draw, draw(valid), most)


def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at up to 8 random points, as a stream delivers it, drawn in ``draw``."""
    if not data:
        return [b""]
    position = between(1, max(1, len(data) - 1))
    cuts = sorted({draw(position) for _ in range(draw(between(0, 8)))})
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at random points, as a stream delivers it."""
    return split(draw, data)


def with_chunks(data: st.SearchStrategy[bytes]) -> st.SearchStrategy[tuple[bytes, list[bytes]]]:
    """Data and that data split as a stream delivers it (no strategy built per draw)."""

    @st.composite
    def whole_and_pieces(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
        drawn = draw(data)
        return drawn, split(draw, drawn)

    return whole_and_pieces()


def stream(messages: st.SearchStrategy[bytes], max_messages: int = 8) -> st.SearchStrategy[bytes]:
    """Several messages back to back."""
    return st.lists(messages, max_size=max_messages).map(b"".join)


def noise(max_size: int = 512) -> st.SearchStrategy[bytes]:
    """Raw bytes, weighted towards line and JSON punctuation."""
    return st.lists(st.sampled_from(SPECIAL_BYTES) | st.binary(max_size=16), max_size=32).map(
        lambda parts: b"".join(parts)[:max_size]
    )


def deep_json(depth: int) -> bytes:
    """A JSON array nested ``depth`` deep: past a recursive decoder's limit."""
    return b"[" * depth + b"]" * depth


WEIRD_JSON: st.SearchStrategy[Any] = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        -1,
        2**31,
        2**64,
        10**400,  # a float overflows on it
        -(10**400),
        1.5,
        1e308,
        "",
        "\0",
        "\ud800",  # a lone surrogate survives json.loads
        "x" * 300,
        [],
        {},
        [[[]]],
        {"class": 1},
        {"seconds": 10**400, "microseconds": 10**400},
    ]
)


def _json_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=12)
        | WEIRD_JSON
    )
    strategy = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )
    strategy.validate()
    return strategy


_JSON_VALUES = _json_values()


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, small, including the weird ones (one strategy, built once)."""
    return _JSON_VALUES


_JSON_EDITS = ("replace", "remove", "add", "wrap", "nested")
_WRAPPINGS = ("list", "text", 1, None)
_NEW_KEY = st.text(max_size=10)


def json_mutate(draw: st.DrawFn, message: Any) -> Any:
    """``message`` with members replaced, removed or added (often none), drawn in ``draw``."""
    for _ in range(draw(between(0, 3))):
        if not isinstance(message, dict):
            break
        op = pick(draw, _JSON_EDITS)
        keys = sorted(message)
        if op == "replace" and keys:
            message = {**message, pick(draw, keys): draw(_JSON_VALUES)}
        elif op == "remove" and keys:
            removed = pick(draw, keys)
            message = {k: v for k, v in message.items() if k != removed}
        elif op == "add":
            message = {**message, draw(_NEW_KEY): draw(_JSON_VALUES)}
        elif op == "wrap":
            wrapping = pick(draw, _WRAPPINGS)
            message = [message] if wrapping == "list" else wrapping
        elif op == "nested" and keys:
            key = pick(draw, keys)
            inner = message[key]
            if isinstance(inner, dict) and inner:
                inner_key = pick(draw, sorted(inner))
                message = {**message, key: {**inner, inner_key: draw(_JSON_VALUES)}}
    return message


@st.composite
def json_mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid JSON message with members replaced, removed or added (often none)."""
    return json_mutate(draw, draw(valid))


def dumps(value: Any) -> bytes:
    """JSON bytes; a lone surrogate is written as QEMU or a hostile peer would (escaped)."""
    return json.dumps(value).encode("utf-8")
