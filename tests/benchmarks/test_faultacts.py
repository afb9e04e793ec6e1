"""``benchmarks._faultacts``: the steps on VMs a daemon's text log tells of."""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from benchmarks._faultacts import acts_in_log, fence_kills
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
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.driver.HypervisorDriver#info] "
    "VM c6 runs as process 4242\n",
    "2026-11-29T11:15:40+0000 [vmready.hypervisor.stopping.Stopping#info] "
    "c6: the monitor closed as QEMU exited\n",
    "2026-11-29T11:15:40+0000 [vmready.lifecycle.leaseguard.LeaseGuard#warn] "
    "the lease of member m3 was last confirmed 17.0s ago (lease 3s): renewing it "
    "before quit on VM c6\n",
]


class ActsInLogTests(SynchronousTestCase):
    """Also: what the daemon only saw of its VM (its process, its monitor closing) is no act."""

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


class FenceKillsTests(SynchronousTestCase):
    def test_eachKillOfTheHostFenceToTheMillisecond(self) -> None:
        log = self.mktemp()
        with open(log, "w", encoding="utf-8") as f:
            f.write(
                "2026-11-29T11:15:40.250+0000 [vmready.fence] member m1: its lease was not "
                "confirmed in time (0.00s past): killing its VMs\n"
                "2026-11-29T11:15:40.261+0000 [vmready.fence] member m1: killed VM 1a2b "
                "(process 4242)\n"
            )
        self.assertEqual(fence_kills(log), [(SECOND + 0.261, "1a2b", 4242)])

    def test_noLogNoKill(self) -> None:
        self.assertEqual(fence_kills(os.path.join(self.mktemp(), "fence.log")), [])
