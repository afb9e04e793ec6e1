"""Tests for vmready.agent.service: the core's commands carried out, on a virtual clock.

The agent runs on a ``VirtualTimeLoop`` with a serial port in memory and
scripted dials: each dial is a future the test resolves with a link in memory
(``MemoryLink``) or a failure, so heartbeats, retries and timeouts are checked
to the second without waiting for any.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.agent.test_agent_serial import FakeChannel
from tests.agentfakes import MemoryLink
from tests.asynciotesting import run_virtual
from vmready.agent.apisocket import bind_socket, prepare_socket_path
from vmready.agent.core import AgentCore, Backoff, HostAddress, VsockAddress
from vmready.agent.host import HostError, HostRefused, LinkWatch
from vmready.agent.memory import ReadyMemory
from vmready.agent.options import ConfigError
from vmready.agent.ports import PORT_NAME, FoundPort
from vmready.agent.proxy import HostUnreachable
from vmready.agent.serial import OnData, OnLost, SerialChannel, SerialKeeper
from vmready.agent.service import Agent

HOST = VsockAddress(2, 49152)
HEARTBEAT = 5.0
DIAL_TIMEOUT = 3.0  # shorter than a heartbeat: a timeout's STARTED stands alone


async def settle() -> None:
    """Let scheduled callbacks and tasks run (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


class Harness:
    """An Agent on a virtual clock, with a serial port in memory and scripted dials."""

    def __init__(self, test: SynchronousTestCase, retries: int = 2) -> None:
        self.test = test
        self.state_dir = tempfile.mkdtemp(prefix="vra-")
        test.addCleanup(shutil.rmtree, self.state_dir, True)
        self.memory = ReadyMemory(self.state_dir)
        self.dials: list[tuple[HostAddress, float, asyncio.Future[LinkWatch]]] = []
        self.patches: list[HostAddress] = []
        self.patch_error: BaseException | None = None
        self.channels: list[FakeChannel] = []
        self.agent = Agent(
            AgentCore(
                retries=retries,
                backoff=Backoff(first=1.0, longest=4.0),
                describe=lambda address: f"vsock {address}",
            ),
            self.endpoint_for,
            lambda address: f"vsock {address}",
            self.memory,
            HEARTBEAT,
            dial_timeout=DIAL_TIMEOUT,
            dial=self.dial,
            reassert=self.reassert,
        )
        self.agent.attach_serial(
            SerialKeeper(
                lambda: FoundPort("/dev/virtio-ports/com.canonical.lxd", PORT_NAME),
                self.agent.serial_data,
                self.agent.serial_opened,
                self.agent.serial_gave_up,
                delays=(1.0,),
                opener=self.open_serial,
            )
        )

    def endpoint_for(self, address: HostAddress) -> Any:
        return f"endpoint for {address}"

    async def open_serial(self, path: str, on_data: OnData, on_lost: OnLost) -> SerialChannel:
        channel = FakeChannel(on_data, on_lost)
        self.channels.append(channel)
        return channel

    async def dial(self, address: HostAddress) -> LinkWatch:
        outcome: asyncio.Future[LinkWatch] = asyncio.get_running_loop().create_future()
        self.dials.append((address, asyncio.get_running_loop().time(), outcome))
        return await outcome

    async def reassert(self, address: HostAddress) -> None:
        self.patches.append(address)
        if self.patch_error is not None:
            raise self.patch_error

    def written(self) -> list[bytes]:
        """Lines written to the serial port since the last call (over its reopenings)."""
        data = b"".join(bytes(channel.written) for channel in self.channels)
        for channel in self.channels:
            channel.written.clear()
        return data.splitlines()

    async def start(self) -> None:
        await self.agent.start()
        await settle()

    async def connect(self) -> MemoryLink:
        """CONNECT, and the dial succeeds."""
        self.agent.serial_data(b"CONNECT 2:49152\n")
        await settle()
        link = MemoryLink()
        self.dials[-1][2].set_result(link.watch)
        await settle()
        return link

    def run(self, scenario: Callable[[], Awaitable[Any]]) -> Any:
        async def wrapped() -> Any:
            try:
                return await scenario()
            finally:
                if self.agent.serial is not None and self.agent.serial.running:
                    await self.agent.stop()

        return run_virtual(self.test, wrapped)


class HeartbeatTests(SynchronousTestCase):
    def test_startWritesStartedOnTheSerialPort(self) -> None:
        harness = Harness(self)

        async def scenario() -> list[bytes]:
            await harness.start()
            return harness.written()

        self.assertEqual(harness.run(scenario), [b"STARTED"])

    def test_heartbeatRepeatsTheStatusEveryInterval(self) -> None:
        harness = Harness(self)

        async def scenario() -> list[list[bytes]]:
            await harness.start()
            harness.written()
            seen = []
            for _ in range(2):
                await asyncio.sleep(HEARTBEAT - 0.1)
                seen.append(harness.written())
                await asyncio.sleep(0.1)
                seen.append(harness.written())
            return seen

        self.assertEqual(harness.run(scenario), [[], [b"STARTED"], [], [b"STARTED"]])

    def test_heartbeatSaysConnectedOnceConnected(self) -> None:
        harness = Harness(self)

        async def scenario() -> list[bytes]:
            await harness.start()
            await harness.connect()
            harness.written()
            await asyncio.sleep(HEARTBEAT)
            return harness.written()

        self.assertEqual(harness.run(scenario), [b"CONNECTED"])


class DialTests(SynchronousTestCase):
    def test_connectDialsTheAdvertisedAddress(self) -> None:
        harness = Harness(self)

        async def scenario() -> None:
            await harness.start()
            harness.agent.serial_data(b"CONNECT 2:49152\n")
            await settle()

        harness.run(scenario)
        self.assertEqual([address for address, _, _ in harness.dials], [HOST])

    def test_successfulDialWritesConnected(self) -> None:
        harness = Harness(self)

        async def scenario() -> tuple[list[bytes], Any]:
            await harness.start()
            harness.written()
            await harness.connect()
            return harness.written(), harness.agent.core.link

        self.assertEqual(harness.run(scenario), ([b"CONNECTED"], HOST))

    def test_failedDialIsRetriedAfterTheBackoffDelay(self) -> None:
        harness = Harness(self)

        async def scenario() -> None:
            await harness.start()
            harness.agent.serial_data(b"CONNECT 2:49152\n")
            await settle()
            harness.dials[0][2].set_exception(HostError("cannot connect: Connection refused"))
            await asyncio.sleep(1.5)

        harness.run(scenario)
        self.assertEqual(len(harness.dials), 2)
        self.assertEqual(harness.dials[1][1] - harness.dials[0][1], 1.0)

    def test_lastFailedRetryWritesStarted(self) -> None:
        harness = Harness(self, retries=1)

        async def scenario() -> tuple[list[bytes], str]:
            await harness.start()
            harness.agent.serial_data(b"CONNECT 2:49152\n")
            await settle()
            harness.written()
            harness.dials[0][2].set_exception(HostError("cannot connect: Connection refused"))
            await asyncio.sleep(1.0)
            await settle()
            harness.dials[1][2].set_exception(HostError("cannot connect: Connection refused"))
            await settle()
            return harness.written(), harness.agent.core.unreachable_reason

        self.assertEqual(
            harness.run(scenario),
            (
                [b"STARTED"],
                "cannot connect to the host at vsock 2:49152: cannot connect: Connection refused",
            ),
        )

    def test_dialThatNeverAnswersTimesOut(self) -> None:
        harness = Harness(self, retries=0)

        async def scenario() -> tuple[list[bytes], list[bytes], str]:
            await harness.start()
            harness.agent.serial_data(b"CONNECT 2:49152\n")
            harness.written()
            await asyncio.sleep(DIAL_TIMEOUT - 0.01)
            before = harness.written()
            await asyncio.sleep(0.02)
            return before, harness.written(), harness.agent.core.unreachable_reason

        self.assertEqual(
            harness.run(scenario),
            ([], [b"STARTED"], "cannot connect to the host at vsock 2:49152: timed out"),
        )

    def test_connectToANewPortCancelsTheDialUnderWay(self) -> None:
        harness = Harness(self)

        async def scenario() -> bool:
            await harness.start()
            harness.agent.serial_data(b"CONNECT 2:49152\n")
            await settle()
            harness.agent.serial_data(b"CONNECT 2:50000\n")
            await settle()
            return harness.dials[0][2].cancelled()

        self.assertTrue(harness.run(scenario))
        self.assertEqual(harness.dials[1][0], VsockAddress(2, 50000))

    def test_linkLossWritesStarted(self) -> None:
        harness = Harness(self)

        async def scenario() -> tuple[list[bytes], Any, str]:
            await harness.start()
            link = await harness.connect()
            harness.written()
            link.host_ends()
            await settle()
            return (
                harness.written(),
                harness.agent.core.link,
                harness.agent.core.unreachable_reason,
            )

        self.assertEqual(
            harness.run(scenario),
            (
                [b"STARTED"],
                None,
                "lost the link to the host at vsock 2:49152: the host ended the event stream",
            ),
        )

    def test_redialingClosesTheOldLink(self) -> None:
        harness = Harness(self)

        async def scenario() -> bool:
            await harness.start()
            link = await harness.connect()
            harness.agent.serial_data(b"CONNECT 2:50000\n")
            await settle()
            return link.transport.closed

        self.assertTrue(harness.run(scenario))


class RouteTests(SynchronousTestCase):
    def test_routeIsUnreachableBeforeConnect(self) -> None:
        harness = Harness(self)

        async def scenario() -> str:
            await harness.start()
            try:
                harness.agent.route()
            except HostUnreachable as e:
                return str(e)
            return "reachable"

        self.assertEqual(harness.run(scenario), "the host has not sent CONNECT yet")

    def test_routeNamesTheHostOnceConnected(self) -> None:
        harness = Harness(self)

        async def scenario() -> tuple[str, Any]:
            await harness.start()
            await harness.connect()
            route = harness.agent.route()
            return route.label, route.endpoint

        self.assertEqual(harness.run(scenario), ("vsock 2:49152", "endpoint for 2:49152"))


class ReadyMemoryTests(SynchronousTestCase):
    def test_rememberedReadyIsPatchedAfterConnecting(self) -> None:
        harness = Harness(self)
        harness.memory.remember(True)

        async def scenario() -> None:
            await harness.start()
            await harness.connect()

        harness.run(scenario)
        self.assertEqual(harness.patches, [HOST])

    def test_nothingIsPatchedWithoutRememberedReady(self) -> None:
        harness = Harness(self)

        async def scenario() -> None:
            await harness.start()
            await harness.connect()

        harness.run(scenario)
        self.assertEqual(harness.patches, [])

    def test_readyIsPatchedAgainAfterEveryReconnect(self) -> None:
        harness = Harness(self)
        harness.memory.remember(True)

        async def scenario() -> None:
            await harness.start()
            link = await harness.connect()
            link.host_ends()
            await settle()
            await harness.connect()

        harness.run(scenario)
        self.assertEqual(harness.patches, [HOST, HOST])

    def test_refusedReassertionIsLoggedNotFatal(self) -> None:
        harness = Harness(self)
        harness.memory.remember(True)
        harness.patch_error = HostRefused("HTTP 409: Instance demo is not running")

        async def scenario() -> Any:
            await harness.start()
            await harness.connect()
            return harness.agent.core.link

        with self.assertLogs("vmready.agent.service") as logged:
            self.assertEqual(harness.run(scenario), HOST)
        self.assertIn(
            "could not reassert Ready to the host at vsock 2:49152 (refused): "
            "HTTP 409: Instance demo is not running",
            [record.getMessage() for record in logged.records],
        )

    def test_acceptedStateIsRemembered(self) -> None:
        harness = Harness(self)
        harness.agent.remember_state("Ready")
        self.assertTrue(harness.memory.is_ready())
        harness.agent.remember_state("Started")
        self.assertFalse(harness.memory.is_ready())


class StopTests(SynchronousTestCase):
    def test_stopWritesStopped(self) -> None:
        harness = Harness(self)

        async def scenario() -> bytes:
            await harness.start()
            harness.written()
            await harness.agent.stop()
            return bytes(harness.channels[-1].written)

        self.assertEqual(harness.run(scenario), b"STOPPED\n")

    def test_stopClosesTheLink(self) -> None:
        harness = Harness(self)

        async def scenario() -> tuple[bool, str]:
            await harness.start()
            link = await harness.connect()
            await harness.agent.stop()
            return link.transport.closed, link.watch.lost.result()

        self.assertEqual(harness.run(scenario), (True, "closed by the agent"))

    def test_runReturnsZeroAfterAStopRequest(self) -> None:
        harness = Harness(self)

        async def scenario() -> int:
            running = asyncio.ensure_future(harness.agent.run())
            await settle()
            harness.agent.request_stop()
            return await running

        self.assertEqual(harness.run(scenario), 0)

    def test_serialGivingUpEndsTheRunWithOne(self) -> None:
        harness = Harness(self)

        async def scenario() -> int:
            running = asyncio.ensure_future(harness.agent.run())
            await settle()
            harness.agent.serial_gave_up("serial port unusable after 2 attempts: gone")
            return await running

        with self.assertLogs("vmready.agent.service") as logged:
            self.assertEqual(harness.run(scenario), 1)
        self.assertEqual(
            logged.records[-1].getMessage(),
            "vmready-agent exits: serial port unusable after 2 attempts: gone",
        )


class SocketPathTests(SynchronousTestCase):
    """Preparing the devlxd socket's path, and binding it."""

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

    def test_boundSocketIsOwnerOnly(self) -> None:
        prepare_socket_path(self.path)
        listening = bind_socket(self.path)
        self.addCleanup(listening.close)
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)

    def test_bindingWhereItCannotSaysWhy(self) -> None:
        missing = os.path.join(self.base, "nowhere", "sock")
        error = self.assertRaises(ConfigError, bind_socket, missing)
        self.assertEqual(
            str(error), f"cannot serve the guest API on {missing}: No such file or directory"
        )

    def test_stopRemovesItsOwnSocketOnly(self) -> None:
        prepare_socket_path(self.path)
        harness = Harness(self)
        harness.agent.attach_socket(bind_socket(self.path), self.path)

        async def scenario() -> bool:
            await harness.start()
            await harness.agent.stop()
            return os.path.exists(self.path)

        self.assertFalse(harness.run(scenario))

    def test_aSocketAnotherAgentMadeMeanwhileStays(self) -> None:
        prepare_socket_path(self.path)
        harness = Harness(self)
        harness.agent.attach_socket(bind_socket(self.path), self.path)

        async def scenario() -> bool:
            await harness.start()
            os.unlink(self.path)
            self.bound_socket()  # the socket file of another agent
            await harness.agent.stop()
            return os.path.exists(self.path)

        self.assertTrue(harness.run(scenario))
