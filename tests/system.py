"""Real processes for system tests: the daemon, the CLI, guest agents and guest programs.

``System`` owns one short data dir under /tmp and every process a test starts
in it: ``twistd -n vmready`` daemons, ``vmready`` CLI commands, ``vmready-agent``
processes (a fakeqemu guest is a host process, so its agent is one too) and
the fakeqemu VMs the daemon starts.  Everything it started is killed in the
test's cleanup, also when the test failed half-way: the tracked children by
their ``Popen``, then any process whose command line names the data dir (the
daemonized VMs), by pid.

Every wait is bounded (``DEADLINE``) and polls; nothing sleeps for a fixed
long time, and nothing asserts on how long something took.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any, NamedTuple, TypeVar

from twisted.trial.unittest import SynchronousTestCase

from tests.processes import kill_strays
from vmready.daemon.daemonconfig import GUEST_SOCKET_BASE
from vmready.domain.states import READY_KEY
from vmready.hypervisor.configdrive import AGENT_CONFIG, AGENT_ZIPAPP
from vmready.lifecycle.specs import CONFIG_DRIVE, run_dir_name

__all__ = [
    "DEADLINE",
    "READY_KEY",
    "Answer",
    "EventReader",
    "GuestPort",
    "System",
    "eventually",
    "unix_http",
]

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
# The bound of every wait: generous, so a loaded machine is slow, not failing.
DEADLINE = 60.0
# Quick follow-ups after a CONNECT; everything else is the event-driven default (reads on
# VSERPORT_CHANGE), so these tests show that a daemon hears its agents without polling.
POLLING = ("--agent-follow-up", "0.02")

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None], what: str, timeout: float = DEADLINE, interval: float = 0.05
) -> T:
    """Poll ``probe`` until it returns something truthy (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class Answer(NamedTuple):
    """An HTTP answer as a client on a unix socket sees it."""

    status: int
    content_type: str
    body: bytes


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def unix_http(
    path: str, method: str, target: str, body: bytes | None = None, timeout: float = DEADLINE
) -> Answer:
    """One HTTP/1.1 request on the unix socket at ``path`` (a guest program, or an operator)."""
    connection = _UnixHTTPConnection(path, timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, target, body=body, headers=headers)
        response = connection.getresponse()
        return Answer(response.status, response.getheader("Content-Type", ""), response.read())
    finally:
        connection.close()


class EventReader:
    """The operator API's ``/1.0/events`` stream, read on a plain socket.

    The daemon sends the response headers once it has subscribed the client,
    so when the constructor returns no later event can be missed.
    """

    def __init__(self, socket_path: str, types: str = "lifecycle") -> None:
        self.events: list[dict[str, Any]] = []
        self._buffer = b""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(DEADLINE)
        self._sock.connect(socket_path)
        # HTTP/1.0: the body is the raw stream, no chunked framing.
        self._sock.sendall(
            f"GET /1.0/events?type={types} HTTP/1.0\r\nHost: vmready\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise AssertionError(f"the event stream closed before its headers: {head!r}")
            head += chunk
        head, _, self._buffer = head.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status + b" ":
            raise AssertionError(f"the event stream answered {status!r}")
        self._split()

    def close(self) -> None:
        """Hang up."""
        self._sock.close()

    def _split(self) -> None:
        *lines, self._buffer = self._buffer.split(b"\n")
        self.events.extend(json.loads(line) for line in lines if line.strip())

    def _read_available(self, wait: float) -> None:
        readable, _, _ = select.select([self._sock], [], [], wait)
        if not readable:
            return
        chunk = self._sock.recv(65536)
        if not chunk:
            raise AssertionError("the daemon closed the event stream")
        self._buffer += chunk
        self._split()

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        what: str,
        timeout: float = DEADLINE,
        after: int = 0,
    ) -> int:
        """The position of the first event from ``after`` on (seen or arriving) that satisfies
        ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            for position in range(after, len(self.events)):
                if predicate(self.events[position]):
                    return position
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out after {timeout:g}s waiting for {what}; saw {self.actions_of_all()}"
                )
            self._read_available(min(left, 0.5))

    def wait_for_action(
        self, name: str, action: str, timeout: float = DEADLINE, after: int = 0
    ) -> int:
        """Where the first lifecycle event ``action`` about ``name`` from ``after`` on is."""
        return self.wait_for(
            lambda event: _source(event) == name and _action(event) == action,
            f"{action} of {name}",
            timeout,
            after,
        )

    def actions(self, name: str, prefix: str = "", until: int | None = None) -> list[str]:
        """The lifecycle actions about ``name`` seen so far (or before position ``until``),
        those starting with ``prefix``."""
        return [
            _action(event)
            for event in self.events[:until]
            if _source(event) == name and _action(event).startswith(prefix)
        ]

    def actions_of_all(self) -> list[str]:
        """Every lifecycle action seen so far, as ``name:action``."""
        return [f"{_source(event)}:{_action(event)}" for event in self.events]


def _action(event: dict[str, Any]) -> str:
    return str((event.get("metadata") or {}).get("action", ""))


def _source(event: dict[str, Any]) -> str:
    source = str((event.get("metadata") or {}).get("source", ""))
    return source.removeprefix("/1.0/instances/")


class GuestPort:
    """A guest program holding the VM's agent serial port (fakeqemu: a unix socket).

    It writes on the agent's port and reads the host's CONNECT lines from the
    ``vmready.connect`` port (``connect``), as the agent does; without one it
    reads the agent's port itself.  fakeqemu lets one client hold a port at a
    time and hangs up on a second one at once, so connecting retries until the
    port is really ours.
    """

    def __init__(self, path: str, connect: str | None = None) -> None:
        self.received = b""
        self._sock = eventually(lambda: self._hold(path), f"holding the serial port {path}")
        self._replies = (
            self._sock
            if connect is None
            else eventually(lambda: self._hold(connect), f"holding the connect port {connect}")
        )

    @staticmethod
    def _hold(path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            # A refused second client is closed at once: an EOF within a moment.
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable and not sock.recv(65536, socket.MSG_PEEK):
                sock.close()
                return None
        except OSError:
            sock.close()
            return None
        return sock

    def send(self, data: bytes) -> None:
        """Write to the port, as the agent would."""
        self._sock.sendall(data)

    def wait_for_line(self, predicate: Callable[[bytes], bool], what: str) -> bytes:
        """The first complete line from the host that satisfies ``predicate``."""
        deadline = time.monotonic() + DEADLINE
        while True:
            for line in self.received.split(b"\n")[:-1]:
                if predicate(line):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {what} on the serial port; got {self.received!r}"
                )
            readable, _, _ = select.select([self._replies], [], [], min(left, 0.5))
            if readable:
                chunk = self._replies.recv(65536)
                if not chunk:
                    raise AssertionError(f"the serial port closed; got {self.received!r}")
                self.received += chunk

    def close(self) -> None:
        """Let go of the ports."""
        self._sock.close()
        self._replies.close()


class System:
    """One data dir, its daemon(s), CLI, agents and VMs; all cleaned up after the test."""

    def __init__(self, case: SynchronousTestCase) -> None:
        self.case = case
        # Short: the VM's guest sockets live under it and must stay below 107 bytes.
        self.directory = tempfile.mkdtemp(prefix="vmr-s-", dir="/tmp")
        case.addCleanup(shutil.rmtree, self.directory, True)
        self.socket_path = os.path.join(self.directory, "vmready.sock")
        self.log_path = os.path.join(self.directory, "vmready.log")
        self.daemon: subprocess.Popen[bytes] | None = None
        self._children: list[subprocess.Popen[Any]] = []
        self._files: list[IO[Any]] = []
        case.addCleanup(self._clean_up)

    # -- cleanup ------------------------------------------------------------

    def _clean_up(self) -> None:
        for child in reversed(self._children):
            if child.poll() is None:
                child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=DEADLINE)
        kill_strays(self.directory)  # the daemonized VMs, and anything else we left
        for f in self._files:
            f.close()

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        output = open(os.path.join(self.directory, log_name), "ab")  # noqa: SIM115
        self._files.append(output)
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT
        )
        self._children.append(child)
        return child

    # -- the daemon ---------------------------------------------------------

    def start_daemon(self, *options: str) -> subprocess.Popen[bytes]:
        """``twistd -n vmready`` on the data dir; returns once its operator API answers."""
        command = [TWISTD, "-n", "--pidfile", "", "--logfile", self.log_path, "vmready"]
        command += ["--config", ""]  # whatever /etc/vmready/vmready.yaml the host has
        command += ["--data-dir", self.directory, *POLLING, *options]
        command += ["--stop-timeout", "2", "--power-sync-interval", "1"]
        daemon = self.daemon = self._spawn(command, "twistd.out")

        def answers() -> bool:
            if daemon.poll() is not None:
                raise AssertionError(f"the daemon exited with {daemon.returncode}")
            try:
                return (
                    unix_http(self.socket_path, "GET", "/1.0/instances", timeout=5).status == 200
                )
            except OSError:
                return False

        eventually(answers, "the daemon's operator API")
        return daemon

    def stop_daemon(self, how: signal.Signals = signal.SIGTERM) -> int:
        """Signal the daemon and wait for it to exit; its exit status."""
        assert self.daemon is not None
        self.daemon.send_signal(how)
        return self.daemon.wait(timeout=DEADLINE)

    def daemon_log(self) -> str:
        """Everything the daemons wrote to their log so far, rotated parts included."""
        rotated = [path for path in glob.glob(self.log_path + ".*") if path[-1].isdigit()]
        older_first = sorted(rotated, key=lambda path: -int(path.rpartition(".")[2]))
        text = []
        for path in [*older_first, self.log_path]:
            with open(path, errors="replace") as f:
                text.append(f.read())
        return "".join(text)

    def guest_api_ports(self) -> list[int]:
        """The ports of the guest API's hybrid vsock sockets in the data dir."""
        base = os.path.join(self.directory, GUEST_SOCKET_BASE)
        return sorted(int(path.rpartition("_")[2]) for path in glob.glob(base + "_*"))

    def events(self) -> EventReader:
        """A subscribed lifecycle event stream of the running daemon (closed at cleanup)."""
        reader = EventReader(self.socket_path)
        self.case.addCleanup(reader.close)
        return reader

    # -- the CLI ------------------------------------------------------------

    def _cli_command(self, args: tuple[str, ...]) -> list[str]:
        return [sys.executable, "-m", "vmready.cli.main", "--socket", self.socket_path, *args]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``vmready ARGS``; by default it must succeed.

        A command given ``--timeout T`` is waited for T plus the usual deadline: a
        ``wait`` that may take minutes (a guest booting under TCG on a loaded
        machine) ends by its own timeout, with its own message, not by ours.
        """
        result = subprocess.run(
            self._cli_command(args),
            capture_output=True,
            text=True,
            timeout=_own_timeout(args) + DEADLINE,
            check=False,
        )
        if check:
            self.case.assertEqual(
                result.returncode, 0, f"vmready {' '.join(args)}: {result.stdout}{result.stderr}"
            )
        return result

    def cli_in_background(self, *args: str) -> subprocess.Popen[str]:
        """Start ``vmready ARGS`` without waiting for it (killed at cleanup)."""
        child = subprocess.Popen(
            self._cli_command(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._children.append(child)
        return child

    def info(self, name: str) -> dict[str, Any]:
        """``vmready info NAME --format json``."""
        document: dict[str, Any] = json.loads(self.cli("info", name, "--format", "json").stdout)
        return document

    def listed_status(self, name: str) -> str:
        """The STATUS column of ``vmready list`` for ``name``."""
        for line in self.cli("list").stdout.splitlines():
            words = line.split()
            if words and words[0] == name:
                return words[1]
        raise AssertionError(f"{name} is not in vmready list")

    # -- the guest ----------------------------------------------------------

    def run_dir(self, name: str) -> str:
        """The instance's run directory (its VM's sockets, pidfile and config drive)."""
        return os.path.join(self.directory, "run", run_dir_name(self.info(name)["uuid"]))

    def agent_settings(self, name: str) -> dict[str, str]:
        """The instance's config drive ``agent.json``."""
        with open(os.path.join(self.run_dir(name), CONFIG_DRIVE, AGENT_CONFIG)) as f:
            settings: dict[str, str] = json.load(f)
        return settings

    def devlxd_socket(self, name: str) -> str:
        """Where the instance's agent serves the guest API to guest programs."""
        return self.agent_settings(name)["devlxd_socket"]

    def serial_port(self, name: str) -> str:
        """The VM's agent serial port as a guest process opens it."""
        return os.path.join(
            self.run_dir(name), "qmp.sock.guest", "virtio-ports", "com.canonical.lxd"
        )

    def guest_port(self, name: str) -> GuestPort:
        """A guest program on the VM's agent port that reads CONNECT where the agent does."""
        ports = os.path.dirname(self.serial_port(name))
        return GuestPort(self.serial_port(name), os.path.join(ports, "vmready.connect"))

    def start_agent(
        self, name: str, log_name: str = "agent.log", *options: str
    ) -> subprocess.Popen[bytes]:
        """``vmready-agent --config-drive <drive> [options]`` as its own process, in the guest."""
        drive = os.path.join(self.run_dir(name), CONFIG_DRIVE)
        # As a guest runs it: the drive's zipapp, without the host's site-packages.
        zipapp = os.path.join(drive, AGENT_ZIPAPP)
        command = [sys.executable, "-S", "-I", zipapp, "--config-drive", drive, *options]
        return self._spawn(command, log_name)

    def agent_log(self, log_name: str = "agent.log") -> str:
        """What an agent wrote (its log goes to stderr)."""
        with open(os.path.join(self.directory, log_name), errors="replace") as f:
            return f.read()

    def notify(self, name: str, state: str = "ready") -> subprocess.CompletedProcess[str]:
        """A guest program runs ``vmready-agent notify STATE`` against the agent's socket."""
        command = [sys.executable, "-m", "vmready.agent.main", "notify", state]
        return subprocess.run(
            [*command, "--socket", self.devlxd_socket(name)],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )

    def guest_request(
        self, name: str, method: str, target: str, body: bytes | None = None
    ) -> Answer:
        """A guest program's own HTTP request on the agent's socket."""
        return unix_http(self.devlxd_socket(name), method, target, body)

    def control(self, name: str, action: str) -> bytes:
        """The guest OS's power management (fakeqemu's control socket): ``poweroff`` and so on."""
        path = os.path.join(self.run_dir(name), "qmp.sock.guest", "control")
        answer = b""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(DEADLINE)
            sock.connect(path)
            sock.sendall(action.encode() + b"\n")
            while not answer.endswith(b"\n"):
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
        return answer

    def vm_pid(self, name: str) -> int:
        """The pid of the instance's fakeqemu VM process."""
        with open(os.path.join(self.run_dir(name), "vm.pid")) as f:
            return int(f.read().strip())


def _own_timeout(args: tuple[str, ...]) -> float:
    """The ``--timeout`` a CLI command was given, or 0."""
    for flag, value in itertools.pairwise(args):
        if flag == "--timeout":
            return float(value)
    return 0.0
