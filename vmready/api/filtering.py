"""LXD's ``filter=`` on lists (the ``api_filtering`` extension), sans-I/O.

An expression is clauses ``FIELD OP VALUE`` joined by ``and``/``or`` (``and``
binds first), each optionally preceded by ``not``; ``OP`` is ``eq`` or ``ne``.
``FIELD`` is a JSON field of the listed object, nested with dots
(``status``, ``config.user.role``: under an object such as ``config`` the rest
is one key, dots and all); values compare as text, case-insensitively, as
``lxc list status=running`` expects; a value may be quoted ('a b' or "a b").
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from vmready.domain import BadRequest

Predicate = Callable[[dict[str, Any]], bool]
_OPERATORS = ("eq", "ne")


def parse_filter(text: str | None) -> Predicate | None:
    """The predicate ``filter=`` asks for (None: no filter); BadRequest naming what is wrong."""
    if text is None or not text.strip():
        return None
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise BadRequest(f"Invalid filter {text!r}: {e}") from None
    alternatives: list[list[Predicate]] = [[]]
    position = 0
    while True:
        clause, position = _clause(text, words, position)
        alternatives[-1].append(clause)
        if position == len(words):
            break
        joiner = words[position].lower()
        if joiner not in ("and", "or") or position + 1 == len(words):
            raise BadRequest(f"Invalid filter {text!r}: expected 'and' or 'or' between clauses")
        if joiner == "or":
            alternatives.append([])
        position += 1
    return lambda item: any(all(clause(item) for clause in group) for group in alternatives)


def _clause(text: str, words: list[str], position: int) -> tuple[Predicate, int]:
    """One ``[not] FIELD OP VALUE`` from ``words[position]`` on, and where the next starts."""
    negated = position < len(words) and words[position].lower() == "not"
    if negated:
        position += 1
    if position + 3 > len(words):
        raise BadRequest(f"Invalid filter {text!r}: expected FIELD eq|ne VALUE")
    name, operator, wanted = words[position : position + 3]
    operator = operator.lower()
    if operator not in _OPERATORS:
        raise BadRequest(
            f"Invalid filter {text!r}: unknown operator {operator!r} (expected eq or ne)"
        )

    def clause(item: dict[str, Any]) -> bool:
        equal = _text(_lookup(item, name)).lower() == wanted.lower()
        return (equal if operator == "eq" else not equal) != negated

    return clause, position + 3


def _lookup(item: Any, path: str) -> Any:
    """The value at a dotted ``path``; under an object, the longest key that matches wins."""
    if not path:
        return item
    if not isinstance(item, dict):
        return None
    if path in item:
        return item[path]
    head, _, rest = path.partition(".")
    if not rest:
        return None
    return _lookup(item.get(head), rest)


def _text(value: Any) -> str:
    """A field's value as the filter compares it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
