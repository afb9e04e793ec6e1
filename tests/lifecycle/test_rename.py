"""Renaming an instance against real fakeqemu VMs: its VM, agent, Ready and snapshots follow."""

from __future__ import annotations

import json
import os

from tests.lifecycle.test_lifecycle import _async
from tests.lifecycle.test_ready import AgentLinkTestCase
from vmready.domain.model import BadRequest, Conflict, NotFound, VMReadyError
from vmready.domain.states import PowerState, VMState
from vmready.protocols.ringbuffer import AgentStatus
from vmready.trust.certs import fingerprint


class RenameTests(AgentLinkTestCase):
    async def refused(self, name: str, new_name: str, kind: type[VMReadyError]) -> VMReadyError:
        """The error ``rename`` raises, before any operation exists."""
        try:
            await self.lifecycle.renaming.rename(name, new_name)
        except kind as e:
            return e
        raise AssertionError(f"rename {name} {new_name} was not refused")

    @_async
    async def test_aRenamedInstanceBootsIsRecognisedGetsReadyAndRestoresItsSnapshots(self) -> None:
        await self.launch("vm1", **{"user.role": "db"})
        await self.connected_guest("vm1")
        await self.wait(
            await self.lifecycle.act("vm1", "snapshot", snapshot="warm", stateful=True)
        )
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        before = self.lifecycle.store.view.get_instance("vm1")
        with open(os.path.join(self.lifecycle.specs.config_drive(before), "agent.crt"), "rb") as f:
            certificate = f.read()

        operation = await self.wait(await self.lifecycle.renaming.rename("vm1", "web1"))

        self.assertEqual(operation.error, "")
        self.assertIsNone(self.store.instances.find_instance("vm1"))
        record = self.lifecycle.store.view.get_instance("web1")
        self.assertEqual((record.uuid, record.vm_state), (before.uuid, VMState.STOPPED))
        self.assertEqual(self.lifecycle_actions("web1"), ["instance-renamed"])
        renamed = [e for e in self.events if e.metadata.get("action") == "instance-renamed"]
        self.assertEqual(renamed[0].metadata["context"], {"old_name": "vm1"})
        self.assertEqual(
            [s["name"] for s in self.store.snapshots.list_snapshots("web1")], ["warm"]
        )
        history = [action.action for action in self.store.actions.list_actions("web1")]
        self.assertEqual(history[0], "rename")
        self.assertIn("create", history)  # the history before the rename is still its own
        found = self.store.certificates.instance_for_fingerprint(fingerprint(certificate))
        self.assertEqual(found.name if found else None, "web1")

        await self.wait(await self.lifecycle.act("web1", "start"))
        with open(os.path.join(self.lifecycle.specs.config_drive(record), "agent.json")) as f:
            self.assertEqual(json.load(f)["instance"], "web1")
        await self.connected_guest("web1")
        self.assertIs(self.lifecycle.running.agent_status("web1"), AgentStatus.CONNECTED)
        self.assertTrue((await self.lifecycle.guestside.set_ready("web1", True)).ready)

        restored = await self.wait(
            await self.lifecycle.act("web1", "restore", snapshot="warm", stateful=True)
        )
        self.assertEqual(restored.error, "")
        after = self.lifecycle.store.view.get_instance("web1")
        self.assertEqual(
            (after.vm_state, after.power_state, after.config["user.role"]),
            (VMState.ACTIVE, PowerState.RUNNING, "db"),
        )

    @_async
    async def test_aRunningInstanceIsNotRenamed(self) -> None:
        await self.launch("vm1")
        error = await self.refused("vm1", "web1", Conflict)
        self.assertEqual(
            error.message,
            "Cannot rename instance vm1: it is running; only a stopped instance can be renamed",
        )
        self.assertIsNotNone(self.store.instances.find_instance("vm1"))

    @_async
    async def test_aTakenOrBadNameOrAnUnknownInstanceIsRefusedBeforeAnOperation(self) -> None:
        await self.launch("vm1")
        await self.launch("vm2")
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        taken = await self.refused("vm1", "vm2", Conflict)
        self.assertEqual(taken.message, "Cannot rename vm1 to vm2: instance vm2 exists")
        bad = await self.refused("vm1", "2bad", BadRequest)
        self.assertIn("Invalid instance name '2bad'", bad.message)
        await self.refused("nope", "web1", NotFound)
        self.assertEqual(self.lifecycle.operations.list()[-1].description, "Stop instance vm1")

    @_async
    async def test_standingFaultsFollowTheNewName(self) -> None:
        await self.launch("vm1")
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        self.lifecycle.events.lifecycle(
            "instance-certificate-error", "vm1", {"error": "agent.crt: Permission denied"}
        )
        await self.wait(await self.lifecycle.renaming.rename("vm1", "web1"))
        faults = self.lifecycle.events.faults
        self.assertEqual([f.kind for f in faults.of("web1")], ["certificate"])
        self.assertEqual(faults.of("vm1"), [])
