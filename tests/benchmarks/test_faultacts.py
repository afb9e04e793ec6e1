"""``benchmarks._faultacts``: the steps on VMs a daemon's text log tells of."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from benchmarks._faultacts import acts_in_log
from benchmarks._history import Act

# 2026-11-29T11:15:40+0000
SECOND = 1795950940.0
LOG = [
    "2026-11-29T11:15:39+0000 [vmready.lifecycle.members.Membership#info] joined the cluster\n",
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.driver.HypervisorDriver#info] "
    "starting VM c6: fakeqemu -name guest=c6\n",
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.runningvm.RunningVM#info] "
    "VM c6 did not power off within 1.0s; forcing it\n",
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.runningvm.RunningVM#info] "
    "VM c6 is gone: shut down (host-qmp-quit)\n",
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.driver.HypervisorDriver#warn] "
    "killing VM other (process 12)\n",
    "2026-11-29T11:15:40+0000 [vmready.lifecycle.leaseguard.LeaseGuard#warn] "
    "the lease of member m3 was last confirmed 17.0s ago (lease 3s): renewing it "
    "before quit on VM c6\n",
]


class ActsInLogTests(SynchronousTestCase):
    def test_theHypervisorsStepsOnAKnownInstanceAreActsAtTheEndOfTheirSecond(self) -> None:
        acts = acts_in_log(LOG, {"c6": "c6-key"}, "m3", "m3#1", 1)
        self.assertEqual(
            acts,
            [
                Act(
                    "c6-key",
                    SECOND + 1,
                    "starting VM c6: fakeqemu -name guest=c6",
                    "m3",
                    "m3#1",
                    1,
                ),
                Act(
                    "c6-key",
                    SECOND + 1,
                    "VM c6 did not power off within 1.0s; forcing it",
                    "m3",
                    "m3#1",
                    1,
                ),
            ],
        )
