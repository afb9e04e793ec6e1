"""Tests for vmready.agent.service: the core's commands carried out, on a Clock."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

from treq.testing import RequestTraversalAgent
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransportWithDisconnection
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IAgent

from vmready.agent.config import ConfigError
from vmready.agent.core import AgentCore, Backoff, HostAddress
from vmready.agent.host import LinkWatch
from vmready.agent.memory import ReadyMemory
from vmready.agent.proxy import HostUnreachable
from vmready.agent.serial import SerialKeeper
from vmready.agent.service import AgentService, prepare_socket_path
from vmready.agent.testing import FakeGuestHost

HOST = HostAddress(2, 49152)
HEARTBEAT = 5.0
DIAL_TIMEOUT = 3.0  # shorter than a heartbeat: a timeout's STARTED stands alone


class FakeWatch(LinkWatch):
    """A link watch with no connection: closing it ends it at once."""

    def close(self) -> None:
        super().close()
        self.connectionLost(Failure(ConnectionDone()))


class Harness:
    """An AgentService on a Clock, with a StringTransport serial port and scripted dials."""

    def __init__(self, test: SynchronousTestCase, retries: int = 2) -> None:
        self.clock = Clock()
        self.state_dir = tempfile.mkdtemp(prefix="vra-")
        test.addCleanup(shutil.rmtree, self.state_dir, True)
        self.memory = ReadyMemory(self.state_dir)
        self.dials: list[tuple[HostAddress, Deferred[LinkWatch]]] = []
        self.host = FakeGuestHost(self.clock)
        self.host_agent = RequestTraversalAgent(self.host.app.resource())
        self.fatal: list[str] = []
        self.service = AgentService(
            self.clock,
            AgentCore(
                retries=retries,
                backoff=Backoff(first=1.0, longest=4.0),
                describe=lambda address: f"vsock {address}",
            ),
            self.agent_for,
            lambda address: f"vsock {address}",
            self.memory,
            HEARTBEAT,
            dial_timeout=DIAL_TIMEOUT,
            dial=self.dial,
        )
        self.service.on_fatal = self.fatal.append
        self.serial_transport = StringTransportWithDisconnection()
        self.serial = SerialKeeper(
            self.clock,
            lambda: "/dev/virtio-ports/com.canonical.lxd",
            self.service.serial_data,
            self.service.serial_opened,
            self.service.serial_gave_up,
            delays=(1.0,),
            opener=self.open_serial,
        )
        self.service.attach_serial(self.serial)

    def agent_for(self, address: HostAddress) -> IAgent:
        return self.host_agent

    def open_serial(self, reactor: Any, path: str, protocol: Protocol) -> Deferred[None]:
        self.serial_transport.protocol = protocol
        protocol.makeConnection(self.serial_transport)
        return succeed(None)

    def dial(self, address: HostAddress) -> Deferred[LinkWatch]:
        dialing: Deferred[LinkWatch] = Deferred()
        self.dials.append((address, dialing))
        return dialing

    def written(self) -> list[bytes]:
        """Lines written to the serial port since the last call."""
        data: bytes = self.serial_transport.value()
        self.serial_transport.clear()
        return data.splitlines()

    def connect(self) -> FakeWatch:
        """CONNECT, and the dial succeeds."""
        self.service.serial_data(b"CONNECT 2:49152\n")
        watch = FakeWatch()
        self.dials[-1][1].callback(watch)
        return watch


class HeartbeatTests(SynchronousTestCase):
    def test_startWritesStartedOnTheSerialPort(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        self.assertEqual(harness.written(), [b"STARTED"])

    def test_heartbeatRepeatsTheStatusEveryInterval(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.written()
        harness.clock.advance(HEARTBEAT)
        self.assertEqual(harness.written(), [b"STARTED"])
        harness.clock.advance(HEARTBEAT)
        self.assertEqual(harness.written(), [b"STARTED"])

    def test_heartbeatSaysConnectedOnceConnected(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.connect()
        harness.written()
        harness.clock.advance(HEARTBEAT)
        self.assertEqual(harness.written(), [b"CONNECTED"])


class DialTests(SynchronousTestCase):
    def test_connectDialsTheAdvertisedAddress(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.service.serial_data(b"CONNECT 2:49152\n")
        self.assertEqual([address for address, _ in harness.dials], [HOST])

    def test_successfulDialWritesConnected(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.written()
        harness.connect()
        self.assertEqual(harness.written(), [b"CONNECTED"])
        self.assertEqual(harness.service.core.link, HOST)

    def test_failedDialIsRetriedAfterTheBackoffDelay(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.service.serial_data(b"CONNECT 2:49152\n")
        harness.dials[0][1].errback(ConnectionRefusedError())
        harness.clock.advance(0.9)
        self.assertEqual(len(harness.dials), 1)
        harness.clock.advance(0.1)
        self.assertEqual(len(harness.dials), 2)

    def test_lastFailedRetryWritesStarted(self) -> None:
        harness = Harness(self, retries=1)
        harness.service.startService()
        harness.service.serial_data(b"CONNECT 2:49152\n")
        harness.written()
        harness.dials[0][1].errback(ConnectionRefusedError())
        harness.clock.advance(1.0)
        harness.dials[1][1].errback(ConnectionRefusedError())
        self.assertEqual(harness.written(), [b"STARTED"])
        self.assertEqual(
            harness.service.core.unreachable_reason,
            "cannot connect to the host at vsock 2:49152: "
            "cannot connect: Connection was refused by other side",
        )

    def test_dialThatNeverAnswersTimesOut(self) -> None:
        harness = Harness(self, retries=0)
        harness.service.startService()
        harness.service.serial_data(b"CONNECT 2:49152\n")
        harness.written()
        harness.clock.advance(DIAL_TIMEOUT)
        self.assertEqual(harness.written(), [b"STARTED"])
        self.assertEqual(
            harness.service.core.unreachable_reason,
            "cannot connect to the host at vsock 2:49152: timed out",
        )

    def test_connectToANewPortCancelsTheDialUnderWay(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.service.serial_data(b"CONNECT 2:49152\n")
        first = harness.dials[0][1]
        first.addErrback(lambda f: None)
        harness.service.serial_data(b"CONNECT 2:50000\n")
        self.assertTrue(first.called)
        self.assertEqual(harness.dials[1][0], HostAddress(2, 50000))

    def test_linkLossWritesStarted(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        watch = harness.connect()
        harness.written()
        watch.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(harness.written(), [b"STARTED"])
        self.assertIsNone(harness.service.core.link)


class RouteTests(SynchronousTestCase):
    def test_routeIsUnreachableBeforeConnect(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        error = self.assertRaises(HostUnreachable, harness.service.route)
        self.assertEqual(str(error), "the host has not sent CONNECT yet")

    def test_routeNamesTheHostOnceConnected(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.connect()
        self.assertEqual(harness.service.route().label, "vsock 2:49152")


class ReadyMemoryTests(SynchronousTestCase):
    def test_rememberedReadyIsPatchedAfterConnecting(self) -> None:
        harness = Harness(self)
        harness.memory.remember(True)
        harness.service.startService()
        harness.connect()
        harness.host_agent.flush()
        self.assertEqual(harness.host.patches, ["Ready"])

    def test_nothingIsPatchedWithoutRememberedReady(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.connect()
        harness.host_agent.flush()
        self.assertEqual(harness.host.patches, [])

    def test_readyIsPatchedAgainAfterEveryReconnect(self) -> None:
        harness = Harness(self)
        harness.memory.remember(True)
        harness.service.startService()
        harness.connect().connectionLost(Failure(ConnectionDone()))
        harness.host_agent.flush()
        harness.connect()
        harness.host_agent.flush()
        self.assertEqual(harness.host.patches, ["Ready", "Ready"])

    def test_acceptedStateIsRemembered(self) -> None:
        harness = Harness(self)
        harness.service.remember_state("Ready")
        self.assertTrue(harness.memory.is_ready())
        harness.service.remember_state("Started")
        self.assertFalse(harness.memory.is_ready())


class StopTests(SynchronousTestCase):
    def test_stopWritesStopped(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        harness.written()
        harness.service.stopService()
        self.assertEqual(harness.written(), [b"STOPPED"])

    def test_stopClosesTheLink(self) -> None:
        harness = Harness(self)
        harness.service.startService()
        watch = harness.connect()
        stopped = harness.service.stopService()
        self.assertTrue(watch.lost.called)
        self.assertIsNone(self.successResultOf(stopped))

    def test_serialGivingUpIsFatal(self) -> None:
        harness = Harness(self)
        harness.service.serial_gave_up("serial port unusable after 2 attempts: gone")
        self.assertEqual(harness.service.exit_code, 1)
        self.assertEqual(harness.fatal, ["serial port unusable after 2 attempts: gone"])


class SocketPathTests(SynchronousTestCase):
    """Preparing the devlxd socket's path before listening."""

    def setUp(self) -> None:
        self.base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.path = os.path.join(self.base, "dev", "lxd", "sock")

    def bound_socket(self) -> socket.socket:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(bound.close)
        bound.bind(self.path)
        return bound

    def test_missingDirectoryIsMade(self) -> None:
        prepare_socket_path(self.path)
        self.assertTrue(os.path.isdir(os.path.dirname(self.path)))

    def test_socketNobodyServesIsRemoved(self) -> None:
        self.bound_socket()  # bound, never listening: connecting is refused
        prepare_socket_path(self.path)
        self.assertFalse(os.path.exists(self.path))

    def test_socketSomeoneServesIsRefused(self) -> None:
        self.bound_socket().listen(1)
        error = self.assertRaises(ConfigError, prepare_socket_path, self.path)
        self.assertEqual(str(error), f"{self.path} is in use: another vmready-agent is serving it")

    def test_fileThatIsNotASocketIsRefused(self) -> None:
        os.makedirs(os.path.dirname(self.path))
        open(self.path, "w").close()
        error = self.assertRaises(ConfigError, prepare_socket_path, self.path)
        self.assertEqual(str(error), f"{self.path} exists and is not a socket; not replacing it")

    def test_pathTooLongForAUnixSocketIsRefused(self) -> None:
        error = self.assertRaises(ConfigError, prepare_socket_path, "/" + "x" * 120)
        self.assertIn("is longer than 107 bytes", str(error))
