"""A fuzz target as a trial test method: 200 inputs, the same ones every run."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing.target import FuzzTarget


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


def tested_targets(case: type) -> set[str]:
    """The names of the targets the ``fuzzed`` methods of test case class ``case`` run."""
    return {
        value.__doc__.split(":")[0]
        for name, value in vars(case).items()
        if name.startswith("test_") and value.__doc__ and ":" in value.__doc__
    }
