"""Backends and helpers for running the same checks against fakeqemu and real QEMU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, NoReturn

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from tests.reactor import reactor
from vmready.hypervisor.accel import accelerators_for_host
from vmready.hypervisor.cmdline import AGENT_PORT, AGENT_RING, LEGACY_PORT
from vmready.protocols.qmp import QMPClientProtocol, QMPEvent, connect_qmp

REQUIRE_QEMU_VARIABLE = "VMREADY_REQUIRE_QEMU"
QEMU_BINARY_VARIABLE = "VMREADY_QEMU_BINARY"
START_TIMEOUT = 60.0

# Re-exported from the one command-line builder: the serial layout vmready gives a VM.
__all__ = ["AGENT_PORT", "AGENT_RING", "LEGACY_PORT"]


def cannot_run(case: SynchronousTestCase, reason: str) -> NoReturn:
    """Skip ``case`` for ``reason``; under VMREADY_REQUIRE_QEMU=1 (CI) fail it instead."""
    if os.environ.get(REQUIRE_QEMU_VARIABLE) == "1":
        case.fail(f"{REQUIRE_QEMU_VARIABLE}=1 but {reason}")
    case.skipTest(reason)


def require_program(case: SynchronousTestCase, program: str, package: str) -> str:
    """Where ``program`` is; where it is missing, ``cannot_run`` names its Debian ``package``."""
    path = shutil.which(program)
    if path is None:
        cannot_run(case, f"{program} is not installed (Debian: apt-get install {package})")
    return path


def accelerator() -> str:
    """kvm where /dev/kvm opens, else tcg: the first accelerator vmready would try."""
    return accelerators_for_host()[0]


@attrs.frozen
class Backend:
    """A hypervisor binary the checks can run: its argv prefix and what it can do."""

    name: str
    program: tuple[str, ...]
    has_guest_sockets: bool
    # What its messages start with, as QEMU's: the basename of its argv[0].
    message_prefix: str

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here, or None."""
        if shutil.which(self.program[0]) is None and not os.path.exists(self.program[0]):
            return f"{self.program[0]} is not installed (Debian: apt-get install qemu-system-x86)"
        return None


FAKEQEMU = Backend(
    "fakeqemu",
    (sys.executable, "-m", "fakeqemu"),
    has_guest_sockets=True,
    message_prefix="fakeqemu",
)
_QEMU_BINARY = os.environ.get(QEMU_BINARY_VARIABLE, "qemu-system-x86_64")
REAL_QEMU = Backend(
    "qemu", (_QEMU_BINARY,), has_guest_sockets=False, message_prefix=os.path.basename(_QEMU_BINARY)
)


def qemu_text(backend: Backend, *messages: str) -> str:
    """What ``backend`` prints for ``messages``: each prefixed, continuation lines bare."""
    text = ""
    for message in messages:
        first, *rest = message.split("\n")
        text += f"{backend.message_prefix}: {first}\n" + "".join(line + "\n" for line in rest)
    return text


def serial_devices(
    ring_size: int = 16, ports: Sequence[tuple[str, str | None]] = ((AGENT_PORT, AGENT_RING),)
) -> list[str]:
    """QEMU arguments for a virtio-serial bus, the ring buffers and the named ports."""
    args = ["-device", "virtio-serial-pci,id=vs0"]
    for _, chardev in ports:
        if chardev is not None:
            args += ["-chardev", f"ringbuf,id={chardev},size={ring_size}"]
    for name, chardev in ports:
        wiring = f"chardev={chardev}," if chardev is not None else ""
        args += ["-device", f"virtserialport,{wiring}name={name},bus=vs0.0"]
    return args


def strip_program(stderr: str) -> list[str]:
    """QEMU's stderr lines without the ``<program>: `` prefix, warnings dropped."""
    lines = []
    for line in stderr.splitlines():
        head, sep, rest = line.partition(": ")
        text = rest if sep and " " not in head else line
        if text.startswith("warning: "):
            continue
        lines.append(text)
    return lines


@attrs.define
class ProcessResult:
    """A finished hypervisor process."""

    returncode: int
    stderr: str

    @property
    def messages(self) -> list[str]:
        """stderr without program prefixes and warnings."""
        return strip_program(self.stderr)


class VMWorkspace:
    """A short temporary directory holding one test's sockets, pidfiles and state files."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="vmr-", dir="/tmp")
        self.pids: list[int] = []

    def file(self, name: str) -> str:
        """A path inside the workspace."""
        return os.path.join(self.path, name)

    def cleanup(self) -> None:
        """Kill whatever VM of this workspace is left and remove the directory."""
        for pid in self.pids:
            # A VM that exited by itself may have left its pid to another process.
            if not self._is_ours(pid):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        shutil.rmtree(self.path, ignore_errors=True)

    def _is_ours(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return os.fsencode(self.path) in f.read()
        except OSError:
            return False

    def write(self, name: str, text: str) -> str:
        """Create a file in the workspace holding ``text``; its path."""
        path = self.file(name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def read(self, name: str) -> str | None:
        """A workspace file's text, or None if there is no such file."""
        try:
            with open(self.file(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None


def base_arguments(name: str = "conformance", accel: str | None = None) -> list[str]:
    """The machine every check starts from; ``accel`` defaults to kvm where usable, else tcg."""
    return [
        "-name",
        name,
        "-machine",
        "q35",
        "-accel",
        accel or accelerator(),
        "-nodefaults",
        "-display",
        "none",
        "-m",
        "64",
    ]


def run_foreground(
    backend: Backend, args: Sequence[str], timeout: float = START_TIMEOUT
) -> ProcessResult:
    """Run the hypervisor until it exits by itself (a refused command line or restore)."""
    completed = subprocess.run(
        [*backend.program, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return ProcessResult(completed.returncode, completed.stderr)


def launch_daemonized(
    backend: Backend, workspace: VMWorkspace, args: Sequence[str], socket_name: str = "qmp.sock"
) -> ProcessResult:
    """Run a daemonizing launch with a monitor at ``socket_name`` and a pidfile beside it.

    The launch's own result; the daemon it left, if its pidfile names one, is
    killed at cleanup.  A daemon may already have exited (a failed restore), so
    the pidfile may be gone.
    """
    socket_path = workspace.file(socket_name)
    pidfile = workspace.file(socket_name + ".pid")
    result = run_foreground(
        backend,
        [
            *args,
            "-qmp",
            f"unix:{socket_path},server=on,wait=off",
            "-daemonize",
            "-pidfile",
            pidfile,
        ],
    )
    with contextlib.suppress(OSError, ValueError), open(pidfile) as f:
        workspace.pids.append(int(f.read().strip()))
    return result


def start_daemonized(
    backend: Backend, workspace: VMWorkspace, args: Sequence[str], socket_name: str = "qmp.sock"
) -> str:
    """Start a daemonized VM; returns its QMP socket path once QEMU has returned."""
    result = launch_daemonized(backend, workspace, args, socket_name)
    if result.returncode != 0:
        raise AssertionError(f"{backend.name} refused to start: {result.stderr}")
    if not os.path.exists(workspace.file(socket_name + ".pid")):
        raise AssertionError(f"{backend.name} started but its daemon is already gone")
    return workspace.file(socket_name)


async def monitor(socket_path: str) -> QMPClientProtocol:
    """A negotiated QMP client on ``socket_path``."""
    return await connect_qmp(reactor, socket_path, timeout=START_TIMEOUT)


class EventLog:
    """Collects a monitor's events and lets a check wait for one by name."""

    def __init__(self, client: QMPClientProtocol) -> None:
        self.events: list[QMPEvent] = []
        self._waiting: list[tuple[str, dict[str, Any], Deferred[QMPEvent]]] = []
        client.subscribe(self._received)

    def _received(self, event: QMPEvent) -> None:
        self.events.append(event)
        for entry in list(self._waiting):
            name, data, waiter = entry
            if _matches(event, name, data):
                self._waiting.remove(entry)
                waiter.callback(event)

    def names(self) -> list[str]:
        """Event names in arrival order."""
        return [e.name for e in self.events]

    def wait_for(
        self, name: str, timeout: float = START_TIMEOUT, **data: Any
    ) -> Deferred[QMPEvent]:
        """Fires with the first event called ``name`` whose data includes ``data``."""
        for event in self.events:
            if _matches(event, name, data):
                d: Deferred[QMPEvent] = Deferred()
                d.callback(event)
                return d
        waiter: Deferred[QMPEvent] = Deferred()
        self._waiting.append((name, data, waiter))
        waiter.addTimeout(timeout, reactor)
        return waiter


def _matches(event: QMPEvent, name: str, data: dict[str, Any]) -> bool:
    return event.name == name and all(event.data.get(k) == v for k, v in data.items())


class RawMonitor(Protocol):
    """A QMP connection that sends raw bytes and returns parsed replies, for wire checks."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._buffer = b""
        self._waiters: list[tuple[int, Deferred[list[dict[str, Any]]]]] = []
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.strip():
                self.messages.append(json.loads(line))
        for entry in list(self._waiters):
            count, waiter = entry
            if len(self.messages) >= count:
                self._waiters.remove(entry)
                waiter.callback(self.messages[:count])

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.closed.callback(None)

    def send(self, data: bytes) -> None:
        """Write raw bytes to the monitor."""
        assert self.transport is not None
        self.transport.write(data)

    def wait_for_count(
        self, count: int, timeout: float = START_TIMEOUT
    ) -> Deferred[list[dict[str, Any]]]:
        """Fires with the first ``count`` messages once that many have arrived."""
        waiter: Deferred[list[dict[str, Any]]] = Deferred()
        if len(self.messages) >= count:
            waiter.callback(self.messages[:count])
            return waiter
        self._waiters.append((count, waiter))
        waiter.addTimeout(timeout, reactor)
        return waiter


async def raw_monitor(socket_path: str) -> RawMonitor:
    """A raw connection to the monitor at ``socket_path``."""
    protocol = RawMonitor()
    await connectProtocol(UNIXClientEndpoint(reactor, socket_path), protocol)
    return protocol
