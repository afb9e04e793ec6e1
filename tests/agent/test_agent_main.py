"""The ``vmready-agent`` command as a real process: start, SIGTERM, notify, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from typing import Any, cast
from unittest import mock

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IReactorUNIXDatagram
from twisted.internet.protocol import DatagramProtocol, ProcessProtocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.agentfakes import FakeGuestHost, FakeSerialPeer, agent_ports
from tests.reactor import reactor
from tests.system import unix_http
from vmready.agent.main import _parser, parse_options
from vmready.agent.notify import MAX_ANSWER, NotifyFailed, NotifyRequest, notify, parse_notify
from vmready.agent.options import UsageError
from vmready.trust.certs import generate, write_config_drive

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIENT = generate("demo")
SERVER = generate("vmready")
AGENT = [sys.executable, "-m", "vmready.agent.main"]


class Process(ProcessProtocol):
    """A child process: its stderr, and its exit status once it ends."""

    def __init__(self) -> None:
        self.stderr = b""
        self.ended: Deferred[int] = Deferred()

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason: Failure) -> None:
        ended = reason.value
        if isinstance(ended, ProcessDone):
            self.ended.callback(0)
        elif isinstance(ended, ProcessTerminated):
            code = ended.exitCode
            self.ended.callback(code if code is not None else -ended.signal)


class Notifications(DatagramProtocol):
    """A service manager's notification socket: ``first`` fires with the first datagram."""

    def __init__(self) -> None:
        self.first: Deferred[bytes] = Deferred()

    def datagramReceived(self, datagram: bytes, address: Any) -> None:
        if not self.first.called:
            self.first.callback(datagram)


def demo_guest(
    case: TestCase, base: str, relative: bool
) -> tuple[str, str, FakeSerialPeer, FakeSerialPeer, FakeGuestHost]:
    """Instance demo's config drive under ``base``, and a fake host it trusts, stopped at
    cleanup: the drive, the devlxd socket path, the far ends of its status and connect
    ports, the host.  ``relative``: agent.json names the ports and state directory
    relative to the drive, as a guest running the agent from its drive sees them."""
    drive = os.path.join(base, "drive")
    socket = os.path.join(base, "lxd", "sock")
    host_path = os.path.join(base, "g.sock")
    ports = os.path.join(drive if relative else base, "vp")
    write_config_drive(drive, CLIENT, SERVER.cert_pem)
    with open(os.path.join(drive, "agent.json"), "w") as f:
        json.dump(
            {
                "instance": "demo",
                "virtio_ports": "vp" if relative else ports,
                "transport": f"hvsock:{host_path}",
                "devlxd_socket": socket,
                "state_dir": "run" if relative else os.path.join(base, "run"),
            },
            f,
        )
    peer, connect_port = agent_ports(reactor, ports, case.addCleanup)
    host = FakeGuestHost(reactor, SERVER, CLIENT.cert_pem, host_path)
    case.addCleanup(host.stop)
    return drive, socket, peer, connect_port, host


class AgentProcessTests(TestCase):
    """vmready-agent run as a child process against a fake host and serial peer."""

    def setUp(self) -> None:
        self.base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.drive, self.socket, self.peer, self.connect_port, self.host = demo_guest(
            self, self.base, relative=False
        )

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> Process:
        process = Process()
        transport = reactor.spawnProcess(
            process, sys.executable, [*AGENT, *args], env={**os.environ, **(env or {})}
        )

        async def reap() -> None:
            if not process.ended.called:
                transport.signalProcess("KILL")
            await process.ended

        self.addCleanup(reap)
        return process

    async def connected_agent(self) -> Process:
        await self.host.start()
        agent = self.spawn("--config-drive", self.drive, "--heartbeat", "30")
        await self.peer.wait_for(b"STARTED", since=0)
        connected = self.peer.wait_for(b"CONNECTED")
        self.connect_port.send(self.host.connect_line)
        await connected
        return agent

    async def test_sigtermMakesTheAgentSayStoppedAndExitZero(self) -> None:
        agent = await self.connected_agent()
        stopped = self.peer.wait_for(b"STOPPED")
        os.kill(self._pid(agent), 15)
        await stopped
        self.assertEqual(await agent.ended, 0)

    async def test_notifyReadyReachesTheHost(self) -> None:
        await self.connected_agent()
        notify = self.spawn("notify", "ready", "--socket", self.socket)
        self.assertEqual((await notify.ended, notify.stderr), (0, b""))
        self.assertEqual(self.host.patches, ["Ready"])

    async def test_notifyWithoutALinkIsKeptAndDeliveredWhenTheLinkComes(self) -> None:
        await self.host.start()
        self.spawn("--config-drive", self.drive, "--heartbeat", "30")
        await self.peer.wait_for(b"STARTED", since=0)
        await self.serving()  # STARTED comes first now, before the socket (firstword)
        notify = self.spawn("notify", "ready", "--socket", self.socket)
        self.assertEqual(
            (await notify.ended, notify.stderr),
            (
                0,
                b"vmready-agent: host not reachable: the host has not sent CONNECT yet; "
                b"the agent will tell it Ready when the link returns\n",
            ),
        )
        self.assertEqual(self.host.patches, [])
        connected = self.peer.wait_for(b"CONNECTED")
        self.connect_port.send(self.host.connect_line)
        await connected
        for _ in range(100):  # delivered right after the link is up (bounded)
            if self.host.patches:
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(self.host.patches, ["Ready"])

    async def test_readyToSystemdOnlyOnceTheSocketAnswersItsBootData(self) -> None:
        # As systemd starts a Type=notify unit: $NOTIFY_SOCKET names a datagram socket.
        with open(os.path.join(self.drive, "guest-api.json"), "w") as f:
            json.dump({"meta-data": "instance-id: demo-1\n", "config": {"user.a": "b"}}, f)
        notifications = Notifications()
        notify_path = os.path.join(self.base, "notify")
        datagrams = cast(IReactorUNIXDatagram, reactor)
        port = datagrams.listenUNIXDatagram(notify_path, notifications, 8192, 0o600)
        self.addCleanup(port.stopListening)
        self.spawn("--config-drive", self.drive, env={"NOTIFY_SOCKET": notify_path})
        ready = await notifications.first
        self.assertTrue(ready.startswith(b"READY=1\nSTATUS=serving "), ready)
        # No host has been told to the agent: the socket answers from the config drive.
        answer = unix_http(self.socket, "GET", "/1.0/meta-data")
        self.assertEqual((answer.status, answer.body), (200, b"instance-id: demo-1\n"))

    async def test_notifyWithoutAnAgentExitsOne(self) -> None:
        notify = self.spawn("notify", "ready", "--socket", self.socket)
        self.assertEqual(
            (await notify.ended, notify.stderr),
            (
                1,
                f"vmready-agent: cannot reach the agent at {self.socket}: "
                "No such file or directory\n".encode(),
            ),
        )

    async def test_notifyWithAnUnknownStateIsAUsageError(self) -> None:
        notify = self.spawn("notify", "maybe")
        self.assertEqual(await notify.ended, 2)
        self.assertTrue(
            notify.stderr.startswith(
                b"vmready-agent: the state is 'ready' or 'started', not 'maybe'\n"
            )
        )

    async def test_missingConfigDriveExitsOneWithOneLine(self) -> None:
        missing = os.path.join(self.base, "nope")
        agent = self.spawn("--config-drive", missing)
        self.assertEqual(
            (await agent.ended, agent.stderr),
            (1, f"vmready-agent: config drive {missing} is not a directory\n".encode()),
        )

    async def test_aKeySslRefusesAfterStartedIsStoppedAndOneLine(self) -> None:
        # STARTED is said before ssl is imported (firstword): a key ssl then refuses
        # takes it back with STOPPED, and the agent exits with today's one line.
        with open(os.path.join(self.drive, "agent.key"), "wb") as f:
            f.write(generate("someone-else").key_pem)
        agent = self.spawn("--config-drive", self.drive)
        line = f"vmready-agent: agent.key does not belong to agent.crt in {self.drive}\n"
        self.assertEqual((await agent.ended, agent.stderr), (1, line.encode()))
        self.assertEqual(self.peer.lines, [b"STARTED", b"STOPPED"])

    async def test_startedAgainOnceImportedThenConnected(self) -> None:
        # The first STARTED before the imports, once more after them (a heartbeat).
        await self.connected_agent()
        self.assertEqual(self.peer.lines[:3], [b"STARTED", b"STARTED", b"CONNECTED"])

    async def test_badOptionValueIsAUsageError(self) -> None:
        agent = self.spawn("--config-drive", self.drive, "--heartbeat", "soon")
        self.assertEqual(await agent.ended, 2)
        self.assertTrue(
            agent.stderr.startswith(
                b"vmready-agent: --heartbeat must be a number of seconds, not 'soon'\n"
            )
        )

    async def serving(self) -> None:
        """Once the agent's socket exists (it answers from then on: it listens)."""
        for _ in range(400):
            if os.path.exists(self.socket):
                return
            await deferLater(reactor, 0.05, lambda: None)
        self.fail(f"the agent never served {self.socket}")

    @staticmethod
    def _pid(process: Process) -> int:
        pid: Any = process.transport.pid  # type: ignore[union-attr]
        return int(pid)


class OptionTests(SynchronousTestCase):
    """The agent's command line, parsed (argparse) into config options."""

    def test_optionsTakeTheCommandLineNames(self) -> None:
        options = parse_options(["--serial", "/dev/vport1p1", "--transport", "hvsock:/d/g.sock"])
        self.assertEqual(
            (options["serial"], options["transport"], options["heartbeat"], options["retries"]),
            ("/dev/vport1p1", "hvsock:/d/g.sock", 5.0, 3),
        )

    def test_shortOptionsWork(self) -> None:
        options = parse_options(["-c", "/drive", "-s", "/sock"])
        self.assertEqual((options["config-drive"], options["socket"]), ("/drive", "/sock"))

    def test_unsetOptionsAreNone(self) -> None:
        options = parse_options([])
        self.assertEqual(
            (options["socket"], options["virtio-ports"], options["record"]), (None, None, None)
        )

    def test_badTransportIsAUsageError(self) -> None:
        error = self.assertRaises(UsageError, parse_options, ["--transport", "tcp:1"])
        self.assertEqual(str(error), "transport 'tcp:1' is neither 'vsock' nor 'hvsock:<path>'")

    def test_negativeRetriesAreAUsageError(self) -> None:
        error = self.assertRaises(UsageError, parse_options, ["--retries", "-1"])
        self.assertEqual(str(error), "--retries must be zero or more, not '-1'")

    def test_helpIsSizedByColumnsWithoutShutil(self) -> None:
        # argparse's own sizing imports shutil, and with it zlib, bz2 and lzma.
        with mock.patch.dict(os.environ, {"COLUMNS": "40"}):
            text = _parser().format_help()
        described = text.split("\n\n")[1]  # the description, wrapped to fit
        self.assertEqual(max(len(line) for line in described.splitlines()), 38)

    def test_unknownOptionIsAUsageError(self) -> None:
        error = self.assertRaises(UsageError, parse_options, ["--colour"])
        self.assertEqual(str(error), "unrecognized arguments: --colour")


class NotifyArgumentTests(SynchronousTestCase):
    def test_stateNameIsCapitalisedForTheHost(self) -> None:
        self.assertEqual(parse_notify(["ready"]).state, "Ready")

    def test_optionsMayFollowTheState(self) -> None:
        request = parse_notify(["started", "--socket", "/tmp/s", "--timeout", "5"])
        self.assertEqual(request, NotifyRequest("Started", "/tmp/s", 5.0))

    def test_socketDefaultsToTheDevlxdPath(self) -> None:
        self.assertEqual(parse_notify(["ready"]).socket, "/dev/lxd/sock")

    def test_unknownStateIsAUsageError(self) -> None:
        error = self.assertRaises(UsageError, parse_notify, ["Ready"])
        self.assertEqual(str(error), "the state is 'ready' or 'started', not 'Ready'")

    def test_missingStateIsAUsageError(self) -> None:
        self.assertRaises(UsageError, parse_notify, [])


class StandInAgent:
    """An agent socket served by a thread: it reads one request and sends ``answer`` (None:
    nothing, until the test ends), then closes."""

    def __init__(self, test: SynchronousTestCase, path: str, answer: bytes | None) -> None:
        self.answer = answer
        self.request = b""
        self.listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listening.bind(path)
        self.listening.listen(1)
        self.done = threading.Event()
        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()
        test.addCleanup(thread.join, 10)
        test.addCleanup(self.done.set)
        test.addCleanup(self.listening.close)

    def _serve(self) -> None:
        connection, _ = self.listening.accept()
        with connection:
            connection.settimeout(10)
            while b'{"state": "Ready"}' not in self.request:
                data = connection.recv(4096)
                if not data:
                    return
                self.request += data
            if self.answer is None:
                self.done.wait(10)
                return
            connection.sendall(self.answer)


class NotifyTests(SynchronousTestCase):
    """``notify`` against an agent socket that answers well, badly or not at all."""

    def setUp(self) -> None:
        base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, base, True)
        self.socket = os.path.join(base, "sock")

    def notify_with(self, answer: bytes | None, timeout: float = 5) -> str:
        """``notify`` against a socket that reads the request and writes ``answer``."""
        self.agent = StandInAgent(self, self.socket, answer)
        try:
            kept = notify(self.socket, "Ready", timeout=timeout)
        except NotifyFailed as e:
            return str(e)
        return "accepted" if kept is None else f"kept: {kept}"

    def test_acceptedState(self) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{}\n"
        self.assertEqual(self.notify_with(answer), "accepted")

    def test_theRequestIsAnHTTP10PatchOfTheState(self) -> None:
        self.notify_with(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(
            self.agent.request,
            b"PATCH /1.0 HTTP/1.0\r\nHost: lxd\r\nUser-Agent: vmready-agent\r\n"
            b"Content-Type: application/json\r\nContent-Length: 18\r\n\r\n"
            b'{"state": "Ready"}',
        )

    def test_keptForLaterIsTheAgentsFirstLine(self) -> None:
        answer = b"HTTP/1.0 202 Accepted\r\n\r\nhost not reachable: later\nmore\n"
        self.assertEqual(self.notify_with(answer), "kept: host not reachable: later")

    def test_anInterimAnswerIsSkipped(self) -> None:
        answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        self.assertEqual(self.notify_with(answer), "accepted")

    def test_refusalIsTheAnswersFirstLine(self) -> None:
        answer = b"HTTP/1.1 503 X\r\nContent-Length: 27\r\n\r\nhost not reachable: gone\nx\n"
        self.assertEqual(self.notify_with(answer), "host not reachable: gone")

    def test_refusalUpToTheEndOfTheConnection(self) -> None:
        answer = b"HTTP/1.0 503 X\r\n\r\nhost not reachable: gone\n"
        self.assertEqual(self.notify_with(answer), "host not reachable: gone")

    def test_refusalWithoutABodyNamesTheStatus(self) -> None:
        self.assertEqual(
            self.notify_with(b"HTTP/1.1 500 X\r\nContent-Length: 0\r\n\r\n"), "HTTP 500"
        )

    def test_closedWithoutAnswering(self) -> None:
        self.assertEqual(
            self.notify_with(b""),
            f"the agent at {self.socket} closed the connection without answering",
        )

    def test_closedInTheMiddleOfTheBody(self) -> None:
        self.assertEqual(
            self.notify_with(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}"),
            f"the agent at {self.socket} closed the connection without answering",
        )

    def test_garbageAnswer(self) -> None:
        self.assertEqual(
            self.notify_with(b"hello\r\n\r\n"),
            f"the agent at {self.socket} sent a malformed answer: "
            "a status line without a status code: 'hello'",
        )

    def test_aChunkedAnswerIsMalformed(self) -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        self.assertEqual(
            self.notify_with(answer),
            f"the agent at {self.socket} sent a malformed answer: "
            "a chunked answer to an HTTP/1.0 request",
        )

    def test_anAnswerTooLargeIsMalformed(self) -> None:
        answer = b"HTTP/1.0 503 X\r\n\r\n" + b"x" * (MAX_ANSWER + 1)
        self.assertEqual(
            self.notify_with(answer),
            f"the agent at {self.socket} sent a malformed answer: "
            f"body larger than {MAX_ANSWER} bytes",
        )

    def test_silentAgentTimesOut(self) -> None:
        self.assertEqual(
            self.notify_with(None, timeout=0.2),
            f"no answer from the agent at {self.socket} within 0.2s",
        )

    def test_noAgent(self) -> None:
        error = self.assertRaises(NotifyFailed, notify, self.socket, "Ready", 5)
        self.assertEqual(
            str(error), f"cannot reach the agent at {self.socket}: No such file or directory"
        )


def loaded_by(*argv: str) -> list[str]:
    """The modules ``vmready-agent ARGV`` has loaded when it exits: the agent's own, and
    those of ``HEAVY`` (in a fresh ``python3 -S -I``, as the guest runs it)."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path.insert(0, {checkout!r})
        heavy = {sorted(HEAVY)!r}

        def loaded():
            names = (m for m in sys.modules if m.startswith("vmready") or m in heavy)
            print(" ".join(sorted(names)))

        atexit.register(loaded)
        import vmready.agent.main
        vmready.agent.main.main({list(argv)!r})
        """
    )
    return fresh_interpreter(probe).stdout.split()


def fresh_interpreter(probe: str) -> subprocess.CompletedProcess[str]:
    """``probe`` run by ``python -S -I -c``, as the guest runs the agent; its output."""
    return subprocess.run(
        [sys.executable, "-S", "-I", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# What costs most under emulation: none of it for notify.
HEAVY = ("asyncio", "dataclasses", "json", "logging", "shutil", "ssl", "typing")


class NotifyImportsTests(SynchronousTestCase):
    """``vmready-agent notify`` (a second interpreter at every boot) loads none of the agent."""

    def test_notifyLoadsOnlyItsCodecAndOptions(self) -> None:
        missing = os.path.join(tempfile.mkdtemp(prefix="vra-"), "sock")
        self.addCleanup(shutil.rmtree, os.path.dirname(missing), True)
        self.assertEqual(
            loaded_by("notify", "ready", "--socket", missing, "--timeout", "1"),
            [
                "vmready",
                "vmready.agent",
                "vmready.agent.httpcodec",
                "vmready.agent.main",
                "vmready.agent.minimum",
                "vmready.agent.notify",
                "vmready.agent.options",
                "vmready.agent.records",
            ],
        )

    def test_theAgentsNamesStillComeFromThePackage(self) -> None:
        import vmready.agent

        self.assertIs(vmready.agent.Agent, vmready.agent.service.Agent)
        self.assertRaises(AttributeError, getattr, vmready.agent, "NoSuchThing")


class StartImportsTests(SynchronousTestCase):
    """What the agent imports after its first STARTED, in a fresh interpreter as the guest
    runs it (``python3 -S -I``): under TCG every module costs (``-X importtime`` there)."""

    def test_noModuleTheAgentDoesNotUseOnAVirtioPort(self) -> None:
        unused = (
            # tempfile with shutil and random: 60 ms (its Ready memory writes its own file).
            "tempfile",
            "shutil",
            "random",
            # 84 ms, a shared library: only a tty (a serial line, a test's pty) needs it.
            "termios",
            "tty",
            # The transcript's, with datetime (50 ms): only when recording (--record).
            "vmready.protocols.transcript",
            "vmready.agent.recording",
            "datetime",
        )
        probe = (
            f"import sys; sys.path.insert(0, {CHECKOUT!r}); "
            "import vmready.agent.logs, vmready.agent.config, vmready.agent.service; "
            f"print(sorted(m for m in {unused!r} if m in sys.modules))"
        )
        done = subprocess.run(
            [sys.executable, "-S", "-I", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        self.assertEqual(done.stdout, "[]\n")
