"""vmready.agent.boottimes and its two console lines: the agent's boot on the guest's clock."""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.agent.test_agent_service import Harness
from vmready.agent.boottimes import BootTimeline, process_start
from vmready.agent.core import HostAddress
from vmready.agent.proxy import HostUnreachable


class TimelineTests(SynchronousTestCase):
    """Each moment is kept the first time; the line names the known ones."""

    def test_aMomentIsKeptTheFirstTime(self) -> None:
        times = iter([2.0, 3.0])
        timeline = BootTimeline(clock=lambda: next(times), started=1.25)
        self.assertEqual((timeline.mark("STARTED"), timeline.mark("STARTED")), (True, False))
        self.assertEqual(
            timeline.line("process", "STARTED"), "boot: process [1.25] STARTED [2.00]"
        )

    def test_unknownMomentsAreLeftOut(self) -> None:
        timeline = BootTimeline(clock=lambda: 4.0)
        timeline.mark("CONNECTED")
        self.assertEqual(timeline.line("CONNECT", "CONNECTED"), "boot: CONNECTED [4.00]")

    def test_processStartIsReadFromStatAfterTheCommandName(self) -> None:
        fd, path = tempfile.mkstemp()
        self.addCleanup(os.unlink, path)
        ticks = os.sysconf("SC_CLK_TCK")
        fields = ["S"] + ["0"] * 18 + [str(321 * ticks)] + ["0"] * 30
        with os.fdopen(fd, "w") as f:
            f.write("77 (python3 ) 1 2) " + " ".join(fields) + "\n")
        self.assertEqual(process_start(path), 321.0)

    def test_processStartIsNoneWhereStatCannotBeRead(self) -> None:
        self.assertIsNone(process_start("/nonexistent/stat"))

    def test_thisProcessStartedBeforeNow(self) -> None:
        started = process_start()
        assert started is not None
        self.assertLess(started, BootTimeline().clock())


class AgentLinesTests(SynchronousTestCase):
    """The agent says its first STARTED and its first CONNECTED with their times, once."""

    def test_firstStartedAndFirstConnectedAreDated(self) -> None:
        harness = Harness(self)
        times = iter([2.0, 3.0, 4.0, 5.0])
        harness.agent.timeline = BootTimeline(clock=lambda: next(times), started=1.5)

        async def scenario() -> Any:
            await harness.start()
            await harness.connect()

        with self.assertLogs("vmready.agent.service") as logged:
            harness.run(scenario)
        boot = [r.getMessage() for r in logged.records if r.getMessage().startswith("boot:")]
        self.assertEqual(
            boot, ["boot: process [1.50] STARTED [2.00]", "boot: CONNECT [3.00] CONNECTED [4.00]"]
        )

    def test_aReadyKeptUntilTheLinkIsDatedWhenTheHostHasIt(self) -> None:
        # The workload may declare Ready before CONNECTED: kept, delivered on the link.
        harness = Harness(self)
        times = itertools.count(1.0)
        harness.agent.timeline = BootTimeline(clock=lambda: next(times))
        delivered: list[str] = []

        async def deliver(address: HostAddress, state: str) -> None:
            delivered.append(state)

        harness.agent.deliver = deliver

        async def scenario() -> None:
            self.assertRaises(HostUnreachable, harness.agent.route)  # relay [1.00]
            harness.agent.hold_state("Ready")
            await harness.start()  # STARTED [2.00]
            await harness.connect()  # CONNECT [3.00] CONNECTED [4.00], then the delivery

        with self.assertLogs("vmready.agent.service") as logged:
            harness.run(scenario)
        boot = [r.getMessage() for r in logged.records if r.getMessage().startswith("boot:")]
        self.assertEqual((delivered, boot[-1]), (["Ready"], "boot: relay [1.00] Ready [5.00]"))

    def test_theFirstReadyTheHostAcceptedIsDatedWithTheFirstRelayedRequest(self) -> None:
        harness = Harness(self)
        times = iter([7.0, 8.0])
        harness.agent.timeline = BootTimeline(clock=lambda: next(times))
        harness.agent.timeline.marks["CONNECTED"] = 6.0
        with self.assertLogs("vmready.agent.service") as logged:
            # No link yet: the request is refused, and dated all the same.
            self.assertRaises(HostUnreachable, harness.agent.route)
            harness.agent.remember_state("Ready")
            harness.agent.remember_state("Ready")
        boot = [r.getMessage() for r in logged.records if r.getMessage().startswith("boot:")]
        self.assertEqual(boot, ["boot: relay [7.00] Ready [8.00]"])
