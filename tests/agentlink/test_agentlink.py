"""Tests for vmready.agentlink.link: when the host reads (events first), and the handshake."""

from __future__ import annotations

from typing import cast

from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase

from vmready.agentlink.link import AgentLink, Command, PollIntervals, StatusChanged, WriteConnect
from vmready.protocols.ringbuffer import AgentStatus, Noise

INTERVALS = PollIntervals(
    follow_up=0.05,
    follow_up_window=10.0,
    agentless_first=1.0,
    safety=120.0,
    reopen_grace=1.0,
    silence_timeout=15.0,
)
CONNECT = WriteConnect(b"CONNECT 2:49152\n")


def read(agent: AgentLink, chunk: bytes, now: float) -> list[Command]:
    """One ringbuf-read as the monitor does it: announced, then its answer."""
    agent.read_started()
    return agent.ring_read(chunk, now)


def link() -> AgentLink:
    return AgentLink("vm1", ring_size=4096, port=49152, intervals=INTERVALS)


def connected(now: float = 1.0) -> AgentLink:
    """A link whose agent opened its port, said STARTED, got CONNECT and said CONNECTED."""
    agent = link()
    agent.vm_started(advertise=False)
    read(agent, b"", now=0)
    agent.port_changed(True, now=0)
    read(agent, b"STARTED\n", now=0)
    agent.connect_written(now=0)
    read(agent, b"CONNECTED\n", now=now)
    return agent


class PollingTests(SynchronousTestCase):
    """When the ring buffer is read: on events, and otherwise only slowly."""

    def test_noReadsWhileTheVMIsNotRunning(self) -> None:
        agent = link()
        self.assertIsNone(agent.next_poll_delay())
        agent.vm_started()
        agent.vm_stopped()
        self.assertIsNone(agent.next_poll_delay())
        agent.port_changed(True, now=5)  # a late event of the gone VM
        self.assertIsNone(agent.next_poll_delay())

    def test_readAtOnceWhenTheVMStartsAndAfterEveryQMPEvent(self) -> None:
        agent = connected()
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)
        agent.qmp_event()
        self.assertEqual(agent.next_poll_delay(), 0.0)
        agent.vm_started(advertise=False)
        self.assertEqual(agent.next_poll_delay(), 0.0)

    def test_aConnectedAgentIsReadOnlyOnEventsAndBySafety(self) -> None:
        agent = connected()
        for now in (2.0, 122.0, 242.0):
            self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)
            self.assertEqual(read(agent, b"CONNECTED\n" * 24, now=now), [])
        agent.port_changed(False, now=300)  # a pulse: closed …
        self.assertEqual(agent.next_poll_delay(), 0.0)
        read(agent, b"CONNECTED\n", now=300)
        agent.port_changed(True, now=300)  # … and reopened: maybe another agent, followed up
        self.assertEqual(agent.next_poll_delay(), 0.0)
        read(agent, b"", now=300)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.follow_up)
        read(agent, b"CONNECTED\n", now=300.05)  # its next line: the follow-up ends
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_followUpsAfterConnectUntilConnected(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=0)
        agent.connect_written(now=0)
        self.assertTrue(agent.connect_outstanding)
        delays = []
        for now in (0.05, 0.15, 0.35):
            delays.append(agent.next_poll_delay())
            read(agent, b"", now=now)
        self.assertEqual(delays, [0.05, 0.1, 0.2])
        self.assertEqual(agent.next_poll_delay(), 0.4)
        read(agent, b"CONNECTED\n", now=0.75)
        self.assertFalse(agent.connect_outstanding)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_followUpsEndAfterTheirWindow(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=0)
        agent.connect_written(now=0)
        now = 0.0
        reads = 0
        while agent.connect_outstanding:
            delay = agent.next_poll_delay()
            assert delay is not None
            now += delay
            read(agent, b"", now=now)
            reads += 1
        self.assertGreaterEqual(now, INTERVALS.follow_up_window)
        self.assertLessEqual(reads, 9)  # 0.05 doubling: a handful of reads, not 200
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_aPortOpenedWithNothingInItYetIsFollowedUp(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"", now=0)
        agent.port_changed(True, now=8)  # the agent opened its port, and wrote nothing yet
        self.assertEqual(agent.next_poll_delay(), 0.0)
        read(agent, b"", now=8)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.follow_up)
        read(agent, b"", now=8.05)
        self.assertEqual(agent.next_poll_delay(), 2 * INTERVALS.follow_up)
        self.assertEqual(read(agent, b"STARTED\n", now=8.15)[-1], CONNECT)

    def test_aPortReopenedByANewAgentIsFollowedUp(self) -> None:
        agent = connected()
        agent.port_changed(False, now=10)
        read(agent, b"STOPPED\n", now=10)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)
        agent.port_changed(True, now=20)  # a new agent
        read(agent, b"", now=20)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.follow_up)
        self.assertEqual(
            read(agent, b"STARTED\n", now=20.05),
            [StatusChanged(AgentStatus.STOPPED, AgentStatus.STARTED), CONNECT],
        )

    def test_agentlessVMsBackOffUpToTheSafetyRead(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        delays = []
        now = 0.0
        for _ in range(10):
            read(agent, b"", now=now)
            delay = agent.next_poll_delay()
            assert delay is not None
            delays.append(delay)
            now += delay
        self.assertEqual(delays, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0, 120.0, 120.0])

    def test_theFirstPortEventWakesAnAgentlessVMAtOnce(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        for now in (0.0, 1.0, 3.0, 7.0, 15.0):
            read(agent, b"", now=now)
        self.assertEqual(agent.next_poll_delay(), 16.0)
        agent.port_changed(True, now=20)
        self.assertEqual(agent.next_poll_delay(), 0.0)

    def test_aFailedReadIsNotRetriedAtOnce(self) -> None:
        agent = connected()
        agent.qmp_event()
        agent.read_started()
        agent.read_failed(now=5)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_followUpsWhoseReadsFailStillBackOffAndEnd(self) -> None:
        agent = link()
        agent.vm_started(advertise=True)
        agent.connect_written(now=0)
        now, delays = 0.0, []
        while agent.connect_outstanding:
            delay = agent.next_poll_delay()
            assert delay is not None
            delays.append(delay)
            now += delay
            agent.read_started()
            agent.read_failed(now)
        self.assertEqual(delays[:4], [0.0, 0.05, 0.1, 0.2])  # the start's read, then doubling
        self.assertLessEqual(len(delays), 9)
        self.assertGreaterEqual(now, INTERVALS.follow_up_window)

    def test_anEventDuringAFailedReadIsStillRead(self) -> None:
        agent = connected()
        agent.read_started()
        agent.port_changed(False, now=7)
        agent.read_failed(now=7)
        self.assertEqual(agent.next_poll_delay(), 0.0)

    def test_anAgentThatCannotConnectIsNotFollowedUpForEver(self) -> None:
        """It repeats STARTED every heartbeat: one round of follow-ups, then safety reads."""
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"", now=0)
        agent.port_changed(True, now=0)
        read(agent, b"STARTED\n", now=0)  # the event read: a CONNECT, and follow-ups
        agent.connect_written(now=0)
        now, reads, connects = 0.0, 0, 0
        while now < 600:
            delay = agent.next_poll_delay()
            assert delay is not None
            now += delay
            heartbeats = b"STARTED\n"  # written quietly every 5 s: there is always one by now
            for command in read(agent, heartbeats, now):
                if isinstance(command, WriteConnect):
                    agent.connect_written(now)
                    connects += 1
            reads += 1
        # One 10 s round of follow-ups (8 reads), then one read per safety interval.
        self.assertLessEqual(reads, 8 + 600 / INTERVALS.safety + 1)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)
        self.assertGreater(connects, 0)

    def test_intervalsMustBePositive(self) -> None:
        with self.assertRaises(ValueError):
            PollIntervals(safety=0)
        with self.assertRaises(ValueError):
            PollIntervals(reopen_grace=-1)

    def test_intervalsFromATranscriptHeader(self) -> None:
        """Known keys are taken; unknown (an older link's), negative or absurd ones are not."""
        intervals = PollIntervals.from_mapping(
            {
                "safety": 30,
                "follow_up": "0.2",
                "connected": 1.0,
                "reopen_grace": -1,
                "silence_timeout": float("nan"),
                "agentless_first": True,
            }
        )
        self.assertEqual(intervals, PollIntervals(safety=30.0, follow_up=0.2))
        self.assertEqual(PollIntervals.from_mapping(intervals.as_mapping()), intervals)


class NewAgentWithinTheGraceTests(SynchronousTestCase):
    def test_aPortReopenedWithinTheGraceIsFollowedUpUntilAnyLine(self) -> None:
        """Killed and replaced before the grace ended: the new agent may not announce."""
        agent = connected()
        agent.port_changed(False, now=50)
        read(agent, b"CONNECTED\n", now=50)
        agent.port_changed(True, now=51)
        read(agent, b"", now=51)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.follow_up)
        self.assertEqual(read(agent, b"STARTED\n", now=51.05)[-1], CONNECT)
        agent.connect_written(now=51.05)
        self.assertTrue(agent.connect_outstanding)


class AgentGoneTests(SynchronousTestCase):
    """A port that closes: STOPPED said, a pulse, or an agent killed without a word."""

    def test_stoppedThenClosedIsSeenOnTheCloseEvent(self) -> None:
        agent = connected()
        agent.port_changed(False, now=50)
        self.assertEqual(agent.next_poll_delay(), 0.0)
        self.assertEqual(
            read(agent, b"STOPPED\n", now=50),
            [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)],
        )
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_closedWithoutStoppedAndNotReopenedIsAStop(self) -> None:
        agent = connected()
        agent.port_changed(False, now=50)
        self.assertEqual(read(agent, b"CONNECTED\n" * 9, now=50), [])  # its last heartbeats
        self.assertEqual(agent.port_open, False)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.reopen_grace)
        self.assertEqual(
            read(agent, b"", now=51),
            [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)],
        )
        self.assertEqual(agent.next_poll_delay(), INTERVALS.safety)

    def test_aPortReopenedWithinTheGraceIsNoStop(self) -> None:
        agent = connected()
        agent.port_changed(False, now=50)
        read(agent, b"CONNECTED\n" * 9, now=50)
        agent.port_changed(True, now=50.01)
        self.assertEqual(read(agent, b"CONNECTED\n", now=50.01), [])
        self.assertEqual(read(agent, b"", now=52), [])
        self.assertIs(agent.status, AgentStatus.CONNECTED)

    def test_theGraceStartsAgainWhenAFrozenVMResumes(self) -> None:
        agent = connected()
        agent.port_changed(False, now=50)
        read(agent, b"CONNECTED\n" * 9, now=50)
        agent.vm_paused()
        self.assertIsNone(agent.next_poll_delay())
        agent.vm_resumed(now=500)
        self.assertEqual(read(agent, b"", now=500.5), [])
        self.assertEqual(
            read(agent, b"", now=501), [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)]
        )


class HandshakeTests(SynchronousTestCase):
    """CONNECT on every STARTED and at every (re)start; status changes announced once."""

    def test_daemonStartAdvertisesToARunningVM(self) -> None:
        self.assertEqual(link().vm_started(), [CONNECT])

    def test_startedGetsAConnectAndAnAnnouncement(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        commands = read(agent, b"STARTED\n", now=0)
        self.assertEqual(
            commands, [StatusChanged(AgentStatus.UNKNOWN, AgentStatus.STARTED), CONNECT]
        )
        self.assertEqual(commands[0].event_action, "instance-agent-started")  # type: ignore[union-attr]

    def test_repeatedStartedHeartbeatIsRetriedButNotReannounced(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=0)
        self.assertEqual(read(agent, b"STARTED\n", now=5), [CONNECT])

    def test_manyStartedLinesInOneReadGetOneConnect(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        commands = read(agent, b"STARTED\n" * 5000, now=0)
        self.assertEqual(commands.count(CONNECT), 1)

    def test_connectedIsAnnouncedAndNeedsNoConnect(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=0)
        self.assertEqual(
            read(agent, b"CONNECTED\n", now=1),
            [StatusChanged(AgentStatus.STARTED, AgentStatus.CONNECTED)],
        )

    def test_ourOwnConnectEchoIsIgnored(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"CONNECTED\n", now=0)
        self.assertEqual(read(agent, b"CONNECT 2:49152\n", now=1), [])
        self.assertEqual(agent.status, AgentStatus.CONNECTED)

    def test_agentStoppingIsAnnounced(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"CONNECTED\n", now=0)
        self.assertEqual(
            read(agent, b"STOPPED\n", now=1),
            [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)],
        )

    def test_vmStopMeansTheAgentStopped(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"CONNECTED\n", now=0)
        self.assertEqual(
            agent.vm_stopped(), [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)]
        )
        self.assertEqual(agent.vm_stopped(), [])

    def test_garbageIsLoggedAndIgnored(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        commands = read(agent, b"\xff\xfe\nhello\nCONNECT x:y\n" + b"A" * 5000 + b"\n", now=0)
        self.assertEqual(commands, [])
        self.assertEqual(agent.status, AgentStatus.UNKNOWN)

    def test_overflowedReadStillFindsTheLatestStatus(self) -> None:
        agent = AgentLink("vm1", ring_size=16, port=49152, intervals=INTERVALS)
        agent.vm_started(advertise=False)
        commands = read(agent, b"TED\nCONNECTED\nST", now=0)
        self.assertEqual(commands, [StatusChanged(AgentStatus.UNKNOWN, AgentStatus.CONNECTED)])


class NoiseTests(SynchronousTestCase):
    """Whatever a guest writes, the daemon's log gets one line per read."""

    def test_manyBadLinesInOneReadAreLoggedOnce(self) -> None:
        said: list[dict[str, object]] = []
        self.patch(AgentLink, "log", Logger(observer=cast(ILogObserver, said.append)))
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"x\n" * 20000 + b"\xff\n" + b"y" * 1000 + b"\n", now=0)
        self.assertEqual(len(said), 1)
        # A read as big as the ring may have overflowed: its first line is not trusted.
        self.assertEqual(said[0]["count"], 20001)
        self.assertEqual(said[0]["first"], Noise("x"))

    def test_longNoiseIsShortenedInTheLog(self) -> None:
        said: list[dict[str, object]] = []
        self.patch(AgentLink, "log", Logger(observer=cast(ILogObserver, said.append)))
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"z" * 200 + b"\n", now=0)
        self.assertEqual(said[0]["first"], Noise("z" * 80 + "…"))


class SilenceTests(SynchronousTestCase):
    """An agent that stops repeating its status (killed with SIGKILL) is taken as stopped."""

    def connected(self) -> AgentLink:
        return connected(now=1)

    def test_heartbeatsKeepTheAgentConnected(self) -> None:
        agent = self.connected()
        for now in range(6, 60, 5):
            self.assertEqual(read(agent, b"CONNECTED\n", now=now), [])
        self.assertIs(agent.status, AgentStatus.CONNECTED)

    def test_silenceLongerThanTheTimeoutIsAStop(self) -> None:
        agent = self.connected()
        self.assertEqual(read(agent, b"", now=1 + INTERVALS.silence_timeout - 0.5), [])
        self.assertEqual(
            read(agent, b"", now=1 + INTERVALS.silence_timeout),
            [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)],
        )

    def test_aStoppedAgentThatSpeaksAgainIsBack(self) -> None:
        agent = self.connected()
        read(agent, b"", now=100)
        read(agent, b"", now=200)
        self.assertEqual(
            read(agent, b"STARTED\n", now=201),
            [StatusChanged(AgentStatus.STOPPED, AgentStatus.STARTED), CONNECT],
        )

    def test_silenceWhilePausedDoesNotCount(self) -> None:
        agent = self.connected()
        agent.vm_paused()
        agent.vm_resumed(now=499)
        self.assertEqual(read(agent, b"", now=500), [])
        self.assertIs(agent.status, AgentStatus.CONNECTED)

    def test_anUnknownAgentIsNeverTakenAsStopped(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"", now=0)
        self.assertEqual(read(agent, b"", now=1000), [])
        self.assertIs(agent.status, AgentStatus.UNKNOWN)


class InFlightTests(SynchronousTestCase):
    def test_eventDuringAReadAsksForAnotherReadAtOnce(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        agent.read_started()
        agent.qmp_event()  # arrives while the read is on its way
        agent.ring_read(b"", now=0)
        self.assertEqual(agent.next_poll_delay(), 0.0)

    def test_portEventDuringAReadAsksForAnotherReadAtOnce(self) -> None:
        agent = connected()
        agent.read_started()
        agent.port_changed(False, now=9)  # STOPPED landed after the read took the ring
        self.assertEqual(agent.ring_read(b"", now=9), [])
        self.assertEqual(agent.next_poll_delay(), 0.0)
        self.assertEqual(
            read(agent, b"STOPPED\n", now=9),
            [StatusChanged(AgentStatus.CONNECTED, AgentStatus.STOPPED)],
        )
