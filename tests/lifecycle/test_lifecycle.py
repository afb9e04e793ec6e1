"""The lifecycle end to end: real store, real driver, real fakeqemu VM processes."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.processes import kill_strays, process_state
from tests.reactor import reactor
from vmready.domain.model import BadRequest, Conflict, InstanceRecord
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.commands import MonitorTimeout
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import Event, EventBus
from vmready.store.sqlite import Store

STOP_TIMEOUT = 0.3


def _async(test: Callable[[Any], Coroutine[Any, Any, None]]) -> Callable[[Any], Deferred[None]]:
    def run(self: Any) -> Deferred[None]:
        return ensureDeferred(test(self))

    run.__name__ = test.__name__
    return run


def lifecycle_actions(events: list[Event], name: str) -> list[str]:
    """The actions of the lifecycle events about ``name``, other than instance-state."""
    return [
        e.metadata["action"]
        for e in events
        if e.type == "lifecycle"
        and e.metadata.get("source") == f"/1.0/instances/{name}"
        and e.metadata["action"] != "instance-state"
    ]


class ACPIGuest(Protocol):
    """A guest OS that powers off when the ACPI button is pressed."""

    def __init__(self) -> None:
        self.buffer = b""
        self.ready: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"hello\n")  # the answer proves the host registered us

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        if b"\n" in self.buffer and not self.ready.called:
            self.ready.callback(None)
        if b"POWERDOWN\n" in self.buffer:
            assert self.transport is not None
            self.transport.write(b"poweroff\n")


async def acpi_guest(vm: RunningVM) -> ACPIGuest:
    """An ACPIGuest on ``vm``'s power-management socket, once the host has registered it."""
    guest = ACPIGuest()
    control = os.path.join(vm.spec.guest_dir, "control")
    await connectProtocol(UNIXClientEndpoint(reactor, control), guest)
    await guest.ready
    return guest


async def guest_ends(vm: RunningVM, line: bytes) -> None:
    """The guest OS says ``line`` (``poweroff``, ``panic``) to the host; once ``vm`` is gone."""
    guest = await acpi_guest(vm)
    assert guest.transport is not None
    guest.transport.write(line)
    await vm.when_gone()


class LifecycleTestCase(TestCase):
    """A lifecycle on a fresh store, driving fakeqemu."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-lc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        # After every other cleanup (they run in reverse), before the directory goes: a VM
        # whose launch was still under way when the test ended is in no lifecycle's list,
        # and would outlive the test.
        self.addCleanup(kill_strays, self.directory)
        self.store = Store.open(os.path.join(self.directory, "vmready.sqlite"))
        self.addCleanup(self.store.close)
        self.lifecycle = self.new_lifecycle()
        self.addCleanup(self._kill_everything)

    def new_lifecycle(self, driver: HypervisorDriver | None = None) -> Lifecycle:
        """A lifecycle as a (re)started daemon builds it, on the same store and run dir.

        ``driver``: fakeqemu's by default; the one in use is ``self.driver``.
        """
        self.events: list[Event] = []
        bus = EventBus(reactor.seconds)
        bus.subscribe(self.events.append)
        driver = self.driver = driver or HypervisorDriver(reactor, "fakeqemu")
        return Lifecycle(
            reactor,
            self.store,
            driver,
            bus,
            os.path.join(self.directory, "run"),
            stop_timeout=STOP_TIMEOUT,
        )

    async def _kill_everything(self) -> None:
        for vm in list(self.lifecycle.running.vms.values()):
            if not vm.gone:
                await vm.force_stop()
        await self.lifecycle.shutdown()

    async def wait(self, operation: Any) -> Any:
        """Wait for an operation; return it."""
        return await operation.when_done()

    async def launch(self, name: str = "vm1", **config: str) -> InstanceRecord:
        """Create an instance and wait until it is ACTIVE."""
        operation = await self.lifecycle.create(name, config)
        await self.wait(operation)
        self.assertEqual(operation.error, "")
        return self.lifecycle.store.view.get_instance(name)

    def display_sequence(self, name: str) -> list[str]:
        """The display statuses the instance-state events showed, repeats collapsed."""
        shown = [
            e.metadata["context"]["display_status"]
            for e in self.events
            if e.metadata.get("action") == "instance-state"
            and e.metadata.get("source") == f"/1.0/instances/{name}"
        ]
        return [s for i, s in enumerate(shown) if i == 0 or shown[i - 1] != s]

    def lifecycle_actions(self, name: str) -> list[str]:
        """Lifecycle event actions about ``name``, other than instance-state."""
        return lifecycle_actions(self.events, name)

    def vm_option(self, name: str, option: str) -> str:
        """A value from the running VM's real command line (from /proc), past the program."""
        pid = self.lifecycle.running.vms[name].pid
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        arguments = argv[argv.index("-name") :]
        return arguments[arguments.index(option) + 1]


class CreateAndPowerTests(LifecycleTestCase):
    """Create, stop, start, restart, freeze: the sequences users see."""

    @_async
    async def test_createGoesBuildThenActiveNeverShutdown(self) -> None:
        record = await self.launch()
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state),
            (VMState.ACTIVE, None, PowerState.RUNNING),
        )
        self.assertEqual(self.display_sequence("vm1"), ["BUILD", "ACTIVE"])
        self.assertEqual(record.status.name, "Running")
        self.assertEqual(self.lifecycle_actions("vm1"), ["instance-created", "instance-started"])
        history = self.store.actions.list_actions("vm1")
        self.assertEqual([(a.action, a.result) for a in history], [("create", "success")])
        self.assertEqual([s.name for s in history[0].steps], ["spawning"])

    @_async
    async def test_createRefusesBadNamesAndConfig(self) -> None:
        for name, config in (
            ("1bad", {}),
            ("ok", {"limits.memory": "lots"}),
            ("ok", {"limits.cpu": "0"}),
            ("ok", {"volatile.x": "y"}),
        ):
            with self.assertRaises(BadRequest):
                await self.lifecycle.create(name, config)
        self.assertEqual(self.store.instances.list_instances(), [])

    @_async
    async def test_failedSpawnIsAPersistingError(self) -> None:
        self.lifecycle = self.new_lifecycle(
            HypervisorDriver(reactor, "fakeqemu", "/nonexistent/qemu")
        )
        operation = await self.lifecycle.create("vm1", {})
        await self.wait(operation)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.ERROR)
        self.assertTrue(record.error)
        self.assertEqual(operation.error, record.error)
        self.assertEqual(self.display_sequence("vm1"), ["BUILD", "ERROR"])
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)

    @_async
    async def test_stopWithoutGuestIsForcedAfterTimeoutAndClearsReady(self) -> None:
        await self.launch()
        self.store.instances.update_config("vm1", {READY_KEY: "true"})
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Ready")
        vm = self.lifecycle.running.vms["vm1"]
        await self.wait(await self.lifecycle.act("vm1", "stop"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.status.name), (VMState.STOPPED, "Stopped"))
        self.assertEqual(record.config[READY_KEY], "false")
        self.assertTrue(vm.gone)
        steps = [s.name for s in self.store.actions.list_actions("vm1")[0].steps]
        self.assertIn(f"forced stop after {STOP_TIMEOUT:g}s timeout", steps)
        self.assertEqual(self.display_sequence("vm1"), ["BUILD", "ACTIVE", "SHUTOFF"])

    @_async
    async def test_stopReportsItsGracePeriodInTheOperation(self) -> None:
        await self.launch()
        before = reactor.seconds()
        operation = await self.lifecycle.act("vm1", "stop")
        await self.wait(operation)
        after = reactor.seconds()
        reported = [
            e.metadata["metadata"]
            for e in self.events
            if e.type == "operation" and e.metadata["id"] == operation.id
        ]
        # Created (no metadata yet), the grace period begun, its outcome (then finished,
        # published just after the waiters woke).
        self.assertEqual(len(reported), 3, reported)
        self.assertIsNone(reported[0])
        grace = reported[1]["shutdown"]
        self.assertEqual(set(grace), {"timeout", "force_at"})
        self.assertEqual(grace["timeout"], STOP_TIMEOUT)
        force_at = datetime.datetime.fromisoformat(grace["force_at"]).timestamp()
        self.assertTrue(before + STOP_TIMEOUT <= force_at <= after, grace)
        # fakeqemu ignores the ACPI button: the grace ran out.
        self.assertEqual(reported[2], {"shutdown": {**grace, "result": "forced"}})
        self.assertEqual(operation.to_json()["metadata"], reported[2])

    @_async
    async def test_forcedStopHasNoGracePeriod(self) -> None:
        await self.launch()
        operation = await self.lifecycle.act("vm1", "stop", force=True)
        await self.wait(operation)
        self.assertIsNone(operation.to_json()["metadata"])

    @_async
    async def test_stopWithACPIGuestIsClean(self) -> None:
        await self.launch()
        await acpi_guest(self.lifecycle.running.vms["vm1"])
        await self.wait(await self.lifecycle.act("vm1", "stop", timeout=30))
        steps = [s.name for s in self.store.actions.list_actions("vm1")[0].steps]
        self.assertIn("clean stop", steps)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.STOPPED)

    @_async
    async def test_startAfterStopRunsANewVM(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await self.wait(await self.lifecycle.act("vm1", "start"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.power_state), (VMState.ACTIVE, PowerState.RUNNING)
        )
        self.assertIn("vm1", self.lifecycle.running.vms)

    @_async
    async def test_startFromErrorAdoptsAVMThatStillRuns(self) -> None:
        await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        await self.lifecycle.shutdown()  # the daemon loses track; the VM keeps running
        self.lifecycle = self.new_lifecycle()
        self.store.instances.set_error("vm1", "lost track of the VM")
        operation = await self.lifecycle.act("vm1", "start")
        await self.wait(operation)
        self.assertEqual(operation.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.error), (VMState.ACTIVE, None))
        self.assertEqual(self.lifecycle.running.vms["vm1"].pid, pid)

    @_async
    async def test_restartReplacesTheVMProcess(self) -> None:
        await self.launch()
        before = self.lifecycle.running.vms["vm1"].pid
        await self.wait(await self.lifecycle.act("vm1", "restart", force=True))
        after = self.lifecycle.running.vms["vm1"].pid
        self.assertNotEqual(before, after)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)

    @_async
    async def test_freezeAndUnfreezePauseTheVCPUs(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "freeze"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.status.name, int(record.status.code)), ("Frozen", 110))
        vm = self.lifecycle.running.vms["vm1"]
        self.assertEqual(await vm.query_power_state(), PowerState.PAUSED)
        await self.wait(await self.lifecycle.act("vm1", "unfreeze"))
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").status.name, "Running")


class TransitionTests(LifecycleTestCase):
    """Rebuild, resize, delete, and conflicts."""

    @_async
    async def test_rebuildShowsRebuildThenActive(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "rebuild"))
        self.assertEqual(self.display_sequence("vm1"), ["BUILD", "ACTIVE", "REBUILD", "ACTIVE"])

    @_async
    async def test_resizeWalksEverySeedStatusAndTheVMGetsTheNewSize(self) -> None:
        await self.launch(**{"limits.memory": "256", "limits.cpu": "1"})
        await self.wait(await self.lifecycle.act("vm1", "resize", memory="512", cpus=2))
        self.assertEqual(
            self.display_sequence("vm1")[1:],
            ["ACTIVE", "QUEUE_RESIZE", "PREP_RESIZE", "RESIZE", "VERIFY_RESIZE"],
        )
        self.assertEqual(self.vm_option("vm1", "-m"), "512M")
        self.assertEqual(self.vm_option("vm1", "-smp"), "2")
        await self.wait(await self.lifecycle.act("vm1", "confirm-resize"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.memory_mib, record.cpus), (VMState.ACTIVE, 512, 2)
        )
        self.assertNotIn("volatile.resize.previous.memory", record.config)

    @_async
    async def test_revertResizeGivesTheVMItsOldSizeBack(self) -> None:
        await self.launch(**{"limits.memory": "256"})
        await self.wait(await self.lifecycle.act("vm1", "resize", memory="1GiB"))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").memory_mib, 1024)
        await self.wait(await self.lifecycle.act("vm1", "revert-resize"))
        self.assertEqual(self.vm_option("vm1", "-m"), "256M")
        self.assertEqual(self.display_sequence("vm1")[-1], "ACTIVE")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").memory_mib, 256)

    @_async
    async def test_stoppedResizeThenConfirmEndsStoppedAndCanStart(self) -> None:
        await self.launch(**{"limits.memory": "256"})
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await self.wait(await self.lifecycle.act("vm1", "resize", memory="512"))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.RESIZED)
        await self.wait(await self.lifecycle.act("vm1", "confirm-resize"))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.STOPPED)
        await self.wait(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(self.vm_option("vm1", "-m"), "512M")

    @_async
    async def test_stoppedResizeThenRevertEndsStoppedWithTheOldSize(self) -> None:
        await self.launch(**{"limits.memory": "256"})
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await self.wait(await self.lifecycle.act("vm1", "resize", memory="512"))
        await self.wait(await self.lifecycle.act("vm1", "revert-resize"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.memory_mib), (VMState.STOPPED, 256))
        self.assertNotIn("vm1", self.lifecycle.running.vms)

    @_async
    async def test_nonFiniteOrHugeStopTimeoutIsRefused(self) -> None:
        await self.launch()
        for timeout in (float("inf"), float("nan"), 1e400, 10**9, 10**400, -1):
            with self.assertRaises(BadRequest):
                await self.lifecycle.act("vm1", "stop", timeout=timeout)
        self.assertIsNone(self.lifecycle.store.view.get_instance("vm1").task_state)

    @_async
    async def test_deleteGoesActiveToDeletedWithoutBuild(self) -> None:
        record = await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        run_dir = vm.spec.run_dir
        await self.wait(await self.lifecycle.act("vm1", "delete"))
        self.assertEqual(self.display_sequence("vm1"), ["BUILD", "ACTIVE", "DELETED"])
        self.assertIsNone(self.store.instances.find_instance("vm1"))
        self.assertTrue(vm.gone)
        self.assertFalse(os.path.exists(run_dir))
        self.assertEqual(self.store.actions.list_actions("vm1")[0].action, "delete")
        self.assertTrue(record.uuid)

    @_async
    async def test_racingActionLosesWith409(self) -> None:
        await self.launch()
        operation = await self.lifecycle.act("vm1", "stop", force=True)
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.act("vm1", "rebuild")
        self.assertEqual(
            caught.exception.message,
            "Cannot rebuild instance vm1: it is stopping (a stop is in progress)",
        )
        await self.wait(operation)

    @_async
    async def test_actionNotAllowedInVMStateIs409(self) -> None:
        await self.launch()
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.act("vm1", "start")
        self.assertEqual(caught.exception.message, "Cannot start instance vm1: it is running")


class VMDeathTests(LifecycleTestCase):
    """A VM that goes away on its own: clean power-off vs. death."""

    @_async
    async def test_aDeathReadBeforeATaskClaimedTheInstanceIsLeftToTheTask(self) -> None:
        """The watcher read the instance idle, then waited for a write; a restart claimed it
        meanwhile: the death is the restart's to see, its claim stays (else a start could
        run beside it)."""
        await self.launch()
        idle = self.lifecycle.store.view.get_instance("vm1")
        self.store.instances.claim_task(
            "vm1", "restart", frozenset({VMState.ACTIVE}), TaskState.REBOOTING
        )
        failed = await self.lifecycle.watching.fail(
            idle, "its VM died", PowerState.CRASHED, idle=True
        )
        self.assertFalse(failed)
        record = self.store.instances.get_instance("vm1")
        self.assertEqual(
            (record.task_state, record.vm_state), (TaskState.REBOOTING, VMState.ACTIVE)
        )

    @_async
    async def test_killedVMIsAnErrorThatPersists(self) -> None:
        await self.launch()
        self.store.instances.update_config("vm1", {READY_KEY: "true"})
        vm = self.lifecycle.running.vms["vm1"]
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        await vm.when_gone()
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.ERROR
        )
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertIn("exited unexpectedly", record.error or "")
        self.assertEqual(record.config[READY_KEY], "false")
        last_state = [
            e.metadata["context"]
            for e in self.events
            if e.metadata.get("action") == "instance-state"
        ][-1]
        self.assertEqual(
            (last_state["display_status"], last_state["error"]), ("ERROR", record.error)
        )
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        self.assertEqual(self.store.actions.list_actions("vm1")[0].action, "vm-exited")

    @_async
    async def test_guestPowerOffStopsTheInstance(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        await guest_ends(vm, b"poweroff\n")
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.STOPPED
        )
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").config[READY_KEY], "false")


class PowerSyncAndRecoveryTests(LifecycleTestCase):
    """The poller and a daemon restart."""

    @_async
    async def test_syncStopsAnActiveInstanceWhoseVMIsGoneAndSaysWhy(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms.pop("vm1")
        await vm.force_stop()
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.STOPPED)
        history = self.store.actions.list_actions("vm1")
        self.assertEqual(history[0].action, "power-sync")
        self.assertIn("VM not running", history[0].steps[0].name)
        self.assertEqual((history[0].result, history[0].error), ("success", None))

    @_async
    async def test_syncStopsAVMThatRunsForAStoppedInstance(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        # The store says stopped (say, an operator fixed the row by hand) while the VM runs.
        self.store.instances.claim_task(
            "vm1", "test", frozenset({VMState.ACTIVE}), _task("powering-off")
        )
        self.store.instances.finish_task(
            "vm1", _task("powering-off"), VMState.STOPPED, PowerState.SHUTDOWN
        )
        await self.lifecycle.power_sync.sync_power_states()
        await vm.when_gone()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.STOPPED)
        self.assertNotIn("vm1", self.lifecycle.running.vms)
        self.assertIn("stopped it", self.store.actions.list_actions("vm1")[0].steps[0].name)

    @_async
    async def test_syncLeavesAGuestThatIsPoweringOffToFinish(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        # QEMU announced SHUTDOWN (a guest power-off) and has not exited yet.
        self.store.instances.set_power_state("vm1", PowerState.SHUTDOWN)
        await self.lifecycle.power_sync.sync_power_states()
        self.assertIs(self.lifecycle.running.vms["vm1"], vm)
        self.assertFalse(vm.gone)
        await vm.force_stop()  # what the guest's power-off ends in: the VM exits
        await _until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.STOPPED
        )
        self.assertIn("instance-shutdown", self.lifecycle_actions("vm1"))

    @_async
    async def test_syncSettlesAPoweredOffInstanceWhoseVMIsGone(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms.pop("vm1")  # the daemon lost it in the window
        await vm.force_stop()
        self.store.instances.set_power_state("vm1", PowerState.SHUTDOWN)
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.power_state), (VMState.STOPPED, PowerState.SHUTDOWN)
        )

    @_async
    async def test_syncStopsAnUnfollowedVMOfAStoppedInstance(self) -> None:
        await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        assert pid is not None
        await self.lifecycle.shutdown()  # the daemon lets go; the VM keeps running
        self.lifecycle = self.new_lifecycle()
        self.store.instances.claim_task(
            "vm1", "test", frozenset({VMState.ACTIVE}), _task("powering-off")
        )
        self.store.instances.finish_task(
            "vm1", _task("powering-off"), VMState.STOPPED, PowerState.SHUTDOWN
        )
        await self.lifecycle.power_sync.sync_power_states()
        await _until(lambda: not _alive(pid))
        self.assertIn("stopped it", self.store.actions.list_actions("vm1")[0].steps[0].name)

    @_async
    async def test_syncSkipsInstancesWithATaskInProgress(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms.pop("vm1")
        await vm.force_stop()
        self.store.instances.claim_task(
            "vm1", "test", frozenset({VMState.ACTIVE}), _task("rebuilding")
        )
        actions_before = len(self.store.actions.list_actions("vm1"))
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.task_state), (VMState.ACTIVE, _task("rebuilding"))
        )
        self.assertEqual(len(self.store.actions.list_actions("vm1")), actions_before)
        self.assertNotIn("vm1", self.lifecycle.running.vms)

    @_async
    async def test_syncLeavesAStartingInstancesVMAlone(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        record = self.store.instances.claim_task(
            "vm1", "start", frozenset({VMState.STOPPED}), _task("powering-on")
        )
        # The start's VM is up but not yet followed: the poller must keep its hands off.
        vm = await self.lifecycle.driver.launch(self.lifecycle.specs.spec_for(record))
        self.addCleanup(vm.force_stop)
        await self.lifecycle.power_sync.sync_power_states()
        self.assertFalse(vm.gone)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)

    @_async
    async def test_syncRecordsAMonitorThatStoppedAnsweringAsAnError(self) -> None:
        self.driver.command_timeout = 0.5
        await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        self.addCleanup(_kill_quietly, pid)
        await self.lifecycle.power_sync.sync_power_states()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.ERROR)
        self.assertIn("did not answer query-status", record.error or "")
        self.assertEqual(self.store.actions.list_actions("vm1")[0].action, "power-sync")

    @_async
    async def test_syncLeavesAnInstanceInErrorAndItsVMAlone(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        self.store.instances.set_error("vm1", "operator says no")
        await self.lifecycle.power_sync.sync_power_states()
        self.assertFalse(vm.gone)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.error), (VMState.ERROR, "operator says no"))

    @_async
    async def test_errorSurvivesItsVMExiting(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        self.store.instances.set_error("vm1", "resize failed: disk on fire")
        await guest_ends(vm, b"poweroff\n")
        await _until(lambda: "vm1" not in self.lifecycle.running.vms)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.error), (VMState.ERROR, "resize failed: disk on fire")
        )
        self.assertEqual(self.store.actions.list_actions("vm1")[0].action, "vm-exited")

    @_async
    async def test_restartedDaemonReadoptsTheRunningVMAndClearsReady(self) -> None:
        await self.launch()
        self.store.instances.update_config("vm1", {READY_KEY: "true"})
        pid = self.lifecycle.running.vms["vm1"].pid
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        self.assertEqual(self.lifecycle.running.vms["vm1"].pid, pid)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertNotIn(READY_KEY, record.config)
        self.assertEqual((record.vm_state, record.status.name), (VMState.ACTIVE, "Running"))

    @_async
    async def test_restartResolvesAnInstanceLeftMidTask(self) -> None:
        await self.launch()
        await self.lifecycle.shutdown()
        self.store.instances.claim_task(
            "vm1", "rebuild", frozenset({VMState.ACTIVE}), _task("rebuilding")
        )
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertIsNone(record.task_state)
        self.assertEqual(record.vm_state, VMState.ERROR)
        self.assertEqual(record.error, "daemon stopped during rebuilding")

    @_async
    async def test_restartFinishesAnInterruptedDelete(self) -> None:
        record = await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        pid = vm.pid
        run_dir = vm.spec.run_dir
        await self.lifecycle.shutdown()
        self.store.instances.claim_task(
            "vm1", "delete", frozenset({VMState.ACTIVE}), _task("deleting")
        )
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        self.assertIsNone(self.store.instances.find_instance("vm1"))
        self.assertFalse(os.path.exists(run_dir))
        self.assertEqual(self.display_sequence("vm1"), ["DELETED"])
        assert pid is not None
        await _until(lambda: not _alive(pid))
        self.assertTrue(record.uuid)

    @_async
    async def test_restartWithAnUnansweringVMEndsTheTaskInError(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        pid = vm.pid
        assert pid is not None
        await self.lifecycle.shutdown()
        self.store.instances.claim_task(
            "vm1", "stop", frozenset({VMState.ACTIVE}), _task("powering-off")
        )
        os.kill(pid, signal.SIGSTOP)
        self.addCleanup(_kill_quietly, pid)
        self.lifecycle = self.new_lifecycle()
        self.driver.adopt_timeout = 1.0
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.task_state), (VMState.ERROR, None))
        self.assertIn("daemon stopped during powering-off", record.error or "")
        await _until(lambda: not _alive(pid))

    @_async
    async def test_stopKillsAVMWhoseMonitorSocketVanished(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        pid = vm.pid
        assert pid is not None
        await self.lifecycle.shutdown()
        os.unlink(vm.spec.qmp_socket)
        self.lifecycle = self.new_lifecycle()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await _until(lambda: not _alive(pid))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.STOPPED)

    @_async
    async def test_restartKeepsAStoppedResizeAwaitingConfirmation(self) -> None:
        await self.launch(**{"limits.memory": "256"})
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await self.wait(await self.lifecycle.act("vm1", "resize", memory="512"))
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.RESIZED)
        await self.wait(await self.lifecycle.act("vm1", "revert-resize"))
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.memory_mib), (VMState.STOPPED, 256))

    @_async
    async def test_restartWithAMonitorThatGreetsButHangsEndsTheTaskInError(self) -> None:
        await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        assert pid is not None
        await self.lifecycle.shutdown()
        self.store.instances.claim_task(
            "vm1", "freeze", frozenset({VMState.ACTIVE}), _task("pausing")
        )
        self.lifecycle = self.new_lifecycle()
        driver = self.driver
        adopt = driver.adopt

        async def adopt_hanging(spec: Any) -> Any:
            vm = await adopt(spec)
            assert vm is not None

            async def hangs() -> PowerState:
                raise MonitorTimeout("vm1", "query-status", 10)

            vm.query_power_state = hangs  # type: ignore[method-assign]
            return vm

        driver.adopt = adopt_hanging  # type: ignore[method-assign]
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.task_state), (VMState.ERROR, None))
        self.assertIn("daemon stopped during pausing", record.error or "")
        self.assertIn("did not answer query-status", record.error or "")
        await _until(lambda: not _alive(pid))

    @_async
    async def test_restartRollsBackAStartWhoseVMNeverCameUp(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        await self.lifecycle.shutdown()
        self.store.instances.claim_task(
            "vm1", "start", frozenset({VMState.STOPPED}), _task("powering-on")
        )
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.task_state), (VMState.STOPPED, None))


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    return process_state(pid) not in (None, b"Z")


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return


def _task(value: str) -> Any:
    from vmready.domain.states import TaskState

    return TaskState(value)


async def _until(condition: Callable[[], bool], attempts: int = 400) -> None:
    """Bounded wait for an asynchronous consequence."""
    for _ in range(attempts):
        if condition():
            return
        await deferLater(reactor, 0.025, lambda: None)
    raise AssertionError("condition not reached")
