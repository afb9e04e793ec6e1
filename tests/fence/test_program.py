"""``python -m vmready.fence`` as a real process, over real fakeqemu VM processes.

Each test starts fakeqemu VMs whose monitor sockets are under a run root of
its own, and the fence over that root, speaking to it as the daemon does (its
standard input).  Waits are bounded by ``DEADLINE`` and assert what happened,
never how long it took; a test that must show a VM *not* killed waits past the
moment it would have been.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.system import DEADLINE, eventually
from vmready.fence import LOST_LINE, fence_command, fenced_reason, hold_line, vm_processes
from vmready.fence.program import PIDFILE_NAME

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKEQEMU = os.path.join(os.path.dirname(sys.executable), "fakeqemu-system-x86_64")
# Past a fence's end by this much, a VM it spared is surely spared.
AFTER = 1.0
# A first end far enough ahead for the fence (and what the test does next) to start before
# it, on a loaded machine too.
SOON = 5.0


class FenceProcessTests(SynchronousTestCase):
    def setUp(self) -> None:
        # Short: a unix socket's path has at most 107 bytes, and the VMs' monitors are there.
        self.root = tempfile.mkdtemp(prefix="fence")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.run_root = os.path.join(self.root, "run")
        os.makedirs(self.run_root)
        self.log = os.path.join(self.root, "fence.log")

    def start_vm(self, name: str, run_root: str | None = None) -> int:
        """A fakeqemu VM under ``run_root`` (this test's by default): its pid once it runs."""
        run_dir = os.path.join(run_root or self.run_root, name)
        os.makedirs(run_dir, exist_ok=True)
        qmp = os.path.join(run_dir, "qmp.sock")
        vm = subprocess.Popen(
            [
                *(FAKEQEMU, "-name", name, "-nodefaults", "-display", "none", "-m", "64M"),
                *("-qmp", f"unix:{qmp},server=on,wait=off"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.addCleanup(self._end, vm)
        found = eventually(
            lambda: vm_processes(run_root or self.run_root).get(run_dir), f"VM {name} running"
        )
        return found.pid

    def start_fence(self, until: float) -> subprocess.Popen[bytes]:
        """The fence over this test's run root, holding until ``until`` (monotonic)."""
        environment = dict(os.environ, PYTHONPATH=CHECKOUT)
        command = fence_command(self.run_root, "m1", until, self.log)
        fence = subprocess.Popen(command, stdin=subprocess.PIPE, env=environment)
        self.addCleanup(self._end, fence)
        eventually(lambda: "fencing the VMs" in self.logged(), "the fence started")
        return fence

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdin is not None:
            process.stdin.close()

    def tell(self, fence: subprocess.Popen[bytes], line: bytes) -> None:
        assert fence.stdin is not None
        fence.stdin.write(line)
        fence.stdin.flush()

    def logged(self) -> str:
        try:
            with open(self.log, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def alive(self, pid: int) -> bool:
        return any(vm.pid == pid for vm in vm_processes(self.run_root).values())

    def test_theVMsRunWhileTheLeaseHoldsAndAreKilledOnceItEnds(self) -> None:
        pid = self.start_vm("vm1")
        until = time.monotonic() + SOON
        self.start_fence(until)
        self.assertTrue(self.alive(pid))
        eventually(lambda: not self.alive(pid), "the VM killed")
        self.assertGreaterEqual(time.monotonic(), until)
        self.assertIn(f"killed VM vm1 (process {pid})", self.logged())
        self.assertIn("its lease was not confirmed in time", self.logged())

    def test_eachRenewalKeepsThemRunning(self) -> None:
        pid = self.start_vm("vm1")
        first_end = time.monotonic() + SOON
        fence = self.start_fence(first_end)
        self.tell(fence, hold_line(time.monotonic() + DEADLINE))
        time.sleep(max(0.0, first_end + AFTER - time.monotonic()))
        self.assertTrue(self.alive(pid))
        self.assertNotIn("killed", self.logged())

    def test_aLostLeaseKillsThemAtOnce(self) -> None:
        pid = self.start_vm("vm1")
        fence = self.start_fence(time.monotonic() + DEADLINE)
        self.tell(fence, LOST_LINE)
        eventually(lambda: not self.alive(pid), "the VM killed")
        self.assertIn("the lease is lost: killing its VMs", self.logged())
        # Its run directory says why, for the daemon that sees it gone.
        why = fenced_reason(os.path.join(self.run_root, "vm1"))
        assert why is not None
        self.assertRegex(why, r"^killed by the host fence of member m1 at \S+Z: ")
        self.assertTrue(why.endswith("its lease was lost to another daemon"), why)

    def test_aVMStartedOnceTheLeaseIsLostIsKilledToo(self) -> None:
        fence = self.start_fence(time.monotonic() + DEADLINE)
        self.tell(fence, LOST_LINE)
        eventually(lambda: "the lease is lost" in self.logged(), "the loss heard")
        pid = self.start_vm("late")
        eventually(lambda: not self.alive(pid), "the late VM killed")
        self.assertIsNone(fence.poll())

    def test_aVMOutsideItsRunRootIsLeftAlone(self) -> None:
        other_root = os.path.join(self.root, "other")
        stranger = self.start_vm("stranger", other_root)
        mine = self.start_vm("vm1")
        fence = self.start_fence(time.monotonic() + DEADLINE)
        self.tell(fence, LOST_LINE)
        eventually(lambda: not self.alive(mine), "its VM killed")
        self.assertIn(stranger, [vm.pid for vm in vm_processes(other_root).values()])

    def test_withItsDaemonGoneItHoldsUntilTheEndThenKillsAndEnds(self) -> None:
        pid = self.start_vm("vm1")
        until = time.monotonic() + SOON
        fence = self.start_fence(until)
        assert fence.stdin is not None
        fence.stdin.close()
        eventually(lambda: "its daemon is gone" in self.logged(), "the daemon's end heard")
        self.assertTrue(self.alive(pid))
        self.assertEqual(fence.wait(DEADLINE), 0)
        self.assertGreaterEqual(time.monotonic(), until)
        self.assertFalse(self.alive(pid))
        self.assertIn("the fence ends", self.logged())

    def test_aNewFenceRelievesTheOldOneAndTheVMsRunOn(self) -> None:
        pid = self.start_vm("vm1")
        first_end = time.monotonic() + SOON
        old = self.start_fence(first_end)
        assert old.stdin is not None
        old.stdin.close()  # its daemon stopped; a new one starts on the same data dir
        new = self.start_fence(time.monotonic() + DEADLINE)
        self.assertEqual(old.wait(DEADLINE), 0)
        time.sleep(max(0.0, first_end + AFTER - time.monotonic()))
        self.assertTrue(self.alive(pid))
        self.assertIn(f"relieved the previous fence (process {old.pid})", self.logged())
        with open(os.path.join(self.run_root, PIDFILE_NAME)) as f:
            self.assertEqual(int(f.read()), new.pid)

    def test_aStalePidfileNamingAnotherProcessRelievesNothing(self) -> None:
        with open(os.path.join(self.run_root, PIDFILE_NAME), "w") as f:
            f.write(f"{os.getpid()}\n")  # this test's own process: no fence
        fence = self.start_fence(time.monotonic() + DEADLINE)
        self.assertNotIn("relieved", self.logged())
        with open(os.path.join(self.run_root, PIDFILE_NAME)) as f:
            self.assertEqual(int(f.read()), fence.pid)

    def test_aLineItCannotReadIsLoggedAndChangesNothing(self) -> None:
        pid = self.start_vm("vm1")
        until = time.monotonic() + DEADLINE
        fence = self.start_fence(until)
        self.tell(fence, b"hold soon\nlose everything\n")
        eventually(lambda: self.logged().count("ignored a line") == 2, "both lines refused")
        self.assertTrue(self.alive(pid))
        self.assertIsNone(fence.poll())

    def test_itRunsInASessionOfItsOwn(self) -> None:
        fence = self.start_fence(time.monotonic() + DEADLINE)
        self.assertEqual(os.getsid(fence.pid), fence.pid)
        self.tell(fence, LOST_LINE)
        os.kill(fence.pid, signal.SIGTERM)
        self.assertEqual(fence.wait(DEADLINE), 0)
        self.assertIn("relieved", self.logged())
