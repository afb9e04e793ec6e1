"""The host fence's rule: when it kills, without I/O."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from vmready.fence.rule import ARMED_POLL_SECONDS, FenceRule


class FenceRuleTests(SynchronousTestCase):
    def test_theVMsRunUntilTheLeasesEnd(self) -> None:
        rule = FenceRule(until=10.0)
        self.assertFalse(rule.armed(9.99))
        self.assertEqual(rule.wait(4.0), 6.0)
        self.assertTrue(rule.armed(10.0))

    def test_aRenewalMovesTheEnd(self) -> None:
        rule = FenceRule(until=10.0)
        rule.hold(13.0)
        self.assertFalse(rule.armed(12.0))
        self.assertTrue(rule.armed(13.0))

    def test_anOlderConfirmationDoesNotBringTheEndForward(self) -> None:
        rule = FenceRule(until=10.0)
        rule.hold(8.0)
        self.assertFalse(rule.armed(9.0))

    def test_aRenewalAfterTheEndDisarmsIt(self) -> None:
        rule = FenceRule(until=10.0)
        self.assertTrue(rule.armed(11.0))
        rule.hold(14.0)
        self.assertFalse(rule.armed(11.0))

    def test_aLostLeaseKillsAtOnceAndForGood(self) -> None:
        rule = FenceRule(until=10.0)
        rule.lose()
        self.assertTrue(rule.armed(1.0))
        rule.hold(20.0)
        self.assertTrue(rule.armed(1.0))

    def test_armedItLooksAgainSoon(self) -> None:
        rule = FenceRule(until=10.0)
        self.assertEqual(rule.wait(10.5), ARMED_POLL_SECONDS)

    def test_withItsDaemonGoneItEndsOnceArmed(self) -> None:
        rule = FenceRule(until=10.0)
        rule.close()
        self.assertFalse(rule.finished(9.0))
        self.assertTrue(rule.finished(10.0))

    def test_withItsDaemonThereItNeverEnds(self) -> None:
        rule = FenceRule(until=10.0)
        rule.lose()
        self.assertFalse(rule.finished(11.0))
