"""Damage for the HTTP side's inputs: bytes edited the way a hand or a hostile client edits them.

Like ``wire_mutations.mutated`` but without its 5,000-byte runs: they cross
the wire parsers' line caps, which the HTTP side does not have, and PyYAML's
scanner is quadratic in a run of ``[`` (a config file the operator writes,
not an attack), which would make a YAML input cost a second.
"""

from __future__ import annotations

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
