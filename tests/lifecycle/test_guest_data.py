"""What a guest is given at boot, bounded; and a real guest whose agent never speaks, said why.

The bound on the guest-visible config (``vmready.hypervisor.guestdata``) is
checked when an instance is created and when its config changes: one line, and
nothing created or changed.  ``instance-agent-missing`` is raised for a VM of
the ``qemu`` driver whose agent had not connected ``AGENT_EXPECTED_WITHIN``
seconds after the daemon began following it, silent or only ``STARTED`` (here
a fakeqemu VM followed on a ``task.Clock``, as by a ``qemu`` driver's daemon):
a fault ``vmready info`` shows until an agent connects or the VM stops.
"""

from __future__ import annotations

import os

from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase

from tests.lifecycle.test_lifecycle import _async
from tests.lifecycle.test_ready import AgentLinkTestCase, SerialGuest
from tests.reactor import reactor
from vmready.cli.tables import info_table
from vmready.domain.model import BadRequest
from vmready.hypervisor.guestdata import MAX_GUEST_DATA
from vmready.hypervisor.noagent import AGENT_EXPECTED_WITHIN
from vmready.lifecycle.faults import FaultLog
from vmready.protocols.ringbuffer import AgentStatus

TOO_BIG = "x" * MAX_GUEST_DATA
REFUSED = b"vmready-agent: agent.key does not belong to agent.crt in /run/vmready-agent\n"
LIMIT = (
    "Invalid config: the instance's user.* and cloud-init.* keys come to 4.1 MiB, more than "
    "the 4 MiB a guest is given at boot (its NoCloud seed and config drive); make them smaller"
)


class GuestDataBoundTests(AgentLinkTestCase):
    @_async
    async def test_aLaunchWithTooMuchGuestDataIsRefusedAndCreatesNothing(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            await self.lifecycle.create("vm1", {"user.big": TOO_BIG, "user.more": "y" * 100000})
        self.assertEqual(str(caught.exception), LIMIT)
        self.assertEqual(self.lifecycle.store.view.list_instances(), [])
        self.assertFalse(os.path.exists(os.path.join(self.directory, "run")))

    @_async
    async def test_aChangePastTheBoundIsRefusedAndChangesNothing(self) -> None:
        await self.launch("vm1", **{"user.big": TOO_BIG[:-200000]})
        with self.assertRaises(BadRequest) as caught:
            await self.lifecycle.configuring.update_config(
                "vm1", {"cloud-init.user-data": "y" * 300000}
            )
        self.assertEqual(str(caught.exception), LIMIT)
        self.assertNotIn(
            "cloud-init.user-data", self.lifecycle.store.view.get_instance("vm1").config
        )

    @_async
    async def test_removingKeysIsAlwaysAllowed(self) -> None:
        await self.launch("vm1", **{"user.big": TOO_BIG[:-200000]})
        await self.lifecycle.configuring.update_config("vm1", {"user.big": None})
        self.assertNotIn("user.big", self.lifecycle.store.view.get_instance("vm1").config)


class AgentMissingTests(AgentLinkTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.lifecycle.watching.clock = self.clock  # the agent's polls and the check's timer
        self.lifecycle.watching.driver_kind = "qemu"  # as a real guest's daemon

    def faults(self) -> dict[str, str]:
        return {fault.kind: fault.message for fault in self.lifecycle.events.faults.of("vm1")}

    @_async
    async def test_aGuestWhoseAgentNeverSpeaksIsAFaultWithItsReason(self) -> None:
        await self.launch()
        with open(
            self.lifecycle.specs.spec_for(
                self.lifecycle.store.view.get_instance("vm1")
            ).console_log,
            "ab",
        ) as f:
            f.write(b"Welcome to Debian GNU/Linux 12 (bookworm)!\n")
        self.clock.advance(AGENT_EXPECTED_WITHIN - 1)
        self.assertEqual(self.faults(), {})
        self.clock.advance(1)
        self.assertIn("instance-agent-missing", self.lifecycle_actions("vm1"))
        self.assertEqual(
            self.faults(),
            {
                "agent-missing": "no agent spoke 120s into the boot: the image has neither "
                "cloud-init nor the vmready loader; use a cloud image with cloud-init (it reads "
                "the instance's NoCloud seed, whose vendor-data starts the agent), or install "
                "the vmready loader in the image (docs/real-guests.md)"
            },
        )

    def console_says(self, line: bytes) -> None:
        """The guest writes ``line`` on vm1's console (as systemd copies the agent's stderr)."""
        record = self.lifecycle.store.view.get_instance("vm1")
        with open(self.lifecycle.specs.spec_for(record).console_log, "ab") as f:
            f.write(line)

    async def agent_says(self, guest: SerialGuest, status: AgentStatus) -> None:
        """The agent says ``status``; the daemon reads it on its (fake) clock's polls."""
        guest.say(status.value.upper().encode() + b"\n")
        for _ in range(400):
            if self.lifecycle.running.agent_status("vm1") is status:
                return
            self.clock.advance(0.01)
            await deferLater(reactor, 0.01, lambda: None)
        self.fail(f"the daemon never read {status.value}")

    async def refused(self) -> None:
        """An agent whose configuration is refused: STARTED, STOPPED, its one line; it exits."""
        guest = await self.guest()
        await self.agent_says(guest, AgentStatus.STARTED)
        self.console_says(REFUSED)
        await self.agent_says(guest, AgentStatus.STOPPED)
        for port in (guest.status, guest.connect):
            assert port.transport is not None
            port.transport.loseConnection()
            await port.closed

    @_async
    async def test_anAgentThatStartsThenStopsIsAFaultWithItsConsoleLine(self) -> None:
        await self.launch()
        await self.refused()
        await self.refused()  # systemd's Restart=on-failure, and again
        self.clock.advance(AGENT_EXPECTED_WITHIN - self.clock.seconds() - 1)
        self.assertEqual(self.faults(), {})
        self.clock.advance(1)
        await self.refused()
        await self.refused()
        self.assertEqual(
            (self.lifecycle_actions("vm1").count("instance-agent-missing"), self.faults()),
            (
                1,
                {
                    "agent-missing": "the agent started but had not connected 120s into the "
                    "boot; its last word on the console: vmready-agent: agent.key does not "
                    "belong to agent.crt in /run/vmready-agent"
                },
            ),
        )

    @_async
    async def test_anAgentThatConnectsInTimeIsNoFault(self) -> None:
        await self.launch()
        guest = await self.guest()
        await self.agent_says(guest, AgentStatus.STARTED)
        self.clock.advance(3)  # its imports and its dial (AgentDeadlineTests: up to 30 s)
        await self.agent_says(guest, AgentStatus.CONNECTED)
        self.clock.advance(AGENT_EXPECTED_WITHIN)
        self.assertNotIn("instance-agent-missing", self.lifecycle_actions("vm1"))

    @_async
    async def test_anAgentThatConnectsLaterClearsTheFault(self) -> None:
        await self.launch()
        await self.refused()
        self.clock.advance(AGENT_EXPECTED_WITHIN)
        self.assertEqual(list(self.faults()), ["agent-missing"])
        # Its configuration put right and the agent restarted: it connects.
        guest = await self.guest()
        await self.agent_says(guest, AgentStatus.STARTED)
        self.assertEqual(list(self.faults()), ["agent-missing"])
        await self.agent_says(guest, AgentStatus.CONNECTED)
        self.assertEqual(self.faults(), {})

    @_async
    async def test_aStoppedVMIsNoLongerWatched(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        self.clock.advance(AGENT_EXPECTED_WITHIN)
        self.assertNotIn("instance-agent-missing", self.lifecycle_actions("vm1"))

    @_async
    async def test_fakeqemuGuestsAreNotWatched(self) -> None:
        self.lifecycle.watching.driver_kind = "fakeqemu"  # its agent is a host process, or none
        await self.launch()
        self.clock.advance(AGENT_EXPECTED_WITHIN)
        self.assertNotIn("instance-agent-missing", self.lifecycle_actions("vm1"))


class AgentMissingFaultTests(SynchronousTestCase):
    """The fault's life in the FaultLog: raised by the event, gone when an agent connects."""

    def after(self, action: str) -> list[str]:
        """The standing faults' kinds once the fault was raised and then ``action`` came."""
        log = self.raised()
        log.observe("lifecycle", 11.0, {"action": action, "source": "/1.0/instances/vm1"})
        return [f.kind for f in log.of("vm1")]

    def raised(self) -> FaultLog:
        log = FaultLog()
        log.observe(
            "lifecycle",
            10.0,
            {
                "action": "instance-agent-missing",
                "source": "/1.0/instances/vm1",
                "context": {"reason": "no agent spoke 120s into the boot: …"},
            },
        )
        return log

    def test_theEventRaisesIt(self) -> None:
        faults = self.raised().of("vm1")
        self.assertEqual(
            [(f.kind, f.message, f.since) for f in faults],
            [("agent-missing", "no agent spoke 120s into the boot: …", 10.0)],
        )

    def test_anAgentThatStartsDoesNotClearIt(self) -> None:
        # It says STARTED before it reads its configuration, which may be refused.
        self.assertEqual(self.after("instance-agent-started"), ["agent-missing"])

    def test_anAgentThatConnectsClearsIt(self) -> None:
        self.assertEqual(self.after("instance-agent-connected"), [])

    def test_aStoppedVMClearsIt(self) -> None:
        log = self.raised()
        log.observe(
            "lifecycle",
            11.0,
            {
                "action": "instance-state",
                "source": "/1.0/instances/vm1",
                "context": {"vm_state": "stopped", "power_state": "shutdown"},
            },
        )
        self.assertEqual(log.of("vm1"), [])


class AgentMissingInInfoTests(SynchronousTestCase):
    """``vmready info`` words the fault as a missing agent, not a lost link."""

    def test_theFaultsLine(self) -> None:
        instance = {
            "name": "web1",
            "uuid": "u",
            "status": "Running",
            "limits": {"memory_mib": 1024, "cpus": 2},
            "faults": [
                {"kind": "agent-missing", "message": "no agent spoke 120s …", "since": 0.0}
            ],
        }
        self.assertEqual(
            info_table(instance).splitlines()[-1],
            "Agent: none since 1970-01-01 00:00:00: no agent spoke 120s …",
        )
