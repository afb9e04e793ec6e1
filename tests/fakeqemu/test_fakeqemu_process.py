"""fakeqemu as a real process: real unix sockets, real signals, the real reactor.

Every test here starts ``fakeqemu-system-x86_64`` (or a process playing the
guest) and looks only at what a user of QEMU sees: exit statuses, stderr lines,
QMP replies and events, bytes on the guest's sockets, files on disk.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.error import ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IHalfCloseableProtocol, IProcessTransport
from twisted.internet.protocol import ProcessProtocol, Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from fakeqemu import __version__
from fakeqemu._cmdline import QEMU_VERSION
from tests.fakeqemu.commandlines import (
    LEGACY_PORT,
    MACHINE,
    agent_port,
    guest_devices,
    legacy_port,
    qmp_option,
)
from tests.fakeqemu.commandlines import PORT as AGENT_PORT
from tests.fakeqemu.commandlines import RING as AGENT_RING
from tests.processes import kill_if_named
from tests.reactor import reactor
from tests.received import Received
from vmready.protocols.qmp import QMPClientProtocol, QMPDisconnected, QMPEvent, connect_qmp

BIN_DIRECTORY = os.path.dirname(os.path.abspath(sys.executable))
PROGRAM = "fakeqemu-system-x86_64"
FAKEQEMU = os.path.join(BIN_DIRECTORY, PROGRAM)
FAKEQEMU_HOST = os.path.join(BIN_DIRECTORY, "fakeqemu-host")
# How long a process may take to come up or go away on a loaded CI machine.  A
# bound on waiting, never an assertion about speed.
DEADLINE = 30.0

_E = TypeVar("_E", bound=BaseException)
_Case = TypeVar("_Case", bound=TestCase)


def deferred_test(
    method: Callable[[_Case], Coroutine[Any, Any, None]],
) -> Callable[[_Case], Deferred[None]]:
    """Run an ``async def`` test method as a trial test returning a Deferred."""

    @functools.wraps(method)
    def run(self: _Case) -> Deferred[None]:
        return Deferred.fromCoroutine(method(self))

    return run


def agent_devices(ring_size: int = 4096, legacy: bool = False) -> list[str]:
    """A q35 machine with the agent's ring buffer wired to com.canonical.lxd."""
    return [*MACHINE, *agent_port(ring_size), *(legacy_port() if legacy else [])]


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without fakeqemu's own variables, plus ``extra``."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("FAKEQEMU_HOST", "FAKEQEMU_GUEST_DIR")
    }
    environment.update(extra or {})
    return environment


async def pause(seconds: float = 0.02) -> None:
    """Let the reactor run for a moment (between polls, never as an assertion)."""
    await deferLater(reactor, seconds, lambda: None)


async def wait_until(condition: Callable[[], bool], description: str) -> None:
    """Poll ``condition`` until it holds; fail after DEADLINE seconds."""
    deadline = reactor.seconds() + DEADLINE
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError(f"still waiting after {DEADLINE}s for {description}")
        await pause()


def connect_unix(path: str, protocol: Protocol) -> Deferred[Any]:
    """Connect ``protocol`` to the unix socket at ``path``."""
    endpoint = UNIXClientEndpoint(reactor, path, timeout=int(DEADLINE))
    connected: Deferred[Any] = connectProtocol(endpoint, protocol)
    return connected


def read_pid(pidfile: str) -> int | None:
    """The pid in a pidfile, or None while there is none."""
    try:
        with open(pidfile) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def standard_streams(pid: int) -> list[str]:
    """What a process's file descriptors 0, 1 and 2 point at."""
    return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)]


def monitor_closed(client: QMPClientProtocol) -> Deferred[None]:
    """Fires when the monitor connection is gone; fails after DEADLINE seconds."""
    return client.when_closed().addTimeout(DEADLINE, reactor)


_P = TypeVar("_P", bound=Received)


def _disconnect(protocol: Received) -> Deferred[None] | None:
    if protocol.closed.called or protocol.transport is None:
        return None
    protocol.transport.loseConnection()
    return protocol.closed


class RecordedProcess(ProcessProtocol):
    """A child process whose output is recorded and whose end can be awaited."""

    def __init__(self) -> None:
        self.stdout = b""
        self.stderr = b""
        self.status: int | None = None
        self.pid = 0
        self._waiters: list[Deferred[int]] = []

    @property
    def process(self) -> IProcessTransport:
        """The process transport (pid, signals)."""
        assert self.transport is not None
        return self.transport

    def connectionMade(self) -> None:
        self.pid = int(self.process.pid)

    def outReceived(self, data: bytes) -> None:
        self.stdout += data

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        if isinstance(value, ProcessTerminated) and value.signal is not None:
            self.status = -int(value.signal)
        else:
            self.status = int(getattr(value, "exitCode", 0) or 0)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(self.status)

    def send_signal(self, signal_name: str) -> None:
        """Deliver a signal (``"TERM"``, ``"KILL"``, ``"STOP"``...) to the child."""
        self.process.signalProcess(signal_name)

    def ended(self) -> Deferred[int]:
        """Fires with the exit status (negative: killed by that signal) once all pipes closed."""
        waiter: Deferred[int] = Deferred()
        if self.status is not None:
            waiter.callback(self.status)
        else:
            self._waiters.append(waiter)
            waiter.addTimeout(DEADLINE, reactor)
        return waiter

    async def exit_status(self) -> int:
        """Wait for the child to end; its status, with what it said on stderr if that fails."""
        try:
            return await self.ended()
        except Exception as e:
            raise AssertionError(f"process did not end; stderr so far: {self.stderr!r}") from e


class ProcessTestCase(TestCase):
    """Starts processes in a short /tmp directory and cleans up after them."""

    timeout = 120

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="fq-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    async def failure_of(self, deferred: Deferred[Any], error: type[_E]) -> _E:
        """The ``error`` that ``deferred`` fails with; the test fails if it does not."""
        try:
            result = await deferred
        except error as e:
            return e
        raise self.failureException(f"expected {error.__name__}, got the result {result!r}")

    def path(self, name: str) -> str:
        """A file in the test's directory."""
        return os.path.join(self.directory, name)

    def spawn(
        self,
        args: Sequence[str],
        executable: str = FAKEQEMU,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> RecordedProcess:
        """Start ``executable args``; killed at cleanup unless it ended by itself."""
        if not os.path.exists(executable):
            raise AssertionError(f"{executable} is missing: install the package (./dev test)")
        recorded = RecordedProcess()
        argv = [executable, *args]
        reactor.spawnProcess(
            recorded, executable, argv, env=child_environment(env), path=cwd or self.directory
        )
        recorded.process.closeStdin()
        self.addCleanup(self._reap, recorded)
        return recorded

    def spawn_python(self, code: str, *args: str) -> RecordedProcess:
        """Run a small Python program (a guest process, for instance)."""
        return self.spawn(["-c", code, *args], executable=sys.executable)

    @staticmethod
    def _reap(recorded: RecordedProcess) -> Deferred[int] | None:
        if recorded.status is not None:
            return None
        with contextlib.suppress(ProcessExitedAlready):
            recorded.send_signal("KILL")
        return recorded.ended()

    def log_path(self, directory: str | None = None) -> str:
        """A log file holding a line from an earlier run."""
        path = os.path.join(directory or self.directory, "vm.log")
        with open(path, "wb") as f:
            f.write(b"an earlier run\n")
        return path

    async def assertStartErrorLogged(self, start: Callable[[list[str]], RecordedProcess]) -> None:
        """A VM ``start`` daemonizes with ``-D`` cannot bind its monitor: it exits 1, saying
        why in the log file only."""
        log, missing = self.log_path(), self.path("no-such-directory/qmp")
        launcher = start(["-machine", "none", *qmp_option(missing), "-daemonize", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                1,
                b"",
                stderr_lines(
                    f"-qmp unix:{missing},server=on,wait=off: "
                    f"Failed to bind socket to {missing}: No such file or directory"
                ),
            ),
        )

    def daemon(self, qmp: str, *options: str, legacy: bool = False) -> tuple[RecordedProcess, str]:
        """A VM with the agent's devices and ``options``, its monitor at ``qmp``, daemonized
        (killed at cleanup); its launcher and pidfile."""
        pidfile = self.path("vm.pid")
        devices = agent_devices(legacy=legacy)
        launcher = self.spawn(
            [*devices, *qmp_option(qmp), *options, "-daemonize", "-pidfile", pidfile]
        )
        self.kill_daemon_at_cleanup(pidfile)
        return launcher, pidfile

    def kill_daemon_at_cleanup(self, pidfile: str) -> None:
        """A standalone daemon will write its pid to ``pidfile``: SIGKILL it at the end."""

        def kill() -> None:
            pid = read_pid(pidfile)
            if pid is not None:
                # Its command line names the pidfile's directory (-pidfile PATH).
                kill_if_named(pid, os.path.dirname(pidfile))

        self.addCleanup(kill)

    async def agent_vm(
        self, start: Callable[[list[str]], RecordedProcess] | None = None
    ) -> tuple[RecordedProcess, QMPClientProtocol, str]:
        """A VM with the agent's devices, started by ``start`` (default: ``spawn``): its
        process, its negotiated monitor and the monitor's socket."""
        qmp = self.path("qmp")
        process = (start or self.spawn)([*agent_devices(), *qmp_option(qmp)])
        return process, await self.monitor(qmp, process), qmp

    async def assertSigtermShutsDown(
        self, start: Callable[[list[str]], RecordedProcess] | None = None
    ) -> None:
        """SIGTERM to the process of an ``agent_vm(start)``: a SHUTDOWN for a host signal,
        then exit 0 saying so."""
        process, client, _ = await self.agent_vm(start)
        events = EventRecorder(client)
        process.send_signal("TERM")
        shutdown = await events.first("SHUTDOWN")
        status = await process.exit_status()
        # QEMU adds "from pid N (name)" when it knows the sender; fakeqemu cannot know.
        self.assertEqual(
            (shutdown.data, status, process.stderr),
            (
                {"guest": False, "reason": "host-signal"},
                0,
                stderr_lines("terminating on signal 15"),
            ),
        )

    async def monitor(
        self, socket_path: str, process: RecordedProcess | None = None
    ) -> QMPClientProtocol:
        """A negotiated QMP client, once the VM listens; closed at cleanup."""
        deadline = reactor.seconds() + DEADLINE
        while True:
            try:
                client = await connect_qmp(reactor, socket_path, timeout=DEADLINE)
            except QMPDisconnected:
                if process is not None and process.status is not None:
                    raise AssertionError(
                        f"the VM exited with {process.status} before its monitor answered: "
                        f"{process.stderr!r}"
                    ) from None
                if reactor.seconds() > deadline:
                    raise
                await pause()
                continue
            self.addCleanup(self._hang_up, client)
            return client

    @staticmethod
    def _hang_up(client: QMPClientProtocol) -> Deferred[None]:
        client.close()
        return client.when_closed()

    async def open_socket(self, path: str, protocol: _P) -> _P:
        """Connect ``protocol`` to a unix socket; disconnected at cleanup."""
        await connect_unix(path, protocol)
        self.addCleanup(_disconnect, protocol)
        return protocol

    def guest_socket(self, qmp_path: str, name: str) -> str:
        """A guest port's socket for a VM whose first monitor is at ``qmp_path``."""
        return os.path.join(qmp_path + ".guest", "virtio-ports", name)

    def control_socket(self, qmp_path: str) -> str:
        """The guest's power-management socket."""
        return os.path.join(qmp_path + ".guest", "control")


class EventRecorder:
    """Every event one QMP client receives, and a way to wait for one."""

    def __init__(self, client: QMPClientProtocol) -> None:
        self.events: list[QMPEvent] = []
        client.subscribe(self.events.append)

    def names(self) -> list[str]:
        """The events' names, in order."""
        return [event.name for event in self.events]

    async def first(self, name: str) -> QMPEvent:
        """The first event called ``name``, waiting for it if need be."""
        await wait_until(lambda: name in self.names(), f"a {name} event")
        return next(event for event in self.events if event.name == name)


def stderr_lines(*messages: str) -> bytes:
    """What QEMU prints for these messages: each prefixed with the program name."""
    return b"".join(f"{PROGRAM}: {message}\n".encode() for message in messages)


class CommandLineRefusalTests(ProcessTestCase):
    """A command line fakeqemu cannot honour ends the process as QEMU ends it."""

    async def assert_refused(self, args: Sequence[str], expected_stderr: bytes) -> None:
        process = self.spawn(args)
        status = await process.exit_status()
        self.assertEqual(
            (status, process.stderr, process.stdout),
            (1, expected_stderr, b""),
        )

    @deferred_test
    async def test_unknownOptionIsRefused(self) -> None:
        await self.assert_refused(["-bogus"], stderr_lines("-bogus: invalid option"))

    @deferred_test
    async def test_missingArgumentIsRefused(self) -> None:
        await self.assert_refused(
            ["-machine", "q35", "-m"], stderr_lines("-m: requires an argument")
        )

    @deferred_test
    async def test_ringBufferSizeMustBeAPowerOfTwo(self) -> None:
        await self.assert_refused(
            ["-chardev", "ringbuf,id=agent,size=1000"],
            stderr_lines(
                "-chardev ringbuf,id=agent,size=1000: size of ringbuf chardev must be power of two"
            ),
        )

    @deferred_test
    async def test_unsupportedMachineContinuationLineIsBare(self) -> None:
        await self.assert_refused(
            ["-machine", "pc-q35-2.0"],
            stderr_lines("unsupported machine type")
            + b"Use -machine help to list supported machines\n",
        )

    @deferred_test
    async def test_portWithoutSerialBusIsRefused(self) -> None:
        await self.assert_refused(
            ["-machine", "q35", "-device", f"virtserialport,name={AGENT_PORT}"],
            stderr_lines(
                f"-device virtserialport,name={AGENT_PORT}: "
                "No 'virtio-serial-bus' bus found for device 'virtserialport'"
            ),
        )

    @deferred_test
    async def test_unbindableMonitorSocketIsRefused(self) -> None:
        missing = self.path("no-such-directory/qmp")
        await self.assert_refused(
            ["-machine", "none", *qmp_option(missing)],
            stderr_lines(
                f"-qmp unix:{missing},server=on,wait=off: "
                f"Failed to bind socket to {missing}: No such file or directory"
            ),
        )

    @deferred_test
    async def test_pythonDashMNamesItselfFakeqemu(self) -> None:
        process = self.spawn(["-m", "fakeqemu", "-bogus"], executable=sys.executable)
        status = await process.exit_status()
        self.assertEqual((status, process.stderr), (1, b"fakeqemu: -bogus: invalid option\n"))

    @deferred_test
    async def test_versionPrintsQEMUsFirstLineAndExitsZero(self) -> None:
        process = self.spawn(["-version"])
        status = await process.exit_status()
        major, minor, micro = QEMU_VERSION
        self.assertEqual(
            (status, process.stdout.decode().splitlines()[0], process.stderr),
            (0, f"QEMU emulator version {major}.{minor}.{micro} (fakeqemu {__version__})", b""),
        )


class LifecycleTests(ProcessTestCase):
    """Starting, daemonizing, quitting and signalling a VM process."""

    @deferred_test
    async def test_daemonizeReturnsZeroOnceTheMonitorAnswers(self) -> None:
        qmp = self.path("qmp")
        launcher, pidfile = self.daemon(qmp)
        status = await launcher.exit_status()
        daemon_pid = read_pid(pidfile)
        self.assertEqual((status, launcher.stdout, launcher.stderr), (0, b"", b""))
        # No retry: the monitor must already be listening when the launcher returns.
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        self.addCleanup(self._hang_up, client)
        self.assertEqual((await client.execute("query-status"))["status"], "running")
        # The pidfile names the daemon, not the launcher that has exited.
        with open(f"/proc/{daemon_pid}/cmdline", "rb") as f:
            self.assertIn(f"unix:{qmp},server=on,wait=off".encode(), f.read().split(b"\0"))

    @deferred_test
    async def test_daemonDetachesItsStandardStreams(self) -> None:
        qmp = self.path("qmp")
        launcher, pidfile = self.daemon(qmp)
        await wait_until(lambda: read_pid(pidfile) is not None, "the daemon's pidfile")
        daemon_pid = read_pid(pidfile)
        assert daemon_pid is not None
        await wait_until(
            lambda: standard_streams(daemon_pid) == [os.devnull] * 3,
            "the daemon to point its standard streams at /dev/null",
        )
        # Only now can the launcher's end be seen: the daemon let go of its pipes.
        self.assertEqual(await launcher.exit_status(), 0)

    @deferred_test
    async def test_daemonizeFailureIsReportedByTheLauncher(self) -> None:
        pidfile = self.path("no-such-directory/vm.pid")
        process = self.spawn(
            [*agent_devices(), *qmp_option(self.path("qmp")), "-daemonize", "-pidfile", pidfile]
        )
        status = await process.exit_status()
        self.assertEqual(
            (status, process.stderr),
            (
                1,
                stderr_lines(
                    f"cannot create PID file: Could not create '{pidfile}': "
                    "No such file or directory"
                ),
            ),
        )

    @deferred_test
    async def test_quitExitsZeroAndRemovesThePidfile(self) -> None:
        qmp, pidfile = self.path("qmp"), self.path("vm.pid")
        process = self.spawn([*agent_devices(), *qmp_option(qmp), "-pidfile", pidfile])
        client = await self.monitor(qmp, process)
        with open(pidfile) as f:
            self.assertEqual(int(f.read()), process.pid)
        events = EventRecorder(client)
        self.assertEqual(await client.execute("quit"), {})
        shutdown = await events.first("SHUTDOWN")
        self.assertEqual(
            (shutdown.data, await process.exit_status(), process.stderr),
            ({"guest": False, "reason": "host-qmp-quit"}, 0, b""),
        )
        self.assertFalse(os.path.exists(pidfile))

    @deferred_test
    async def test_sigtermShutsDownWithReasonHostSignal(self) -> None:
        await self.assertSigtermShutsDown()

    @deferred_test
    async def test_sigkillFailsPendingCommandsWithDisconnected(self) -> None:
        process, client, _ = await self.agent_vm()
        # A stopped process cannot answer, so the command is surely pending when it dies.
        process.send_signal("STOP")
        pending = client.execute("query-status")
        process.send_signal("KILL")
        await self.assertFailure(pending, QMPDisconnected)
        self.assertEqual(await process.exit_status(), -signal.SIGKILL)


def read_file(path: str) -> bytes | None:
    """A file's bytes, or None if there is no such file."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


class LogfileTests(ProcessTestCase):
    """``-D FILE`` as QEMU 7.2 honours it.

    Errors found after the option loop go to FILE instead of stderr when
    daemonized; option-loop errors stay on stderr; FILE is truncated at start.
    """

    @deferred_test
    async def test_daemonizedLateErrorGoesOnlyToTheLogfile(self) -> None:
        log = self.log_path()
        launcher = self.spawn(
            ["-chardev", "ringbuf,id=r,size=3", "-daemonize", "-D", log, "-machine", "none"]
        )
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                1,
                b"",
                stderr_lines(
                    "-chardev ringbuf,id=r,size=3: size of ringbuf chardev must be power of two"
                ),
            ),
        )

    @deferred_test
    async def test_daemonizedUnsupportedMachineGoesToTheLogfile(self) -> None:
        log = self.log_path()
        launcher = self.spawn(["-machine", "pc-q35-2.0", "-daemonize", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                1,
                b"",
                stderr_lines("unsupported machine type")
                + b"Use -machine help to list supported machines\n",
            ),
        )

    @deferred_test
    async def test_optionLoopErrorStaysOnStderrAndLeavesTheLogfileAlone(self) -> None:
        log = self.log_path()
        launcher = self.spawn(["-daemonize", "-D", log, "-chardev", "ringbuf,id=r,foo=1"])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                1,
                stderr_lines("-chardev ringbuf,id=r,foo=1: Invalid parameter 'foo'"),
                b"an earlier run\n",
            ),
        )

    @deferred_test
    async def test_unopenableLogfileIsRefusedOnStderr(self) -> None:
        log = self.path("no-such-directory/vm.log")
        launcher = self.spawn(["-machine", "none", "-daemonize", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr),
            (1, stderr_lines(f"Error opening logfile {log}: No such file or directory")),
        )

    @deferred_test
    async def test_withoutDaemonizeErrorsGoToStderrAndTheLogfileIsEmptied(self) -> None:
        log = self.log_path()
        launcher = self.spawn(["-machine", "none", "-chardev", "ringbuf,id=r,size=3", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                1,
                stderr_lines(
                    "-chardev ringbuf,id=r,size=3: size of ringbuf chardev must be power of two"
                ),
                b"",
            ),
        )

    @deferred_test
    async def test_warningsOfADaemonizedStartGoToTheLogfile(self) -> None:
        log, pidfile = self.log_path(), self.path("vm.pid")
        launcher = self.spawn(
            ["-machine", "none", "-smp", "0", "-daemonize", "-pidfile", pidfile, "-D", log]
        )
        self.kill_daemon_at_cleanup(pidfile)
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (
                0,
                b"",
                stderr_lines(
                    "warning: Deprecated CPU topology (considered invalid): "
                    "CPU topology parameters must be greater than zero"
                ),
            ),
        )

    @deferred_test
    async def test_startErrorOfADaemonGoesToTheLogfile(self) -> None:
        await self.assertStartErrorLogged(self.spawn)

    @deferred_test
    async def test_daemonKeepsTheLogfileAsItsStderr(self) -> None:
        qmp, log = self.path("qmp"), self.log_path()
        launcher, pidfile = self.daemon(qmp, "-D", log)
        self.assertEqual((await launcher.exit_status(), launcher.stderr), (0, b""))
        daemon_pid = read_pid(pidfile)
        assert daemon_pid is not None
        await wait_until(
            lambda: standard_streams(daemon_pid) == [os.devnull, os.devnull, log],
            "the daemon to keep the log file as its stderr",
        )
        client = await self.monitor(qmp)
        await client.execute("quit")
        await monitor_closed(client)
        await wait_until(lambda: read_pid(pidfile) is None, "the daemon to exit")
        # A successful start and a quit write nothing; the earlier run's line is gone.
        self.assertEqual(read_file(log), b"")

    @deferred_test
    async def test_sigtermLineOfADaemonLandsInTheLogfile(self) -> None:
        qmp, log = self.path("qmp"), self.log_path()
        launcher, pidfile = self.daemon(qmp, "-D", log)
        self.assertEqual(await launcher.exit_status(), 0)
        daemon_pid = read_pid(pidfile)
        assert daemon_pid is not None
        os.kill(daemon_pid, signal.SIGTERM)
        await wait_until(lambda: read_pid(pidfile) is None, "the daemon to exit")
        self.assertEqual(read_file(log), stderr_lines("terminating on signal 15"))


GUEST_AGENT = """
import socket, sys
guest = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
guest.connect(sys.argv[1])
guest.sendall(b"STARTED\\n")
print("sent", flush=True)
guest.recv(1)  # hold the port open, as an agent does, until the VM closes it
"""


class GuestSocketTests(ProcessTestCase):
    """The guest end of each virtio serial port is a unix socket a process can open."""

    async def agent_ring_open(self, client: QMPClientProtocol) -> bool:
        chardevs = await client.execute("query-chardev")
        return bool(next(c["frontend-open"] for c in chardevs if c["label"] == AGENT_RING))

    async def wait_for_frontend(self, client: QMPClientProtocol, expected: bool) -> None:
        deadline = reactor.seconds() + DEADLINE
        while await self.agent_ring_open(client) is not expected:
            if reactor.seconds() > deadline:
                raise AssertionError(f"frontend-open never became {expected}")
            await pause()

    @deferred_test
    async def test_guestProcessWritesReachTheRingBuffer(self) -> None:
        _, client, qmp = await self.agent_vm()
        agent = self.spawn_python(GUEST_AGENT, self.guest_socket(qmp, AGENT_PORT))
        await wait_until(lambda: agent.stdout == b"sent\n", "the guest process to write")
        drained = ""
        deadline = reactor.seconds() + DEADLINE
        while not drained.endswith("\n") and reactor.seconds() < deadline:
            drained += await client.execute(
                "ringbuf-read", {"device": AGENT_RING, "size": 4096, "format": "utf8"}
            )
            await pause()
        self.assertEqual(drained, "STARTED\n")

    @deferred_test
    async def test_aSocketChardevCarriesHostBytesToTheGuestSocket(self) -> None:
        qmp = self.path("qmp")
        connect = self.path("connect.sock")
        process = self.spawn(
            [
                *agent_devices(),
                *qmp_option(qmp),
                "-chardev",
                f"socket,id=vmready-connect,path={connect},server=on,wait=off",
                "-device",
                "virtserialport,chardev=vmready-connect,name=vmready.connect,bus=vs0.0,"
                "id=vmready.connect",
            ]
        )
        await self.monitor(qmp, process)
        guest = await self.open_socket(self.guest_socket(qmp, "vmready.connect"), Received())
        host = await self.open_socket(connect, Received())
        assert host.transport is not None and guest.transport is not None
        host.transport.write(b"CONNECT 2:1234\n")
        guest.transport.write(b"ok\n")
        await wait_until(lambda: len(guest.received) >= 15, "the host's bytes at the guest")
        await wait_until(lambda: host.received == b"ok\n", "the guest's bytes at the host")
        self.assertEqual(guest.received, b"CONNECT 2:1234\n")

    @deferred_test
    async def test_frontendOpenFollowsTheGuestSocket(self) -> None:
        _, client, qmp = await self.agent_vm()
        before = await self.agent_ring_open(client)
        guest = await self.open_socket(self.guest_socket(qmp, AGENT_PORT), Received())
        await self.wait_for_frontend(client, True)
        assert guest.transport is not None
        guest.transport.loseConnection()
        await guest.closed
        await self.wait_for_frontend(client, False)
        self.assertFalse(before)

    @deferred_test
    async def test_guestPoweroffEndsTheVM(self) -> None:
        process, client, qmp = await self.agent_vm()
        events = EventRecorder(client)
        control = await self.open_socket(self.control_socket(qmp), Received())
        assert control.transport is not None
        control.transport.write(b"poweroff\n")
        shutdown = await events.first("SHUTDOWN")
        status = await process.exit_status()
        self.assertEqual(
            (control.received, shutdown.data, status, process.stderr),
            (b"ok\n", {"guest": True, "reason": "guest-shutdown"}, 0, b""),
        )


class MigrationTests(ProcessTestCase):
    """Migrate to a state file, then restore it in a new process."""

    async def save_state(self) -> str:
        """Run a VM, migrate it to ``exec:cat > state``, and quit it; the state file's path."""
        qmp, state = self.path("source.qmp"), self.path("vm.state")
        source = self.spawn([*agent_devices(), *qmp_option(qmp)])
        client = await self.monitor(qmp, source)
        await client.execute("migrate", {"uri": f"exec:cat > {state}"})
        deadline = reactor.seconds() + DEADLINE
        while (await client.execute("query-migrate")).get("status") != "completed":
            if reactor.seconds() > deadline:
                raise AssertionError("migration never completed")
            await pause()
        self.assertEqual((await client.execute("query-status"))["status"], "postmigrate")
        await client.execute("quit")
        self.assertEqual(await source.exit_status(), 0)
        return state

    @deferred_test
    async def test_restoreWithTheSameDevicesResumes(self) -> None:
        state = await self.save_state()
        qmp = self.path("target.qmp")
        target = self.spawn([*agent_devices(), *qmp_option(qmp), "-incoming", f"exec:cat {state}"])
        client = await self.monitor(qmp, target)
        deadline = reactor.seconds() + DEADLINE
        status = (await client.execute("query-status"))["status"]
        while status == "inmigrate" and reactor.seconds() < deadline:
            await pause()
            status = (await client.execute("query-status"))["status"]
        self.assertEqual(status, "running")
        self.assertIsNone(target.status)

    @deferred_test
    async def test_restoreWithAnExtraPortFailsAsQEMUDoes(self) -> None:
        state = await self.save_state()
        qmp = self.path("target.qmp")
        target = self.spawn(
            [
                *agent_devices(legacy=True),
                *qmp_option(qmp),
                "-incoming",
                f"exec:cat {state}",
            ]
        )
        answered = await self.commands_answered_until_exit(qmp, target)
        self.assertEqual(
            (await target.exit_status(), target.stderr),
            (
                1,
                stderr_lines(
                    "Failed to load virtio-console:virtio",
                    "error while loading state for instance 0x0 of device "
                    "'0000:00:01.0/virtio-console'",
                    "load of migration failed: Invalid argument",
                ),
            ),
        )
        self.assertEqual(answered, [])
        # Afterwards nobody answers on the monitor socket at all.
        await self.assertFailure(connect_qmp(reactor, qmp, timeout=DEADLINE), QMPDisconnected)

    async def commands_answered_until_exit(
        self, qmp: str, process: RecordedProcess
    ) -> list[object]:
        """Keep trying the monitor while the process lives; what it answered, if anything."""
        answered: list[object] = []
        deadline = reactor.seconds() + DEADLINE
        while process.status is None and not answered and reactor.seconds() < deadline:
            try:
                client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
            except QMPDisconnected:
                await pause()  # refused or not there yet: the monitor is not serving
                continue
            try:
                answered.append(await client.execute("query-status"))
            except QMPDisconnected:
                # connected, then the monitor went away: what a client must see
                continue
            finally:
                await self._hang_up(client)
        return answered

    async def waiting_for_stream(self, incoming: str) -> RecordedProcess:
        """Start a VM restoring from ``incoming``; check it serves QMP, waiting in inmigrate."""
        qmp = self.path("target.qmp")
        process = self.spawn([*agent_devices(), *qmp_option(qmp), "-incoming", incoming])
        client = await self.monitor(qmp, process)
        self.assertEqual(
            (
                (await client.execute("query-status"))["status"],
                await client.execute("query-migrate"),
                process.status,
            ),
            ("inmigrate", {}, None),
        )
        return process

    async def daemon_restoring(
        self, qmp: str, incoming: str, legacy: bool = False
    ) -> tuple[str, str]:
        """A daemonized VM told to restore from ``incoming``, its monitor at ``qmp``; its
        pidfile and log file once its launcher has returned."""
        log = self.path("vm.log")
        launcher, pidfile = self.daemon(qmp, "-incoming", incoming, "-D", log, legacy=legacy)
        # As QEMU's: the launcher has returned before the daemon loads the stream.
        self.assertEqual((await launcher.exit_status(), launcher.stderr), (0, b""))
        return pidfile, log

    @deferred_test
    async def test_missingIncomingFileLeavesTheVMWaiting(self) -> None:
        missing = self.path("missing.state")
        process = await self.waiting_for_stream(f"exec:cat {missing}")
        process.send_signal("TERM")
        # As QEMU 7.2: cat's complaint, then nothing until the VM is told to stop.
        self.assertEqual(
            (await process.exit_status(), process.stderr),
            (
                0,
                f"cat: {missing}: No such file or directory\n".encode()
                + stderr_lines("terminating on signal 15"),
            ),
        )

    @deferred_test
    async def test_daemonizedRefusedRestoreLogsQEMUsLinesAndExits(self) -> None:
        state = await self.save_state()
        qmp = self.path("target.qmp")
        pidfile, log = await self.daemon_restoring(qmp, f"exec:cat {state}", legacy=True)
        expected = stderr_lines(
            "Failed to load virtio-console:virtio",
            "error while loading state for instance 0x0 of device '0000:00:01.0/virtio-console'",
            "load of migration failed: Invalid argument",
        )
        await wait_until(lambda: read_file(log) == expected, "the restore's lines in the log")
        await wait_until(lambda: read_pid(pidfile) is None, "the daemon to exit")
        await self.assertFailure(connect_qmp(reactor, qmp, timeout=DEADLINE), QMPDisconnected)

    @deferred_test
    async def test_missingIncomingFileComplaintLandsInTheLogfile(self) -> None:
        missing, qmp = self.path("missing.state"), self.path("qmp")
        _, log = await self.daemon_restoring(qmp, f"exec:cat {missing}")
        client = await self.monitor(qmp)
        self.assertEqual(
            ((await client.execute("query-status"))["status"], read_file(log)),
            ("inmigrate", f"cat: {missing}: No such file or directory\n".encode()),
        )

    @deferred_test
    async def test_emptyIncomingFileLeavesTheVMWaiting(self) -> None:
        empty = self.path("empty.state")
        open(empty, "wb").close()
        process = await self.waiting_for_stream(f"exec:cat {empty}")
        process.send_signal("TERM")
        self.assertEqual(
            (await process.exit_status(), process.stderr),
            (0, stderr_lines("terminating on signal 15")),
        )


@implementer(IHalfCloseableProtocol)
class HalfClosingEnd(Received):
    """A socket end that can shut down its sending side and still read the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.read_closed = False

    def readConnectionLost(self) -> None:
        # The peer will send nothing more: the connection is over for us too.
        self.read_closed = True
        assert self.transport is not None
        self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        """Our half-close went through; the peer may still send."""

    def send(self, data: bytes) -> None:
        """Write bytes as the guest."""
        assert self.transport is not None
        self.transport.write(data)

    def half_close(self) -> None:
        """Shut down our sending side, as a guest's ``shutdown(SHUT_WR)``."""
        assert self.transport is not None
        self.transport.loseWriteConnection()  # type: ignore[attr-defined]


def _received(end: Received, expected: bytes) -> bool:
    return end.received == expected


class GuestDeviceTests(ProcessTestCase):
    """The issue 11 devices on a real fakeqemu process: console, forwards, 9p, port ids."""

    def devices(self, command: str = "sh -c 'echo out; echo err >&2; exec cat'") -> list[str]:
        """The agent's devices, a port id, the console, a 9p export and one guestfwd rule."""
        os.makedirs(self.path("config-drive"), exist_ok=True)
        return [
            *agent_devices(),
            "-device",
            f"virtserialport,name={LEGACY_PORT},bus=vs0.0,id=legacy",
            *guest_devices(self.directory, command, mac="52:54:00:76:6d:01"),
        ]

    def guest_path(self, qmp: str, name: str) -> str:
        """A path in the VM's guest directory."""
        return os.path.join(qmp + ".guest", name)

    async def start_vm(self, *extra: str) -> tuple[RecordedProcess, QMPClientProtocol, str]:
        qmp = self.path("qmp")
        process = self.spawn([*self.devices(), *qmp_option(qmp), *extra])
        return process, await self.monitor(qmp, process), qmp

    @deferred_test
    async def test_consoleWritesLandInTheLogFile(self) -> None:
        with open(self.path("console.log"), "wb") as f:
            f.write(b"earlier boot\n")
        _, _, qmp = await self.start_vm()
        console = await self.open_socket(self.guest_path(qmp, "console"), HalfClosingEnd())
        console.send(b"[    0.000000] Linux version 6.1.0\n")

        def logged() -> bytes:
            with open(self.path("console.log"), "rb") as f:
                return f.read()

        await wait_until(lambda: logged().endswith(b"6.1.0\n"), "the console line in the file")
        self.assertEqual(logged(), b"earlier boot\n[    0.000000] Linux version 6.1.0\n")

    @deferred_test
    async def test_forwardRunsTheCommandWithTheConnectionAsItsStreams(self) -> None:
        _, _, qmp = await self.start_vm()
        guest = await self.open_socket(
            self.guest_path(qmp, "tcp/10.0.2.100:8443"), HalfClosingEnd()
        )
        await wait_until(lambda: guest.received == b"out\nerr\n", "stdout and stderr at the guest")
        guest.send(b"GET /1.0\n")
        await wait_until(lambda: guest.received.endswith(b"GET /1.0\n"), "cat's echo")
        guest.half_close()
        await guest.closed
        self.assertEqual(guest.received, b"out\nerr\nGET /1.0\n")

    @deferred_test
    async def test_eachForwardedConnectionHasItsOwnCommand(self) -> None:
        _, _, qmp = await self.start_vm()
        socket_path = self.guest_path(qmp, "tcp/10.0.2.100:8443")
        first = await self.open_socket(socket_path, HalfClosingEnd())
        second = await self.open_socket(socket_path, HalfClosingEnd())
        for end, word in ((first, b"one\n"), (second, b"two\n")):
            await wait_until(functools.partial(_received, end, b"out\nerr\n"), "the banner")
            end.send(word)
        for end, word in ((first, b"out\nerr\none\n"), (second, b"out\nerr\ntwo\n")):
            await wait_until(functools.partial(_received, end, word), "the echo")
        self.assertEqual(
            (first.received, second.received), (b"out\nerr\none\n", b"out\nerr\ntwo\n")
        )

    @deferred_test
    async def test_commandThatCannotStartIsReportedAndTheConnectionClosed(self) -> None:
        qmp = self.path("qmp")
        log = self.path("qemu.log")
        pidfile = self.path("vm.pid")
        self.kill_daemon_at_cleanup(pidfile)
        launcher = self.spawn(
            [
                *self.devices(command="nonexistent-command-xyz"),
                *qmp_option(qmp),
                "-daemonize",
                "-pidfile",
                pidfile,
                "-D",
                log,
            ]
        )
        self.assertEqual(await launcher.exit_status(), 0)
        guest = await self.open_socket(self.guest_path(qmp, "tcp/10.0.2.100:8443"), Received())
        await guest.closed
        with open(log, "rb") as f:
            self.assertEqual(
                (guest.received, f.read()),
                (
                    b"",
                    stderr_lines(
                        "Slirp: fork_exec: Failed to execute child process "
                        "\u201cnonexistent-command-xyz\u201d (No such file or directory)"
                    ),
                ),
            )

    @deferred_test
    async def test_daemonizedVMRunsForwardCommandsFromTheRoot(self) -> None:
        qmp = self.path("qmp")
        pidfile = self.path("vm.pid")
        self.kill_daemon_at_cleanup(pidfile)
        launcher = self.spawn(
            [*self.devices(command="pwd"), *qmp_option(qmp), "-daemonize", "-pidfile", pidfile]
        )
        self.assertEqual(await launcher.exit_status(), 0)
        guest = await self.open_socket(self.guest_path(qmp, "tcp/10.0.2.100:8443"), Received())
        await guest.closed
        self.assertEqual(guest.received, b"/\n")

    @deferred_test
    async def test_exportIsLinkedForTheGuestUntilTheVMExits(self) -> None:
        process, client, qmp = await self.start_vm()
        link = self.guest_path(qmp, "9p/config")
        target = os.readlink(link)
        await client.execute("quit")
        await process.exit_status()
        self.assertEqual((target, os.path.lexists(link)), (self.path("config-drive"), False))

    @deferred_test
    async def test_portWithAnIdReportsTheGuestOpeningIt(self) -> None:
        _, client, qmp = await self.start_vm()
        events = EventRecorder(client)
        guest = await self.open_socket(self.guest_socket(qmp, LEGACY_PORT), Received())
        opened = await events.first("VSERPORT_CHANGE")
        assert guest.transport is not None
        guest.transport.loseConnection()
        await wait_until(lambda: len(events.events) == 2, "the port's closing")
        self.assertEqual(
            [(e.name, e.data) for e in events.events],
            [
                ("VSERPORT_CHANGE", {"open": True, "id": "legacy"}),
                ("VSERPORT_CHANGE", {"open": False, "id": "legacy"}),
            ],
        )
        self.assertEqual(opened.data, {"open": True, "id": "legacy"})
