"""The agent's ``vmready.connect`` port: CONNECT lines arrive; no host means wait, not give up.

A FIFO stands in for the virtio port: opened for reading with no writer it
reads end-of-file at once and polls as hung up, exactly as a virtio port does
while no daemon is connected to its chardev socket; a writer opening it is the
daemon connecting.  A unix socket stands in for a fakeqemu guest's port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.asynciotesting import run_virtual, wait_until
from vmready.agent.connectport import ConnectPortReader
from vmready.agent.core import AgentCore, Dial, TcpAddress
from vmready.agent.ports import CONNECT_PORT_NAME, FoundPort, SerialPortMissing


class Tree:
    """A guest's /dev/virtio-ports with (or without) the connect port."""

    def __init__(self, base: str) -> None:
        self.directory = os.path.join(base, "virtio-ports")
        os.makedirs(self.directory)
        self.path = os.path.join(self.directory, CONNECT_PORT_NAME)

    def make_fifo(self) -> None:
        os.mkfifo(self.path)

    def locate(self) -> FoundPort:
        if not os.path.exists(self.path):
            raise SerialPortMissing(f"{CONNECT_PORT_NAME} in {self.directory}")
        return FoundPort(self.path, CONNECT_PORT_NAME)

    def host_writes(self, data: bytes) -> None:
        """The daemon connects and writes, then hangs up."""
        fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


class ConnectPortReaderTests(SynchronousTestCase):
    """What the reader does with the port in each state."""

    def setUp(self) -> None:
        # Short: a unix socket path holds 107 bytes at most.
        base = tempfile.mkdtemp(prefix="vmr-cp-", dir="/tmp")
        self.addCleanup(shutil.rmtree, base, True)
        self.tree = Tree(base)
        self.received: list[bytes] = []

    def reader(self) -> ConnectPortReader:
        return ConnectPortReader(self.tree.locate, self.received.append)

    def test_connectLineArrives(self) -> None:
        self.tree.make_fifo()

        async def scenario() -> None:
            reader = self.reader()
            reader.start()
            await asyncio.sleep(1)
            self.tree.host_writes(b"CONNECT tcp:10.0.2.100:8443\n")
            await wait_until(lambda: bool(self.received), timeout=10)
            await reader.stop()

        run_virtual(self, scenario)
        self.assertEqual(b"".join(self.received), b"CONNECT tcp:10.0.2.100:8443\n")

    def test_noHostMeansWaitingNotABusyLoop(self) -> None:
        self.tree.make_fifo()
        reader = self.reader()

        async def scenario() -> None:
            reader.start()
            await asyncio.sleep(1)
            self.tree.host_writes(b"")  # a daemon came and went: the port now says hung up
            await asyncio.sleep(60)
            await reader.stop()

        run_virtual(self, scenario)
        # End-of-file at most every 0.5 s at first, then every 2 s: about 30 reads a minute.
        self.assertGreater(reader.reads, 20)
        self.assertLess(reader.reads, 40)
        self.assertEqual(self.received, [])

    def test_hostThatComesAndGoesIsHeardEachTime(self) -> None:
        self.tree.make_fifo()

        async def scenario() -> None:
            reader = self.reader()
            reader.start()
            for port in (41001, 41002):
                await asyncio.sleep(30)  # no daemon for a while: the reader keeps waiting
                line = f"CONNECT 2:{port}\n".encode()
                self.tree.host_writes(line)
                await wait_until(lambda: line in b"".join(self.received))  # noqa: B023
            await reader.stop()

        run_virtual(self, scenario)
        self.assertEqual(b"".join(self.received), b"CONNECT 2:41001\nCONNECT 2:41002\n")

    def test_missingPortIsSaidOnceAndLookedForAgain(self) -> None:
        async def scenario() -> None:
            reader = self.reader()
            reader.start()
            await asyncio.sleep(25)
            self.tree.make_fifo()  # udev made the link late
            await asyncio.sleep(15)
            self.tree.host_writes(b"CONNECT 2:41001\n")
            await wait_until(lambda: bool(self.received), timeout=10)
            await reader.stop()

        with self.assertLogs("vmready.agent.connectport", logging.INFO) as logs:
            run_virtual(self, scenario)
        missing = [line for line in logs.output if "no vmready.connect port" in line]
        self.assertEqual(len(missing), 1, logs.output)
        self.assertEqual(self.received, [b"CONNECT 2:41001\n"])

    def test_fakeqemuSocketThatClosesIsConnectedAgain(self) -> None:
        connections: list[asyncio.StreamWriter] = []

        async def scenario() -> None:
            async def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                connections.append(writer)
                if len(connections) == 1:
                    writer.close()  # the host is not there yet
                else:
                    writer.write(b"CONNECT 2:41001\n")

            server = await asyncio.start_unix_server(accepted, self.tree.path)
            reader = self.reader()
            reader.start()
            await wait_until(lambda: bool(self.received), timeout=30)
            await reader.stop()
            server.close()
            await server.wait_closed()

        run_virtual(self, scenario)
        self.assertEqual(self.received, [b"CONNECT 2:41001\n"])
        self.assertEqual(len(connections), 2)


class CoreTests(SynchronousTestCase):
    """The core reads the connect port as a stream of its own."""

    def test_connectOnTheConnectPortDials(self) -> None:
        core = AgentCore()
        commands = core.connect_port_data(b"CONNECT tcp:10.0.2.100:8443\n")
        self.assertEqual([type(c) for c in commands], [Dial], commands)
        dial = commands[0]
        assert isinstance(dial, Dial)
        self.assertEqual(dial.address, TcpAddress("10.0.2.100", 8443))

    def test_aLineDoesNotContinueAcrossThePorts(self) -> None:
        core = AgentCore()
        self.assertEqual(core.data_received(b"CONNECT tcp:10.0"), [])
        self.assertEqual(core.connect_port_data(b".2.100:8443\n"), [])
