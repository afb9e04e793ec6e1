"""The values ``twistd vmready``'s options take: ``optParameters`` rows with a coerce column.

Each value is converted and checked as it is parsed, from the command line
or the config file.  A refusal is one line naming the option (``--stop-timeout
must be 0 to 3600 seconds``), raised as ``usage.UsageError``, which Twisted's
option parser passes on as it is.  Defaults are given as values already.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from twisted.python import usage

T = TypeVar("T")
# What a value must hold to, and how the refusal says it ("--x must be <that>").
Rule = tuple[Callable[[Any], bool], str]

FINITE: Rule = (math.isfinite, "a finite number of seconds")


def at_least(least: int) -> Rule:
    """A whole number ``least`` or more."""
    return (lambda value: value >= least, f"at least {least}")


def _coerce(option: str, convert: Callable[[str], T], what: str, rules: Sequence[Rule]) -> Any:
    def coerce(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise usage.UsageError(f"--{option} must be {what}") from None
        for holds, must in rules:
            if not holds(value):
                raise usage.UsageError(f"--{option} must be {must}")
        return value

    return coerce


def seconds(option: str, default: float, doc: str, *rules: Rule) -> list[Any]:
    """An option taking a number of seconds that keeps ``rules``."""
    return [option, None, default, doc, _coerce(option, float, "a number of seconds", rules)]


def whole(option: str, default: int, doc: str, *rules: Rule) -> list[Any]:
    """An option taking a whole number that keeps ``rules``."""
    return [option, None, default, doc, _coerce(option, int, "a whole number", rules)]


def choice(option: str, default: str, doc: str, choices: Sequence[str]) -> list[Any]:
    """An option taking one of ``choices``."""
    rule: Rule = (lambda value: value in choices, f"one of {', '.join(choices)}")
    return [option, None, default, doc, _coerce(option, str, "", [rule])]
