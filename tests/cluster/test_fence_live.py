"""A fenced cluster member (``--fence vms``): real ``twistd vmready`` daemons on a real
PostgreSQL database, their real fakeqemu VMs, their real fence processes.

Without the fence a VM started under a valid lease runs on after the lease
(``test_members_live``: a killed member's VM outlives it).  With it, the VM
is killed before the store would let another daemon take the member's name:
checked against the lease's end as the store holds it.  Every wait is
bounded by a generous deadline; none asserts how long anything took.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
from typing import Any

import psycopg
from twisted.trial.unittest import SynchronousTestCase

from tests.cluster.test_members_live import NAME, Member
from tests.postgres import postgres_location
from tests.system import eventually
from vmready.fence import vm_processes

FENCE_LOG = "fence.log"
# Long enough for a daemon's restart to come well within it, even on a loaded machine.
RESTART_LEASE = "10"
_KILLED = re.compile(r"^(\S+) \[vmready\.fence\] member \S+: killed VM (\S+) \(process (\d+)\)$")


class FencedMember(Member):
    def options(self) -> list[str]:
        return [*super().options(), "--fence", "vms"]

    @property
    def run_root(self) -> str:
        return os.path.join(self.system.directory, "run")

    def vm_pids(self) -> set[int]:
        return {vm.pid for vm in vm_processes(self.run_root).values()}

    def fence_log(self) -> str:
        try:
            with open(os.path.join(self.system.directory, FENCE_LOG), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def kills(self) -> dict[int, float]:
        """The fence's kills: each pid, when (wall clock, seconds)."""
        found = {}
        for line in self.fence_log().splitlines():
            matched = _KILLED.match(line)
            if matched:
                at = datetime.datetime.strptime(matched[1], "%Y-%m-%dT%H:%M:%S.%f%z")
                found[int(matched[3])] = at.timestamp()
        return found

    def fence_pids(self) -> set[int]:
        return fence_pids(self.run_root)

    def signal(self, number: signal.Signals) -> None:
        daemon = self.system.daemon
        assert daemon is not None
        daemon.send_signal(number)


def fence_pids(run_root: str) -> set[int]:
    """The live fence processes over ``run_root``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"vmready.fence" in argv and os.fsencode(run_root) in argv:
            found.add(int(entry))
    return found


class FencedMemberTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.store = postgres_location(self)

    def lease_expires(self, member: str) -> float:
        """The end of ``member``'s lease as the store holds it (its own clock)."""
        with psycopg.connect(self.store) as db:
            row: Any = db.execute(
                "SELECT lease_expires FROM members WHERE name = %s", (member,)
            ).fetchone()
        return float(row[0])

    def launched(self, member: FencedMember) -> int:
        member.cli("launch", NAME, "--memory", "128")
        self.assertEqual(member.listed().get(NAME), "RUNNING")
        (pid,) = member.vm_pids()
        return pid

    def test_aFrozenMembersVMIsKilledBeforeItsLeaseRunsOut(self) -> None:
        a = FencedMember(self, "a", self.store)
        a.start()
        pid = self.launched(a)
        a.signal(signal.SIGSTOP)
        self.addCleanup(a.signal, signal.SIGCONT)
        eventually(lambda: pid not in a.vm_pids(), "the frozen member's VM killed")
        killed_at = a.kills()[pid]
        self.assertLess(killed_at, self.lease_expires("a"))
        a.signal(signal.SIGCONT)
        # Woken, its name still its own: it renews, and shows the VM as the fence left it,
        # saying why.
        eventually(lambda: a.listed().get(NAME) == "ERROR", f"{NAME} shown killed")
        seen = a.instance(NAME)
        assert seen is not None
        self.assertEqual(seen["power_state"], "crashed")
        self.assertRegex(
            seen["error"],
            r"^killed by the host fence of member a at \S+: its lease was not confirmed in time",
        )
        eventually(lambda: "confirmed again" in a.fence_log(), "the fence disarmed")

    def test_aStoppedMemberStartedAgainInTimeKeepsItsVMs(self) -> None:
        a = FencedMember(self, "a", self.store, lease=RESTART_LEASE)
        a.start()
        self.assertEqual(a.get("/1.0")[1]["metadata"]["config"]["fence"], "vms")
        pid = self.launched(a)
        (first_fence,) = a.fence_pids()
        a.system.stop_daemon()
        self.assertEqual(a.fence_pids(), {first_fence})  # it holds the VMs meanwhile
        a.start()
        eventually(lambda: first_fence not in a.fence_pids(), "the first fence relieved")
        self.assertIn(f"relieved the previous fence (process {first_fence})", a.fence_log())
        self.assertEqual(a.vm_pids(), {pid})
        self.assertEqual(a.listed().get(NAME), "RUNNING")

    def test_aStoppedMemberNotBackInTimeHasItsVMsKilled(self) -> None:
        a = FencedMember(self, "a", self.store)
        a.start()
        pid = self.launched(a)
        a.system.stop_daemon()
        eventually(lambda: not a.fence_pids(), "the fence ended")
        self.assertNotIn(pid, a.vm_pids())
        self.assertLess(a.kills()[pid], self.lease_expires("a"))
        self.assertIn("its daemon is gone and its VMs with it", a.fence_log())

    def test_aFenceThatEndsWhileItsDaemonRunsIsStartedAgain(self) -> None:
        a = FencedMember(self, "a", self.store, lease=RESTART_LEASE)
        a.start()
        pid = self.launched(a)
        (first_fence,) = a.fence_pids()
        os.kill(first_fence, signal.SIGKILL)
        (second_fence,) = eventually(
            lambda: a.fence_pids() - {first_fence}, "a fence started again"
        )
        with open(a.system.log_path, encoding="utf-8") as log:
            self.assertIn("the host fence of member a ended", log.read())
        self.assertEqual(a.vm_pids(), {pid})
        # It is told of the renewals as the first was: the lease lost, it kills.
        self.assertEqual(a.listed().get(NAME), "RUNNING")
        self.assertIn(second_fence, a.fence_pids())

    def test_anUnfencedMemberStartsNoFence(self) -> None:
        a = Member(self, "a", self.store)
        a.start()
        a.cli("launch", NAME, "--memory", "128")
        self.assertEqual(fence_pids(os.path.join(a.system.directory, "run")), set())
        self.assertFalse(os.path.exists(os.path.join(a.system.directory, FENCE_LOG)))
