"""A running fakeqemu VM: a Machine with its QMP and guest sockets on a reactor."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import CannotListenError
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
OutputCallback = Callable[[str], None]


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
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _strerror(error: object) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)


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
        on_output: OutputCallback | None = None,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.guest_dir = guest_dir
        self._on_exit = on_exit
        self._on_output = on_output
        self.machine = Machine(config, reactor, self._machine_exited)
        self.qmp_factory = QMPServerFactory(self.machine, write_file)
        self._listening: list[IListeningPort] = []
        self._closing: list[Deferred[Any]] = []
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
        try:
            for path in self.config.qmp_sockets:
                self._listen_qmp(path)
            self._listen_guest()
        except StartError:
            self._stop_listening()
            raise
        except Exception as e:
            self._stop_listening()
            raise StartError([f"cannot listen: {e}"]) from e
        if self.config.incoming_path is not None:
            self._start_incoming(self.config.incoming_path)

    def _listen_qmp(self, path: str) -> None:
        _remove_stale_socket(path)
        try:
            self._listening.append(self.reactor.listenUNIX(path, self.qmp_factory))
        except CannotListenError as e:
            # QEMU names the option (fakeqemu accepts only this form of it) and the bind error.
            raise StartError(
                [
                    f"-qmp unix:{path},server=on,wait=off: "
                    f"Failed to bind socket to {path}: {_strerror(e.socketError)}"
                ]
            ) from e

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

    def _start_incoming(self, path: str) -> None:
        """``-incoming "exec:cat PATH"``: load the stream once the reactor runs."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            # cat complains on QEMU's stderr and its stream ends empty; QEMU 7.2 then
            # waits in inmigrate for a stream that never comes, serving QMP meanwhile.
            self._output(f"cat: {path}: {_strerror(e)}\n")
            return
        if data:
            self.reactor.callLater(0, self._load_incoming, data)
        # An empty stream leaves QEMU waiting just the same, without a message.

    def _load_incoming(self, data: bytes) -> None:
        if self.machine.exited is None:
            self.machine.load_incoming(data)

    def _output(self, text: str) -> None:
        """Text that QEMU's stderr would show, unprefixed (it comes from a helper process)."""
        if self._on_output is not None:
            self._on_output(text)
        else:
            self.log.info("stderr: {text}", text=text.rstrip("\n"))

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
            stopped = port.stopListening()
            if stopped is not None:
                self._closing.append(stopped)

    def when_stopped(self) -> Deferred[None]:
        """Fires once every socket this VM listened on is closed and unlinked."""
        closing, self._closing = self._closing, []
        return gatherResults(closing).addCallback(lambda _: None)
