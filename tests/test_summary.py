"""Tests for tests/summary.py, the closing line CI reads."""

from twisted.trial.unittest import SynchronousTestCase

from tests.summary import summarize


class SummaryTests(SynchronousTestCase):
    """trial's verdict becomes one plain counting line."""

    def test_passedRunWithSkips(self) -> None:
        self.assertEqual(
            summarize("...\nPASSED (skips=2, successes=120)\n"),
            ("tests: 120 passed, 0 failed, 2 skipped", True),
        )

    def test_failedRunCountsFailuresAndErrors(self) -> None:
        self.assertEqual(
            summarize("FAILED (failures=1, errors=2, successes=7)\n"),
            ("tests: 7 passed, 3 failed, 0 skipped", False),
        )

    def test_runWithNoResultIsAFailure(self) -> None:
        self.assertFalse(summarize("Traceback (most recent call last):\n")[1])

    def test_runThatPassedNothingIsAFailure(self) -> None:
        self.assertFalse(summarize("PASSED (skips=3)\n")[1])
