"""A running fakeqemu VM: a Machine with its QMP and guest sockets on a reactor."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger

from fakeqemu._cmdline import MachineConfig
from fakeqemu._guest import (
    CONTROL_SOCKET,
    PORTS_DIRECTORY,
    GuestControlFactory,
    GuestPortFactory,
)
from fakeqemu._machine import Machine
from fakeqemu._qmp import QMPServerFactory

GUEST_DIR_VARIABLE = "FAKEQEMU_GUEST_DIR"
GUEST_DIR_SUFFIX = ".guest"
_MAX_UNIX_PATH = 107

ExitCallback = Callable[[int, list[str]], None]


class StartError(Exception):
    """The VM could not start; ``lines`` are the messages, without the program prefix."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def guest_directory(config: MachineConfig, environ: Mapping[str, str]) -> str | None:
    """Where the guest sockets go: $FAKEQEMU_GUEST_DIR, else ``<first QMP socket>.guest``."""
    explicit = environ.get(GUEST_DIR_VARIABLE)
    if explicit:
        return explicit
    if config.qmp_sockets:
        return config.qmp_sockets[0] + GUEST_DIR_SUFFIX
    return None


def write_state_file(path: str, data: bytes) -> None:
    """What ``exec:cat > PATH`` does with the migration stream."""
    with open(path, "wb") as f:
        f.write(data)


def _remove_stale_socket(path: str) -> None:
    # QEMU replaces a leftover socket at its listening path.
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


class RunningVM:
    """Serves one Machine's QMP monitors and guest sockets until the machine exits."""

    log = Logger()

    def __init__(
        self,
        config: MachineConfig,
        reactor: Any,
        guest_dir: str | None,
        on_exit: ExitCallback,
        write_file: Callable[[str, bytes], None] = write_state_file,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.guest_dir = guest_dir
        self._on_exit = on_exit
        self.machine = Machine(config, reactor, self._machine_exited)
        self.qmp_factory = QMPServerFactory(self.machine, write_file)
        self._listening: list[IListeningPort] = []
        self._abrupt = False
        self.exit_status: int | None = None

    def guest_socket_paths(self) -> dict[str, str]:
        """Guest port name → its socket path, plus ``control``."""
        if self.guest_dir is None:
            return {}
        paths = {
            port.guest_name: os.path.join(self.guest_dir, PORTS_DIRECTORY, port.guest_name)
            for port in self.machine.ports
        }
        paths[CONTROL_SOCKET] = os.path.join(self.guest_dir, CONTROL_SOCKET)
        return paths

    def start(self) -> None:
        """Listen on every socket; raise StartError with QEMU-style lines if one fails."""
        incoming = self.config.incoming_path
        if incoming is not None and not os.path.exists(incoming):
            raise StartError(
                [f"{incoming}: Could not open '{incoming}': No such file or directory"]
            )
        try:
            for path in self.config.qmp_sockets:
                _remove_stale_socket(path)
                self._listening.append(self.reactor.listenUNIX(path, self.qmp_factory))
            self._listen_guest()
        except Exception as e:
            self._stop_listening()
            raise StartError([f"cannot listen: {e}"]) from e
        if incoming is not None:
            self.reactor.callLater(0, self._load_incoming, incoming)

    def _listen_guest(self) -> None:
        paths = self.guest_socket_paths()
        if not paths:
            return
        assert self.guest_dir is not None
        os.makedirs(os.path.join(self.guest_dir, PORTS_DIRECTORY), exist_ok=True)
        for path in paths.values():
            if len(os.fsencode(path)) > _MAX_UNIX_PATH:
                raise StartError(
                    [
                        f"guest socket path '{path}' is too long; "
                        f"set {GUEST_DIR_VARIABLE} to a shorter directory"
                    ]
                )
        for port in self.machine.ports:
            path = paths[port.guest_name]
            _remove_stale_socket(path)
            factory = GuestPortFactory(self.machine, port)
            self._listening.append(self.reactor.listenUNIX(path, factory, mode=0o600))
        control = paths[CONTROL_SOCKET]
        _remove_stale_socket(control)
        self._listening.append(
            self.reactor.listenUNIX(control, GuestControlFactory(self.machine), mode=0o600)
        )

    def _load_incoming(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            self.machine.exit(1, [f"{path}: Could not open '{path}': {e.strerror}"])
            return
        self.machine.load_incoming(data)

    def kill(self) -> None:
        """Vanish at once, as after SIGKILL: no event, connections cut."""
        self._abrupt = True
        self.machine.exit(-9, [])

    def crash(self, message: str) -> None:
        """Die as QEMU does on an internal error: one line on stderr, then abort."""
        self._abrupt = True
        self.machine.exit(-6, [message])

    def _machine_exited(self, status: int, lines: list[str]) -> None:
        self.exit_status = status
        if self._abrupt:
            for client in list(self.qmp_factory.clients):
                if client.transport is not None:
                    client.transport.abortConnection()  # type: ignore[attr-defined]
        else:
            self.qmp_factory.disconnect_all()
        self._stop_listening()
        self._on_exit(status, lines)

    def _stop_listening(self) -> None:
        listening, self._listening = self._listening, []
        for port in listening:
            port.stopListening()
