"""Inputs the wire targets share: mutations of valid messages, chunkings, JSON values.

Random bytes rarely get past a parser's first check, so most inputs start as
a real message and are then damaged the ways a wire damages them: a byte
flipped, a piece cut out or repeated, a NUL, a stray CR or LF, bytes that are
not UTF-8, a run long enough to cross a length cap.  JSON messages are also
damaged before they are serialised: a member given a value of another type,
a huge number, nesting deeper than a parser's recursion.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import strategies as st

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


def _run() -> st.SearchStrategy[bytes]:
    """A long run of one byte: crosses the line and token caps (256 B, 4 KiB…)."""
    return st.builds(
        lambda byte, count: byte * count,
        st.sampled_from([b"A", b"9", b"[", b"\xff", b" ", b"\r"]),
        st.sampled_from([255, 256, 257, 1000, 4097, 5000]),
    )


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes], most: int = 4) -> bytes:
    """One valid message, then up to ``most`` random edits (often none)."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, most))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "duplicate", "truncate", "run"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            at = min(at, len(data) - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "insert":
            data[at:at] = draw(st.sampled_from(SPECIAL_BYTES) | st.binary(min_size=1, max_size=4))
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[at:]
        elif op == "run":
            data[at:at] = draw(_run())
    return bytes(data)


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at random points, as a stream delivers it."""
    if not data:
        return [b""]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8))))
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


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


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, small, including the weird ones."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=12)
        | WEIRD_JSON
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )


@st.composite
def json_mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid JSON message with members replaced, removed or added (often none)."""
    message: Any = draw(valid)
    for _ in range(draw(st.integers(0, 3))):
        if not isinstance(message, dict):
            break
        op = draw(st.sampled_from(["replace", "remove", "add", "wrap", "nested"]))
        keys = sorted(message)
        if op == "replace" and keys:
            message = {**message, draw(st.sampled_from(keys)): draw(json_values())}
        elif op == "remove" and keys:
            message = {k: v for k, v in message.items() if k != draw(st.sampled_from(keys))}
        elif op == "add":
            message = {**message, draw(st.text(max_size=10)): draw(json_values())}
        elif op == "wrap":
            message = draw(st.sampled_from([[message], "text", 1, None]))
        elif op == "nested" and keys:
            key = draw(st.sampled_from(keys))
            inner = message[key]
            if isinstance(inner, dict) and inner:
                inner_key = draw(st.sampled_from(sorted(inner)))
                message = {**message, key: {**inner, inner_key: draw(json_values())}}
    return message


def dumps(value: Any) -> bytes:
    """JSON bytes; a lone surrogate is written as QEMU or a hostile peer would (escaped)."""
    return json.dumps(value).encode("utf-8")
