"""vmready.lifecycle.agentdeadline: a real guest's agent that has not connected, said once.

Each test follows one VM on a ``task.Clock`` and announces its agent's
status changes as the daemon does (``heard``, then ``instance-agent-<status>``
on the bus, whose ``FaultLog`` keeps the faults), and looks at what a watcher
of the events and ``vmready info`` see.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from vmready.hypervisor import AGENT_CONNECT_WITHIN, AGENT_EXPECTED_WITHIN
from vmready.lifecycle.agentdeadline import AgentDeadline
from vmready.lifecycle.events import Event, EventBus
from vmready.protocols import AgentStatus

REFUSED = b"vmready-agent: agent.key does not belong to agent.crt in /run/vmready-agent\n"
STARTED, CONNECTED, STOPPED = AgentStatus.STARTED, AgentStatus.CONNECTED, AgentStatus.STOPPED


class AgentDeadlineTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)  # the daemon has run a while when the VM starts
        self.bus = EventBus(self.clock.seconds)
        self.events: list[Event] = []
        self.bus.subscribe(self.events.append)
        self.console = self.mktemp()
        with open(self.console, "wb") as f:
            f.write(b"\n--- vmready: starting vm1 ---\nWelcome to Debian GNU/Linux 12!\n")
        self.running = True
        self.deadline = AgentDeadline(
            "vm1", self.clock, self.bus, self.console, lambda: self.running
        )
        self.deadline.start()

    def at(self, seconds: float) -> None:
        """Move the clock to ``seconds`` after the VM began to be followed."""
        self.clock.advance(1000 + seconds - self.clock.seconds())

    def say(self, status: AgentStatus) -> None:
        """The agent's status changes, announced as the daemon announces it."""
        self.deadline.heard(status)
        self.bus.lifecycle(f"instance-agent-{status.value}", "vm1")

    def console_says(self, line: bytes) -> None:
        with open(self.console, "ab") as f:
            f.write(line)

    def missing(self) -> list[str]:
        """The reasons of the ``instance-agent-missing`` events so far."""
        return [
            e.metadata["context"]["reason"]
            for e in self.events
            if e.metadata.get("action") == "instance-agent-missing"
        ]

    def faults(self) -> dict[str, str]:
        return {fault.kind: fault.message for fault in self.bus.faults.of("vm1")}

    def flap(self, start: float, until: float) -> None:
        """STARTED, its configuration refused, STOPPED; systemd restarts it 2 s later."""
        when = start
        while when < until:
            self.at(when)
            self.say(STARTED)
            self.console_says(REFUSED)
            self.at(when + 4)
            self.say(STOPPED)
            when += 6

    def test_anAgentNeverHeardIsMissingWhenTheWindowEnds(self) -> None:
        self.at(AGENT_EXPECTED_WITHIN - 1)
        self.assertEqual(self.missing(), [])
        self.at(AGENT_EXPECTED_WITHIN)
        self.assertEqual(
            self.missing(),
            [
                "no agent spoke 120s into the boot: the image has neither cloud-init nor the "
                "vmready loader; use a cloud image with cloud-init (it reads the instance's "
                "NoCloud seed, whose vendor-data starts the agent), or install the vmready "
                "loader in the image (docs/real-guests.md)"
            ],
        )

    def test_anAgentStartedThenStoppedIsMissingWithItsConsoleLine(self) -> None:
        self.flap(5, 10)
        self.at(AGENT_EXPECTED_WITHIN)
        expected = (
            "the agent started but had not connected 120s into the boot; its last word on the "
            "console: vmready-agent: agent.key does not belong to agent.crt in /run/vmready-agent"
        )
        self.assertEqual(self.missing(), [expected])
        self.assertEqual(self.faults(), {"agent-missing": expected})

    def test_aFlappingAgentIsOneFaultThatStands(self) -> None:
        # Restart=on-failure: STARTED, STOPPED every 6 s, before the window ends and long after.
        self.flap(5, AGENT_EXPECTED_WITHIN)
        standing = set()
        for start in range(int(AGENT_EXPECTED_WITHIN) + 6, 600, 6):
            self.flap(start, start + 1)
            standing.add(tuple(self.faults()))
        self.assertEqual((len(self.missing()), standing), (1, {("agent-missing",)}))

    def test_anAgentThatConnectsInTimeIsNoFault(self) -> None:
        # The first STARTED before its imports, one after them (12 s under load), then CONNECTED.
        self.at(20)
        self.say(STARTED)
        self.at(35)
        self.say(CONNECTED)
        self.at(3600)
        self.assertEqual((self.missing(), self.faults()), ([], {}))

    def test_anAgentFirstHeardLateIsGivenTimeToConnect(self) -> None:
        self.at(AGENT_EXPECTED_WITHIN - 5)
        self.say(STARTED)
        self.at(AGENT_EXPECTED_WITHIN - 5 + AGENT_CONNECT_WITHIN - 1)
        self.say(CONNECTED)
        self.at(3600)
        self.assertEqual(self.missing(), [])

    def test_anAgentFirstHeardLateIsJudgedWhenItsTimeIsUp(self) -> None:
        self.flap(AGENT_EXPECTED_WITHIN - 5, AGENT_EXPECTED_WITHIN + 1)
        self.assertEqual(self.missing(), [])
        self.flap(AGENT_EXPECTED_WITHIN + 1, AGENT_EXPECTED_WITHIN + AGENT_CONNECT_WITHIN - 6)
        self.at(AGENT_EXPECTED_WITHIN - 5 + AGENT_CONNECT_WITHIN)
        self.assertEqual(
            self.missing(),
            [
                "the agent started but had not connected 145s into the boot; its last word on "
                "the console: vmready-agent: agent.key does not belong to agent.crt in "
                "/run/vmready-agent"
            ],
        )

    def test_anAgentHeardAfterTheFaultIsJudgedAgainInItsOwnWords(self) -> None:
        self.at(AGENT_EXPECTED_WITHIN)
        self.flap(AGENT_EXPECTED_WITHIN + 10, 600)
        first, second = self.missing()
        self.assertTrue(first.startswith("no agent spoke 120s into the boot: the image has"))
        self.assertEqual(
            (second, self.faults()),
            (
                "the agent started but had not connected 160s into the boot; its last word on "
                "the console: vmready-agent: agent.key does not belong to agent.crt in "
                "/run/vmready-agent",
                {"agent-missing": second},
            ),
        )

    def test_aConnectionClearsTheFault(self) -> None:
        self.flap(5, AGENT_EXPECTED_WITHIN + 10)
        self.say(STARTED)
        self.assertEqual(list(self.faults()), ["agent-missing"])
        self.say(CONNECTED)
        self.at(3600)
        self.assertEqual((len(self.missing()), self.faults()), (1, {}))

    def test_aStartedAgentWithNoLineOfItsOwnSaysWhereToLook(self) -> None:
        self.at(5)
        self.say(STARTED)
        self.at(AGENT_EXPECTED_WITHIN)
        self.assertEqual(
            self.missing(),
            [
                "the agent started but had not connected 120s into the boot, and wrote no "
                "line of its own on the console: its log in the guest says why "
                "(docs/agent.md, troubleshooting)"
            ],
        )

    def test_aVMThatNoLongerRunsIsNotJudged(self) -> None:
        self.running = False
        self.at(3600)
        self.assertEqual(self.missing(), [])

    def test_aCancelledDeadlineIsNotJudged(self) -> None:
        self.flap(5, 20)
        self.deadline.cancel()
        self.at(3600)
        self.assertEqual((self.missing(), self.clock.getDelayedCalls()), ([], []))
