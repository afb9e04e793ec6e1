"""Fuzz targets as trial test methods: 200 inputs each, the same ones every run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from hypothesis import HealthCheck, given, settings
from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing.target import FuzzTarget

_Case = TypeVar("_Case", bound=type[SynchronousTestCase])


def fuzzed(target: FuzzTarget) -> Any:
    """A test method that runs ``target`` on 200 inputs, the same ones every run."""

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(target.inputs)
    def test(self: SynchronousTestCase, example: Any) -> None:
        target.check(example)

    test.__doc__ = f"{target.name}: {target.description}."
    return test


def method_name(target: FuzzTarget) -> str:
    """``ring-reader`` → ``test_ringReader``."""
    first, *rest = target.name.split("-")
    return "test_" + first + "".join(word.capitalize() for word in rest)


def with_target_tests(targets: Iterable[FuzzTarget]) -> Callable[[_Case], _Case]:
    """A class decorator: a ``fuzzed`` test method per target, named after it."""

    def decorate(case: _Case) -> _Case:
        for target in targets:
            setattr(case, method_name(target), fuzzed(target))
        return case

    return decorate
