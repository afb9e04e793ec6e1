"""Tests for vmready.agentlink.link: the host's polling and handshake decisions."""

from __future__ import annotations

from typing import cast

from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase

from vmready.agentlink.link import AgentLink, Command, PollIntervals, StatusChanged, WriteConnect
from vmready.protocols.ringbuffer import AgentStatus, Noise

INTERVALS = PollIntervals(
    connecting=0.05, started=0.25, connected=1.0, connect_timeout=10.0, silence_timeout=15.0
)
CONNECT = WriteConnect(b"CONNECT 2:49152\n")


def read(agent: AgentLink, chunk: bytes, now: float) -> list[Command]:
    """One ringbuf-read as the monitor does it: announced, then its answer."""
    agent.read_started()
    return agent.ring_read(chunk, now)


def link() -> AgentLink:
    return AgentLink("vm1", ring_size=4096, port=49152, intervals=INTERVALS)


class PollingTests(SynchronousTestCase):
    """How often the ring buffer is read in each situation."""

    def test_noPollingWhileTheVMIsNotRunning(self) -> None:
        agent = link()
        self.assertIsNone(agent.next_poll_delay())
        agent.vm_started()
        agent.vm_stopped()
        self.assertIsNone(agent.next_poll_delay())

    def test_pollAtOnceWhenTheVMStartsAndAfterEveryQMPEvent(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        self.assertEqual(agent.next_poll_delay(), 0.0)
        read(agent, b"", now=0)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.started)
        agent.qmp_event()
        self.assertEqual(agent.next_poll_delay(), 0.0)

    def test_fastWhileConnectOutstandingSlowestOnceConnected(self) -> None:
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=1)
        agent.connect_written(now=1)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.connecting)
        read(agent, b"CONNECTED\n", now=1.2)
        self.assertFalse(agent.connect_outstanding)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.connected)

    def test_unansweredConnectExpiresBackToStartedPace(self) -> None:
        agent = link()
        agent.vm_started()
        agent.connect_written(now=0)
        read(agent, b"", now=0)
        agent.tick(now=9.9)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.connecting)
        agent.tick(now=10.0)
        self.assertEqual(agent.next_poll_delay(), INTERVALS.started)

    def test_intervalsMustBePositive(self) -> None:
        with self.assertRaises(ValueError):
            PollIntervals(connected=0)


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
        agent = link()
        agent.vm_started(advertise=False)
        read(agent, b"STARTED\n", now=0)
        read(agent, b"CONNECTED\n", now=1)
        return agent

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
        agent.vm_resumed()
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
