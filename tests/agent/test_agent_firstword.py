"""The agent's first STARTED: said on the real port before the agent's loop, and handed over."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import socket
import stat
import textwrap
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.agent.test_agent_main import fresh_interpreter
from tests.agent.test_agent_serial import Peer, line_collector, short_tempdir
from tests.asynciotesting import run_in_loop
from vmready.agent.firstword import FirstWord, api_socket_path, locate_status_port, say_started
from vmready.agent.ports import LEGACY_PORT_NAME, PORT_NAME, FoundPort, SerialPortMissing
from vmready.agent.serial import SerialKeeper, adopt_serial

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def options(**given: Any) -> dict[str, Any]:
    """``parse_options``' keys, unset unless ``given`` (underscores for dashes)."""
    names = ("config-drive", "serial", "virtio-ports", "socket")
    return {name: given.get(name.replace("-", "_")) for name in names}


class PtyPort:
    """A real guest's port stand-in: a pty whose far end the test reads."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.master, slave = pty.openpty()
        test.addCleanup(os.close, self.master)
        self.path = os.ttyname(slave)
        os.close(slave)

    def read(self) -> bytes:
        return os.read(self.master, 1024)


class LocateTests(SynchronousTestCase):
    """The status port, found as the agent's configuration will name it."""

    def setUp(self) -> None:
        self.base = short_tempdir(self)
        self.drive = os.path.join(self.base, "drive")
        os.makedirs(os.path.join(self.drive, "vp"))

    def agent_json(self, settings: dict[str, str]) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            json.dump(settings, f)

    def port(self, directory: str, name: str) -> str:
        path = os.path.join(directory, name)
        open(path, "w").close()
        return path

    def test_agentJsonsPortsDirectoryIsRelativeToTheDrive(self) -> None:
        path = self.port(os.path.join(self.drive, "vp"), PORT_NAME)
        self.agent_json({"virtio_ports": "vp"})
        self.assertEqual(
            locate_status_port(options(config_drive=self.drive)), FoundPort(path, PORT_NAME)
        )

    def test_theWiredNameComesFirst(self) -> None:
        self.port(os.path.join(self.drive, "vp"), PORT_NAME)
        legacy = self.port(os.path.join(self.drive, "vp"), LEGACY_PORT_NAME)
        self.agent_json({"virtio_ports": "vp", "port": LEGACY_PORT_NAME})
        self.assertEqual(
            locate_status_port(options(config_drive=self.drive)),
            FoundPort(legacy, LEGACY_PORT_NAME),
        )

    def test_theCommandLinesPortsDirectoryWins(self) -> None:
        elsewhere = os.path.join(self.base, "other")
        os.makedirs(elsewhere)
        path = self.port(elsewhere, PORT_NAME)
        self.agent_json({"virtio_ports": "vp"})
        found = locate_status_port(options(config_drive=self.drive, virtio_ports=elsewhere))
        self.assertEqual(found, FoundPort(path, PORT_NAME))

    def test_aNamedSerialPortIsTakenAsItIs(self) -> None:
        found = locate_status_port(options(serial="/dev/vport1p1"))
        self.assertEqual(found, FoundPort("/dev/vport1p1", "vport1p1"))

    def test_aWiredNameThatIsAPathIsNotFollowed(self) -> None:
        self.agent_json({"virtio_ports": "vp", "port": "../agent.json"})
        self.assertRaises(ValueError, locate_status_port, options(config_drive=self.drive))

    def test_aBrokenAgentJsonLeavesTheDefaults(self) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            f.write("{not json")
        error = self.assertRaises(
            SerialPortMissing, locate_status_port, options(config_drive=self.drive)
        )
        self.assertIn("/dev/virtio-ports", str(error))


class SayStartedTests(SynchronousTestCase):
    """STARTED written on the port, which stays open for the agent."""

    def test_aDeviceHearsStartedAndStaysOpen(self) -> None:
        port = PtyPort(self)
        word = say_started(options(serial=port.path))
        assert word is not None
        self.addCleanup(word.stop)
        self.assertEqual((port.read(), word.handed_over), (b"STARTED\n", False))

    def test_sayingItAgainIsAQuietHeartbeat(self) -> None:
        port = PtyPort(self)
        word = say_started(options(serial=port.path))
        assert word is not None
        self.addCleanup(word.stop)
        port.read()
        word.say_again()
        self.assertEqual((port.read(), word.handed_over), (b"STARTED\n", False))

    def test_stopSaysStoppedAndClosesThePort(self) -> None:
        port = PtyPort(self)
        word = say_started(options(serial=port.path))
        assert word is not None
        port.read()
        word.stop()
        self.assertEqual((port.read(), word.handed_over), (b"STOPPED\n", True))

    def test_aFakeqemuSocketHearsStartedAndStaysConnected(self) -> None:
        path = os.path.join(short_tempdir(self), PORT_NAME)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(server.close)
        server.bind(path)
        server.listen(1)
        word = say_started(options(serial=path))
        assert word is not None
        self.addCleanup(word.stop)
        client, _ = server.accept()
        self.addCleanup(client.close)
        client.settimeout(5)
        self.assertEqual(client.recv(64), b"STARTED\n")

    def test_nothingIsSaidWithoutAPort(self) -> None:
        missing = os.path.join(short_tempdir(self), "nope")
        self.assertIsNone(say_started(options(serial=missing)))

    def test_theMomentItWasSaidIsOnTheGuestsClock(self) -> None:
        port = PtyPort(self)
        word = say_started(options(serial=port.path))
        assert word is not None
        self.addCleanup(word.stop)
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        self.assertTrue(0 < word.said_at <= now, (word.said_at, now))


class EarlySocketTests(SynchronousTestCase):
    """The guest API's socket, bound with STARTED: requests wait in its backlog."""

    def setUp(self) -> None:
        self.port = PtyPort(self)
        self.drive = short_tempdir(self)
        self.path = os.path.join(short_tempdir(self), "lxd", "sock")

    def say(self, **given: Any) -> FirstWord:
        word = say_started(
            options(**{"serial": self.port.path, "config_drive": self.drive, **given})
        )
        assert word is not None
        self.addCleanup(word.stop)
        return word

    def test_boundWithStartedAndConnectableAtOnce(self) -> None:
        word = self.say(socket=self.path)
        self.assertEqual(self.port.read(), b"STARTED\n")
        self.assertEqual(word.api_path, self.path)
        self.assertTrue(stat.S_ISSOCK(os.lstat(self.path).st_mode))
        self.assertEqual(stat.S_IMODE(os.lstat(self.path).st_mode), 0o600)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(client.close)
        client.connect(self.path)  # accepted into the backlog: nobody serves it yet
        client.sendall(b"PATCH /1.0 HTTP/1.1\r\n")

    def test_agentJsonNamesItRelativeToTheDrive(self) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            json.dump({"devlxd_socket": "guest/devlxd.sock"}, f)
        self.assertEqual(
            api_socket_path(options(config_drive=self.drive)),
            os.path.join(self.drive, "guest", "devlxd.sock"),
        )
        self.assertEqual(api_socket_path(options(config_drive=self.drive)), self.say().api_path)

    def test_theCommandLineWinsAndTheDefaultIsDevLxd(self) -> None:
        with open(os.path.join(self.drive, "agent.json"), "w") as f:
            json.dump({"devlxd_socket": "guest/devlxd.sock"}, f)
        given = options(config_drive=self.drive)
        self.assertEqual(api_socket_path({**given, "socket": "/x/s"}), "/x/s")
        os.unlink(os.path.join(self.drive, "agent.json"))
        self.assertEqual(api_socket_path(given), "/dev/lxd/sock")

    def test_withoutAConfigDriveNothingIsBound(self) -> None:
        missing = os.path.join(self.drive, "nope")
        self.assertIsNone(api_socket_path({**options(config_drive=missing), "socket": self.path}))
        word = self.say(config_drive=missing, socket=self.path)
        self.assertIsNone(word.api_socket)
        self.assertFalse(os.path.exists(self.path))

    def test_aLiveAgentsSocketIsLeftToTheAgentsStartToReport(self) -> None:
        os.makedirs(os.path.dirname(self.path))
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(live.close)
        live.bind(self.path)
        live.listen(1)
        word = self.say(socket=self.path)
        self.assertEqual((word.api_socket, word.api_path), (None, None))
        self.assertTrue(os.path.exists(self.path))

    def test_theAgentTakesItAtItsPathOnce(self) -> None:
        word = self.say(socket=self.path)
        listening = word.take_api_socket(self.path)
        assert listening is not None
        self.addCleanup(listening.close)
        self.assertIsNone(word.take_api_socket(self.path))
        word.stop()  # the agent has it: stop leaves it
        self.assertTrue(os.path.exists(self.path))

    def test_boundElsewhereItIsClosedAndRemoved(self) -> None:
        word = self.say(socket=self.path)
        self.assertIsNone(word.take_api_socket(self.path + ".other"))
        self.assertFalse(os.path.exists(self.path))

    def test_anAgentThatCannotStartRemovesIt(self) -> None:
        word = self.say(socket=self.path)
        self.assertEqual(self.port.read(), b"STARTED\n")
        word.stop()
        self.assertEqual(self.port.read(), b"STOPPED\n")
        self.assertFalse(os.path.exists(self.path))


class AdoptionTests(SynchronousTestCase):
    """The serial keeper takes the port over as it is, without saying STARTED again."""

    def test_anAdoptedSocketCarriesBothWaysWithoutReopening(self) -> None:
        path = os.path.join(short_tempdir(self), "vp", PORT_NAME)

        async def scenario() -> tuple[bytes, bytes, int, list[str]]:
            peer = Peer(path)
            server = await peer.start()
            word = await asyncio.get_running_loop().run_in_executor(
                None, say_started, options(serial=path)
            )
            assert word is not None
            await peer.got_data.wait()
            opened: list[str] = []
            data = bytearray()
            arrived = asyncio.Event()

            def on_data(chunk: bytes) -> None:
                data.extend(chunk)
                arrived.set()

            keeper = SerialKeeper(
                lambda: FoundPort(path, PORT_NAME),
                on_data,
                lambda: opened.append("opened"),
                lambda reason: None,
            )
            keeper.start(word)
            peer.clients[0].write(b"CONNECT 2:1234\n")
            await arrived.wait()
            keeper.write(b"CONNECTED\n")
            while not peer.received.endswith(b"CONNECTED\n"):
                peer.got_data.clear()
                await peer.got_data.wait()
            await keeper.stop()
            server.close()
            return bytes(peer.received), bytes(data), len(peer.clients), opened

        self.assertEqual(
            run_in_loop(self, scenario),
            (b"STARTED\nCONNECTED\n", b"CONNECT 2:1234\n", 1, []),
        )

    def test_anAdoptedDeviceReadsWhatWaitedForIt(self) -> None:
        port = PtyPort(self)

        async def scenario() -> bytes:
            word = say_started(options(serial=port.path))
            assert word is not None
            port.read()
            os.write(port.master, b"CONNECT 2:1234\n")  # while the agent still imported
            data, complete, on_data = line_collector()
            channel = await adopt_serial(word, on_data, lambda reason: None)
            await complete.wait()
            channel.close()
            return bytes(data)

        self.assertEqual(run_in_loop(self, scenario), b"CONNECT 2:1234\n")

    def test_aWordIsHandedOverOnce(self) -> None:
        port = PtyPort(self)
        word = say_started(options(serial=port.path))
        assert word is not None

        async def scenario() -> str:
            channel = await adopt_serial(word, lambda data: None, lambda reason: None)
            channel.close()
            try:
                await adopt_serial(word, lambda data: None, lambda reason: None)
            except Exception as e:
                return str(e)
            return "adopted twice"

        self.assertEqual(run_in_loop(self, scenario), f"{port.path} was handed over already")


class OrderTests(SynchronousTestCase):
    """``vmready-agent`` says STARTED before it imports asyncio, ssl or logging."""

    def first_heavy_import(self, *options: str) -> tuple[str, str]:
        """The first heavy module ``vmready-agent OPTIONS`` imports (the real entry point
        in a fresh interpreter, stopped there by an audit hook), and what its port had
        been told by then."""
        probe = textwrap.dedent(
            f"""
            import os, pty, sys
            sys.path.insert(0, {CHECKOUT!r})
            master, slave = pty.openpty()
            os.set_blocking(master, False)
            HEAVY = {{"asyncio", "ssl", "logging", "json", "dataclasses", "shutil", "typing"}}

            def hook(event, args):
                if event == "import" and args[0] in HEAVY:
                    try:
                        said = os.read(master, 64)
                    except BlockingIOError:
                        said = b""
                    sys.stdout.write(f"{{args[0]}} {{said!r}}\\n")
                    sys.stdout.flush()
                    os._exit(0)

            sys.argv = ["vmready-agent", "--serial", os.ttyname(slave),
                        "--config-drive", "/nonexistent", *{list(options)!r}]
            sys.addaudithook(hook)
            import vmready.agent.main
            vmready.agent.main.main()
            """
        )
        result = fresh_interpreter(probe)
        module, said = result.stdout.split()
        return module, said

    def test_startedIsWrittenBeforeTheHeavyImports(self) -> None:
        self.assertEqual(self.first_heavy_import(), ("logging", "b'STARTED\\n'"))

    def test_aRecordingAgentSaysStartedOnlyOnceItsRecorderRuns(self) -> None:
        # Its transcript dates each line as written; the recorder comes after the imports.
        recording = os.path.join(short_tempdir(self), "agent.jsonl")
        self.assertEqual(self.first_heavy_import("--record", recording), ("logging", "b''"))
