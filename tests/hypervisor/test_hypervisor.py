"""vmready.hypervisor.driver and runningvm: real fakeqemu (and real QEMU) processes over QMP.

Every VM runs in a short temporary directory under /tmp and is killed at
cleanup.  The checks in ``PowerChecks`` run unchanged against fakeqemu and
real ``qemu-system-x86_64``; the QEMU class skips where QEMU is missing unless
``VMREADY_REQUIRE_QEMU=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.conformance.support import require_program
from tests.processes import process_state
from tests.reactor import reactor
from vmready.domain.model import HypervisorError
from vmready.domain.states import PowerState
from vmready.fence import kill_vms
from vmready.hypervisor.accel import accelerators_for_host
from vmready.hypervisor.cmdline import AGENT_RING, VMSpec
from vmready.hypervisor.commands import MonitorTimeout
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.qemulog import error_lines
from vmready.hypervisor.runningvm import RunningVM
from vmready.hypervisor.stopping import VMStopper
from vmready.hypervisor.vmevents import (
    UNEXPECTED_EXIT,
    VMEvent,
    VMEventKind,
    gone_event,
    power_state_for,
    vm_event_for,
)
from vmready.protocols.qmp import QMPEvent

QEMU_BINARY_VARIABLE = "VMREADY_QEMU_BINARY"
WAIT = 30.0

_T = TypeVar("_T")
_P = TypeVar("_P", bound=Protocol)


async def bounded(deferred: Deferred[_T], seconds: float = WAIT) -> _T:
    """``deferred``'s result, failing the test with a TimeoutError after ``seconds``."""
    return await deferred.addTimeout(seconds, reactor)


def qmp_event(name: str, **data: Any) -> QMPEvent:
    """A QMP event as the client hands it over."""
    return QMPEvent(name=name, data=data, timestamp=0.0)


async def eventually(condition: Callable[[], bool], seconds: float = WAIT) -> None:
    """Return once ``condition()`` holds; fail the test with a TimeoutError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition still false after {seconds:g}s")
        await deferLater(reactor, 0.01, lambda: None)


def process_is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T in /proc)."""
    return process_state(pid) in (b"T", b"t")


def vm_process_alive(pid: int, qmp_socket: str) -> bool:
    """Whether ``pid`` is a live, unreaped process whose command line names ``qmp_socket``."""
    if process_state(pid) in (None, b"Z", b"X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.fsencode(qmp_socket) in f.read()
    except OSError:
        return False


class EventRecorder:
    """Collects a RunningVM's events and waits for one of a kind."""

    def __init__(self, vm: RunningVM) -> None:
        self.events: list[VMEvent] = []
        self._waiting: list[tuple[VMEventKind, Deferred[VMEvent]]] = []
        vm.subscribe(self._received)

    def _received(self, event: VMEvent) -> None:
        self.events.append(event)
        for entry in list(self._waiting):
            if entry[0] is event.kind:
                self._waiting.remove(entry)
                entry[1].callback(event)

    def kinds(self) -> list[VMEventKind]:
        """Event kinds in arrival order."""
        return [event.kind for event in self.events]

    async def next(self, kind: VMEventKind) -> VMEvent:
        """The first event of ``kind`` (already seen, or the next to arrive)."""
        for event in self.events:
            if event.kind is kind:
                return event
        waiter: Deferred[VMEvent] = Deferred()
        self._waiting.append((kind, waiter))
        return await bounded(waiter)


class ACPIGuest(LineOnlyReceiver):
    """A guest OS on fakeqemu's control socket that powers off when the ACPI button is pressed."""

    delimiter = b"\n"

    def __init__(self) -> None:
        self.listening: Deferred[None] = Deferred()
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        # fakeqemu answers any line; the answer proves it now sends us ACPI events.
        self.sendLine(b"are-you-there")

    def lineReceived(self, line: bytes) -> None:
        if line == b"POWERDOWN":
            self.sendLine(b"poweroff")
        elif not self.listening.called:
            self.listening.callback(None)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.closed.callback(None)


class BootingACPIGuest(ACPIGuest):
    """A guest still booting: its power daemon is not up for the first press, then it is."""

    def __init__(self) -> None:
        super().__init__()
        self.presses = 0

    def lineReceived(self, line: bytes) -> None:
        if line == b"POWERDOWN":
            self.presses += 1
            if self.presses == 1:
                return
        super().lineReceived(line)


class VMTestCase(TestCase):
    """Runs VMs through a HypervisorDriver in a short /tmp directory; kills them at cleanup."""

    timeout = 120
    kind = "fakeqemu"
    binary: str | None = None

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-", dir="/tmp")
        self.specs: list[VMSpec] = []
        self.addCleanup(self._remove_everything)
        self.driver = self.make_driver()

    def make_driver(self) -> HypervisorDriver:
        """A driver for this test's hypervisor."""
        return HypervisorDriver(reactor, self.kind, self.binary)

    def spec(self, name: str = "vm1", **overrides: Any) -> VMSpec:
        """A small VM in its own run directory under this test's directory."""
        fields: dict[str, Any] = {
            "name": name,
            "uuid": str(uuid.uuid4()),
            "memory_mib": 64,
            "cpus": 1,
            "run_dir": os.path.join(self.directory, name),
            "ring_size": 4096,
        }
        fields.update(overrides)
        spec = VMSpec(**fields)
        self.specs.append(spec)
        return spec

    async def launch(
        self,
        spec: VMSpec | None = None,
        driver: HypervisorDriver | None = None,
        **options: Any,
    ) -> RunningVM:
        """Launch ``spec`` (a fresh one by default); the VM is killed at cleanup."""
        vm = await (driver or self.driver).launch(spec or self.spec(), **options)
        self.follow(vm)
        return vm

    def follow(self, vm: RunningVM) -> None:
        """Kill ``vm`` at cleanup unless it is gone or was let go of."""

        async def finish() -> None:
            if vm.gone or not vm.qmp.is_open:
                return
            if vm.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(vm.pid, signal.SIGKILL)
            else:
                vm.qmp.close()
            await bounded(vm.when_gone())

        self.addCleanup(lambda: Deferred.fromCoroutine(finish()))

    def _remove_everything(self) -> None:
        for spec in self.specs:
            try:
                with open(spec.pidfile) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if vm_process_alive(pid, spec.qmp_socket):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)

    async def hang(self, spec: VMSpec, pid: int | None) -> int:
        """SIGSTOP ``spec``'s VM process: it keeps its monitor socket but answers nothing.

        The process is SIGKILLed at cleanup if it is still there.
        """
        assert pid is not None

        def kill() -> None:
            if vm_process_alive(pid, spec.qmp_socket):
                os.kill(pid, signal.SIGKILL)

        self.addCleanup(kill)
        os.kill(pid, signal.SIGSTOP)
        await eventually(lambda: process_is_stopped(pid))
        return pid

    async def hung_vm(self, spec: VMSpec | None = None) -> RunningVM:
        """A running VM whose process is then stopped, with a 0.5s command timeout."""
        driver = self.make_driver()
        driver.command_timeout = 0.5
        vm = await self.launch(spec, driver)
        await self.hang(vm.spec, vm.pid)
        return vm

    def write_program(self, name: str, script: str) -> str:
        """An executable shell script standing in for a hypervisor binary."""
        path = os.path.join(self.directory, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + script + "\n")
        os.chmod(path, 0o755)
        return path

    async def control(self, spec: VMSpec, protocol: _P) -> _P:
        """``protocol`` connected to fakeqemu's guest control socket (the guest OS's power)."""
        endpoint = UNIXClientEndpoint(reactor, os.path.join(spec.guest_dir, "control"))
        await connectProtocol(endpoint, protocol)
        return protocol

    async def launch_error(self, spec: VMSpec, driver: HypervisorDriver | None = None) -> str:
        """The HypervisorError message of a launch that must fail."""
        try:
            vm = await (driver or self.driver).launch(spec)
        except HypervisorError as e:
            return e.message
        self.follow(vm)
        raise self.failureException(f"launch of {spec.name} succeeded")


if TYPE_CHECKING:
    _ChecksBase = VMTestCase
else:
    _ChecksBase = object


class PowerChecks(_ChecksBase):
    """Launch, power, pause/resume, stops, crashes, adoption and saved state, on any hypervisor."""

    async def test_launchRunsTheVM(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        assert vm.pid is not None
        self.assertTrue(vm_process_alive(vm.pid, spec.qmp_socket))
        self.assertFalse(vm.gone)
        self.assertEqual(stat.S_IMODE(os.stat(spec.run_dir).st_mode), 0o700)

    async def test_pausedLaunchStaysPausedUntilResumed(self) -> None:
        vm = await self.launch(paused=True)
        self.assertEqual(await vm.query_power_state(), PowerState.PAUSED)
        await vm.resume()
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)

    async def test_pauseAndResumeAreEventsAndStates(self) -> None:
        vm = await self.launch()
        recorder = EventRecorder(vm)
        await vm.pause()
        self.assertEqual(await vm.query_power_state(), PowerState.PAUSED)
        await vm.resume()
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        self.assertEqual(
            recorder.events,
            [
                VMEvent(VMEventKind.STOP, "paused", PowerState.PAUSED),
                VMEvent(VMEventKind.RESUME, "running", PowerState.RUNNING),
            ],
        )

    async def test_refusedCommandLineCarriesTheHypervisorsOwnWords(self) -> None:
        spec = self.spec(ring_size=1000)
        message = await self.launch_error(spec)
        self.assertEqual(len(message.splitlines()), 1, message)
        self.assertTrue(
            message.endswith(
                ": -chardev ringbuf,id=vmready,size=1000: "
                "size of ringbuf chardev must be power of two"
            ),
            message,
        )
        self.assertFalse(os.path.exists(spec.pidfile))

    async def test_shutdownWithoutAGuestIsForcedAfterTheTimeout(self) -> None:
        vm = await self.launch()
        recorder = EventRecorder(vm)
        self.assertEqual(await vm.shutdown(0.5), "forced")
        self.assertTrue(vm.gone)
        self.assertEqual(
            recorder.kinds(),
            [VMEventKind.POWERDOWN, VMEventKind.SHUTDOWN, VMEventKind.GONE],
        )
        self.assertEqual(
            await vm.when_gone(),
            VMEvent(VMEventKind.GONE, "shut down (host-qmp-quit)", PowerState.SHUTDOWN),
        )
        self.assertEqual(await vm.query_power_state(), PowerState.SHUTDOWN)

    async def test_forceStopQuits(self) -> None:
        vm = await self.launch()
        await vm.force_stop()
        self.assertEqual(
            await vm.when_gone(),
            VMEvent(VMEventKind.GONE, "shut down (host-qmp-quit)", PowerState.SHUTDOWN),
        )

    async def test_killedVMIsGoneAndCrashed(self) -> None:
        vm = await self.launch()
        recorder = EventRecorder(vm)
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        gone = await recorder.next(VMEventKind.GONE)
        self.assertEqual(gone, VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED))
        self.assertEqual(
            gone.detail,
            "QEMU process exited unexpectedly (QMP monitor disconnected without a SHUTDOWN event)",
        )
        self.assertEqual(await vm.query_power_state(), PowerState.CRASHED)
        with self.assertRaises(HypervisorError) as caught:
            await vm.pause()
        self.assertIn(UNEXPECTED_EXIT, caught.exception.message)

    async def test_aVMTheHostFenceKilledIsGoneSayingWhy(self) -> None:
        vm = await self.launch()
        recorder = EventRecorder(vm)
        why = "killed by the host fence of member a at 2026-11-29T17:00:00Z: its lease was lost"
        self.assertEqual([v.pid for v in kill_vms(self.directory, why)], [vm.pid])
        gone = await recorder.next(VMEventKind.GONE)
        self.assertEqual(gone, VMEvent(VMEventKind.GONE, why, PowerState.CRASHED))

    async def test_theHostFencesNoteIsForgottenWhenTheVMStartsAgain(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        kill_vms(self.directory, "killed by the host fence of member a: its lease was lost")
        await vm.when_gone()
        again = await self.launch(spec)
        recorder = EventRecorder(again)
        assert again.pid is not None
        os.kill(again.pid, signal.SIGKILL)
        gone = await recorder.next(VMEventKind.GONE)
        self.assertEqual(gone, VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED))

    async def test_pauseOfAHungVMFailsAfterTheCommandTimeout(self) -> None:
        vm = await self.hung_vm()
        with self.assertRaises(HypervisorError) as caught:
            await vm.pause()
        self.assertEqual(
            caught.exception.message, "QEMU monitor of VM vm1 did not answer stop within 0.5s"
        )

    async def test_resumeOfAHungVMFailsAfterTheCommandTimeout(self) -> None:
        vm = await self.hung_vm()
        with self.assertRaises(HypervisorError) as caught:
            await vm.resume()
        self.assertEqual(
            caught.exception.message, "QEMU monitor of VM vm1 did not answer cont within 0.5s"
        )

    async def test_powerStateOfAHungVMFailsAfterTheCommandTimeout(self) -> None:
        vm = await self.hung_vm()
        with self.assertRaises(MonitorTimeout) as caught:
            await vm.query_power_state()
        self.assertIsInstance(caught.exception, HypervisorError)
        self.assertEqual(
            caught.exception.message,
            "QEMU monitor of VM vm1 did not answer query-status within 0.5s",
        )

    async def test_shutdownOfAHungVMKillsIt(self) -> None:
        vm = await self.hung_vm()
        self.assertEqual(await bounded(Deferred.fromCoroutine(vm.shutdown(2.0))), "forced")
        self.assertTrue(vm.gone)
        self.assertEqual(
            await vm.when_gone(),
            VMEvent(
                VMEventKind.GONE,
                "killed by vmready with SIGKILL "
                "(its QMP monitor did not answer system_powerdown within 0.5s)",
                PowerState.SHUTDOWN,
            ),
        )
        assert vm.pid is not None
        self.assertFalse(vm_process_alive(vm.pid, vm.spec.qmp_socket))

    async def test_shutdownDeadlineCoversThePowerButtonCommand(self) -> None:
        vm = await self.hung_vm()
        vm.command_timeout = 1.0
        # system_powerdown is cut off by the 0.2s stop deadline, so quit is tried next.
        self.assertEqual(await bounded(Deferred.fromCoroutine(vm.shutdown(0.2))), "forced")
        self.assertEqual(
            (await vm.when_gone()).detail,
            "killed by vmready with SIGKILL (its QMP monitor did not answer quit within 1s)",
        )
        assert vm.pid is not None
        self.assertFalse(vm_process_alive(vm.pid, vm.spec.qmp_socket))

    async def test_forceStopOfAHungVMKillsIt(self) -> None:
        vm = await self.hung_vm()
        await bounded(Deferred.fromCoroutine(vm.force_stop()))
        self.assertEqual(
            await vm.when_gone(),
            VMEvent(
                VMEventKind.GONE,
                "killed by vmready with SIGKILL (its QMP monitor did not answer quit within 0.5s)",
                PowerState.SHUTDOWN,
            ),
        )
        assert vm.pid is not None
        self.assertFalse(vm_process_alive(vm.pid, vm.spec.qmp_socket))

    async def test_adoptOfAHungVMNamesItsProcess(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        await bounded(vm.detach())  # the daemon stops; then the VM hangs
        pid = await self.hang(spec, vm.pid)
        other = self.make_driver()
        other.adopt_timeout = 0.5
        with self.assertRaises(HypervisorError) as caught:
            await other.adopt(spec)
        self.assertIn(
            f"the VM of vm1 runs as process {pid} but its QMP monitor did not answer: ",
            caught.exception.message,
        )
        self.assertTrue(vm_process_alive(pid, spec.qmp_socket))

    async def test_killOwnedKillsAHungVM(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        await bounded(vm.detach())
        pid = await self.hang(spec, vm.pid)
        self.assertTrue(await bounded(self.driver.kill_owned(spec)))
        self.assertFalse(vm_process_alive(pid, spec.qmp_socket))
        self.assertIsNone(await self.make_driver().adopt(spec))

    async def test_killOwnedKillsAVMWhoseMonitorSocketVanished(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        await bounded(vm.detach())
        os.unlink(spec.qmp_socket)
        self.assertTrue(await bounded(self.driver.kill_owned(spec)))
        assert vm.pid is not None
        self.assertFalse(vm_process_alive(vm.pid, spec.qmp_socket))
        self.assertFalse(await self.driver.kill_owned(spec))

    async def test_killOwnedSignalsBeforeItIsAwaited(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        await bounded(vm.detach())
        pid = vm.pid
        assert pid is not None
        killed = self.driver.kill_owned(spec)
        await eventually(lambda: not vm_process_alive(pid, spec.qmp_socket))
        self.assertTrue(await bounded(killed))

    async def test_adoptReattachesToTheSameProcess(self) -> None:
        spec = self.spec()
        first = await self.launch(spec)
        await first.qmp.execute(
            "ringbuf-write", {"device": AGENT_RING, "data": "written before the restart\n"}
        )
        await bounded(first.detach())  # the daemon stops; the VM keeps running
        self.assertFalse(first.gone)

        adopted = await self.make_driver().adopt(spec)
        assert adopted is not None
        self.follow(adopted)
        self.assertEqual(adopted.pid, first.pid)
        self.assertEqual(await adopted.query_power_state(), PowerState.RUNNING)
        text = await adopted.qmp.execute(
            "ringbuf-read", {"device": AGENT_RING, "size": 4096, "format": "utf8"}
        )
        self.assertEqual(text, "written before the restart\n")

    async def test_adoptOfADeadVMRemovesItsStaleFiles(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        await bounded(vm.when_gone())
        self.assertTrue(os.path.exists(spec.pidfile))  # SIGKILL leaves them behind

        self.assertIsNone(await self.make_driver().adopt(spec))
        self.assertFalse(os.path.exists(spec.qmp_socket))
        self.assertFalse(os.path.exists(spec.pidfile))
        self.assertFalse(os.path.exists(spec.guest_dir))

    async def test_savedStateRestoresIntoANewVM(self) -> None:
        vm = await self.launch()
        state = os.path.join(self.directory, "vm1.state")
        await vm.migrate_to_file(state)
        self.assertTrue(os.path.getsize(state) > 0)
        self.assertEqual(await vm.query_power_state(), PowerState.PAUSED)
        await vm.force_stop()

        restored = await self.launch(self.spec("vm2"), incoming=state)
        # QEMU loads the state after it daemonized (paused in inmigrate meanwhile).
        for _ in range(600):
            if await restored.query_power_state() is PowerState.RUNNING:
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(await restored.query_power_state(), PowerState.RUNNING)

    async def test_unwritableTargetFails(self) -> None:
        vm = await self.launch()
        target = os.path.join(self.directory, "missing", "vm1.state")
        with self.assertRaises(HypervisorError) as caught:
            await vm.migrate_to_file(target)
        self.assertIn(f"saving the state of vm1 to {target} failed", caught.exception.message)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)


class FakeQemuPowerTests(PowerChecks, VMTestCase):
    """The power checks on fakeqemu."""


class RealQemuPowerTests(PowerChecks, VMTestCase):
    """The power checks on real qemu-system-x86_64 (kvm where /dev/kvm opens, else tcg)."""

    kind = "qemu"
    binary = os.environ.get(QEMU_BINARY_VARIABLE) or None

    def setUp(self) -> None:
        require_program(self, self.binary or "qemu-system-x86_64", "qemu-system-x86")
        super().setUp()


class FakeQemuLaunchTests(VMTestCase):
    """How launch prepares, runs and reports the hypervisor process."""

    async def test_staleFilesAreReplaced(self) -> None:
        spec = self.spec()
        os.makedirs(spec.run_dir)
        for path, text in ((spec.qmp_socket, "stale"), (spec.pidfile, "999999999\n")):
            with open(path, "w") as f:
                f.write(text)
        vm = await self.launch(spec)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        with open(spec.pidfile) as f:
            self.assertEqual(int(f.read()), vm.pid)

    async def test_launchRefusesWhileItsVMRuns(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        message = await self.launch_error(spec, self.make_driver())
        self.assertEqual(
            message, f"cannot start vm1: its VM is already running as process {vm.pid}"
        )
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)

    async def test_launchRefusesWhileItsMonitorSocketIsServed(self) -> None:
        spec = self.spec()
        os.makedirs(spec.run_dir)
        port = IReactorUNIX(reactor).listenUNIX(spec.qmp_socket, Factory.forProtocol(Protocol))
        self.addCleanup(port.stopListening)
        message = await self.launch_error(spec)
        self.assertEqual(
            message,
            f"cannot start vm1: its QMP socket {spec.qmp_socket} is in use by a running VM",
        )

    async def test_missingProgramIsAHypervisorError(self) -> None:
        driver = HypervisorDriver(reactor, "qemu", os.path.join(self.directory, "no-such-qemu"))
        message = await self.launch_error(self.spec(), driver)
        self.assertIn("no-such-qemu", message)
        self.assertIn("is not installed", message)

    async def test_silentFailureNamesTheExitStatus(self) -> None:
        driver = HypervisorDriver(reactor, "qemu", self.write_program("fails", "exit 3"))
        message = await self.launch_error(self.spec(), driver)
        self.assertEqual(message, "fails exited with status 3 without saying why")

    async def test_warningsAreLeftOutOfTheError(self) -> None:
        script = (
            "echo 'fails: warning: host does not support a feature' >&2\n"
            "echo 'fails: cannot do it' >&2\n"
            "exit 1"
        )
        driver = HypervisorDriver(reactor, "qemu", self.write_program("fails", script))
        self.assertEqual(await self.launch_error(self.spec(), driver), "fails: cannot do it")

    async def test_hungStartIsKilledAfterTheStartTimeout(self) -> None:
        driver = HypervisorDriver(reactor, "qemu", self.write_program("hangs", "exec sleep 60"))
        driver.start_timeout = 0.5
        message = await self.launch_error(self.spec(), driver)
        self.assertEqual(message, "hangs did not finish starting vm1 within 0.5s")

    async def test_launcherKilledBySignal(self) -> None:
        driver = HypervisorDriver(reactor, "qemu", self.write_program("dies", "kill -9 $$"))
        message = await self.launch_error(self.spec(), driver)
        self.assertEqual(message, "dies was killed by signal 9 while starting")


class FakeQemuEventTests(VMTestCase):
    """QMP events reach subscribers as VMEvents."""

    async def test_resetAndPowerButtonAreEvents(self) -> None:
        vm = await self.launch()
        recorder = EventRecorder(vm)
        await vm.qmp.execute("system_reset")
        await vm.qmp.execute("system_powerdown")
        self.assertEqual(
            recorder.events,
            [
                VMEvent(VMEventKind.RESET, "reset by the host (host-qmp-system-reset)", None),
                VMEvent(VMEventKind.POWERDOWN, "ACPI power button pressed", None),
            ],
        )

    async def test_guestPanicIsACrash(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        recorder = EventRecorder(vm)
        guest = await self.control(spec, LineOnlyReceiver())
        guest.sendLine(b"panic")
        gone = await recorder.next(VMEventKind.GONE)
        self.assertEqual(
            gone, VMEvent(VMEventKind.GONE, "shut down (guest-panic)", PowerState.CRASHED)
        )
        self.assertEqual(
            recorder.kinds(),
            # QEMU 7.2 with pvpanic: the panic, then its default shutdown; no STOP (measured).
            [VMEventKind.PANICKED, VMEventKind.SHUTDOWN, VMEventKind.GONE],
        )

    async def test_unsubscribedListenerHearsNothingMore(self) -> None:
        vm = await self.launch()
        heard: list[VMEvent] = []
        unsubscribe = vm.subscribe(heard.append)
        await vm.pause()
        unsubscribe()
        await vm.resume()
        self.assertEqual([event.kind for event in heard], [VMEventKind.STOP])


class FakeQemuStopTests(VMTestCase):
    """Clean stops need a guest that honours ACPI; otherwise the stop is forced."""

    async def stopped_cleanly(self, guest: ACPIGuest) -> tuple[VMSpec, EventRecorder]:
        """A VM whose guest OS is ``guest``, stopped through its ACPI button: cleanly."""
        spec = self.spec()
        vm = await self.launch(spec)
        recorder = EventRecorder(vm)
        await self.control(spec, guest)
        await bounded(guest.listening)
        self.assertEqual(await vm.shutdown(WAIT), "clean")
        return spec, recorder

    async def test_cleanShutdownWithAnACPIHonouringGuest(self) -> None:
        guest = ACPIGuest()
        spec, recorder = await self.stopped_cleanly(guest)
        self.assertEqual(
            recorder.events,
            [
                VMEvent(VMEventKind.POWERDOWN, "ACPI power button pressed", None),
                VMEvent(
                    VMEventKind.SHUTDOWN,
                    "shut down by the guest (guest-shutdown)",
                    PowerState.SHUTDOWN,
                ),
                VMEvent(VMEventKind.GONE, "shut down (guest-shutdown)", PowerState.SHUTDOWN),
            ],
        )
        await bounded(guest.closed)
        self.assertFalse(os.path.exists(spec.pidfile))

    async def test_aPressDroppedByABootingGuestIsRepeated(self) -> None:
        guest = BootingACPIGuest()
        _, recorder = await self.stopped_cleanly(guest)
        self.assertEqual(guest.presses, 2)
        self.assertEqual(
            recorder.kinds(),
            [
                VMEventKind.POWERDOWN,
                VMEventKind.POWERDOWN,
                VMEventKind.SHUTDOWN,
                VMEventKind.GONE,
            ],
        )

    def test_theButtonIsPressedAgainEverySecond(self) -> None:
        # Not a timing test: the setting. A guest that has just declared Ready may not
        # handle the button yet; its restart waits for the next press (benchmarks/real_guest.py).
        self.assertEqual(VMStopper.powerdown_repeat, 1.0)

    async def test_shutdownOfAGoneVMIsClean(self) -> None:
        vm = await self.launch()
        await vm.force_stop()
        self.assertEqual(await vm.shutdown(0.5), "clean")

    async def test_detachedVMKeepsRunning(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        recorder = EventRecorder(vm)
        await bounded(vm.detach())
        assert vm.pid is not None
        self.assertTrue(vm_process_alive(vm.pid, spec.qmp_socket))
        self.assertFalse(vm.gone)
        self.assertEqual(recorder.events, [])
        with self.assertRaises(HypervisorError):
            await vm.query_power_state()

    async def test_closingTheMonitorDirectlyIsNotADeath(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        vm.qmp.close()
        await bounded(vm.qmp.when_closed())
        self.assertFalse(vm.gone)
        assert vm.pid is not None
        self.assertTrue(vm_process_alive(vm.pid, spec.qmp_socket))

    async def test_stopOfAVMWhoseMonitorIsClosedKillsItsProcess(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        await bounded(vm.detach())
        self.assertEqual(await vm.shutdown(0.5), "forced")
        self.assertEqual(
            await vm.when_gone(),
            VMEvent(
                VMEventKind.GONE,
                "killed by vmready with SIGKILL (its QMP monitor is closed)",
                PowerState.SHUTDOWN,
            ),
        )
        assert vm.pid is not None
        self.assertFalse(vm_process_alive(vm.pid, spec.qmp_socket))


class FakeQemuAdoptTests(VMTestCase):
    """adopt() after a daemon restart: the same process, or nothing."""

    async def test_adoptWithNothingThereIsNone(self) -> None:
        self.assertIsNone(await self.driver.adopt(self.spec()))

    async def test_killOwnedWithNothingRunningIsFalse(self) -> None:
        self.assertFalse(await self.driver.kill_owned(self.spec()))

    async def test_killOwnedSparesAProcessThatIsNotTheVM(self) -> None:
        spec = self.spec()
        os.makedirs(spec.run_dir)
        # A stale pidfile whose pid now belongs to some other process.
        other = subprocess.Popen(["sleep", "60"])
        self.addCleanup(other.wait)
        self.addCleanup(other.kill)
        with open(spec.pidfile, "w") as f:
            f.write(f"{other.pid}\n")
        self.assertFalse(await self.driver.kill_owned(spec))
        self.assertIsNone(other.poll())

    async def test_adoptOfAVMWhoseMonitorIsHeldIsAnError(self) -> None:
        spec = self.spec()
        vm = await self.launch(spec)
        other = self.make_driver()
        other.adopt_timeout = 0.5
        with self.assertRaises(HypervisorError) as caught:
            await other.adopt(spec)
        self.assertIn(f"runs as process {vm.pid}", caught.exception.message)
        self.assertTrue(os.path.exists(spec.qmp_socket))
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)

    async def test_adoptedVMReportsItsDeath(self) -> None:
        spec = self.spec()
        first = await self.launch(spec)
        await bounded(first.detach())
        adopted = await self.driver.adopt(spec)
        assert adopted is not None and adopted.pid is not None
        self.follow(adopted)
        os.kill(adopted.pid, signal.SIGKILL)
        self.assertEqual((await bounded(adopted.when_gone())).power_state, PowerState.CRASHED)


class EventMappingTests(SynchronousTestCase):
    """QMP events and run states, mapped without any process."""

    def test_runStateAndResumeEvents(self) -> None:
        self.assertEqual(
            vm_event_for(qmp_event("STOP")),
            VMEvent(VMEventKind.STOP, "paused", PowerState.PAUSED),
        )
        self.assertEqual(
            vm_event_for(qmp_event("RESUME")),
            VMEvent(VMEventKind.RESUME, "running", PowerState.RUNNING),
        )

    def test_shutdownNamesWhoAndWhy(self) -> None:
        self.assertEqual(
            vm_event_for(qmp_event("SHUTDOWN", guest=True, reason="guest-shutdown")),
            VMEvent(
                VMEventKind.SHUTDOWN,
                "shut down by the guest (guest-shutdown)",
                PowerState.SHUTDOWN,
            ),
        )
        self.assertEqual(
            vm_event_for(qmp_event("SHUTDOWN", guest=False, reason="host-signal")),
            VMEvent(
                VMEventKind.SHUTDOWN, "shut down by the host (host-signal)", PowerState.SHUTDOWN
            ),
        )

    def test_resetPowerdownAndPanic(self) -> None:
        self.assertEqual(
            vm_event_for(qmp_event("RESET", guest=True, reason="guest-reset")),
            VMEvent(VMEventKind.RESET, "reset by the guest (guest-reset)", None),
        )
        self.assertEqual(
            vm_event_for(qmp_event("POWERDOWN")),
            VMEvent(VMEventKind.POWERDOWN, "ACPI power button pressed", None),
        )
        self.assertEqual(
            vm_event_for(qmp_event("GUEST_PANICKED", action="poweroff")),
            VMEvent(
                VMEventKind.PANICKED,
                "guest kernel panicked (action: poweroff)",
                PowerState.CRASHED,
            ),
        )

    def test_otherEventsAreNotFollowed(self) -> None:
        self.assertIsNone(vm_event_for(qmp_event("MIGRATION", status="active")))

    def test_goneAfterShutdownIsAShutdown(self) -> None:
        self.assertEqual(
            gone_event(qmp_event("SHUTDOWN", guest=False, reason="host-qmp-quit")),
            VMEvent(VMEventKind.GONE, "shut down (host-qmp-quit)", PowerState.SHUTDOWN),
        )

    def test_goneAfterAPanicIsACrash(self) -> None:
        self.assertEqual(
            gone_event(qmp_event("SHUTDOWN", guest=True, reason="guest-panic")).power_state,
            PowerState.CRASHED,
        )

    def test_goneWithoutShutdownIsACrash(self) -> None:
        self.assertEqual(
            gone_event(None),
            VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED),
        )

    def test_goneAfterOurKillIsAStop(self) -> None:
        self.assertEqual(
            gone_event(None, "it did not answer"),
            VMEvent(
                VMEventKind.GONE,
                "killed by vmready with SIGKILL (it did not answer)",
                PowerState.SHUTDOWN,
            ),
        )

    def test_runStates(self) -> None:
        expected = {
            "running": PowerState.RUNNING,
            "paused": PowerState.PAUSED,
            "prelaunch": PowerState.PAUSED,
            "postmigrate": PowerState.PAUSED,
            "inmigrate": PowerState.PAUSED,
            "shutdown": PowerState.SHUTDOWN,
            "guest-panicked": PowerState.CRASHED,
            "something-new": PowerState.NOSTATE,
        }
        self.assertEqual({state: power_state_for(state) for state in expected}, expected)


class HostProbeTests(SynchronousTestCase):
    """Accelerators and stderr, without a hypervisor."""

    def test_kvmFirstWhenTheDeviceOpens(self) -> None:
        device = self.mktemp()
        open(device, "w").close()
        self.assertEqual(accelerators_for_host(device), ["kvm", "tcg"])

    def test_tcgOnlyWhenTheDeviceDoesNotOpen(self) -> None:
        self.assertEqual(accelerators_for_host(self.mktemp()), ["tcg"])

    def test_errorLinesDropWarningsAndBlankLines(self) -> None:
        stderr = (
            "qemu-system-x86_64: warning: host doesn't support requested feature\n"
            "\n"
            "qemu-system-x86_64: Failed to load virtio-console:virtio\n"
            "warning: bare\n"
            "qemu-system-x86_64: load of migration failed: Invalid argument\n"
        )
        self.assertEqual(
            error_lines(stderr),
            [
                "qemu-system-x86_64: Failed to load virtio-console:virtio",
                "qemu-system-x86_64: load of migration failed: Invalid argument",
            ],
        )


class DriverConstructionTests(SynchronousTestCase):
    """The driver's program per hypervisor kind."""

    def test_fakeqemuRunsThisPython(self) -> None:
        self.assertEqual(
            HypervisorDriver(reactor, "fakeqemu").program, [sys.executable, "-m", "fakeqemu"]
        )

    def test_binaryOverridesTheProgram(self) -> None:
        self.assertEqual(HypervisorDriver(reactor, "fakeqemu", "/opt/fq").program, ["/opt/fq"])
        self.assertEqual(
            HypervisorDriver(reactor, "qemu", "/opt/qemu-7.2").program, ["/opt/qemu-7.2"]
        )

    def test_qemuDefaultsToQemuSystemX86(self) -> None:
        self.assertEqual(HypervisorDriver(reactor, "qemu").program, ["qemu-system-x86_64"])

    def test_unknownKindIsRefused(self) -> None:
        self.assertRaises(ValueError, HypervisorDriver, reactor, "xen")

    def test_commandLineAsksForTheSpecsOneAccelerator(self) -> None:
        driver = HypervisorDriver(reactor, "qemu")
        for accel in ("kvm", "tcg"):
            spec = VMSpec(name="a", uuid="u", memory_mib=64, cpus=1, run_dir="/r", accel=accel)
            argv = driver.command_line(spec)
            self.assertEqual([argv[i + 1] for i, w in enumerate(argv) if w == "-accel"], [accel])
