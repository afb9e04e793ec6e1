"""``benchmarks._bootphases``: a boot's milestones from console lines and host events."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from benchmarks._bootphases import (
    ConsoleLine,
    guest_times,
    kernel_start,
    medians,
    phase_durations,
    timeline,
)

# A demo guest's console as it reaches the host: (arrival on the host's clock, line).
CONSOLE = [
    (100.02, "--- vmready: starting bench0: TCG: KVM failed here (…) ---"),
    (100.90, "vmready-initramfs: [0.35] started"),
    (101.10, "vmready-initramfs: [0.52] loading 14 kernel modules"),
    (102.40, "vmready-initramfs: [1.80] mounted /dev/vda; starting /sbin/init"),
    (
        103.40,
        "vmready-agent-setup: copied the config drive (9p tag 'config') to /run/vmready-agent",
    ),
    (
        103.50,
        "[    2.920000] vmready-agent-setup[137]: vmready-agent-setup: boot: setup [2.40] "
        "copied [2.90]",
    ),
    (
        104.60,
        "[    3.950000] vmready-agent[201]: vmready-agent: boot: process [3.10] STARTED [3.80]",
    ),
    (105.30, "vmready-agent: boot: CONNECT [4.20] CONNECTED [4.65]"),
    (105.90, "vmready-agent: boot: relay [5.10] Ready [5.30]"),
]


def lines() -> list[ConsoleLine]:
    return [ConsoleLine(arrived, text) for arrived, text in CONSOLE]


class GuestTimesTests(SynchronousTestCase):
    """Each dated line gives its milestone on the guest's uptime clock."""

    def test_initramfsAndAgentLinesAreDated(self) -> None:
        self.assertEqual(
            guest_times(lines()),
            {
                "init": 0.35,
                "root": 1.80,
                "setup": 2.40,
                "agent": 3.10,
                "said": 3.80,
                "connect": 4.20,
                "relay": 5.10,
            },
        )

    def test_anAgentThatRanItsOwnSetupStartsWhenTheCopyIsDone(self) -> None:
        # Started by the initramfs: the process is made, runs the setup, becomes the agent.
        early = [
            ConsoleLine(1.0, "vmready-agent-setup: boot: setup [2.67] copied [3.05]"),
            ConsoleLine(2.0, "vmready-agent: boot: process [2.50] STARTED [4.05]"),
        ]
        self.assertEqual(guest_times(early), {"setup": 2.67, "agent": 3.05, "said": 4.05})

    def test_anOlderInitramfsIsDatedByItsModuleLoading(self) -> None:
        older = [ConsoleLine(1.0, "vmready-initramfs: [0.52] loading 14 kernel modules")]
        self.assertEqual(guest_times(older), {"init": 0.52})

    def test_theFirstOfEachCounts(self) -> None:
        again = [
            *lines(),
            ConsoleLine(200.0, "vmready-agent: boot: process [9.00] STARTED [9.50]"),
        ]
        self.assertEqual(guest_times(again)["agent"], 3.10)

    def test_undatedAndForeignLinesAreIgnored(self) -> None:
        noise = [
            ConsoleLine(1.0, "vmready-agent: serial port: /dev/vport1p1"),
            ConsoleLine(1.0, "Welcome to Debian GNU/Linux 12 (bookworm)!"),
            ConsoleLine(1.0, "vmready-agent: boot:"),
        ]
        self.assertEqual(guest_times(noise), {})


class KernelStartTests(SynchronousTestCase):
    """The kernel started no later than the earliest (arrival - uptime) of the dated lines."""

    def test_theTightestLineWins(self) -> None:
        # 100.90 - 0.35 = 100.55; 102.40 - 1.80 = 100.60; the journal's 104.60 - 3.95 = 100.65.
        start = kernel_start(lines())
        assert start is not None
        self.assertAlmostEqual(start, 100.55)

    def test_kernelTimestampsCount(self) -> None:
        kernel = [ConsoleLine(50.0, "[    0.412345] Run /init as init process")]
        start = kernel_start(kernel)
        assert start is not None
        self.assertAlmostEqual(start, 49.587655)

    def test_noDatedLineNoEstimate(self) -> None:
        self.assertIsNone(kernel_start([ConsoleLine(1.0, "no time here")]))


class TimelineTests(SynchronousTestCase):
    """Guest and host milestones on one clock, from the launch; phases between them."""

    def test_guestMilestonesAreCountedFromTheLaunch(self) -> None:
        host = {"started": 104.1, "connected": 105.4, "ready": 106.0, "woken": 106.3}
        found = timeline(lines(), host, since=99.5)
        expected = {
            "exec": 0.52,
            "kernel": 1.05,
            "init": 1.40,
            "root": 2.85,
            "setup": 3.45,
            "agent": 4.15,
            "said": 4.85,
            "started": 4.6,
            "connect": 5.25,
            "connected": 5.9,
            "relay": 6.15,
            "ready": 6.5,
            "woken": 6.8,
        }
        self.assertEqual(found.keys(), expected.keys())
        for name, value in expected.items():
            self.assertAlmostEqual(found[name], value, places=6, msg=name)

    def test_aRestartedGuestsLastWordsBeforeTheMarkAreNotThisBoot(self) -> None:
        shutdown = ConsoleLine(99.8, "[  120.000000] systemd-shutdown[1]: Syncing filesystems")
        found = timeline([shutdown, *lines()], {}, since=99.5)
        self.assertAlmostEqual(found["kernel"], 1.05)

    def test_withoutDatedLinesOnlyTheHostsMilestones(self) -> None:
        found = timeline([], {"ready": 12.0}, since=2.0)
        self.assertEqual(found, {"ready": 10.0})

    def test_phasesRunFromTheMilestoneBefore(self) -> None:
        durations = phase_durations({"exec": 0.5, "kernel": 1.0, "ready": 4.0})
        self.assertEqual(durations, {"exec": 0.5, "kernel": 0.5, "ready": 3.0})

    def test_mediansTakeEachMilestoneWhereItIsKnown(self) -> None:
        boots = [{"exec": 1.0, "ready": 5.0}, {"exec": 3.0}, {"exec": 2.0, "ready": 7.0}]
        self.assertEqual(medians(boots), {"exec": 2.0, "ready": 6.0})
