"""The ring-buffer rename and stateful snapshots, on fakeqemu and on real QEMU.

The same checks run against both hypervisors: a stateful snapshot taken of a
VM started with the legacy serial layout cannot be loaded into the current
layout; vmready refuses that before it touches anything, and with ``force``
lets QEMU try and reports QEMU's own lines, leaving the instance in error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from tests.conformance.support import REAL_QEMU, cannot_run
from tests.lifecycle.test_lifecycle import _async, _until
from tests.reactor import reactor
from vmready.domain.model import BadRequest, Conflict, HypervisorError, InstanceRecord, NotFound
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    AGENT_RING,
    CURRENT_LAYOUT,
    LEGACY_LAYOUT,
    LEGACY_PORT,
    UNRECORDED_LAYOUT,
    SerialLayout,
)
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import Event, EventBus
from vmready.lifecycle.specs import LAYOUT_KEY, run_dir_name
from vmready.store.sqlite import Store

STOP_TIMEOUT = 0.3
# What QEMU writes to its -D log, each line after its program name (DESIGN.md, measured).
QEMU_LINES = [
    "Failed to load virtio-console:virtio",
    "error while loading state for instance 0x0 of device '0000:00:01.0/virtio-console'",
    "load of migration failed: Invalid argument",
]


class SnapshotTestCase(TestCase):
    """A lifecycle (rebuilt as an upgraded daemon would be) on one store and data dir."""

    hypervisor = "fakeqemu"

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-sn-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.store = Store.open(os.path.join(self.directory, "vmready.sqlite"))
        self.addCleanup(self.store.close)
        self.lifecycle = self.new_lifecycle(CURRENT_LAYOUT)
        self.addCleanup(self._kill_everything)

    def new_lifecycle(self, layout: SerialLayout) -> Lifecycle:
        """A daemon starting VMs with ``layout``, on the same store, run and snapshot dirs."""
        self.events: list[Event] = []
        bus = EventBus(reactor.seconds)
        bus.subscribe(self.events.append)
        self.driver = HypervisorDriver(reactor, self.hypervisor)
        return Lifecycle(
            reactor,
            self.store,
            self.driver,
            bus,
            os.path.join(self.directory, "run"),
            stop_timeout=STOP_TIMEOUT,
            serial_layout=layout,
        )

    async def upgrade(self, layout: SerialLayout = CURRENT_LAYOUT) -> None:
        """Stop this daemon (VMs keep running) and start one with ``layout``."""
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle(layout)
        await self.lifecycle.recovery.recover()

    async def _kill_everything(self) -> None:
        for vm in list(self.lifecycle.running.vms.values()):
            if not vm.gone:
                await vm.force_stop()
        await self.lifecycle.shutdown()
        for record in self.store.instances.list_instances():
            await self.lifecycle.driver.kill_owned(self.lifecycle.specs.spec_for(record))

    async def finish(self, operation: Any) -> Any:
        done = await operation.when_done()
        return done

    def command_line(self, record: InstanceRecord) -> list[str]:
        """The argv the instance's VM process runs with."""
        pid = self.lifecycle.running.vms[record.name].pid
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")

    async def launch(self, name: str = "vm1", **config: str) -> InstanceRecord:
        operation = await self.finish(
            await self.lifecycle.create(name, {"limits.memory": "64", **config})
        )
        self.assertEqual(operation.error, "")
        return self.lifecycle.store.view.get_instance(name)

    def snapshot_dir(self, record: InstanceRecord, name: str) -> str:
        return os.path.join(self.directory, "snapshots", run_dir_name(record.uuid), name)

    def files(self, record: InstanceRecord) -> dict[str, bytes]:
        """Everything in the instance's snapshot directory, by relative path."""
        root = os.path.join(self.directory, "snapshots", run_dir_name(record.uuid))
        found = {}
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, root)] = f.read()
        return found


class RenameChecks(SnapshotTestCase):
    """Serial layouts before and after the rename, and a daemon upgraded under running VMs."""

    @_async
    async def test_newVMsGetTheNewPortWiredAndTheOldNameUnwired(self) -> None:
        record = await self.launch()
        self.assertEqual(record.config[LAYOUT_KEY], "current")
        ports = self.lifecycle.specs.spec_for(record).serial_ports
        self.assertEqual(
            [(port.name, port.chardev) for port in ports],
            [(AGENT_PORT, AGENT_RING), (LEGACY_PORT, None)],
        )
        self.assertIn(f"name={LEGACY_PORT}", " ".join(self.command_line(record)))

    @_async
    async def test_legacyDaemonWiresTheOldPortOnly(self) -> None:
        await self.upgrade(LEGACY_LAYOUT)
        record = await self.launch()
        self.assertEqual(record.config[LAYOUT_KEY], "legacy")
        line = " ".join(self.command_line(record))
        self.assertIn(f"chardev={AGENT_RING},name={LEGACY_PORT}", line)
        self.assertNotIn(AGENT_PORT, line)

    @_async
    async def test_upgradedDaemonKeepsTheLayoutARunningVMWasStartedWith(self) -> None:
        await self.upgrade(LEGACY_LAYOUT)
        record = await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        await self.upgrade(CURRENT_LAYOUT)
        adopted = self.lifecycle.running.vms["vm1"]
        self.assertEqual(adopted.pid, pid)
        self.assertEqual(
            self.lifecycle.store.view.get_instance("vm1").config[LAYOUT_KEY], "legacy"
        )
        self.assertEqual(adopted.spec.serial_ports, LEGACY_LAYOUT.ports)
        # Read through the chardev it was started with: nothing refused, nothing there yet.
        self.assertEqual(await adopted.ringbuf_read(AGENT_RING, 64), b"")
        # A restart gives it the new layout, recorded.
        await self.finish(await self.lifecycle.act("vm1", "restart", force=True))
        self.assertEqual(
            self.lifecycle.store.view.get_instance("vm1").config[LAYOUT_KEY], "current"
        )
        self.assertEqual(self.lifecycle.running.vms["vm1"].spec.serial_ports, CURRENT_LAYOUT.ports)
        self.assertIn(AGENT_PORT, " ".join(self.command_line(record)))


class SnapshotChecks(SnapshotTestCase):
    """Snapshots: stateless always restore; stateful ones only into the same device set."""

    @_async
    async def test_statelessSnapshotBringsTheConfigBack(self) -> None:
        await self.launch(**{"user.role": "db"})
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="before"))
        await self.lifecycle.configuring.update_config(
            "vm1", {"user.role": "web", "user.extra": "1"}
        )
        operation = await self.finish(
            await self.lifecycle.act("vm1", "restore", snapshot="before")
        )
        self.assertEqual(operation.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.config["user.role"], "user.extra" in record.config), ("db", False)
        )
        self.assertEqual(
            (record.vm_state, record.power_state), (VMState.ACTIVE, PowerState.RUNNING)
        )

    @_async
    async def test_statefulSnapshotSavesTheStateAndTheVMRunsOn(self) -> None:
        record = await self.launch()
        pid = self.lifecycle.running.vms["vm1"].pid
        operation = await self.finish(
            await self.lifecycle.act("vm1", "snapshot", snapshot="s1", stateful=True)
        )
        self.assertEqual(operation.error, "")
        vm = self.lifecycle.running.vms["vm1"]
        self.assertEqual((vm.pid, await vm.query_power_state()), (pid, PowerState.RUNNING))
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        snapshot = self.store.snapshots.find_snapshot("vm1", "s1")
        assert snapshot is not None
        self.assertTrue(snapshot["stateful"])
        self.assertEqual(snapshot["metadata"]["layout"], "current")
        self.assertEqual(
            snapshot["metadata"]["device_set"]["serial_ports"],
            [{"name": AGENT_PORT, "chardev": AGENT_RING}, {"name": LEGACY_PORT, "chardev": None}],
        )
        self.assertEqual(sorted(self.files(record)), ["s1/snapshot.json", "s1/state"])
        self.assertGreater(len(self.files(record)["s1/state"]), 0)

    @_async
    async def test_statefulRestoreIntoTheSameLayoutResumesTheVM(self) -> None:
        await self.launch()
        await self.finish(
            await self.lifecycle.act("vm1", "snapshot", snapshot="s1", stateful=True)
        )
        pid = self.lifecycle.running.vms["vm1"].pid
        operation = await self.finish(
            await self.lifecycle.act("vm1", "restore", snapshot="s1", stateful=True)
        )
        self.assertEqual(operation.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (record.vm_state, record.power_state), (VMState.ACTIVE, PowerState.RUNNING)
        )
        vm = self.lifecycle.running.vms["vm1"]
        self.assertNotEqual(vm.pid, pid)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)

    @_async
    async def test_deletedSnapshotIsGoneWithItsFilesWhileTheVMAndOtherSnapshotsStay(
        self,
    ) -> None:
        record = await self.launch()
        for name in ("s1", "s2"):
            await self.finish(
                await self.lifecycle.act("vm1", "snapshot", snapshot=name, stateful=True)
            )
        vm = self.lifecycle.running.vms["vm1"]
        deleted = await self.lifecycle.snapshotting.delete_snapshot("vm1", "s1")
        self.assertEqual((deleted["name"], deleted["stateful"]), ("s1", True))
        self.assertEqual([s["name"] for s in self.store.snapshots.list_snapshots("vm1")], ["s2"])
        self.assertEqual(sorted(self.files(record)), ["s2/snapshot.json", "s2/state"])
        self.assertIs(self.lifecycle.running.vms["vm1"], vm)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        self.assertIn(
            ("instance-snapshot-deleted", {"snapshot": "s1"}),
            [
                (e.metadata["action"], e.metadata.get("context"))
                for e in self.events
                if e.type == "lifecycle"
            ],
        )
        self.assertEqual(
            self.store.actions.list_actions("vm1")[0].steps[0].name,
            "snapshot-delete: deleted snapshot s1",
        )
        with self.assertRaises(NotFound):
            await self.lifecycle.act("vm1", "restore", snapshot="s1")
        with self.assertRaises(NotFound):
            await self.lifecycle.snapshotting.delete_snapshot("vm1", "s1")

    async def legacy_snapshot_then_upgrade(self) -> InstanceRecord:
        await self.upgrade(LEGACY_LAYOUT)
        await self.launch()
        operation = await self.finish(
            await self.lifecycle.act("vm1", "snapshot", snapshot="old", stateful=True)
        )
        self.assertEqual(operation.error, "")
        await self.upgrade(CURRENT_LAYOUT)
        return self.lifecycle.store.view.get_instance("vm1")

    @_async
    async def test_statefulRestoreIntoANewLayoutIsRefusedBeforeAnythingChanges(self) -> None:
        record = await self.legacy_snapshot_then_upgrade()
        pid = self.lifecycle.running.vms["vm1"].pid
        files = self.files(record)
        snapshots = self.store.snapshots.list_snapshots("vm1")
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.act("vm1", "restore", snapshot="old", stateful=True)
        message = caught.exception.message
        self.assertIn("serial layout legacy (org.linuxcontainers.lxd on the agent ring", message)
        self.assertIn("would now start with layout current (com.canonical.lxd on the", message)
        self.assertIn("Restore without --stateful", message)
        self.assertIn("--force", message)
        after = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(after, record)
        self.assertEqual(self.lifecycle.running.vms["vm1"].pid, pid)
        self.assertEqual(
            await self.lifecycle.running.vms["vm1"].query_power_state(), PowerState.RUNNING
        )
        self.assertEqual(self.files(record), files)
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), snapshots)

    @_async
    async def test_forcedRestoreFailsWithQEMUsLinesAndAPersistingError(self) -> None:
        record = await self.legacy_snapshot_then_upgrade()
        files = self.files(record)
        operation = await self.finish(
            await self.lifecycle.act("vm1", "restore", snapshot="old", stateful=True, force=True)
        )
        state = os.path.join(self.snapshot_dir(record, "old"), "state")
        said = [f"{self.driver.program_name}: {line}" for line in QEMU_LINES]
        self.assertEqual(
            operation.error.splitlines(),
            [f"Failed restoring state from {state}: {said[0]}", *said[1:]],
        )
        failed = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(failed.vm_state, VMState.ERROR)
        self.assertEqual(failed.error, operation.error)
        self.assertEqual(self.files(record), files)
        self.assertEqual([s["name"] for s in self.store.snapshots.list_snapshots("vm1")], ["old"])
        # The poller never turns it into "stopped".
        await self.lifecycle.power_sync.sync_power_states()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        # A stateless restore recovers it.
        recovered = await self.finish(await self.lifecycle.act("vm1", "restore", snapshot="old"))
        self.assertEqual(recovered.error, "")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.STOPPED)
        started = await self.finish(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(started.error, "")
        self.assertEqual(
            self.lifecycle.store.view.get_instance("vm1").config[LAYOUT_KEY], "current"
        )

    @_async
    async def test_startRecoversAFailedForcedRestore(self) -> None:
        await self.legacy_snapshot_then_upgrade()
        await self.finish(
            await self.lifecycle.act("vm1", "restore", snapshot="old", stateful=True, force=True)
        )
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ERROR)
        started = await self.finish(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(started.error, "")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)

    @_async
    async def test_statelessRestoreOfALegacySnapshotWorksAfterTheUpgrade(self) -> None:
        await self.legacy_snapshot_then_upgrade()
        operation = await self.finish(await self.lifecycle.act("vm1", "restore", snapshot="old"))
        self.assertEqual(operation.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.config[LAYOUT_KEY]), (VMState.ACTIVE, "current"))


class SnapshotRefusalTests(SnapshotTestCase):
    """What is refused before a task is claimed (fakeqemu only: no hypervisor behaviour)."""

    @_async
    async def test_statefulSnapshotOfAStoppedInstanceIsRefused(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "stop", force=True))
        with self.assertRaises(Conflict):
            await self.lifecycle.act("vm1", "snapshot", snapshot="s", stateful=True)
        self.assertIsNone(self.lifecycle.store.view.get_instance("vm1").task_state)

    @_async
    async def test_duplicateSnapshotNameIsRefused(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        with self.assertRaises(Conflict):
            await self.lifecycle.act("vm1", "snapshot", snapshot="s")

    @_async
    async def test_unknownSnapshotIsNotFound(self) -> None:
        await self.launch()
        with self.assertRaises(NotFound):
            await self.lifecycle.act("vm1", "restore", snapshot="nope")

    @_async
    async def test_statefulRestoreOfAStatelessSnapshotIsABadRequest(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        with self.assertRaises(BadRequest):
            await self.lifecycle.act("vm1", "restore", snapshot="s", stateful=True)

    @_async
    async def test_badSnapshotNamesAreRefused(self) -> None:
        await self.launch()
        for name in ("", "../x", "a/b", ".", "x" * 64, 7):
            with self.assertRaises(BadRequest):
                await self.lifecycle.act("vm1", "snapshot", snapshot=name)

    @_async
    async def test_deleteRemovesTheSnapshots(self) -> None:
        record = await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s", stateful=True))
        self.assertNotEqual(self.files(record), {})
        await self.finish(await self.lifecycle.act("vm1", "delete"))
        self.assertEqual(self.files(record), {})

    @_async
    async def test_missingStateFileIsRefusedBeforeAnythingStops(self) -> None:
        record = await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s", stateful=True))
        os.unlink(os.path.join(self.snapshot_dir(record, "s"), "state"))
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.act("vm1", "restore", snapshot="s", stateful=True)
        self.assertIn("is missing", caught.exception.message)
        await _until(lambda: self.lifecycle.store.view.get_instance("vm1").task_state is None)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)


class SnapshotDeleteTests(SnapshotTestCase):
    """Deleting a snapshot: refused while a restore from it runs, precise errors otherwise."""

    @_async
    async def test_deleteIsRefusedWhileARestoreFromItRunsAndAllowedOnceItEnds(self) -> None:
        record = await self.launch()
        for name in ("s1", "other"):
            await self.finish(
                await self.lifecycle.act("vm1", "snapshot", snapshot=name, stateful=True)
            )
        files = self.files(record)
        restoring = await self.lifecycle.act("vm1", "restore", snapshot="s1", stateful=True)
        self.assertFalse(restoring.done)
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.snapshotting.delete_snapshot("vm1", "s1")
        self.assertEqual(
            caught.exception.message,
            "Cannot delete snapshot s1 of instance vm1: the instance is being restored from it",
        )
        # Another snapshot of the instance is not in use.
        await self.lifecycle.snapshotting.delete_snapshot("vm1", "other")
        operation = await self.finish(restoring)
        self.assertEqual(operation.error, "")
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        self.assertEqual(
            {path: data for path, data in self.files(record).items() if path.startswith("s1/")},
            {path: data for path, data in files.items() if path.startswith("s1/")},
        )
        await self.lifecycle.snapshotting.delete_snapshot("vm1", "s1")
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), [])
        self.assertEqual(self.files(record), {})

    @_async
    async def test_aRefusedRestoreDoesNotHoldItsSnapshot(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        with self.assertRaises(BadRequest):
            await self.lifecycle.act("vm1", "restore", snapshot="s", stateful=True)
        await self.lifecycle.snapshotting.delete_snapshot("vm1", "s")
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), [])

    @_async
    async def test_aRestoreAskedAfterTheDeleteFindsNoSnapshotAndChangesNothing(self) -> None:
        await self.launch(**{"user.role": "db"})
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        await self.lifecycle.configuring.update_config("vm1", {"user.role": "web"})
        before = self.lifecycle.store.view.get_instance("vm1")
        deleting = ensureDeferred(self.lifecycle.snapshotting.delete_snapshot("vm1", "s"))
        with self.assertRaises(NotFound):
            await self.lifecycle.act("vm1", "restore", snapshot="s")
        await deleting
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1"), before)

    @_async
    async def test_unknownSnapshotInstanceOrBadNameAreRefusedPrecisely(self) -> None:
        await self.launch()
        with self.assertRaises(NotFound) as missing:
            await self.lifecycle.snapshotting.delete_snapshot("vm1", "nope")
        self.assertEqual(missing.exception.message, "Snapshot nope of instance vm1 not found")
        with self.assertRaises(NotFound):
            await self.lifecycle.snapshotting.delete_snapshot("vm9", "s")
        for name in ("", "../x", "a/b", ".", "x" * 64):
            with self.assertRaises(BadRequest):
                await self.lifecycle.snapshotting.delete_snapshot("vm1", name)

    @_async
    async def test_theDirectoryOfAnotherInstancesSnapshotIsNeverTouched(self) -> None:
        first = await self.launch("vm1")
        second = await self.launch("vm2")
        for name in ("vm1", "vm2"):
            await self.finish(await self.lifecycle.act(name, "snapshot", snapshot="s"))
        kept = self.files(second)
        await self.lifecycle.snapshotting.delete_snapshot("vm1", "s")
        self.assertEqual(self.files(first), {})
        self.assertEqual(self.files(second), kept)
        self.assertEqual([s["name"] for s in self.store.snapshots.list_snapshots("vm2")], ["s"])


class InterruptedSnapshotTests(SnapshotTestCase):
    """A daemon that died while saving a VM's state leaves it running, and no snapshot."""

    @_async
    async def test_restartAfterAnInterruptedSnapshotResumesTheVM(self) -> None:
        await self.launch()
        await self.lifecycle.running.vms["vm1"].pause()  # as migrate leaves it
        self.store.instances.claim_task(
            "vm1", "snapshot", frozenset({VMState.ACTIVE}), TaskState.SNAPSHOTTING
        )
        await self.upgrade(CURRENT_LAYOUT)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.task_state), (VMState.ACTIVE, None))
        self.assertEqual(
            await self.lifecycle.running.vms["vm1"].query_power_state(), PowerState.RUNNING
        )
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), [])

    @_async
    async def test_restartAfterAnInterruptedRestoreIsAnErrorThatStartRecovers(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        self.store.instances.claim_task(
            "vm1", "restore", frozenset({VMState.ACTIVE}), TaskState.RESTORING
        )
        await self.upgrade(CURRENT_LAYOUT)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.ERROR)
        self.assertIn("daemon stopped during restoring", record.error or "")
        self.assertEqual([s["name"] for s in self.store.snapshots.list_snapshots("vm1")], ["s"])
        started = await self.finish(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(started.error, "")


class UnrecordedLayoutTests(SnapshotTestCase):
    """A VM started by a vmready that recorded no layout: the wiring it really has."""

    @_async
    async def test_adoptedVMWithoutARecordedLayoutIsUnrecordedAndRefusesAStatefulRestore(
        self,
    ) -> None:
        await self.upgrade(UNRECORDED_LAYOUT)  # what every earlier vmready started
        await self.launch()
        self.store.instances.update_config("vm1", {LAYOUT_KEY: None})  # and it recorded nothing
        await self.upgrade(CURRENT_LAYOUT)
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.config[LAYOUT_KEY], "unrecorded")
        self.assertEqual(
            self.lifecycle.running.vms["vm1"].spec.serial_ports, UNRECORDED_LAYOUT.ports
        )
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s", stateful=True))
        with self.assertRaises(Conflict) as caught:
            await self.lifecycle.act("vm1", "restore", snapshot="s", stateful=True)
        self.assertIn("serial layout unrecorded", caught.exception.message)


class FailedSnapshotTests(SnapshotTestCase):
    """A snapshot that fails leaves a running VM running and the instance as it was."""

    @_async
    async def test_failedStatefulSnapshotKeepsTheInstanceActiveAndRecordsNothing(self) -> None:
        record = await self.launch()
        vm = self.lifecycle.running.vms["vm1"]

        async def disk_full(path: str, timeout: float = 600.0) -> None:
            raise HypervisorError("saving the state of vm1 failed: No space left on device")

        self.patch(vm, "migrate_to_file", disk_full)
        operation = await self.finish(
            await self.lifecycle.act("vm1", "snapshot", snapshot="s", stateful=True)
        )
        self.assertIn("No space left on device", operation.error)
        after = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(
            (after.vm_state, after.task_state, after.error), (VMState.ACTIVE, None, None)
        )
        self.assertIs(self.lifecycle.running.vms["vm1"], vm)
        self.assertEqual(self.store.snapshots.list_snapshots("vm1"), [])
        self.assertEqual(self.files(record), {})
        self.assertEqual(self.store.actions.list_actions("vm1")[0].result, "error")
        self.assertIn(
            "instance-snapshot-failed",
            [e.metadata["action"] for e in self.events if e.type == "lifecycle"],
        )

    @_async
    async def test_startFromErrorKeepsAVMThatStillRunsAndIsFollowed(self) -> None:
        await self.launch()
        vm = self.lifecycle.running.vms["vm1"]
        self.store.instances.set_error("vm1", "something went wrong", PowerState.RUNNING)
        started = await self.finish(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(started.error, "")
        self.assertIs(self.lifecycle.running.vms["vm1"], vm)
        self.assertFalse(vm.gone)
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)

    @_async
    async def test_forceWithoutStatefulIsABadRequest(self) -> None:
        await self.launch()
        await self.finish(await self.lifecycle.act("vm1", "snapshot", snapshot="s"))
        with self.assertRaises(BadRequest):
            await self.lifecycle.act("vm1", "restore", snapshot="s", force=True)


class FakeqemuRename(RenameChecks):
    """Layouts on fakeqemu."""


class FakeqemuSnapshots(SnapshotChecks):
    """Snapshots on fakeqemu."""


class QemuSnapshotTestCase(SnapshotTestCase):
    """Real qemu-system-x86_64: skipped where it is missing, failed if CI requires it."""

    hypervisor = "qemu"

    def setUp(self) -> None:
        reason = REAL_QEMU.unavailable_reason()
        if reason is not None:
            cannot_run(self, f"QEMU cannot run: {reason}")
        super().setUp()


class QemuRename(QemuSnapshotTestCase, RenameChecks):
    """Layouts on real QEMU."""


class QemuSnapshots(QemuSnapshotTestCase, SnapshotChecks):
    """Snapshots on real QEMU."""


del RenameChecks, SnapshotChecks  # run only through a hypervisor
