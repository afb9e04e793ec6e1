"""The virtio-rng device every VM gets, and the VMs and saved states from before it.

A vmready before the device started VMs without one and recorded neither the
device nor its absence.  Such a VM keeps running as it is across the upgrade;
a stateful snapshot of it (or one an older vmready took) restores into a VM
without the device, since QEMU loads a state only into the devices it was
saved from; the next boot gives the VM the device.  The same checks run on
fakeqemu and on real QEMU.
"""

from __future__ import annotations

from typing import Any

from twisted.python.monkey import MonkeyPatcher
from twisted.trial.unittest import SynchronousTestCase

from tests.hypervisor.test_snapshots import QemuSnapshotTestCase, SnapshotTestCase
from tests.lifecycle.test_lifecycle import _async
from vmready.domain.model import InstanceRecord
from vmready.domain.states import VMState
from vmready.hypervisor import saved_rng, state_mismatch
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.specs import RNG_KEY

RNG_DEVICE = "virtio-rng-pci"


class RngChecks(SnapshotTestCase):
    """New VMs get the device; VMs and states from before it keep going without it."""

    @_async
    async def test_newVMsGetTheDeviceRecorded(self) -> None:
        record = await self.launch()
        self.assertEqual(record.config[RNG_KEY], "true")
        self.assertIn(RNG_DEVICE, self.command_line(record))
        self.assertTrue(self.lifecycle.specs.spec_for(record).device_set()["rng"])

    @_async
    async def test_aVMFromBeforeTheDeviceRestoresItsStateWithoutItThenBootsWithIt(self) -> None:
        record = await self.started_by_an_older_vmready()
        self.assertNotIn(RNG_DEVICE, self.command_line(record))
        self.assertFalse(self.lifecycle.specs.spec_for(record).device_set()["rng"])
        snapshot = await self.finish(
            await self.lifecycle.act("vm1", "snapshot", snapshot="before", stateful=True)
        )
        self.assertEqual(snapshot.error, "")
        restored = await self.finish(
            await self.lifecycle.act("vm1", "restore", snapshot="before", stateful=True)
        )
        self.assertEqual(restored.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual((record.vm_state, record.config[RNG_KEY]), (VMState.ACTIVE, "false"))
        self.assertNotIn(RNG_DEVICE, self.command_line(record))
        # Its next boot is a new VM's.
        restarted = await self.finish(await self.lifecycle.act("vm1", "restart", force=True))
        self.assertEqual(restarted.error, "")
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.config[RNG_KEY], "true")
        self.assertIn(RNG_DEVICE, self.command_line(record))

    async def started_by_an_older_vmready(self) -> InstanceRecord:
        """vm1 running without the device, as a vmready before it left it, and adopted."""
        launch = Booting.launch

        def without_rng(booting: Booting, record: InstanceRecord, *args: Any, **kw: Any) -> Any:
            return launch(booting, record, *args, **{**kw, "rng": False})

        older = MonkeyPatcher((Booting, "launch", without_rng))
        older.patch()
        try:
            await self.launch()
        finally:
            older.restore()
        self.store.instances.update_config("vm1", {RNG_KEY: None})  # it recorded nothing
        await self.upgrade()
        return self.lifecycle.store.view.get_instance("vm1")


class FakeqemuRng(RngChecks):
    """On fakeqemu."""


class QemuRng(QemuSnapshotTestCase, RngChecks):
    """On real QEMU."""


class SavedDeviceSetTests(SynchronousTestCase):
    """What a saved state's recorded device set says of the rng device."""

    NOW = {"machine": "q35", "accel": "tcg", "rng": True}

    def test_aSetRecordedBeforeTheDeviceHadNone(self) -> None:
        older = {"machine": "q35", "accel": "tcg"}
        self.assertFalse(saved_rng(older))
        self.assertIsNone(state_mismatch(older, {**self.NOW, "rng": False}))
        self.assertEqual(
            state_mismatch(older, self.NOW), "virtio-rng device absent then, present now"
        )

    def test_aSetRecordedWithTheDevice(self) -> None:
        self.assertTrue(saved_rng(self.NOW))
        self.assertIsNone(state_mismatch(self.NOW, self.NOW))
        self.assertEqual(
            state_mismatch(self.NOW, {**self.NOW, "rng": False}),
            "virtio-rng device present then, absent now",
        )


del RngChecks  # run only through a hypervisor
