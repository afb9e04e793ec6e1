"""The agent's first ``STARTED``: said before it imports what the rest of its work needs.

The host learns that a guest's agent runs when it reads ``STARTED`` from the
agent's status port.  Everything else the agent does needs asyncio, ssl and
its TLS, serial, proxy and configuration modules, whose imports take seconds
under emulation (TCG), where Python runs dozens of times slower than on the
host.  So ``vmready-agent`` first finds its status port with ``os`` alone
(the command line, and ``agent.json``'s ``port`` and ``virtio_ports``), opens
it, writes ``STARTED`` and keeps it open, and only then imports the rest.

The port stays open because the host takes an agent whose port stayed closed
for a few seconds as gone; the agent's ``SerialKeeper`` adopts it as it is,
without saying ``STARTED`` again.  The host answers with ``CONNECT`` on the
``vmready.connect`` port, where it waits in QEMU (or in a fakeqemu socket)
until the agent, its imports done, reads it.

Right after ``STARTED`` it binds the guest API's socket (``/dev/lxd/sock``,
``apisocket``): a workload waiting for the socket finds it then and sends its
request (the demo's ``vmready-agent notify ready``, itself a Python start),
which waits in the socket's backlog until the agent's loop serves it, instead
of the workload starting only once the imports are done.  The agent adopts the
bound socket (``take_api_socket``).

Best effort: when the port cannot be found, opened or written now, nothing is
said and the agent says ``STARTED`` once its keeper opens the port, as it
always did; a wrong ``agent.json`` is left for the configuration to report.
When the agent cannot start after all (a certificate ssl refuses, a socket in
use), ``stop`` says ``STOPPED`` on the port (and removes the socket it bound)
before the agent exits with its one line, so the host does not wait for an
agent that is gone.
"""

from __future__ import annotations

import os
import stat

from vmready.agent.boottimes import uptime
from vmready.agent.options import DEFAULT_CONFIG_DRIVE, DEFAULT_SOCKET
from vmready.agent.ports import (
    DEFAULT_SYSFS_PORTS,
    DEFAULT_VIRTIO_PORTS,
    FoundPort,
    SerialPortMissing,
    find_port,
    is_port_name,
    port_names,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Mapping
    from typing import Any

STARTED_LINE = b"STARTED\n"
STOPPED_LINE = b"STOPPED\n"
SETTINGS = "agent.json"
# A fakeqemu port is a unix socket: how long its connect may take.
CONNECT_TIMEOUT = 5.0


class FirstWord:
    """The status port, opened and written before the agent's event loop ran."""

    def __init__(
        self,
        found: FoundPort,
        said_at: float,
        fd: int | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """``fd``: a character device's descriptor; ``sock``: a fakeqemu port's socket."""
        self.found = found
        self.said_at = said_at
        self.fd = fd
        self.sock = sock
        # The guest API's socket, bound with this STARTED (``bind_api``), and its path.
        self.api_socket: socket.socket | None = None
        self.api_path: str | None = None

    def bind_api(self, path: str) -> bool:
        """Bind the guest API's socket at ``path`` now (best effort); whether it is bound.

        A workload that finds it connects at once; its request waits in the
        socket's backlog until the agent's loop serves it.  Where it cannot be
        bound now (a live agent's socket, a bad path), the agent's own start
        reports why.
        """
        from vmready.agent.apisocket import bind_socket, prepare_socket_path
        from vmready.agent.options import ConfigError

        try:
            prepare_socket_path(path)
            self.api_socket = bind_socket(path)
        except ConfigError:
            return False
        self.api_path = path
        return True

    def take_api_socket(self, path: str) -> socket.socket | None:
        """The socket ``bind_api`` bound, if it is at ``path``; the caller serves it.

        One bound elsewhere (the configuration named another path after all) is
        closed and removed.
        """
        listening, bound_at = self.api_socket, self.api_path
        self.api_socket = self.api_path = None
        if listening is None or bound_at is None:
            return None
        if bound_at == path:
            return listening
        _close_api(listening, bound_at)
        return None

    @property
    def handed_over(self) -> bool:
        """The agent's serial keeper has the port now (or it is closed)."""
        return self.fd is None and self.sock is None

    def hand_over(self) -> tuple[int | None, socket.socket | None]:
        """The open descriptor or socket, for the serial keeper; this object lets go of it."""
        taken = (self.fd, self.sock)
        self.fd = self.sock = None
        return taken

    def say_again(self) -> None:
        """Say STARTED once more (best effort): the agent's heartbeat after its imports.

        The host takes an agent silent for 15 s as hung, and under emulation the
        imports after the first STARTED can take that long; the heartbeat proper
        starts with the agent's loop, whose first act (opening ``vmready.connect``)
        makes the host read, so this line comes just before it.
        """
        # Unsaid, the keeper's adoption of the port finds out what is wrong with it.
        _send(self.fd, self.sock, STARTED_LINE)

    def stop(self) -> None:
        """The agent cannot start after all: say ``STOPPED`` (best effort), close the port and
        the guest API's socket if the agent did not take it."""
        listening, bound_at = self.api_socket, self.api_path
        self.api_socket = self.api_path = None
        if listening is not None and bound_at is not None:
            _close_api(listening, bound_at)
        fd, sock = self.hand_over()
        try:
            # Unsaid, the port's closing tells the host as well, a little later.
            _send(fd, sock, STOPPED_LINE)
        finally:
            if fd is not None:
                os.close(fd)
            if sock is not None:
                sock.close()


def _close_api(listening: socket.socket, path: str) -> None:
    """Close the guest API's socket ``bind_api`` bound and remove its file."""
    from vmready.agent.apisocket import remove_own_socket, socket_identity

    try:
        identity: tuple[int, int] | None = socket_identity(path)
    except OSError:
        identity = None
    listening.close()
    remove_own_socket(path, identity)


def _send(fd: int | None, sock: socket.socket | None, line: bytes) -> bool:
    """Write ``line`` on the port (a descriptor or a fakeqemu socket); whether it was written."""
    try:
        if fd is not None:
            os.write(fd, line)
        elif sock is not None:
            sock.sendall(line)
        else:
            return False
    except OSError:
        return False
    return True


def _drive_settings(drive: str) -> dict[str, str]:
    """agent.json's string values; empty when it is absent or not a JSON object."""
    path = os.path.join(drive, SETTINGS)
    if not os.path.exists(path):
        return {}
    import json  # only where there is an agent.json (a real guest's drive has one)

    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {key: value for key, value in raw.items() if isinstance(value, str) and value}


def locate_status_port(options: Mapping[str, Any]) -> FoundPort:
    """The status port the agent's configuration will name; SerialPortMissing, ValueError.

    ``options`` are ``parse_options``' (command-line names); ``agent.json`` fills
    in what they leave unset, as ``config.load_config`` does.
    """
    forced = options.get("serial")
    if forced:
        path = os.path.abspath(forced)
        return FoundPort(path, os.path.basename(path))
    drive = os.path.abspath(options.get("config-drive") or DEFAULT_CONFIG_DRIVE)
    settings = _drive_settings(drive)
    wired = settings.get("port")
    if wired is not None and not is_port_name(wired):
        raise ValueError(f"port {wired!r} is not a port name")
    if options.get("virtio-ports"):
        virtio_ports = os.path.abspath(options["virtio-ports"])
    elif "virtio_ports" in settings:  # relative to the drive, as every path agent.json names
        virtio_ports = os.path.abspath(os.path.join(drive, settings["virtio_ports"]))
    else:
        return find_port(port_names(wired), DEFAULT_VIRTIO_PORTS, DEFAULT_SYSFS_PORTS)
    # A named ports directory is a fakeqemu guest's: the host's sysfs is not its own.
    return find_port(port_names(wired), virtio_ports, None)


def _open_and_say(path: str) -> tuple[int | None, socket.socket | None]:
    """Open the port at ``path`` and write STARTED; OSError if either fails."""
    if stat.S_ISSOCK(os.stat(path).st_mode):
        import socket  # a fakeqemu guest's port only

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(path)
            sock.sendall(STARTED_LINE)
        except OSError:
            sock.close()
            raise
        return None, sock
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if os.isatty(fd):  # a serial line (or a test's pty): bytes as they are
            import termios
            import tty

            tty.setraw(fd, termios.TCSANOW)
        if os.write(fd, STARTED_LINE) != len(STARTED_LINE):
            raise BlockingIOError("the port took part of the line")
    except BaseException:
        os.close(fd)
        raise
    return fd, None


def api_socket_path(options: Mapping[str, Any]) -> str | None:
    """The guest API's socket the configuration will name (``config.load_config``'s way);
    None without a config drive (the agent will not start: nothing to serve)."""
    drive = os.path.abspath(options.get("config-drive") or DEFAULT_CONFIG_DRIVE)
    if not os.path.isdir(drive):
        return None
    explicit = options.get("socket")
    if explicit:
        return os.path.abspath(str(explicit))
    configured = _drive_settings(drive).get("devlxd_socket")
    if configured:  # relative to the drive, as every path agent.json names
        return os.path.abspath(os.path.join(drive, configured))
    return DEFAULT_SOCKET


def say_started(options: Mapping[str, Any]) -> FirstWord | None:
    """Say STARTED on the agent's status port now and keep it open, then bind the guest API's
    socket (``FirstWord.bind_api``); None if STARTED cannot be said now."""
    try:
        found = locate_status_port(options)
        fd, sock = _open_and_say(found.path)
    except (OSError, SerialPortMissing, ValueError):
        return None
    first = FirstWord(found, uptime(), fd, sock)
    path = api_socket_path(options)
    if path is not None:
        first.bind_api(path)
    return first
