"""Tests for vmready.lifecycle.agenthistory: the agent link's recent changes per instance."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests.lifecycle.test_lifecycle import _async, _until
from tests.lifecycle.test_ready import AgentLinkTestCase
from tests.reactor import reactor
from vmready.lifecycle.agenthistory import DEFAULT_HISTORY_LENGTH, AgentHistory, LinkChange
from vmready.protocols.ringbuffer import AgentStatus

LOST = "lost: the agent said nothing for 15.0s (no heartbeat)"


class AgentHistoryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.history = AgentHistory(length=3)

    def test_changesAreKeptOldestFirstWithTimesAndReasons(self) -> None:
        changes = [
            LinkChange("started", 10.0),
            LinkChange("connected", 11.5),
            LinkChange("stopped", 40.0, LOST),
        ]
        for change in changes:
            self.history.record("vm1", change)
        self.assertEqual(self.history.of("vm1"), changes)

    def test_onlyTheLastChangesAreKept(self) -> None:
        for at, status in enumerate(["started", "connected", "stopped", "started", "connected"]):
            self.history.record("vm1", LinkChange(status, float(at)))
        self.assertEqual(
            [(change.status, change.at) for change in self.history.of("vm1")],
            [("stopped", 2.0), ("started", 3.0), ("connected", 4.0)],
        )

    def test_theDefaultLengthBoundsAFlappingLink(self) -> None:
        history = AgentHistory()
        for at in range(1000):
            history.record("vm1", LinkChange("started" if at % 2 else "stopped", float(at)))
        changes = history.of("vm1")
        self.assertEqual(len(changes), DEFAULT_HISTORY_LENGTH)
        self.assertEqual(changes[0], LinkChange("stopped", 990.0))
        self.assertEqual(changes[-1], LinkChange("started", 999.0))

    def test_eachInstanceHasItsOwnHistory(self) -> None:
        self.history.record("vm1", LinkChange("started", 1.0))
        self.history.record("vm2", LinkChange("connected", 2.0))
        self.assertEqual(self.history.of("vm1"), [LinkChange("started", 1.0)])
        self.assertEqual(self.history.of("vm2"), [LinkChange("connected", 2.0)])
        self.assertEqual(self.history.of("vm3"), [])

    def test_aForgottenInstanceStartsAfresh(self) -> None:
        self.history.record("vm1", LinkChange("started", 1.0))
        self.history.record("vm2", LinkChange("started", 1.0))
        self.history.forget("vm1")
        self.history.forget("never-seen")
        self.assertEqual(self.history.of("vm1"), [])
        self.assertEqual(self.history.of("vm2"), [LinkChange("started", 1.0)])
        self.history.record("vm1", LinkChange("connected", 3.0))
        self.assertEqual(self.history.of("vm1"), [LinkChange("connected", 3.0)])

    def test_theCallerGetsACopy(self) -> None:
        self.history.record("vm1", LinkChange("started", 1.0))
        self.history.of("vm1").clear()
        self.assertEqual(len(self.history.of("vm1")), 1)

    def test_aHistoryKeepsAtLeastOneChange(self) -> None:
        self.assertRaises(ValueError, AgentHistory, 0)


class AgentHistoryLifecycleTests(AgentLinkTestCase):
    """The history a real agent link leaves, against fakeqemu VMs and a serial agent."""

    def history(self, name: str = "vm1") -> list[tuple[str, str | None]]:
        return [(change.status, change.reason) for change in self.lifecycle.agent_history.of(name)]

    @_async
    async def test_aStartedAgentThatFallsSilentIsLostThenBack(self) -> None:
        self.guest_api_listens(self.lifecycle, silence_timeout=0.5, safety=0.2)
        before = reactor.seconds()
        await self.launch()
        guest = await self.connected_guest()
        self.assertEqual(self.history(), [("started", None), ("connected", None)])
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        [(status, reason)] = self.history()[2:]
        self.assertEqual(status, "stopped")
        assert reason is not None
        self.assertRegex(reason, r"^lost: the agent said nothing for [0-9.]+s \(no heartbeat\)$")
        guest.say(b"STARTED\n")  # it wakes up and starts over
        await _until(lambda: len(self.history()) == 4)
        self.assertEqual(self.history()[3], ("started", None))
        times = [change.at for change in self.lifecycle.agent_history.of("vm1")]
        self.assertEqual(times, sorted(times))
        self.assertLessEqual(before, times[0])

    @_async
    async def test_aKilledAgentIsLostAndAStoppedVMSaysSo(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        for port in (guest.status, guest.connect):  # SIGKILL: both its ports close
            port.transport.loseConnection()  # type: ignore[union-attr]
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.STOPPED)
        self.assertEqual(
            self.history()[-1], ("stopped", "lost: the agent closed its port without STOPPED")
        )
        # Each change at its event's time; the events themselves say no more than before.
        agent_events = [
            event
            for event in self.events
            if str(event.metadata.get("action")).startswith("instance-agent-")
        ]
        self.assertEqual(
            [event.timestamp for event in agent_events],
            [change.at for change in self.lifecycle.agent_history.of("vm1")],
        )
        self.assertEqual(
            agent_events[-1].metadata["context"], {"status": "stopped", "previous": "connected"}
        )
        await guest.closed
        await guest.connect.closed
        await self.connected_guest()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))
        self.assertEqual(
            self.history()[-3:],
            [("started", None), ("connected", None), ("stopped", "its VM stopped")],
        )

    @_async
    async def test_anAdoptedVMsAgentIsSentCONNECTAgainAndTheHistorySaysSo(self) -> None:
        await self.launch()
        guest = await self.connected_guest()
        await self.lifecycle.shutdown()  # the daemon stops; the VM and its agent run on
        self.lifecycle = self.new_lifecycle()
        self.assertEqual(self.history(), [])  # a new daemon knows no history
        await self.lifecycle.recovery.recover()
        guest.say(b"STARTED\n")  # its link to the old daemon is gone: it starts over
        await _until(lambda: self.history() != [])
        self.assertEqual(self.history()[0][1], "the VM was adopted; CONNECT advertised again")
        guest.say(b"CONNECTED\n")
        await _until(lambda: self.lifecycle.running.agent_status("vm1") is AgentStatus.CONNECTED)
        self.assertEqual(self.history()[-1], ("connected", None))

    @_async
    async def test_deletingTheInstanceDropsItsHistory(self) -> None:
        await self.launch()
        await self.connected_guest()
        self.assertNotEqual(self.history(), [])
        await self.wait(await self.lifecycle.act("vm1", "delete"))
        self.assertEqual(self.history(), [])
