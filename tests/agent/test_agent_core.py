"""Tests for vmready.agent.core: what the agent says and when it dials, without I/O."""

from __future__ import annotations

import logging

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.core import (
    MAX_COOLDOWN_HEARTBEATS,
    NO_CONNECT_YET,
    AbandonDial,
    AgentCore,
    Backoff,
    CloseLink,
    Command,
    Dial,
    HostAddress,
    Phase,
    ReassertReady,
    TcpAddress,
    VsockAddress,
    WriteStatus,
)
from vmready.protocols.ringbuffer import MAX_LINE_BYTES, AgentStatus

STARTED = WriteStatus(AgentStatus.STARTED)
CONNECTED = WriteStatus(AgentStatus.CONNECTED)
# STOPPED and heartbeats are written quietly (the port's close at exit announces STOPPED).
STOPPED = WriteStatus(AgentStatus.STOPPED, announce=False)
STARTED_BEAT = WriteStatus(AgentStatus.STARTED, announce=False)
CONNECTED_BEAT = WriteStatus(AgentStatus.CONNECTED, announce=False)
HOST = VsockAddress(2, 49152)
NEW_HOST = VsockAddress(2, 50000)
TCP_HOST = TcpAddress("10.0.2.100", 8443)


def core(retries: int = 3) -> AgentCore:
    return AgentCore(retries=retries, backoff=Backoff(first=0.5, longest=4.0))


def connected(agent: AgentCore, address: HostAddress = HOST) -> int:
    """Drive ``agent`` to CONNECTED at ``address``; the dial id of the link."""
    [dial] = [c for c in agent.connect_received(address) if isinstance(c, Dial)]
    agent.dial_succeeded(dial.dial_id)
    return dial.dial_id


def dial_of(commands: list[Command]) -> Dial:
    [dial] = [c for c in commands if isinstance(c, Dial)]
    return dial


class StatusLineTests(SynchronousTestCase):
    """When the agent writes which status line."""

    def test_serialOpenedSaysStarted(self) -> None:
        self.assertEqual(core().serial_opened(), [STARTED])

    def test_heartbeatRepeatsStartedWhileWaiting(self) -> None:
        agent = core()
        self.assertEqual(agent.heartbeat(), [STARTED_BEAT])
        self.assertEqual(agent.heartbeat(), [STARTED_BEAT])

    def test_heartbeatRepeatsConnectedWhileConnected(self) -> None:
        agent = core()
        connected(agent)
        self.assertEqual(agent.heartbeat(), [CONNECTED_BEAT])

    def test_serialReopenedSaysTheCurrentStatus(self) -> None:
        agent = core()
        connected(agent)
        self.assertEqual(agent.serial_opened(), [CONNECTED])

    def test_stopSaysStopped(self) -> None:
        self.assertEqual(core().stop(), [STOPPED])

    def test_nothingIsSaidAfterStop(self) -> None:
        agent = core()
        agent.stop()
        self.assertEqual(agent.heartbeat(), [])
        self.assertEqual(agent.serial_opened(), [])
        self.assertEqual(agent.data_received(b"CONNECT 2:1\n"), [])
        self.assertEqual(agent.stop(), [])


class ConnectTests(SynchronousTestCase):
    """CONNECT lines, dials and their outcomes."""

    def test_connectLineDialsAtOnce(self) -> None:
        agent = core()
        self.assertEqual(agent.data_received(b"CONNECT 2:49152\n"), [Dial(1, HOST, 0.0)])
        self.assertIs(agent.phase, Phase.DIALING)

    def test_connectLineInPiecesDialsOnceComplete(self) -> None:
        agent = core()
        self.assertEqual(agent.data_received(b"CONN"), [])
        self.assertEqual(agent.data_received(b"ECT 2:491"), [])
        self.assertEqual(agent.data_received(b"52\r\n"), [Dial(1, HOST, 0.0)])

    def test_successSaysConnectedAndAsksToReassertReady(self) -> None:
        agent = core()
        dial = dial_of(agent.connect_received(HOST))
        self.assertEqual(
            agent.dial_succeeded(dial.dial_id), [CONNECTED, ReassertReady(dial.dial_id, HOST)]
        )
        self.assertEqual(agent.link, HOST)

    def test_failedDialIsRetriedWithDoublingDelays(self) -> None:
        agent = core(retries=3)
        dial = dial_of(agent.connect_received(HOST))
        delays = []
        for _ in range(3):
            dial = dial_of(agent.dial_failed(dial.dial_id, "connection refused"))
            delays.append(dial.delay)
        self.assertEqual(delays, [0.5, 1.0, 2.0])

    def test_backoffNeverExceedsItsLongestDelay(self) -> None:
        self.assertEqual(Backoff(first=0.5, longest=4.0).delay(10), 4.0)

    def test_lastFailureSaysStartedAndWaitsForConnect(self) -> None:
        agent = core(retries=1)
        dial = dial_of(agent.connect_received(HOST))
        dial = dial_of(agent.dial_failed(dial.dial_id, "refused"))
        self.assertEqual(agent.dial_failed(dial.dial_id, "refused"), [STARTED])
        self.assertIs(agent.phase, Phase.WAITING)
        self.assertIsNone(agent.link)

    def test_noRetriesMeansOneAttempt(self) -> None:
        agent = core(retries=0)
        dial = dial_of(agent.connect_received(HOST))
        self.assertEqual(agent.dial_failed(dial.dial_id, "refused"), [STARTED])

    def test_connectAfterGivingUpDialsAgainAfterAHeartbeat(self) -> None:
        agent = core(retries=0)
        dial = dial_of(agent.connect_received(HOST))
        agent.dial_failed(dial.dial_id, "refused")
        # The host answers the STARTED at once; that CONNECT waits out one heartbeat.
        self.assertEqual(agent.connect_received(HOST), [])
        agent.heartbeat()
        self.assertEqual(dial_of(agent.connect_received(HOST)).address, HOST)

    def test_theHeartbeatThatEndsACooldownAnnouncesStarted(self) -> None:
        """The host reads on events: the end of a cooldown is announced, the rest is quiet."""
        agent = core(retries=0)
        agent.dial_failed(dial_of(agent.connect_received(HOST)).dial_id, "refused")
        self.assertEqual(agent.heartbeat(), [STARTED])  # a cooldown of one heartbeat: over
        self.assertEqual(agent.heartbeat(), [STARTED_BEAT])

    def test_repeatedGiveUpsWaitLongerUpToACap(self) -> None:
        agent = core(retries=0)
        agent.dial_failed(dial_of(agent.connect_received(HOST)).dial_id, "refused")
        waits = []
        for _ in range(6):
            beats = 0
            while not (commands := agent.connect_received(HOST)):
                agent.heartbeat()
                beats += 1
            waits.append(beats)
            agent.dial_failed(dial_of(commands).dial_id, "refused")
        self.assertEqual(waits, [1, 2, 4, 8, MAX_COOLDOWN_HEARTBEATS, MAX_COOLDOWN_HEARTBEATS])

    def test_connectToAnotherAddressAfterGivingUpDialsAtOnce(self) -> None:
        agent = core(retries=0)
        agent.dial_failed(dial_of(agent.connect_received(HOST)).dial_id, "refused")
        self.assertEqual(dial_of(agent.connect_received(NEW_HOST)).address, NEW_HOST)

    def test_successEndsTheCooldown(self) -> None:
        agent = core(retries=0)
        agent.dial_failed(dial_of(agent.connect_received(HOST)).dial_id, "refused")
        agent.heartbeat()
        connected(agent)
        agent.link_lost(agent._dial_id, "host went away")
        self.assertEqual(dial_of(agent.connect_received(HOST)).address, HOST)

    def test_repeatedConnectWhileDialingIsIgnored(self) -> None:
        agent = core()
        agent.connect_received(HOST)
        self.assertEqual(agent.data_received(b"CONNECT 2:49152\n"), [])

    def test_repeatedConnectWhileConnectedIsIgnored(self) -> None:
        agent = core()
        connected(agent)
        self.assertEqual(agent.data_received(b"CONNECT 2:49152\n"), [])
        self.assertEqual(agent.link, HOST)

    def test_connectToANewPortWhileConnectedRedials(self) -> None:
        agent = core()
        old = connected(agent)
        commands = agent.connect_received(NEW_HOST)
        self.assertEqual(commands, [CloseLink(old), STARTED, Dial(old + 1, NEW_HOST, 0.0)])
        self.assertIsNone(agent.link)

    def test_connectToANewPortWhileDialingAbandonsTheFirstDial(self) -> None:
        agent = core()
        first = dial_of(agent.connect_received(HOST))
        commands = agent.connect_received(NEW_HOST)
        self.assertEqual(
            commands, [AbandonDial(first.dial_id), Dial(first.dial_id + 1, NEW_HOST, 0.0)]
        )

    def test_lateResultOfAnAbandonedDialIsIgnored(self) -> None:
        agent = core()
        first = dial_of(agent.connect_received(HOST))
        agent.connect_received(NEW_HOST)
        self.assertEqual(agent.dial_failed(first.dial_id, "refused"), [])
        self.assertEqual(agent.dial_succeeded(first.dial_id), [CloseLink(first.dial_id)])
        self.assertIs(agent.phase, Phase.DIALING)

    def test_linkLostSaysStartedAndWaitsForConnect(self) -> None:
        agent = core()
        dial_id = connected(agent)
        self.assertEqual(agent.link_lost(dial_id, "the host closed the connection"), [STARTED])
        self.assertIs(agent.phase, Phase.WAITING)
        self.assertIsNone(agent.link)

    def test_linkLostThenConnectToTheSamePortRedials(self) -> None:
        agent = core()
        dial_id = connected(agent)
        agent.link_lost(dial_id, "gone")
        self.assertEqual(dial_of(agent.connect_received(HOST)).address, HOST)

    def test_lossOfAnOldLinkIsIgnored(self) -> None:
        agent = core()
        old = connected(agent)
        connected(agent, NEW_HOST)
        self.assertEqual(agent.link_lost(old, "closed by the agent"), [])
        self.assertEqual(agent.link, NEW_HOST)

    def test_stopWhileConnectedClosesTheLinkThenSaysStopped(self) -> None:
        agent = core()
        dial_id = connected(agent)
        self.assertEqual(agent.stop(), [CloseLink(dial_id), STOPPED])

    def test_stopWhileDialingAbandonsTheDial(self) -> None:
        agent = core()
        dial = dial_of(agent.connect_received(HOST))
        self.assertEqual(agent.stop(), [AbandonDial(dial.dial_id), STOPPED])


class UnreachableReasonTests(SynchronousTestCase):
    """Why the host cannot be reached, for the guest API's 503 answers."""

    def test_beforeAnyConnect(self) -> None:
        self.assertEqual(core().unreachable_reason, NO_CONNECT_YET)

    def test_whileDialing(self) -> None:
        agent = AgentCore(describe=lambda a: f"vsock {a}")
        agent.connect_received(HOST)
        self.assertEqual(agent.unreachable_reason, "connecting to the host at vsock 2:49152")

    def test_afterAFailedDial(self) -> None:
        agent = AgentCore(retries=0, describe=lambda a: f"vsock {a}")
        dial = dial_of(agent.connect_received(HOST))
        agent.dial_failed(dial.dial_id, "cannot connect: Connection refused")
        self.assertEqual(
            agent.unreachable_reason,
            "cannot connect to the host at vsock 2:49152: cannot connect: Connection refused",
        )

    def test_afterTheLinkDropped(self) -> None:
        agent = AgentCore(describe=lambda a: f"vsock {a}")
        dial_id = connected(agent)
        agent.link_lost(dial_id, "the host closed the connection")
        self.assertEqual(
            agent.unreachable_reason,
            "lost the link to the host at vsock 2:49152: the host closed the connection",
        )


class BadInputTests(SynchronousTestCase):
    """Nothing on the serial line crashes the agent or makes it dial."""

    def assertIgnored(self, data: bytes) -> None:
        agent = core()
        self.assertEqual(agent.data_received(data), [])
        self.assertIs(agent.phase, Phase.WAITING)

    def test_garbageIsIgnored(self) -> None:
        self.assertIgnored(b"hello there\n")

    def test_nonNumericConnectIsIgnored(self) -> None:
        self.assertIgnored(b"CONNECT x:y\n")

    def test_outOfRangeConnectIsIgnored(self) -> None:
        self.assertIgnored(b"CONNECT 2:4294967296\n")

    def test_elevenDigitConnectIsIgnored(self) -> None:
        self.assertIgnored(b"CONNECT 2:12345678901\n")

    def test_lowerCaseConnectIsIgnored(self) -> None:
        self.assertIgnored(b"connect 2:49152\n")

    def test_undecodableLineIsIgnored(self) -> None:
        self.assertIgnored(b"CONNECT \xff\xfe\n")

    def test_ownStatusEchoIsIgnored(self) -> None:
        self.assertIgnored(b"STARTED\nCONNECTED\nSTOPPED\n")

    def test_overlongLineIsDiscardedUpToItsNewline(self) -> None:
        agent = core()
        self.assertEqual(agent.data_received(b"C" * (MAX_LINE_BYTES + 1)), [])
        self.assertEqual(agent.data_received(b"ONNECT 2:49152\n"), [])
        self.assertEqual(agent.data_received(b"CONNECT 2:49152\n"), [Dial(1, HOST, 0.0)])

    def test_overlongLineKeepsNoMoreThanALine(self) -> None:
        agent = core()
        for _ in range(100):
            agent.data_received(b"x" * 10_000)
        self.assertLessEqual(len(agent._reader.pending), MAX_LINE_BYTES)

    def test_goodLineAfterGarbageStillDials(self) -> None:
        agent = core()
        self.assertEqual(
            agent.data_received(b"\x00\x01junk\nCONNECT 2:49152\n"), [Dial(1, HOST, 0.0)]
        )


class TcpConnectTests(SynchronousTestCase):
    """``CONNECT tcp:<ipv4>:<port>``: the fallback transport's address."""

    def test_tcpConnectLineDialsThatAddress(self) -> None:
        agent = core()
        self.assertEqual(
            agent.data_received(b"CONNECT tcp:10.0.2.100:8443\n"), [Dial(1, TCP_HOST, 0.0)]
        )

    def test_repeatedTcpConnectWhileConnectedIsIgnored(self) -> None:
        agent = core()
        connected(agent, TCP_HOST)
        self.assertEqual(agent.data_received(b"CONNECT tcp:10.0.2.100:8443\n"), [])
        self.assertEqual(agent.link, TCP_HOST)

    def test_tcpConnectToAnotherPortRedials(self) -> None:
        agent = core()
        old = connected(agent, TCP_HOST)
        other = TcpAddress("10.0.2.100", 8444)
        self.assertEqual(
            agent.connect_received(other), [CloseLink(old), STARTED, Dial(old + 1, other, 0.0)]
        )

    def test_vsockConnectWhileOnTcpRedials(self) -> None:
        agent = core()
        old = connected(agent, TCP_HOST)
        self.assertEqual(dial_of(agent.connect_received(HOST)).dial_id, old + 1)

    def test_addressesOfTheTwoKindsNeverMatch(self) -> None:
        self.assertNotEqual(VsockAddress(2, 8443), TcpAddress("0.0.0.2", 8443))

    def test_tcpAddressReadsAsItsConnectLine(self) -> None:
        self.assertEqual(str(TCP_HOST), "tcp:10.0.2.100:8443")


class MalformedConnectTests(SynchronousTestCase):
    """A malformed CONNECT is ignored, and the log says precisely what is wrong with it."""

    def assertIgnoredSaying(self, line: bytes, message: str) -> None:
        agent = core()
        with self.assertLogs("vmready.agent.core", logging.WARNING) as logged:
            self.assertEqual(agent.data_received(line + b"\n"), [])
        self.assertIs(agent.phase, Phase.WAITING)
        self.assertEqual(logged.records[0].getMessage(), message)

    def test_badIPv4Address(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT tcp:999.0.2.100:8443",
            "ignoring a malformed CONNECT line: '999.0.2.100' is not an IPv4 address",
        )

    def test_ipv4WithLeadingZeros(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT tcp:010.0.2.100:8443",
            "ignoring a malformed CONNECT line: '010.0.2.100' is not an IPv4 address",
        )

    def test_tcpPortOutOfRange(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT tcp:10.0.2.100:65536",
            "ignoring a malformed CONNECT line: TCP port 65536 is out of range (1-65535)",
        )

    def test_tcpPortZero(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT tcp:10.0.2.100:0",
            "ignoring a malformed CONNECT line: TCP port 0 is out of range (1-65535)",
        )

    def test_tcpHostName(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT tcp:host:8443",
            "ignoring a malformed CONNECT line: "
            "not a 'CONNECT tcp:<ipv4>:<port>' line: 'CONNECT tcp:host:8443'",
        )

    def test_vsockPortOutOfRange(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT 2:4294967296",
            "ignoring a malformed CONNECT line: vsock port 4294967296 is out of range "
            "(0-4294967295)",
        )

    def test_garbageAfterConnect(self) -> None:
        self.assertIgnoredSaying(
            b"CONNECT now",
            "ignoring a malformed CONNECT line: "
            "'CONNECT now' is neither 'CONNECT <cid>:<port>' nor 'CONNECT tcp:<ipv4>:<port>'",
        )

    def test_otherNoiseIsQuoted(self) -> None:
        self.assertIgnoredSaying(b"hello there", "ignoring serial line 'hello there'")
