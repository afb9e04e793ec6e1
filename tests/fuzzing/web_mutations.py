"""Damage for the HTTP side's inputs: bytes edited the way a hand or a hostile client edits them.

Like ``wire_mutations.mutated`` but without its 5,000-byte runs: they cross
the wire parsers' line caps, which the HTTP side does not have, and PyYAML's
scanner is quadratic in a run of ``[`` (a config file the operator writes,
not an attack), which would make a YAML input cost a second.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.fuzzing.wire_mutations import SPECIAL_BYTES

_OPS = st.sampled_from(["flip", "delete", "insert", "duplicate", "truncate", "run"])
_INSERTS = st.sampled_from(SPECIAL_BYTES) | st.binary(min_size=1, max_size=4)
_RUNS = st.builds(
    lambda byte, count: byte * count,
    st.sampled_from([b"A", b"9", b"[", b"{", b"\xff", b" ", b"\n", b"%"]),
    st.sampled_from([2, 16, 64, 200]),
)


@st.composite
def edited(draw: st.DrawFn, valid: st.SearchStrategy[bytes], most: int = 3) -> bytes:
    """One valid input, then up to ``most`` random edits (often none)."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, most))):
        op = draw(_OPS)
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            at = min(at, len(data) - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "insert":
            data[at:at] = draw(_INSERTS)
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[at:]
        elif op == "run":
            data[at:at] = draw(_RUNS)
    return bytes(data)


# -- JSON values, built once (a strategy built inside a draw costs more than the draw) --

JSON_SCALARS: st.SearchStrategy[Any] = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(
        [
            2**63,
            10**400,
            -(10**400),
            1e308,
            "",
            "\0",
            "\ud800",
            "x" * 300,
            "Ready",
            "virtual-machine",
            "512MiB",
            "stop",
        ]
    )
)
JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_JSON_OPS = st.sampled_from(["replace", "remove", "add", "wrap", "nested"])
_KEYS = st.text(max_size=10)
_WRAPPED = st.sampled_from([["list"], "text", 1, None])


@st.composite
def json_edited(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid JSON object with members replaced, removed or added (often none)."""
    message: Any = draw(valid)
    for _ in range(draw(st.integers(0, 3))):
        if not isinstance(message, dict):
            break
        op = draw(_JSON_OPS)
        keys = sorted(message)
        if op == "replace" and keys:
            message = {**message, keys[draw(st.integers(0, len(keys) - 1))]: draw(JSON_VALUES)}
        elif op == "remove" and keys:
            gone = keys[draw(st.integers(0, len(keys) - 1))]
            message = {k: v for k, v in message.items() if k != gone}
        elif op == "add":
            message = {**message, draw(_KEYS): draw(JSON_VALUES)}
        elif op == "wrap":
            wrapper = draw(_WRAPPED)
            message = [message] if isinstance(wrapper, list) else wrapper
        elif op == "nested" and keys:
            key = keys[draw(st.integers(0, len(keys) - 1))]
            inner = message[key]
            if isinstance(inner, dict) and inner:
                inner_keys = sorted(inner)
                inner_key = inner_keys[draw(st.integers(0, len(inner_keys) - 1))]
                message = {**message, key: {**inner, inner_key: draw(JSON_VALUES)}}
    return message
