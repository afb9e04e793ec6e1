"""pylxd 2.4, unchanged, against ``twistd vmready`` with fakeqemu VMs.

The same client object is used across actions, as a pylxd program does:
each call must leave the instance as it says and the object usable.
"""

from __future__ import annotations

import time
from typing import Any

from pylxd.models.instance import Instance
from twisted.trial.unittest import SynchronousTestCase

from tests.lxdclients.support import EventSocket, pylxd_client
from tests.system import DEADLINE, System

EMPTY_VM = {"name": "c1", "type": "virtual-machine", "source": {"type": "none"}}


class PylxdTestCase(SynchronousTestCase):
    """A daemon, and a pylxd client on its socket."""

    def setUp(self) -> None:
        self.system = System(self)
        self.system.start_daemon()
        self.client = pylxd_client(self.system)

    def create(self, **fields: Any) -> Instance:
        """``instances.create(wait=True)`` of an empty VM (stopped, as LXD creates it)."""
        instance: Instance = self.client.instances.create({**EMPTY_VM, **fields}, wait=True)
        return instance

    def assertSyncedStatus(self, instance: Instance, status: str) -> None:
        """After ``sync()``, the object shows ``status``."""
        instance.sync()
        self.assertEqual(instance.status, status)


class InstanceTests(PylxdTestCase):
    """``instances.all/get/exists/create``, config saves, rename, delete."""

    def test_createGetAllExists(self) -> None:
        created = self.create()
        self.assertEqual((created.name, created.status), ("c1", "Stopped"))
        self.assertEqual([i.name for i in self.client.instances.all()], ["c1"])
        self.assertEqual(self.client.instances.get("c1").status, "Stopped")
        self.assertTrue(self.client.instances.exists("c1"))
        self.assertFalse(self.client.instances.exists("c2"))

    def test_configSaveWaits(self) -> None:
        instance = self.create()
        instance.config["user.role"] = "web"
        instance.save(wait=True)
        self.assertEqual(self.client.instances.get("c1").config["user.role"], "web")
        self.assertEqual(self.system.info("c1")["config"]["user.role"], "web")

    def test_rename(self) -> None:
        instance = self.create()
        instance.rename("c2", wait=True)
        self.assertEqual([i.name for i in self.client.instances.all()], ["c2"])

    def test_deleteWaits(self) -> None:
        instance = self.create()
        instance.delete(wait=True)
        self.assertFalse(self.client.instances.exists("c1"))


class PowerTests(PylxdTestCase):
    """start/stop/restart/freeze/unfreeze on one object, several times over."""

    def test_sameObjectStartsAndStopsSeveralTimes(self) -> None:
        instance = self.create()
        for _ in range(3):
            instance.start(wait=True)
            self.assertSyncedStatus(instance, "Running")
            instance.stop(wait=True)
            self.assertSyncedStatus(instance, "Stopped")
        self.assertEqual(self.system.listed_status("c1"), "STOPPED")

    def test_restartFreezeUnfreeze(self) -> None:
        instance = self.create()
        instance.start(wait=True)
        instance.restart(wait=True)
        instance.freeze(wait=True)
        self.assertSyncedStatus(instance, "Frozen")
        instance.unfreeze(wait=True)
        self.assertSyncedStatus(instance, "Running")


class SnapshotTests(PylxdTestCase):
    """``snapshots.create/get/all/delete`` and ``restore_snapshot``."""

    def test_snapshotsCreateGetAllDelete(self) -> None:
        instance = self.create()
        instance.snapshots.create("s1", wait=True)
        instance.snapshots.create("s2", wait=True)
        self.assertEqual([s.name for s in instance.snapshots.all()], ["s1", "s2"])
        self.assertEqual(instance.snapshots.get("s1").stateful, False)
        instance.snapshots.get("s1").delete(wait=True)
        self.assertEqual([s.name for s in instance.snapshots.all()], ["s2"])

    def test_restoreSnapshot(self) -> None:
        instance = self.create(config={"user.v": "1"})
        instance.snapshots.create("s1", wait=True)
        instance.config["user.v"] = "2"
        instance.save(wait=True)
        instance.restore_snapshot("s1", wait=True)
        self.assertEqual(self.client.instances.get("c1").config["user.v"], "1")


class EventAndOperationTests(PylxdTestCase):
    """``client.events()`` (the WebSocket) and ``operations.get``."""

    def test_eventsDeliverReadyAndAgentEvents(self) -> None:
        events = EventSocket(self.client)
        self.addCleanup(events.close)
        self.create().start(wait=True)
        self.system.start_agent("c1")
        self.system.cli("wait", "c1", "agent", "--timeout", "30")
        notified = self.system.notify("c1")
        self.assertEqual(notified.returncode, 0, notified.stderr)
        deadline = time.monotonic() + DEADLINE
        while "instance-ready" not in events.actions("c1") and time.monotonic() < deadline:
            time.sleep(0.05)
        actions = events.actions("c1")
        self.assertIn("instance-ready", actions)
        self.assertIn("instance-agent-connected", actions)
        self.assertLess(actions.index("instance-agent-connected"), actions.index("instance-ready"))

    def test_operationsGet(self) -> None:
        response = self.client.api.instances.post(json=EMPTY_VM)
        operation_id = response.json()["operation"].rsplit("/", 1)[-1]
        self.client.operations.wait_for_operation(operation_id)
        operation = self.client.operations.get(operation_id)
        self.assertEqual(
            (operation.status, operation.description), ("Success", "Creating instance c1")
        )
