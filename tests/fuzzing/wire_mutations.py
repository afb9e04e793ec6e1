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
import random
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


# The structural choices of an edit (how many, which, where) come from one
# seeded ``random.Random`` per edited message: one hypothesis draw instead of
# a dozen, which is most of the input's cost otherwise.  The seed is drawn,
# so an input is still the same for the same hypothesis seed.
_SEEDS = st.integers(0, 2**64 - 1)


def randomness(draw: st.DrawFn) -> random.Random:
    """A ``random.Random`` seeded by one draw: cheap choices, reproducible."""
    return random.Random(draw(_SEEDS))


# A long run of one byte: crosses the line and token caps (256 B, 4 KiB…).
_RUN_BYTES = (b"A", b"9", b"[", b"\xff", b" ", b"\r")
_RUN_LENGTHS = (255, 256, 257, 1000, 4097, 5000)
_EDITS = ("flip", "delete", "insert", "duplicate", "truncate", "run")


def _special_or_random(rng: random.Random, shortest: int, longest: int) -> bytes:
    """Bytes that mean something to a parser, or ``shortest``..``longest`` random bytes."""
    if rng.random() < 0.5:
        return rng.choice(SPECIAL_BYTES)
    return rng.randbytes(rng.randint(shortest, longest))


def mutate(draw: st.DrawFn, data: bytes, most: int = 4) -> bytes:
    """``data`` with up to ``most`` random edits (often none), drawn in ``draw``."""
    rng = randomness(draw)
    edited = bytearray(data)
    for _ in range(rng.randint(0, most)):
        op = rng.choice(_EDITS)
        at = rng.randint(0, len(edited))
        if op == "flip" and edited:
            at = min(at, len(edited) - 1)
            edited[at] ^= 1 << rng.randint(0, 7)
        elif op == "delete":
            del edited[at : at + rng.randint(1, 8)]
        elif op == "insert":
            edited[at:at] = _special_or_random(rng, 1, 4)
        elif op == "duplicate":
            edited[at:at] = edited[at : at + rng.randint(1, 32)]
        elif op == "truncate":
            del edited[at:]
        elif op == "run":
            edited[at:at] = rng.choice(_RUN_BYTES) * rng.choice(_RUN_LENGTHS)
    return bytes(edited)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes], most: int = 4) -> bytes:
    """One valid message, then up to ``most`` random edits (often none)."""
    return mutate(draw, draw(valid), most)


def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at up to 8 random points, as a stream delivers it, drawn in ``draw``."""
    if not data:
        return [b""]
    rng = randomness(draw)
    last = max(1, len(data) - 1)
    cuts = sorted({rng.randint(1, last) for _ in range(rng.randint(0, 8))})
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at random points, as a stream delivers it.

    A strategy for one ``data``: built inside a draw (``flatmap``) it costs a
    validation per input; ``with_chunks`` draws the data and its split at once.
    """
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


@st.composite
def _noise(draw: st.DrawFn, max_size: int) -> bytes:
    rng = randomness(draw)
    parts = [_special_or_random(rng, 0, 16) for _ in range(rng.randint(0, 32))]
    return b"".join(parts)[:max_size]


def noise(max_size: int = 512) -> st.SearchStrategy[bytes]:
    """Raw bytes, weighted towards line and JSON punctuation."""
    return _noise(max_size)


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
    rng = randomness(draw)
    for _ in range(rng.randint(0, 3)):
        if not isinstance(message, dict):
            break
        op = rng.choice(_JSON_EDITS)
        keys = sorted(message)
        if op == "replace" and keys:
            message = {**message, rng.choice(keys): draw(_JSON_VALUES)}
        elif op == "remove" and keys:
            removed = rng.choice(keys)
            message = {k: v for k, v in message.items() if k != removed}
        elif op == "add":
            message = {**message, draw(_NEW_KEY): draw(_JSON_VALUES)}
        elif op == "wrap":
            wrapping = rng.choice(_WRAPPINGS)
            message = [message] if wrapping == "list" else wrapping
        elif op == "nested" and keys:
            key = rng.choice(keys)
            inner = message[key]
            if isinstance(inner, dict) and inner:
                inner_key = rng.choice(sorted(inner))
                message = {**message, key: {**inner, inner_key: draw(_JSON_VALUES)}}
    return message


@st.composite
def json_mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid JSON message with members replaced, removed or added (often none)."""
    return json_mutate(draw, draw(valid))


def dumps(value: Any) -> bytes:
    """JSON bytes; a lone surrogate is written as QEMU or a hostile peer would (escaped)."""
    return json.dumps(value).encode("utf-8")
