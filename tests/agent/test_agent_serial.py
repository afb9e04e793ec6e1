"""Tests for vmready.agent.serial: finding, opening and keeping the agent's serial port."""

from __future__ import annotations

import asyncio
import os
import pty
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.asynciotesting import run_in_loop, run_virtual
from vmready.agent.ports import (
    LEGACY_PORT_NAME,
    PORT_NAME,
    FoundPort,
    SerialPortMissing,
    find_port,
    port_names,
)
from vmready.agent.serial import (
    OnData,
    OnLost,
    SerialChannel,
    SerialKeeper,
    SerialOpenError,
    open_serial,
)


def short_tempdir(test: SynchronousTestCase) -> str:
    """A temp dir under /tmp: unix socket paths must stay short."""
    base = tempfile.mkdtemp(prefix="vra-")
    test.addCleanup(shutil.rmtree, base, True)
    return base


class FakeTree:
    """A guest's /dev/virtio-ports, /sys/class/virtio-ports and /dev, in a temp dir."""

    def __init__(self, test: SynchronousTestCase) -> None:
        base = short_tempdir(test)
        self.links = os.path.join(base, "dev", "virtio-ports")
        self.sysfs = os.path.join(base, "sys", "class", "virtio-ports")
        self.dev = os.path.join(base, "dev")
        for directory in (self.links, self.sysfs):
            os.makedirs(directory)

    def udev_link(self, name: str) -> str:
        """udev's link for the port ``name``."""
        path = os.path.join(self.links, name)
        open(path, "w").close()
        return path

    def vport(self, entry: str, name: str) -> str:
        """A port without a link: ``/dev/<entry>``, named in sysfs."""
        os.makedirs(os.path.join(self.sysfs, entry))
        with open(os.path.join(self.sysfs, entry, "name"), "w") as f:
            f.write(name + "\n")
        path = os.path.join(self.dev, entry)
        open(path, "w").close()
        return path

    def find(self, names: tuple[str, ...] = port_names(None), sysfs: bool = True) -> FoundPort:
        return find_port(names, self.links, self.sysfs if sysfs else None, self.dev)


class FindPortTests(SynchronousTestCase):
    """Where the agent finds its port, with udev's links and without them."""

    def setUp(self) -> None:
        self.tree = FakeTree(self)

    def test_prefersTheCurrentName(self) -> None:
        self.tree.udev_link(LEGACY_PORT_NAME)
        current = self.tree.udev_link(PORT_NAME)
        self.assertEqual(self.tree.find(), FoundPort(current, PORT_NAME))

    def test_fallsBackToTheLegacyName(self) -> None:
        legacy = self.tree.udev_link(LEGACY_PORT_NAME)
        self.assertEqual(self.tree.find(), FoundPort(legacy, LEGACY_PORT_NAME))

    def test_theWiredNameIsTriedFirst(self) -> None:
        self.tree.udev_link(PORT_NAME)
        legacy = self.tree.udev_link(LEGACY_PORT_NAME)
        self.assertEqual(self.tree.find(port_names(LEGACY_PORT_NAME)).path, legacy)

    def test_withoutUdevTheNameIsLookedUpInSysfs(self) -> None:
        self.tree.vport("vport1p1", LEGACY_PORT_NAME)
        device = self.tree.vport("vport1p2", PORT_NAME)
        self.assertEqual(self.tree.find(), FoundPort(device, PORT_NAME, self.tree.sysfs))

    def test_withoutUdevTheLegacyNameIsFoundInSysfs(self) -> None:
        device = self.tree.vport("vport2p1", LEGACY_PORT_NAME)
        self.assertEqual(self.tree.find().path, device)

    def test_aLinkOfTheSameNameWinsOverSysfs(self) -> None:
        self.tree.vport("vport1p1", PORT_NAME)
        link = self.tree.udev_link(PORT_NAME)
        self.assertEqual(self.tree.find().path, link)

    def test_theCurrentNameInSysfsWinsOverALegacyLink(self) -> None:
        self.tree.udev_link(LEGACY_PORT_NAME)
        device = self.tree.vport("vport1p1", PORT_NAME)
        self.assertEqual(self.tree.find().path, device)

    def test_sysfsNamingADeviceThatIsMissingIsSkipped(self) -> None:
        os.unlink(self.tree.vport("vport1p1", PORT_NAME))
        self.assertRaises(SerialPortMissing, self.tree.find)

    def test_sysfsIsNotSearchedWhenTurnedOff(self) -> None:
        self.tree.vport("vport1p1", PORT_NAME)
        error = self.assertRaises(SerialPortMissing, self.tree.find, sysfs=False)
        self.assertEqual(
            str(error), f"neither {PORT_NAME} nor {LEGACY_PORT_NAME} in {self.tree.links}"
        )

    def test_noPortSaysWhereItLooked(self) -> None:
        error = self.assertRaises(SerialPortMissing, self.tree.find)
        self.assertEqual(
            str(error),
            f"neither {PORT_NAME} nor {LEGACY_PORT_NAME} in {self.tree.links} "
            f"or {self.tree.sysfs}",
        )

    def test_missingSysfsIsNoError(self) -> None:
        shutil.rmtree(self.tree.sysfs)
        self.assertRaises(SerialPortMissing, self.tree.find)

    def test_anUnknownWiredNameIsTriedBeforeTheKnownOnes(self) -> None:
        self.assertEqual(port_names("x.y"), ("x.y", PORT_NAME, LEGACY_PORT_NAME))
        error = self.assertRaises(SerialPortMissing, self.tree.find, port_names("x.y"))
        self.assertIn(f"none of x.y, {PORT_NAME}, {LEGACY_PORT_NAME} in", str(error))


class FoundPortTests(SynchronousTestCase):
    """How the log names the port it opened."""

    def test_linkOfTheCurrentName(self) -> None:
        self.assertEqual(
            FoundPort("/dev/virtio-ports/x", PORT_NAME).describe(), "/dev/virtio-ports/x"
        )

    def test_linkOfTheLegacyName(self) -> None:
        found = FoundPort("/d/org.linuxcontainers.lxd", LEGACY_PORT_NAME)
        self.assertEqual(found.describe(), "/d/org.linuxcontainers.lxd (legacy name)")

    def test_foundInSysfs(self) -> None:
        found = FoundPort("/dev/vport1p1", LEGACY_PORT_NAME, "/sys/class/virtio-ports")
        self.assertEqual(
            found.describe(),
            "/dev/vport1p1 (org.linuxcontainers.lxd, found in /sys/class/virtio-ports; "
            "legacy name)",
        )


class FakeChannel(SerialChannel):
    """A port in memory: it keeps what is written; the test can close it from the far end."""

    def __init__(self, on_data: OnData, on_lost: OnLost, flushes: bool = True) -> None:
        super().__init__(on_data, on_lost)
        self.written = bytearray()
        self.flushes = flushes

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self._closing = True
        if self.flushes:
            self._end("closed by the agent")

    def abort(self) -> None:
        self._end("aborted")

    def hang_up(self) -> None:
        """The far end closes (a fakeqemu VM reset)."""
        self._end("closed by the other end")


class KeeperHarness:
    """A SerialKeeper on a virtual-time loop whose openings are scripted."""

    def __init__(self, delays: tuple[float, ...] = (1.0, 2.0), stable_after: float = 5.0) -> None:
        self.refusals = 0
        self.channels: list[FakeChannel] = []
        self.attempts: list[float] = []
        self.opened = 0
        self.data: list[bytes] = []
        self.gave_up: list[str] = []
        self.flushes = True
        self.keeper = SerialKeeper(
            lambda: FoundPort("/dev/virtio-ports/com.canonical.lxd", PORT_NAME),
            self.data.append,
            self.on_open,
            self.gave_up.append,
            delays=delays,
            stable_after=stable_after,
            opener=self.open,
        )

    def on_open(self) -> None:
        self.opened += 1

    async def started(self) -> None:
        """The keeper started, and its first opening tried."""
        self.keeper.start()
        await settle()

    async def open(self, path: str, on_data: OnData, on_lost: OnLost) -> SerialChannel:
        self.attempts.append(asyncio.get_running_loop().time())
        if self.refusals:
            self.refusals -= 1
            raise SerialOpenError("cannot open it: No such device")
        channel = FakeChannel(on_data, on_lost, self.flushes)
        self.channels.append(channel)
        return channel

    @property
    def gaps(self) -> list[float]:
        """Seconds between successive opening attempts."""
        pairs = zip(self.attempts, self.attempts[1:], strict=False)
        return [later - earlier for earlier, later in pairs]


async def settle() -> None:
    """Let scheduled callbacks and tasks run (no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


class SerialKeeperTests(SynchronousTestCase):
    def test_openingTellsTheAgent(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> None:
            await harness.started()

        run_virtual(self, scenario)
        self.assertEqual((harness.opened, harness.keeper.is_open), (1, True))

    def test_writesGoToThePort(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> bool:
            await harness.started()
            return harness.keeper.write(b"STARTED\n")

        self.assertTrue(run_virtual(self, scenario))
        self.assertEqual(bytes(harness.channels[0].written), b"STARTED\n")

    def test_writesWhileClosedAreDropped(self) -> None:
        harness = KeeperHarness()
        harness.refusals = 1

        async def scenario() -> bool:
            await harness.started()
            written = harness.keeper.write(b"STARTED\n")
            await harness.keeper.stop()
            return written

        self.assertFalse(run_virtual(self, scenario))

    def test_closedPortIsReopenedAfterTheFirstDelay(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> None:
            harness.keeper.start()
            await asyncio.sleep(10)  # the port was stable
            harness.channels[0].hang_up()
            await asyncio.sleep(5)
            await harness.keeper.stop()

        run_virtual(self, scenario)
        self.assertEqual((harness.opened, harness.gaps), (2, [11.0]))

    def test_failedOpeningsWaitLongerEachTime(self) -> None:
        harness = KeeperHarness(delays=(1.0, 2.0, 4.0))
        harness.refusals = 3

        async def scenario() -> None:
            harness.keeper.start()
            await asyncio.sleep(20)
            await harness.keeper.stop()

        run_virtual(self, scenario)
        self.assertEqual((harness.gaps, harness.opened), ([1.0, 2.0, 4.0], 1))

    def test_givesUpAfterTheLastDelayWithOneLine(self) -> None:
        harness = KeeperHarness(delays=(1.0,))
        harness.refusals = 2

        async def scenario() -> None:
            harness.keeper.start()
            await asyncio.sleep(10)

        run_virtual(self, scenario)
        self.assertEqual(
            harness.gave_up,
            ["serial port unusable after 2 attempts: cannot open it: No such device"],
        )
        self.assertEqual(len(harness.attempts), 2)

    def test_portThatClosesAtOnceEndsInGivingUp(self) -> None:
        # fakeqemu lets one client hold a port: a second is closed as soon as it connects.
        harness = KeeperHarness(delays=(1.0, 1.0), stable_after=5.0)

        async def scenario() -> None:
            harness.keeper.start()
            for _ in range(3):
                await settle()
                harness.channels[-1].hang_up()
                await asyncio.sleep(1.0)

        run_virtual(self, scenario)
        self.assertEqual(len(harness.gave_up), 1)
        self.assertIn("closed by the other end", harness.gave_up[0])

    def test_portThatStayedOpenStartsTheDelaysAfresh(self) -> None:
        harness = KeeperHarness(delays=(1.0,), stable_after=5.0)

        async def scenario() -> None:
            harness.keeper.start()
            for _ in range(3):
                await asyncio.sleep(5.0)
                harness.channels[-1].hang_up()
                await asyncio.sleep(1.0)
            await harness.keeper.stop()

        run_virtual(self, scenario)
        self.assertEqual((harness.opened, harness.gave_up), (4, []))

    def test_stopClosesThePortAfterFlushing(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> None:
            await harness.started()
            harness.keeper.write(b"STOPPED\n")
            await harness.keeper.stop()

        run_virtual(self, scenario)
        channel = harness.channels[0]
        self.assertEqual((bytes(channel.written), channel.ended), (b"STOPPED\n", True))
        self.assertFalse(harness.keeper.is_open)

    def test_stopCancelsAPendingReopen(self) -> None:
        harness = KeeperHarness()
        harness.refusals = 1

        async def scenario() -> None:
            await harness.started()
            await harness.keeper.stop()
            await asyncio.sleep(10)

        run_virtual(self, scenario)
        self.assertEqual(len(harness.attempts), 1)

    def test_portThatNeverFlushesIsClosedAfterTwoSeconds(self) -> None:
        harness = KeeperHarness()
        harness.flushes = False

        async def scenario() -> float:
            await harness.started()
            loop = asyncio.get_running_loop()
            started = loop.time()
            await harness.keeper.stop()
            return loop.time() - started

        self.assertEqual(run_virtual(self, scenario), 2.0)
        self.assertTrue(harness.channels[0].ended)


class PulseTests(SynchronousTestCase):
    """An announced line: the port closes once it is flushed and reopens at once, quietly."""

    def test_anAnnouncedLineClosesAndReopensThePort(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> None:
            await harness.started()
            harness.keeper.write(b"CONNECTED\n", announce=True)
            await settle()

        run_virtual(self, scenario)
        first, second = harness.channels
        self.assertEqual((bytes(first.written), first.ended), (b"CONNECTED\n", True))
        self.assertFalse(second.ended)
        self.assertTrue(harness.keeper.is_open)
        self.assertEqual(harness.opened, 1)  # the reopening is not a new opening for the agent
        self.assertEqual(harness.gaps, [0.0])

    def test_aQuietLineLeavesThePortOpen(self) -> None:
        harness = KeeperHarness()

        async def scenario() -> None:
            await harness.started()
            harness.keeper.write(b"CONNECTED\n")
            await settle()

        run_virtual(self, scenario)
        self.assertEqual(len(harness.channels), 1)
        self.assertFalse(harness.channels[0].ended)

    def test_linesWrittenDuringAPulseAreHeldAndAnnounced(self) -> None:
        harness = KeeperHarness()
        harness.flushes = False  # the first close waits for its flush: the pulse is slow

        async def scenario() -> None:
            await harness.started()
            harness.keeper.write(b"STARTED\n", announce=True)
            await settle()
            harness.flushes = True
            self.assertTrue(harness.keeper.write(b"CONNECTED\n", announce=True))
            await asyncio.sleep(5)

        run_virtual(self, scenario)
        written = [bytes(channel.written) for channel in harness.channels]
        self.assertEqual(written, [b"STARTED\n", b"CONNECTED\n", b""])
        self.assertEqual([channel.ended for channel in harness.channels], [True, True, False])

    def test_stopDuringAPulseStillWritesWhatWasHeld(self) -> None:
        """STOPPED said while the port is between close and reopen reaches the host."""
        harness = KeeperHarness()
        harness.flushes = False

        async def scenario() -> None:
            await harness.started()
            harness.keeper.write(b"STARTED\n", announce=True)
            await settle()
            harness.flushes = True
            harness.keeper.write(b"STOPPED\n")
            await harness.keeper.stop()

        run_virtual(self, scenario)
        self.assertEqual(
            [bytes(channel.written) for channel in harness.channels], [b"STARTED\n", b"STOPPED\n"]
        )
        self.assertTrue(all(channel.ended for channel in harness.channels))
        self.assertFalse(harness.keeper.is_open)

    def test_aReopeningThatFailsFallsBackToTheDelays(self) -> None:
        """The port is gone during a pulse: the usual reopening, which tells the agent."""
        harness = KeeperHarness(delays=(1.0, 2.0))

        async def scenario() -> None:
            await harness.started()
            harness.refusals = 1
            harness.keeper.write(b"STARTED\n", announce=True)
            await asyncio.sleep(5)
            await harness.keeper.stop()

        run_virtual(self, scenario)
        self.assertEqual(harness.gaps, [0.0, 1.0])
        self.assertEqual(harness.opened, 2)


class Peer:
    """fakeqemu's end of a virtio port: a unix socket holding one client, in the test's loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.received = bytearray()
        self.clients: list[asyncio.StreamWriter] = []
        self.connected = asyncio.Event()
        self.got_data = asyncio.Event()

    async def start(self) -> asyncio.AbstractServer:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        return await asyncio.start_unix_server(self._client, self.path)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.clients.append(writer)
        self.connected.set()
        while True:
            data = await reader.read(1024)
            if not data:
                return
            self.received += data
            self.got_data.set()


class UnixSocketPortTests(SynchronousTestCase):
    """A fakeqemu guest's port: a unix socket."""

    def setUp(self) -> None:
        self.base = short_tempdir(self)
        self.path = os.path.join(self.base, "virtio-ports", PORT_NAME)

    def test_bytesGoBothWays(self) -> None:
        async def scenario() -> tuple[bytes, bytes]:
            peer = Peer(self.path)
            server = await peer.start()
            arrived = asyncio.Event()
            data = bytearray()

            def on_data(chunk: bytes) -> None:
                data.extend(chunk)
                arrived.set()

            channel = await open_serial(self.path, on_data, lambda reason: None)
            await peer.connected.wait()
            channel.write(b"STARTED\n")
            await peer.got_data.wait()
            peer.clients[0].write(b"CONNECT 2:1234\n")
            await arrived.wait()
            channel.close()
            server.close()
            return bytes(peer.received), bytes(data)

        self.assertEqual(run_in_loop(self, scenario), (b"STARTED\n", b"CONNECT 2:1234\n"))

    def test_peerClosingIsReportedOnce(self) -> None:
        async def scenario() -> list[str]:
            peer = Peer(self.path)
            server = await peer.start()
            reasons: list[str] = []
            lost = asyncio.Event()

            def on_lost(reason: str) -> None:
                reasons.append(reason)
                lost.set()

            await open_serial(self.path, lambda data: None, on_lost)
            await peer.connected.wait()
            peer.clients[0].close()
            await lost.wait()
            server.close()
            return reasons

        self.assertEqual(run_in_loop(self, scenario), ["closed by the other end"])

    def open_error(self, path: str) -> str:
        """Why ``open_serial(path)`` refused (the SerialOpenError's message), or "opened"."""

        async def scenario() -> str:
            try:
                await open_serial(path, lambda data: None, lambda reason: None)
            except SerialOpenError as e:
                return str(e)
            return "opened"

        return run_in_loop(self, scenario)

    def test_missingSocketIsAnOpenError(self) -> None:
        self.assertEqual(
            self.open_error(self.path), f"cannot open {self.path}: No such file or directory"
        )

    def test_aPlainFileIsRefused(self) -> None:
        plain = os.path.join(self.base, "file")
        open(plain, "w").close()
        self.assertEqual(
            self.open_error(plain), f"{plain} is neither a character device nor a unix socket"
        )

    def test_keeperReopensAPortTheVMReset(self) -> None:
        async def scenario() -> int:
            peer = Peer(self.path)
            server = await peer.start()
            opened = asyncio.Event()
            keeper = SerialKeeper(
                lambda: find_port(port_names(None), os.path.dirname(self.path), None),
                lambda data: None,
                opened.set,
                lambda reason: None,
                delays=(0.01, 0.02),
            )
            keeper.start()
            await opened.wait()
            opened.clear()
            peer.clients[0].close()  # the VM reset
            await opened.wait()
            await keeper.stop()
            server.close()
            return len(peer.clients)

        self.assertEqual(run_in_loop(self, scenario), 2)


def line_collector() -> tuple[bytearray, asyncio.Event, OnData]:
    """What the port delivers, an event set once it ends a line, and the ``on_data`` that
    fills both (call in the test's loop)."""
    data = bytearray()
    complete = asyncio.Event()

    def on_data(chunk: bytes) -> None:
        data.extend(chunk)
        if data.endswith(b"\n"):
            complete.set()

    return data, complete, on_data


class CharacterDevicePortTests(SynchronousTestCase):
    """A real guest's port: a character device, here a pty's far end."""

    def setUp(self) -> None:
        self.master, slave = pty.openpty()
        self.addCleanup(os.close, self.master)
        self.path = os.ttyname(slave)
        os.close(slave)

    async def read_master(self, size: int) -> bytes:
        loop = asyncio.get_running_loop()
        got = b""
        while len(got) < size:
            readable: asyncio.Future[None] = loop.create_future()

            def ready(waiter: asyncio.Future[None] = readable) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            loop.add_reader(self.master, ready)
            try:
                await readable
            finally:
                loop.remove_reader(self.master)
            got += os.read(self.master, 1024)
        return got

    def device_reads(self, sent_first: bytes = b"") -> bytes:
        """What the device's far end reads of the agent's STARTED line, written after the
        far end sent ``sent_first``."""

        async def scenario() -> bytes:
            channel = await open_serial(self.path, lambda data: None, lambda reason: None)
            if sent_first:
                os.write(self.master, sent_first)
            channel.write(b"STARTED\n")
            got = await self.read_master(8)
            channel.close()
            return got

        return run_in_loop(self, scenario)

    def test_writesReachTheDevice(self) -> None:
        self.assertEqual(self.device_reads(), b"STARTED\n")

    def test_deviceBytesReachTheAgent(self) -> None:
        async def scenario() -> bytes:
            data, complete, on_data = line_collector()
            channel = await open_serial(self.path, on_data, lambda reason: None)
            os.write(self.master, b"CONNECT 2:1234\n")
            await complete.wait()
            channel.close()
            return bytes(data)

        self.assertEqual(run_in_loop(self, scenario), b"CONNECT 2:1234\n")

    def test_deviceIsInRawModeWithoutEcho(self) -> None:
        # Without raw mode the line discipline would echo the CONNECT back first.
        self.assertEqual(self.device_reads(b"CONNECT 2:1234\n"), b"STARTED\n")

    def test_closeReportsClosedByTheAgent(self) -> None:
        async def scenario() -> list[str]:
            reasons: list[str] = []
            channel = await open_serial(self.path, lambda data: None, reasons.append)
            channel.close()
            return reasons

        self.assertEqual(run_in_loop(self, scenario), ["closed by the agent"])
