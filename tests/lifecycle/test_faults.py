"""Faults recovered and visible: each leads to a state, an event, a fault ``vmready info``
shows, and recovery once its cause is gone, against real fakeqemu VMs.

QMP socket gone, QEMU killed, agent killed, agent hung, certificate files
unreadable, a snapshot's files refused by a full disk.  The store's own
disk-full case is in ``tests/store/test_diskfull.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from tests.lifecycle.test_lifecycle import _async, _until
from tests.lifecycle.test_ready import SERVER, AgentLinkTestCase
from tests.reactor import reactor
from tests.store.test_diskfull import small_filesystem
from vmready.domain.model import ActionRecord
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.faults import Fault, FaultLog, error_time
from vmready.lifecycle.watching import MONITOR_LOST_KEY
from vmready.protocols.ringbuffer import AgentStatus
from vmready.store.asyncstore import AsyncStore
from vmready.store.sqlite import Store


class FaultTestCase(AgentLinkTestCase):
    def faults(self, name: str = "vm1") -> dict[str, str]:
        """The standing faults ``vmready info`` would show, by kind."""
        return {fault.kind: fault.message for fault in self.lifecycle.events.faults.of(name)}


class QMPSocketGoneTests(FaultTestCase):
    """The monitor socket vanishes while QEMU runs: error, then re-adopted once it is back."""

    @_async
    async def test_lostMonitorIsAnErrorUntilTheSocketIsBack(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        pid = vm.pid
        socket = vm.spec.qmp_socket
        await self.lifecycle.shutdown()
        hidden = socket + ".away"
        os.rename(socket, hidden)  # gone, while QEMU runs on
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state),
            (VMState.ERROR, None, PowerState.NOSTATE),
        )
        self.assertEqual(record.config[MONITOR_LOST_KEY], "true")
        self.assertIn("QMP monitor did not answer", record.error or "")
        self.assertIn("instance-monitor-lost", self.lifecycle_actions("vm1"))
        self.assertEqual(sorted(self.faults()), ["error", "monitor"])
        # Still gone: power sync leaves it in error and its VM alone.
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        os.rename(hidden, socket)  # back
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.power_state, record.error),
            (VMState.ACTIVE, PowerState.RUNNING, None),
        )
        self.assertNotIn(MONITOR_LOST_KEY, record.config)
        self.assertEqual(self.lifecycle.running.vms["vm1"].pid, pid)
        self.assertEqual(self.lifecycle_actions("vm1")[-1], "instance-monitor-restored")
        self.assertEqual(self.faults(), {})
        # The agent is followed again: it reconnects and can be Ready.
        await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Ready")

    @_async
    async def test_monitorThatStopsAnsweringIsReadoptedWhenItAnswersAgain(self) -> None:
        self.driver.command_timeout = 0.5
        self.driver.adopt_timeout = 0.5
        await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        self.addCleanup(_continue, pid)
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        self.assertIn("monitor", self.faults())
        os.kill(pid, signal.SIGCONT)
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.error), (VMState.ACTIVE, None))
        self.assertEqual(self.lifecycle.running.vms["vm1"].pid, pid)

    @_async
    async def test_startOfALostInstanceReplacesItsVMAndEndsTheLoss(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        await self.lifecycle.shutdown()
        os.unlink(vm.spec.qmp_socket)  # gone for good
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        operation = await self.wait(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(operation.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.ACTIVE)
        await _until(
            lambda: MONITOR_LOST_KEY not in self.lifecycle.store.view.get_instance("vm1").config
        )
        self.assertEqual(self.faults(), {})


class QEMUKilledTests(FaultTestCase):
    @_async
    async def test_killedQEMUIsAnErrorShownWithItsTimeUntilStarted(self) -> None:
        await self.launch()
        await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)
        vm = self.lifecycle.running.vms["vm1"]
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.ERROR
        )
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.power_state, record.config[READY_KEY]), (PowerState.CRASHED, "false")
        )
        self.assertIs(self.lifecycle.running.agent_status("vm1"), AgentStatus.STOPPED)
        self.assertIn("instance-error", self.lifecycle_actions("vm1"))
        self.assertEqual(self.faults(), {"error": record.error})
        await self.wait(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        self.assertEqual(self.faults(), {})
        await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)

    @_async
    async def test_theErrorKeepsItsTimeAcrossADaemonRestart(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        assert vm.pid is not None
        killed_at = reactor.seconds()
        os.kill(vm.pid, signal.SIGKILL)
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.ERROR
        )
        error = self.lifecycle.store.view.get_instance("vm1").error
        assert error is not None
        await self.lifecycle.shutdown()
        restarted_at = reactor.seconds()
        self.lifecycle = self.new_lifecycle()  # a new daemon on the same SQLite file
        self.assertEqual(self.lifecycle.events.faults.of("vm1"), [])
        await self.lifecycle.recovery.recover()
        [fault] = self.lifecycle.events.faults.of("vm1")
        self.assertEqual((fault.kind, fault.message), ("error", error))
        exited = [a for a in self.store.actions.list_actions("vm1") if a.action == "vm-exited"]
        self.assertEqual(fault.since, exited[0].finished_at)
        self.assertTrue(killed_at <= fault.since <= restarted_at, (killed_at, fault.since))
        # Started again: the error and its fault are gone, as without a restart.
        await self.wait(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(self.faults(), {})

    @_async
    async def test_aStoredErrorIsRestoredAtTheTimeOfItsFailedAction(self) -> None:
        await self.launch()
        await self.lifecycle.store.instances.set_error("vm1", "older trouble")
        self.lifecycle.journal.history("vm1", "vm-exited", "older trouble", ok=False)
        await self.lifecycle.store.run(lambda engine: None)  # the history is written
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        [older] = [a for a in self.store.actions.list_actions("vm1") if a.action == "vm-exited"]
        self.assertEqual(
            [(f.kind, f.message, f.since) for f in self.lifecycle.events.faults.of("vm1")],
            [("error", "older trouble", older.finished_at)],
        )


_ERROR_EVENT = {
    "action": "instance-error",
    "source": "/1.0/instances/vm1",
    "context": {"error": "x"},
}


class ErrorTimeTests(SynchronousTestCase):
    """``error_time``: when a stored error happened, from the action history."""

    def action(self, at: float, result: str, error: str | None) -> ActionRecord:
        return ActionRecord(1, "vm1", "start", "r", at - 1, at, result, error, ())

    def test_theNewestFailedActionWhoseErrorBeginsTheInstancesGivesTheTime(self) -> None:
        history = [
            self.action(40.0, "error", "daemon stopped during the action"),
            self.action(30.0, "success", None),
            self.action(20.0, "error", "guest panicked"),
            self.action(10.0, "error", "guest panicked"),
        ]
        self.assertEqual(error_time("guest panicked; its console log may say why", history), 20.0)

    def test_noMatchingFailureGivesNoTime(self) -> None:
        history = [self.action(10.0, "error", "something else"), self.action(5.0, "error", "")]
        self.assertIsNone(error_time("guest panicked", history))
        self.assertIsNone(error_time("guest panicked", []))

    def test_anUnfinishedActionCountsFromItsStart(self) -> None:
        unfinished = ActionRecord(1, "vm1", "start", "r", 7.0, None, "error", "boom", ())
        self.assertEqual(error_time("boom", [unfinished]), 7.0)

    def test_aRestoredFaultDoesNotReplaceOneTheEventsRaised(self) -> None:
        log = FaultLog()
        log.observe(
            "lifecycle",
            50.0,
            {
                "action": "instance-error",
                "source": "/1.0/instances/vm1",
                "context": {"error": "x"},
            },
        )
        log.restore("vm1", Fault("error", "x", 10.0))
        log.restore("vm2", Fault("error", "y", 11.0))
        self.assertEqual(log.of("vm1"), [Fault("error", "x", 50.0)])
        self.assertEqual(log.of("vm2"), [Fault("error", "y", 11.0)])


class AgentFaultTests(FaultTestCase):
    @_async
    async def test_killedAgentIsLostUntilItComesBack(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        await self.lifecycle.guestside.set_ready("vm1", True)
        for port in (guest.status, guest.connect):  # SIGKILL: both its ports close
            port.transport.loseConnection()  # type: ignore[union-attr]
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(self.lifecycle_actions("vm1")[-1], "agent-link-lost")
        self.assertIn("closed its port without STOPPED", self.faults()["agent"])
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.power_state), (VMState.ACTIVE, PowerState.RUNNING)
        )
        await guest.closed
        await guest.connect.closed
        await self.connected_guest()  # the agent is back
        self.assertEqual(self.faults(), {})
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Ready")

    @_async
    async def test_agentThatSaysStoppedIsNotAFault(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        guest.say(b"STOPPED\n")
        guest.status.transport.loseConnection()  # type: ignore[union-attr]
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertNotIn("agent-link-lost", self.lifecycle_actions("vm1"))
        self.assertEqual(self.faults(), {})

    @_async
    async def test_hungAgentIsLostUntilItSpeaksAgain(self) -> None:
        self.guest_api_listens(self.lifecycle, silence_timeout=0.5, safety=0.2)
        await self.launch()
        guest = await self.connected_guest()
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertIn("no heartbeat", self.faults()["agent"])
        self.assertEqual(self.lifecycle_actions("vm1")[-1], "agent-link-lost")
        guest.say(b"STARTED\n")  # it wakes up and starts over
        await _until(lambda: "agent" not in self.faults())


class CertificateFaultTests(FaultTestCase):
    """An instance's config-drive certificate files that cannot be read: its fault alone."""

    @_async
    async def test_anUnusableCertificateFileDoesNotStopRecovery(self) -> None:
        record = await self.launch()
        await self.launch("vm2")
        server = os.path.join(self.lifecycle.specs.config_drive(record), "server.crt")
        await self.lifecycle.shutdown()
        os.unlink(server)
        os.mkdir(server)  # the daemon reads it at start: now it cannot
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        # Its VM is adopted as usual; only its certificate is at fault, and no other's.
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        self.assertIn("vm1", self.lifecycle.running.vms)
        self.assertIn("Is a directory", self.faults()["certificate"])
        self.assertEqual(self.faults("vm2"), {})
        self.assertIn("instance-certificate-error", self.lifecycle_actions("vm1"))
        os.rmdir(server)
        with open(server, "wb") as f:
            f.write(SERVER.cert_pem)
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.faults(), {})
        self.assertEqual(self.lifecycle_actions("vm1")[-1], "instance-certificate-restored")

    @_async
    async def test_aCertificateWithoutReadPermissionIsReportedUntilReadable(self) -> None:
        record = await self.launch()
        drive = self.lifecycle.specs.config_drive(record)
        crt = os.path.join(drive, "agent.crt")
        os.chmod(crt, 0)
        with _unprivileged(drive):
            self.lifecycle.guestside.recheck_identity(record)
        self.assertIn("agent.crt: Permission denied", self.faults()["certificate"])
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        os.chmod(crt, 0o644)
        await (
            self.lifecycle.power_sync.sync_power_states()
        )  # as the files' owner, the daemon's user
        self.assertEqual(self.faults(), {})

    @_async
    async def test_missingOrCorruptCertificateIsReported(self) -> None:
        record = await self.launch()
        drive = self.lifecycle.specs.config_drive(record)
        key = os.path.join(drive, "agent.key")
        with open(key, "rb") as f:
            saved = f.read()
        os.unlink(key)
        self.lifecycle.guestside.recheck_identity(record)
        self.assertIn("agent.key: No such file or directory", self.faults()["certificate"])
        with open(os.path.join(drive, "agent.crt"), "wb") as f:
            f.write(b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
        with open(key, "wb") as f:
            f.write(saved)
        self.lifecycle.guestside.recheck_identity(record)
        self.assertIn("agent.crt: not a valid certificate", self.faults()["certificate"])


class SnapshotDiskFullTests(FaultTestCase):
    """A snapshot whose files the disk refuses fails alone: the VM runs on, nothing half-kept."""

    @_async
    async def test_snapshotOnAFullDiskFailsAndTheNextOneSucceeds(self) -> None:
        root = small_filesystem(self, "64k")
        self.lifecycle.specs.snapshot_root = root
        await self.launch()
        filler = os.path.join(root, "filler")
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        operation = await self.wait(
            await self.lifecycle.act("vm1", "snapshot", snapshot="s1", stateful=False)
        )
        self.assertIn("No space left on device", operation.error)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state),
            (VMState.ACTIVE, None, PowerState.RUNNING),
        )
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), [])
        self.assertIn("instance-snapshot-failed", self.lifecycle_actions("vm1"))
        self.assertIn("No space left on device", self.faults()["snapshot"])
        os.unlink(filler)  # space again
        operation = await self.wait(
            await self.lifecycle.act("vm1", "snapshot", snapshot="s1", stateful=False)
        )
        self.assertEqual(operation.error, "")
        self.assertEqual([s["name"] for s in self.store.snapshots.list_snapshots("vm1")], ["s1"])
        self.assertEqual(self.faults(), {})


def _continue(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _unprivileged(directory: str) -> Iterator[None]:
    """Run as an unprivileged user: root reads a chmod 000 file, anyone else cannot.

    The directories down to ``directory`` are made traversable for that user
    meanwhile (the test's temporary directory is private).
    """
    if os.geteuid() != 0:
        yield
        return
    opened: list[tuple[str, int]] = []
    path = directory
    while path not in ("/", "/tmp"):
        opened.append((path, os.stat(path).st_mode & 0o7777))
        os.chmod(path, opened[-1][1] | 0o111)
        path = os.path.dirname(path)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        for path, mode in opened:
            os.chmod(path, mode)


class StoreDiskFullTests(FaultTestCase):
    """The store's disk fills up under a running lifecycle: announced, shown, then recovered."""

    @_async
    async def test_storeWritesFailingAreAnnouncedAndShownUntilTheyLand(self) -> None:
        root = small_filesystem(self, "1m")
        engine = Store.open(os.path.join(root, "vmready.sqlite"))
        engine.instances.create_instance("vm9", {}, {})
        engine.instances.finish_task(
            "vm9", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        store = AsyncStore.threaded(reactor, engine)
        self.addCleanup(store.close)
        bus = EventBus(reactor.seconds)
        seen: list[str] = []
        bus.subscribe(lambda event: seen.append(event.metadata.get("action", "")))
        lifecycle = Lifecycle(
            reactor, store, HypervisorDriver(reactor, "fakeqemu"), bus, os.path.join(root, "run")
        )
        filler = os.path.join(root, "filler")
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        update = Deferred.fromCoroutine(
            lifecycle.configuring.update_config("vm9", {"user.big": "x" * 200_000})
        )
        await _until(lambda: "store-write-failed" in seen)
        shown = {fault.kind: fault.message for fault in bus.faults.of("vm9")}
        self.assertIn("disk is full", shown["store"])
        self.assertFalse(update.called)
        os.unlink(filler)
        record = await update
        self.assertEqual(len(record.config["user.big"]), 200_000)
        self.assertEqual(seen[-2:], ["store-write-recovered", "instance-updated"])
        self.assertEqual(bus.faults.of("vm9"), [])
