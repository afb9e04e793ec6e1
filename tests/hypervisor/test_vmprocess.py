"""A VM's process while it exits: its threads end one by one, its monitor socket with the last.

A SIGKILLed QEMU (many threads) passes through a state where its leader is
already a zombie, its command line reads empty, and one of its threads still
holds its files: its monitor socket still accepts connections.  Calling the
VM gone then let a start at once find "its QMP socket is in use by a running
VM" (seen in CI).  These tests make that state with a real process: a leader
thread that leaves by the thread-only ``exit`` system call while another
thread, holding a listening socket, waits for its stdin to close.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from vmready.domain import PowerState
from vmready.hypervisor.cmdline import VMSpec, qmp_address
from vmready.hypervisor.following import VMFollower
from vmready.hypervisor.vmevents import UNEXPECTED_EXIT, VMEvent, VMEventKind
from vmready.hypervisor.vmprocess import (
    EXIT_POLL_SECONDS,
    is_exiting,
    is_vm_process,
    socket_listens,
    vm_process_remains,
)
from vmready.protocols.qmp import QMPClientProtocol

# Listens on argv[1] (its command line names the socket as QEMU's does), says
# "ready", then its main thread ends alone; the other thread ends the process
# once stdin closes.
_LINGERING_EXIT = """
import ctypes, os, socket, sys, threading
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen(1)
def linger():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=linger).start()
sys.stdout.write("ready\\n")
sys.stdout.flush()
ctypes.CDLL(None, use_errno=True).syscall(60, 0)  # SYS_exit on x86-64: this thread only
"""


class _ExitingProcess:
    """A real process caught between its leader's exit and its last thread's."""

    def __init__(self, qmp_socket: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LINGERING_EXIT, qmp_socket, qmp_address(qmp_socket) + ","],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            raise AssertionError("the lingering process did not start")
        self.pid = self.process.pid
        _wait_for(lambda: _leader_state(self.pid) == b"Z", "the leader thread to exit")

    def end(self) -> None:
        """Let its last thread go; returns once only a zombie is left (not reaped)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        _wait_for(lambda: not is_exiting(self.pid), "the last thread to exit")

    def reap(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


def _leader_state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    end_of_name = stat.rfind(b")")
    return stat[end_of_name + 2 : end_of_name + 3]


def _wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"waited 30 s for {what}")
        time.sleep(0.01)


class _ExitingProcessCase(SynchronousTestCase):
    def setUp(self) -> None:
        if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
            raise SkipTest("the thread-only exit system call is numbered for Linux on x86-64")
        directory = tempfile.mkdtemp(prefix="vmr-", dir="/tmp")
        self.spec = VMSpec(
            name="vm1",
            uuid=str(uuid.uuid4()),
            memory_mib=64,
            cpus=1,
            run_dir=directory,
        )
        self.exiting = _ExitingProcess(self.spec.qmp_socket)
        self.addCleanup(self.exiting.reap)
        self.addCleanup(os.rmdir, directory)
        self.addCleanup(os.unlink, self.spec.qmp_socket)


class ExitingProcessTests(_ExitingProcessCase):
    def test_aProcessWhoseLastThreadLivesIsExitingAndStillHoldsItsSocket(self) -> None:
        pid = self.exiting.pid
        self.assertFalse(is_vm_process(pid, self.spec.qmp_socket))
        self.assertTrue(is_exiting(pid))
        self.assertTrue(vm_process_remains(pid, self.spec.qmp_socket))
        self.assertTrue(socket_listens(self.spec.qmp_socket))

    def test_onceItsLastThreadEndsItHasEndedAndItsSocketIsClosed(self) -> None:
        self.exiting.end()
        self.assertFalse(vm_process_remains(self.exiting.pid, self.spec.qmp_socket))
        self.assertFalse(socket_listens(self.spec.qmp_socket))

    def test_aLiveProcessOrNoneIsNotExiting(self) -> None:
        self.assertFalse(is_exiting(os.getpid()))
        self.exiting.end()
        self.exiting.reap()
        self.assertFalse(is_exiting(self.exiting.pid))


class FollowerWaitsForTheLastThreadTests(_ExitingProcessCase):
    """The gone event comes once the process has ended, not when its leader has."""

    def test_goneOnlyOnceTheLastThreadEnded(self) -> None:
        clock = Clock()
        qmp = QMPClientProtocol()
        qmp.makeConnection(StringTransport())
        follower = VMFollower(clock, self.spec, qmp, self.exiting.pid, Logger())
        gone = follower.when_gone()
        qmp.connectionLost(Failure(ConnectionError("monitor closed")))
        for _ in range(20):
            clock.advance(EXIT_POLL_SECONDS)
        self.assertNoResult(gone)
        self.assertTrue(socket_listens(self.spec.qmp_socket))
        self.exiting.end()
        clock.advance(EXIT_POLL_SECONDS)
        self.assertEqual(
            self.successResultOf(gone),
            VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED),
        )
        self.assertFalse(socket_listens(self.spec.qmp_socket))
