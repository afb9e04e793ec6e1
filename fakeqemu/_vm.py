"""A running fakeqemu VM: a Machine with its QMP and guest sockets on a reactor."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger

from fakeqemu._chardev import open_chardev_files
from fakeqemu._cmdline import MachineConfig, format_messages, program_name
from fakeqemu._guest import (
    CONSOLE_SOCKET,
    CONTROL_SOCKET,
    PORTS_DIRECTORY,
    SHARES_DIRECTORY,
    EachConnection,
    GuestConsoleProtocol,
    GuestControlProtocol,
    HostChardevProtocol,
    guest_port_factory,
)
from fakeqemu._guestfwd import (
    FORWARDS_DIRECTORY,
    CommandLauncher,
    ForwardCommands,
    ForwardedConnection,
    ForwardFactory,
    SpawningLauncher,
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
        environ: Mapping[str, str] | None = None,
        launcher: CommandLauncher | None = None,
        program: str | None = None,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self.guest_dir = guest_dir
        self._on_exit = on_exit
        self._on_output = on_output
        # QEMU's environment, which the commands of guestfwd rules inherit.
        self._environ = dict(os.environ if environ is None else environ)
        self._launcher = launcher if launcher is not None else SpawningLauncher(reactor)
        # The name QEMU's own messages start with (the launcher's, on a fakeqemu host).
        self._program = program if program is not None else program_name()
        self._chardev_files = open_chardev_files(config.file_chardevs, config.cwd)
        self.machine = Machine(config, reactor, self._machine_exited, self._chardev_files)
        self._shares: list[str] = []
        self.qmp_factory = QMPServerFactory(self.machine, write_file)
        self._listening: list[IListeningPort] = []
        self._closing: list[Deferred[Any]] = []
        self._abrupt = False
        self.exit_status: int | None = None

    def guest_socket_paths(self) -> dict[str, str]:
        """Guest port name → its socket path, plus ``control``, ``console`` and forwards.

        A guestfwd rule's socket is keyed ``tcp/<ip>:<port>``.
        """
        if self.guest_dir is None:
            return {}
        paths = {
            port.guest_name: os.path.join(self.guest_dir, PORTS_DIRECTORY, port.guest_name)
            for port in self.machine.wiring.ports
        }
        paths[CONTROL_SOCKET] = os.path.join(self.guest_dir, CONTROL_SOCKET)
        if self.config.serial_chardev is not None:
            paths[CONSOLE_SOCKET] = os.path.join(self.guest_dir, CONSOLE_SOCKET)
        for forward in self.config.guest_forwards:
            key = f"{FORWARDS_DIRECTORY}/{forward.socket_name}"
            paths[key] = os.path.join(self.guest_dir, key)
        return paths

    def share_paths(self) -> dict[str, str]:
        """Mount tag → the ``9p/<tag>`` link standing for the guest's view of the export."""
        if self.guest_dir is None:
            return {}
        return {
            share.mount_tag: os.path.join(self.guest_dir, SHARES_DIRECTORY, share.mount_tag)
            for share in self.config.shares
        }

    def start(self) -> None:
        """Listen on every socket; raise StartError with QEMU-style lines if one fails."""
        try:
            for path in self.config.qmp_sockets:
                self._listen_qmp(path)
            self._listen_chardevs()
            self._listen_guest()
        except StartError:
            self._abandon()
            raise
        except Exception as e:
            self._abandon()
            raise StartError([f"cannot listen: {e}"]) from e
        if self.config.incoming_path is not None:
            self._start_incoming(self.config.incoming_path)

    def _abandon(self) -> None:
        """A start that failed leaves nothing listening, linked or open."""
        self._stop_listening()
        self._unlink_shares()
        for chardev_file in self._chardev_files.values():
            chardev_file.close()

    def _listen_qmp(self, path: str) -> None:
        # fakeqemu accepts only this form of the option.
        self._listen_unix(path, self.qmp_factory, f"-qmp unix:{path},server=on,wait=off", path)

    def _listen_chardevs(self) -> None:
        """Each ``socket`` chardev's unix socket, where a host process connects."""
        for spec in self.config.socket_chardevs:
            self._listen_unix(
                self.config.host_path(spec.path),
                EachConnection(partial(HostChardevProtocol, self.machine, spec.id)),
                f"-chardev socket,id={spec.id},path={spec.path},server=on,wait=off",
                spec.path,
            )

    def _listen_unix(self, path: str, factory: IProtocolFactory, option: str, given: str) -> None:
        """Listen on ``path``; QEMU names the ``option`` and the path as ``given`` if the bind
        fails, with the bind error."""
        _remove_stale_socket(path)
        try:
            self._listening.append(self.reactor.listenUNIX(path, factory))
        except CannotListenError as e:
            raise StartError(
                [f"{option}: Failed to bind socket to {given}: {_strerror(e.socketError)}"]
            ) from e

    def _listen_guest(self) -> None:
        paths = self.guest_socket_paths()
        if not paths:
            return
        self._make_guest_directory(PORTS_DIRECTORY)
        for path in paths.values():
            if len(os.fsencode(path)) > _MAX_UNIX_PATH:
                raise StartError(
                    [
                        f"guest socket path '{path}' is too long; "
                        f"set {GUEST_DIR_VARIABLE} to a shorter directory"
                    ]
                )
        for port in self.machine.wiring.ports:
            self._listen_for_guest(paths[port.guest_name], guest_port_factory(self.machine, port))
        control = EachConnection(partial(GuestControlProtocol, self.machine))
        self._listen_for_guest(paths[CONTROL_SOCKET], control)
        if CONSOLE_SOCKET in paths:
            console = EachConnection(partial(GuestConsoleProtocol, self.machine))
            self._listen_for_guest(paths[CONSOLE_SOCKET], console)
        self._listen_forwards(paths)
        self._link_shares()

    def _make_guest_directory(self, name: str) -> None:
        """``<guest dir>/<name>``, made if need be."""
        assert self.guest_dir is not None
        os.makedirs(os.path.join(self.guest_dir, name), exist_ok=True)

    def _listen_for_guest(self, path: str, factory: IProtocolFactory) -> None:
        """A guest-side socket at ``path``, for the guest's user only, in place of a stale one."""
        _remove_stale_socket(path)
        self._listening.append(self.reactor.listenUNIX(path, factory, mode=0o600))

    def _listen_forwards(self, paths: dict[str, str]) -> None:
        """One socket per guestfwd rule; the last rule for an address wins, as in libslirp."""
        forwards = {forward.socket_name: forward for forward in self.config.guest_forwards}
        if not forwards:
            return
        self._make_guest_directory(FORWARDS_DIRECTORY)
        # QEMU chdirs to / once daemonized; the commands it spawns start there.
        cwd = "/" if self.config.daemonize else self.config.cwd
        commands = ForwardCommands(self._launcher, cwd, self._environ, self._report)
        for name, forward in forwards.items():
            factory = ForwardFactory(partial(ForwardedConnection, self.machine, forward, commands))
            self._listen_for_guest(paths[f"{FORWARDS_DIRECTORY}/{name}"], factory)

    def _link_shares(self) -> None:
        """``9p/<tag>``: a symlink to each export, the fake guest's view of the mount."""
        links = self.share_paths()
        if not links:
            return
        self._make_guest_directory(SHARES_DIRECTORY)
        for share in self.config.shares:
            link = links[share.mount_tag]
            with contextlib.suppress(FileNotFoundError):
                if os.path.islink(link):
                    os.unlink(link)
            os.symlink(os.path.abspath(self.config.host_path(share.fsdev.path)), link)
            self._shares.append(link)

    def _unlink_shares(self) -> None:
        links, self._shares = self._shares, []
        for link in links:
            with contextlib.suppress(OSError):
                os.unlink(link)

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
            self.machine.migration.load_incoming(data)

    def _report(self, messages: list[str]) -> None:
        """QEMU's own messages, printed with the program prefix where its stderr goes."""
        self._output(format_messages(self._program, messages))

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
                    client.transport.abortConnection()  # type: ignore[attr-defined]  # a socket
        else:
            self.qmp_factory.disconnect_all()
        self._stop_listening()
        self._unlink_shares()
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
