"""Tests for vmready.agent.serial: finding, opening and keeping the agent's serial port."""

from __future__ import annotations

import contextlib
import os
import pty
import shutil
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransportWithDisconnection
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from vmready.agent.serial import (
    LEGACY_PORT_NAME,
    PORT_NAME,
    SerialKeeper,
    SerialOpenError,
    SerialPortMissing,
    choose_port,
)
from vmready.agent.testing import FakeSerialPeer


def short_tempdir(test: SynchronousTestCase) -> str:
    """A temp dir under /tmp: unix socket paths must stay short."""
    base = tempfile.mkdtemp(prefix="vra-")
    test.addCleanup(shutil.rmtree, base, True)
    return base


class ChoosePortTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ports = short_tempdir(self)

    def touch(self, name: str) -> str:
        path = os.path.join(self.ports, name)
        open(path, "w").close()
        return path

    def test_prefersTheCurrentName(self) -> None:
        self.touch(LEGACY_PORT_NAME)
        current = self.touch(PORT_NAME)
        self.assertEqual(choose_port(self.ports), current)

    def test_fallsBackToTheLegacyName(self) -> None:
        legacy = self.touch(LEGACY_PORT_NAME)
        self.assertEqual(choose_port(self.ports), legacy)

    def test_noPortSaysWhereItLooked(self) -> None:
        error = self.assertRaises(SerialPortMissing, choose_port, self.ports)
        self.assertEqual(str(error), f"neither {PORT_NAME} nor {LEGACY_PORT_NAME} in {self.ports}")


class KeeperHarness:
    """A SerialKeeper on a Clock whose openings are scripted."""

    def __init__(self, delays: tuple[float, ...] = (1.0, 2.0), stable_after: float = 5.0) -> None:
        self.clock = Clock()
        self.results: list[Deferred[None] | None] = []
        self.transports: list[StringTransportWithDisconnection] = []
        self.opened = 0
        self.data: list[bytes] = []
        self.gave_up: list[str] = []
        self.keeper = SerialKeeper(
            self.clock,
            lambda: "/dev/virtio-ports/com.canonical.lxd",
            self.data.append,
            self.on_open,
            self.gave_up.append,
            delays=delays,
            stable_after=stable_after,
            opener=self.open,
        )

    def on_open(self) -> None:
        self.opened += 1

    def open(self, reactor: Any, path: str, protocol: Protocol) -> Deferred[None]:
        result = self.results.pop(0) if self.results else None
        if result is not None:
            return result
        transport = StringTransportWithDisconnection()
        transport.protocol = protocol
        protocol.makeConnection(transport)
        self.transports.append(transport)
        return succeed(None)

    def refuse(self, count: int) -> None:
        """The next ``count`` openings fail."""
        for _ in range(count):
            self.results.append(fail(SerialOpenError("cannot open it: No such device")))

    def close_port(self) -> None:
        self.transports[-1].loseConnection()


class SerialKeeperTests(SynchronousTestCase):
    def test_openingTellsTheAgent(self) -> None:
        harness = KeeperHarness()
        harness.keeper.startService()
        self.assertEqual(harness.opened, 1)

    def test_writesGoToThePort(self) -> None:
        harness = KeeperHarness()
        harness.keeper.startService()
        self.assertTrue(harness.keeper.write(b"STARTED\n"))
        self.assertEqual(harness.transports[0].value(), b"STARTED\n")

    def test_writesWhileClosedAreDropped(self) -> None:
        harness = KeeperHarness()
        harness.refuse(1)
        harness.keeper.startService()
        self.assertFalse(harness.keeper.write(b"STARTED\n"))

    def test_closedPortIsReopenedAfterTheFirstDelay(self) -> None:
        harness = KeeperHarness()
        harness.keeper.startService()
        harness.clock.advance(10)  # the port was stable
        harness.close_port()
        harness.clock.advance(0.9)
        self.assertEqual(harness.opened, 1)
        harness.clock.advance(0.1)
        self.assertEqual(harness.opened, 2)

    def test_failedOpeningsWaitLongerEachTime(self) -> None:
        harness = KeeperHarness(delays=(1.0, 2.0, 4.0))
        harness.refuse(3)
        harness.keeper.startService()
        for delay in (1.0, 2.0, 4.0):
            self.assertEqual(
                [c.getTime() - harness.clock.seconds() for c in harness.clock.getDelayedCalls()],
                [delay],
            )
            harness.clock.advance(delay)
        self.assertEqual(harness.opened, 1)

    def test_givesUpAfterTheLastDelayWithOneLine(self) -> None:
        harness = KeeperHarness(delays=(1.0,))
        harness.refuse(2)
        harness.keeper.startService()
        harness.clock.advance(1.0)
        self.assertEqual(
            harness.gave_up,
            ["serial port unusable after 2 attempts: cannot open it: No such device"],
        )
        self.assertEqual(harness.clock.getDelayedCalls(), [])

    def test_portThatClosesAtOnceEndsInGivingUp(self) -> None:
        # fakeqemu lets one client hold a port: a second is closed as soon as it connects.
        harness = KeeperHarness(delays=(1.0, 1.0), stable_after=5.0)
        harness.keeper.startService()
        for _ in range(2):
            harness.close_port()
            harness.clock.advance(1.0)
        harness.close_port()
        self.assertEqual(len(harness.gave_up), 1)
        self.assertIn("closed by the other end", harness.gave_up[0])

    def test_portThatStayedOpenStartsTheDelaysAfresh(self) -> None:
        harness = KeeperHarness(delays=(1.0,), stable_after=5.0)
        harness.keeper.startService()
        for _ in range(3):
            harness.clock.advance(5.0)
            harness.close_port()
            harness.clock.advance(1.0)
        self.assertEqual((harness.opened, harness.gave_up), (4, []))

    def test_stopClosesThePortAfterFlushing(self) -> None:
        harness = KeeperHarness()
        harness.keeper.startService()
        harness.keeper.write(b"STOPPED\n")
        stopped = harness.keeper.stopService()
        self.assertIsNone(self.successResultOf(stopped))
        self.assertEqual(harness.transports[0].value(), b"STOPPED\n")
        self.assertFalse(harness.transports[0].connected)

    def test_stopCancelsAPendingReopen(self) -> None:
        harness = KeeperHarness()
        harness.refuse(1)
        harness.keeper.startService()
        harness.keeper.stopService()
        self.assertEqual(harness.clock.getDelayedCalls(), [])

    def test_portThatNeverFlushesIsClosedAfterTwoSeconds(self) -> None:
        harness = KeeperHarness()
        harness.keeper.startService()
        transport = harness.transports[0]
        transport.loseConnection = lambda: None  # type: ignore[method-assign]
        stopped = harness.keeper.stopService()
        self.assertNoResult(stopped)
        transport.protocol.connectionLost(Failure(ConnectionDone()))
        self.assertIsNone(self.successResultOf(stopped))


class UnixSocketPortTests(TestCase):
    """A fakeqemu guest's port: a unix socket, one client at a time."""

    def setUp(self) -> None:
        self.base = short_tempdir(self)
        self.peer = FakeSerialPeer(reactor, os.path.join(self.base, "virtio-ports", PORT_NAME))
        self.peer.start()
        self.addCleanup(self.peer.stop)
        self.data: list[bytes] = []
        self.gave_up: list[str] = []
        self.opened: list[Deferred[None]] = []
        self.keeper = SerialKeeper(
            reactor,
            lambda: choose_port(os.path.join(self.base, "virtio-ports")),
            self.data.append,
            self._opened,
            self.gave_up.append,
            delays=(0.01, 0.02),
        )

    def _opened(self) -> None:
        waiting, self.opened = self.opened, []
        for waiter in waiting:
            waiter.callback(None)

    def next_open(self) -> Deferred[None]:
        waiter: Deferred[None] = Deferred()
        self.opened.append(waiter)
        return waiter.addTimeout(5, reactor)

    async def start(self) -> None:
        opened = self.next_open()
        self.keeper.startService()
        self.addCleanup(self.keeper.stopService)
        await opened

    async def test_linesWrittenReachThePeer(self) -> None:
        await self.start()
        seen = self.peer.wait_for(b"STARTED")
        self.keeper.write(b"STARTED\n")
        await seen

    async def test_peerBytesReachTheAgent(self) -> None:
        await self.start()
        await self.peer.attached()
        self.peer.send(b"CONNECT 2:1234\n")
        while not self.data:
            await deferLater(reactor, 0.01)
        self.assertEqual(b"".join(self.data), b"CONNECT 2:1234\n")

    async def test_resetPortIsReopened(self) -> None:
        await self.start()
        await self.peer.attached()
        reopened = self.next_open()
        await self.peer.drop_client()
        await reopened
        await self.peer.attached()
        self.assertEqual(self.peer.connections, 2)

    async def test_vanishedPortEndsInGivingUp(self) -> None:
        await self.start()
        await self.peer.attached()
        await self.peer.stop()  # the socket file goes too
        while not self.gave_up:
            await deferLater(reactor, 0.01)
        self.assertIn("neither com.canonical.lxd nor org.linuxcontainers.lxd", self.gave_up[0])

    async def test_stopFlushesTheLastLine(self) -> None:
        await self.start()
        seen = self.peer.wait_for(b"STOPPED")
        self.keeper.write(b"STOPPED\n")
        await self.keeper.stopService()
        await seen


class CharacterDevicePortTests(TestCase):
    """A real guest's port: a character device, here a pty's far end."""

    def setUp(self) -> None:
        self.master, slave = pty.openpty()
        self.addCleanup(os.close, self.master)
        self.path = os.ttyname(slave)
        os.close(slave)
        os.set_blocking(self.master, False)
        self.data: list[bytes] = []
        self.keeper = SerialKeeper(
            reactor, lambda: self.path, self.data.append, lambda: None, lambda r: None
        )
        self.keeper.startService()
        self.addCleanup(self.keeper.stopService)

    async def read_master(self, size: int) -> bytes:
        got = b""
        for _ in range(500):
            with contextlib.suppress(BlockingIOError):
                got += os.read(self.master, 1024)
            if len(got) >= size:
                return got
            await deferLater(reactor, 0.01)
        return got

    def test_deviceIsOpen(self) -> None:
        self.assertTrue(self.keeper.is_open)

    async def test_writesReachTheDevice(self) -> None:
        self.keeper.write(b"STARTED\n")
        self.assertEqual(await self.read_master(8), b"STARTED\n")

    async def test_deviceBytesReachTheAgent(self) -> None:
        os.write(self.master, b"CONNECT 2:1234\n")
        for _ in range(500):
            if b"".join(self.data) == b"CONNECT 2:1234\n":
                break
            await deferLater(reactor, 0.01)
        self.assertEqual(b"".join(self.data), b"CONNECT 2:1234\n")

    async def test_deviceIsInRawModeWithoutEcho(self) -> None:
        os.write(self.master, b"CONNECT 2:1234\n")
        self.keeper.write(b"STARTED\n")
        self.assertEqual(await self.read_master(8), b"STARTED\n")
