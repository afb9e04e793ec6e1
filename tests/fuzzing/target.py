"""What a fuzz target is: a parser, the inputs to throw at it, and what must hold.

A target's ``check`` takes one generated input and feeds it to the parser the
way outside input reaches it (bytes off a socket, a request, a line, a file).
It returns normally when the parser behaved: it accepted the input, or refused
it with its precise error, leaving state unchanged. It raises ``AssertionError``
when a property is broken (a wrong error, changed state, unbounded buffering);
any other exception escaping ``check`` is a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass(frozen=True)
class FuzzTarget:
    """One parser under fuzzing."""

    # Unique, stable, used on the command line: ``benchmarks/fuzz.py --target NAME``.
    name: str
    # What the parser is and where outside input comes from, one line.
    description: str
    # Generates inputs: mostly near-valid (mutations of real messages) plus raw noise.
    inputs: st.SearchStrategy[Any]
    # Feeds one input to the parser; see the module docstring for the contract.
    check: Callable[[Any], None]
