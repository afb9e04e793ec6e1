"""After a kill -9: each interrupted task's recovery rule, on real fakeqemu VM processes.

Each test leaves the store row and the VM as a daemon killed mid-task would
(the task claimed, the VM running or not, the instance Ready from before),
starts a new lifecycle on the same store and run dir, runs its start-up
recovery, and checks the rule: vm_state, power_state, no task, a history
line, an ``instance-state`` event, Ready cleared, and a VM running exactly when
the store says so — at the size the store says (``-m``/``-smp`` of the VM
process). ``docs/state-model.md`` ("After a crash") states the rules.
"""

from __future__ import annotations

import itertools
import os
import signal

from tests.lifecycle.test_lifecycle import LifecycleTestCase, _alive, _async, _until
from vmready.domain.model import InstanceRecord
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.lifecycle.actions import PREVIOUS_CPU_KEY, PREVIOUS_MEMORY_KEY

NAME = "vm1"
PREVIOUS = (PREVIOUS_MEMORY_KEY, PREVIOUS_CPU_KEY)


class CrashTestCase(LifecycleTestCase):
    """A daemon's state as kill -9 leaves it, then a new daemon's recovery."""

    async def running(self, **config: str) -> int:
        """NAME launched, its VM running, its workload Ready; the VM's pid."""
        await self.launch(NAME, **config)
        self.store.instances.update_config(NAME, {READY_KEY: "true"})
        pid = self.lifecycle.running.vms[NAME].pid
        assert pid is not None
        return pid

    async def stopped(self) -> None:
        """NAME launched, then stopped."""
        await self.launch(NAME)
        await self.wait(await self.lifecycle.act(NAME, "stop", force=True))

    async def crash(self, pid: int | None = None) -> None:
        """The daemon dies: it lets go of everything (its VMs run on); ``pid`` dies too."""
        await self.lifecycle.shutdown()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: not _alive(pid))

    def claim(self, action: str, *tasks: TaskState) -> None:
        """The action claimed its first task and got as far as the last one."""
        record = self.store.instances.get_instance(NAME)
        self.store.instances.claim_task(NAME, action, frozenset({record.vm_state}), tasks[0])
        for before, after in itertools.pairwise(tasks):
            self.store.instances.advance_task(NAME, before, after)

    async def recover(self) -> InstanceRecord:
        """A new daemon's start-up recovery; the instance after it."""
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        return self.lifecycle.store.view.get_instance(NAME)

    def assertRule(
        self,
        record: InstanceRecord,
        vm_state: VMState,
        power: PowerState,
        history: str,
    ) -> None:
        """The rule's end state, its history line and event, Ready cleared, the VM as stored."""
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state), (vm_state, None, power)
        )
        self.assertNotEqual(record.config.get(READY_KEY), "true")
        [recovered] = [a for a in self.store.actions.list_actions(NAME) if a.action == "recover"]
        self.assertIn(history, recovered.steps[0].name + (recovered.error or ""))
        states = [
            e.metadata["context"]
            for e in self.events
            if e.metadata.get("action") == "instance-state"
            and e.metadata.get("source") == f"/1.0/instances/{NAME}"
        ]
        self.assertEqual(states[-1]["vm_state"], vm_state.value)
        self.assertIsNone(states[-1]["task_state"])
        runs = power in (PowerState.RUNNING, PowerState.PAUSED)
        vm = self.lifecycle.running.vms.get(NAME)
        self.assertEqual(vm is not None and not vm.gone, runs)
        if runs:
            assert vm is not None and vm.pid is not None
            self.assertTrue(_alive(vm.pid))
            self.assertEqual(
                (self.vm_option(NAME, "-m"), self.vm_option(NAME, "-smp")),
                (f"{record.memory_mib}M", str(record.cpus)),
            )

    async def assertNoVM(self, pid: int) -> None:
        """The VM process ``pid`` is gone (or goes)."""
        await _until(lambda: not _alive(pid))


class PowerTaskTests(CrashTestCase):
    """Create, start, stop, restart, rebuild, snapshot, restore and delete, cut short."""

    @_async
    async def test_spawningWithItsVMRunningEndsActive(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("create", TaskState.SPAWNING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "spawning")
        self.assertEqual(self.lifecycle.running.vms[NAME].pid, pid)

    @_async
    async def test_spawningWithoutAVMEndsInError(self) -> None:
        pid = await self.running()
        await self.crash(pid)
        self.claim("create", TaskState.SPAWNING)
        record = await self.recover()
        self.assertRule(record, VMState.ERROR, PowerState.NOSTATE, "spawning")

    @_async
    async def test_poweringOnWithItsVMRunningEndsActive(self) -> None:
        await self.running()
        await self.crash()
        self.claim("start", TaskState.POWERING_ON)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "powering-on")

    @_async
    async def test_poweringOnWithoutAVMEndsStopped(self) -> None:
        await self.stopped()
        await self.crash()
        self.claim("start", TaskState.POWERING_ON)
        record = await self.recover()
        self.assertRule(record, VMState.STOPPED, PowerState.SHUTDOWN, "powering-on")

    @_async
    async def test_poweringOffStopsTheVMThatStillRuns(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("stop", TaskState.POWERING_OFF)
        record = await self.recover()
        self.assertRule(record, VMState.STOPPED, PowerState.SHUTDOWN, "powering-off")
        await self.assertNoVM(pid)

    @_async
    async def test_poweringOffWhoseVMIsGoneEndsStopped(self) -> None:
        pid = await self.running()
        await self.crash(pid)
        self.claim("stop", TaskState.POWERING_OFF)
        record = await self.recover()
        self.assertRule(record, VMState.STOPPED, PowerState.SHUTDOWN, "powering-off")

    @_async
    async def test_rebootingWithAVMRunningEndsActive(self) -> None:
        await self.running()
        await self.crash()
        self.claim("restart", TaskState.REBOOTING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rebooting")

    @_async
    async def test_rebootingWithoutAVMEndsInError(self) -> None:
        pid = await self.running()
        await self.crash(pid)
        self.claim("restart", TaskState.REBOOTING)
        record = await self.recover()
        self.assertRule(record, VMState.ERROR, PowerState.NOSTATE, "rebooting")

    @_async
    async def test_rebuildingEndsInErrorWithItsVMStopped(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("rebuild", TaskState.REBUILDING)
        record = await self.recover()
        self.assertRule(record, VMState.ERROR, PowerState.NOSTATE, "rebuilding")
        await self.assertNoVM(pid)

    @_async
    async def test_snapshottingLetsTheVMRunOn(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("snapshot", TaskState.SNAPSHOTTING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "image-snapshot")
        self.assertEqual(self.lifecycle.running.vms[NAME].pid, pid)

    @_async
    async def test_snapshottingAStoppedInstanceEndsStopped(self) -> None:
        await self.stopped()
        await self.crash()
        self.claim("snapshot", TaskState.SNAPSHOTTING)
        record = await self.recover()
        self.assertRule(record, VMState.STOPPED, PowerState.SHUTDOWN, "image-snapshot")

    @_async
    async def test_restoringEndsInErrorWithItsVMStopped(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("restore", TaskState.RESTORING)
        record = await self.recover()
        self.assertRule(record, VMState.ERROR, PowerState.NOSTATE, "restoring")
        await self.assertNoVM(pid)

    @_async
    async def test_deletingIsFinished(self) -> None:
        pid = await self.running()
        await self.crash()
        self.claim("delete", TaskState.DELETING)
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        self.assertIsNone(self.store.instances.find_instance(NAME))
        self.assertIn("instance-deleted", self.lifecycle_actions(NAME))
        await self.assertNoVM(pid)


class ResizeTests(CrashTestCase):
    """A resize, confirm or revert cut short: completed or rolled back, never half-applied."""

    OLD = {"limits.memory": "128", "limits.cpu": "1"}
    NEW = {"limits.memory": "256", "limits.cpu": "2"}
    RESIZE = (
        TaskState.RESIZE_QUEUED,
        TaskState.RESIZE_PREP,
        TaskState.RESIZE_MIGRATING,
    )

    def write_new_size(self) -> None:
        """The resize's one store write: the new size, the old one kept beside it."""
        self.store.instances.update_config(
            NAME,
            {**self.NEW, PREVIOUS_MEMORY_KEY: "128", PREVIOUS_CPU_KEY: "1", READY_KEY: "false"},
        )

    def resized(self, power: PowerState) -> None:
        """NAME rests resized (the old size kept), as a finished resize leaves it."""
        self.store.instances.update_config(
            NAME, {PREVIOUS_MEMORY_KEY: "128", PREVIOUS_CPU_KEY: "1"}
        )
        self.claim("resize", TaskState.RESIZE_QUEUED)
        self.store.instances.finish_task(NAME, TaskState.RESIZE_QUEUED, VMState.RESIZED, power)

    def assertSize(self, record: InstanceRecord, memory: int, cpus: int) -> None:
        self.assertEqual((record.memory_mib, record.cpus), (memory, cpus))
        for key in PREVIOUS:
            self.assertEqual(key in record.config, record.vm_state is VMState.RESIZED)

    @_async
    async def test_crashBeforeTheStoreWriteWithTheOldVMRunningRollsBack(self) -> None:
        pid = await self.running(**self.OLD)
        await self.crash()
        self.claim("resize", *self.RESIZE)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rolled back")
        self.assertSize(record, 128, 1)
        self.assertEqual(self.lifecycle.running.vms[NAME].pid, pid)
        self.assertIn("instance-resize-reverted", self.lifecycle_actions(NAME))

    @_async
    async def test_crashBeforeTheStoreWriteWithTheOldVMStoppedStartsItAgain(self) -> None:
        pid = await self.running(**self.OLD)
        await self.crash(pid)
        self.claim("resize", *self.RESIZE)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rolled back")
        self.assertSize(record, 128, 1)

    @_async
    async def test_crashBetweenTheStoreWriteAndTheRelaunchRollsBack(self) -> None:
        pid = await self.running(**self.OLD)
        await self.crash(pid)
        self.claim("resize", *self.RESIZE)
        self.write_new_size()
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rolled back")
        self.assertSize(record, 128, 1)

    @_async
    async def test_crashAfterTheRelaunchCompletesTheResize(self) -> None:
        # The VM already runs at the new size, the store says so: resized, to confirm.
        pid = await self.running(**self.NEW)
        await self.crash()
        self.claim("resize", *self.RESIZE, TaskState.RESIZE_FINISH)
        self.store.instances.update_config(
            NAME, {PREVIOUS_MEMORY_KEY: "128", PREVIOUS_CPU_KEY: "1"}
        )
        record = await self.recover()
        self.assertRule(record, VMState.RESIZED, PowerState.RUNNING, "the new size was applied")
        self.assertSize(record, 256, 2)
        self.assertEqual(self.lifecycle.running.vms[NAME].pid, pid)
        await self.wait(await self.lifecycle.act(NAME, "revert-resize"))
        reverted = self.lifecycle.store.view.get_instance(NAME)
        self.assertEqual((reverted.vm_state, reverted.memory_mib), (VMState.ACTIVE, 128))
        self.assertEqual(self.vm_option(NAME, "-m"), "128M")

    @_async
    async def test_crashAfterTheStoreWriteOfAStoppedResizeCompletesIt(self) -> None:
        await self.stopped()
        await self.crash()
        self.store.instances.update_config(NAME, {**self.OLD})
        self.claim("resize", *self.RESIZE)
        self.write_new_size()
        record = await self.recover()
        self.assertRule(record, VMState.RESIZED, PowerState.SHUTDOWN, "the new size was applied")
        self.assertSize(record, 256, 2)

    @_async
    async def test_crashBeforeTheStoreWriteOfAStoppedResizeLeavesItStopped(self) -> None:
        await self.stopped()
        await self.crash()
        self.store.instances.update_config(NAME, {**self.OLD})
        self.claim("resize", TaskState.RESIZE_QUEUED)
        record = await self.recover()
        self.assertRule(record, VMState.STOPPED, PowerState.SHUTDOWN, "rolled back")
        self.assertSize(record, 128, 1)

    @_async
    async def test_interruptedConfirmIsCompleted(self) -> None:
        pid = await self.running(**self.NEW)
        await self.crash()
        self.resized(PowerState.RUNNING)
        self.claim("confirm-resize", TaskState.RESIZE_CONFIRMING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "confirmed")
        self.assertSize(record, 256, 2)
        self.assertEqual(self.lifecycle.running.vms[NAME].pid, pid)

    @_async
    async def test_revertCutShortBeforeItsStoreWriteIsCompleted(self) -> None:
        pid = await self.running(**self.NEW)
        await self.crash()
        self.resized(PowerState.RUNNING)
        self.claim("revert-resize", TaskState.RESIZE_REVERTING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rolled back")
        self.assertSize(record, 128, 1)
        await self.assertNoVM(pid)

    @_async
    async def test_revertCutShortAfterItsStoreWriteIsCompleted(self) -> None:
        pid = await self.running(**self.NEW)
        await self.crash(pid)
        self.resized(PowerState.RUNNING)
        self.store.instances.update_config(
            NAME, {**self.OLD, PREVIOUS_MEMORY_KEY: None, PREVIOUS_CPU_KEY: None}
        )
        self.claim("revert-resize", TaskState.RESIZE_REVERTING)
        record = await self.recover()
        self.assertRule(record, VMState.ACTIVE, PowerState.RUNNING, "rolled back")
        self.assertSize(record, 128, 1)
