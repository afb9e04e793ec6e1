"""``guestfwd=tcp:IP:PORT-cmd:COMMAND`` for fake guests: each connection runs COMMAND.

On real QEMU, libslirp 4.7 handles a guest's TCP connection to IP:PORT by
splitting COMMAND as ``g_shell_parse_argv`` does (no shell), spawning it with
the connection as its stdin, stdout *and* stderr (one socketpair end for all
three, in a new session), and relaying until either side closes; a second
connection spawns a second command.  fakeqemu's guests are host processes, so
the guest's end of the address is a unix socket, ``<guest dir>/tcp/IP:PORT``;
a connection to it runs COMMAND the same way and fakeqemu relays between the
two, half-closes included (the guest shutting down its sending side gives the
command end-of-file on stdin, and the reverse).  With ``restrict=on`` nothing
else is reachable; fakeqemu has no other sockets to offer anyway.

The command runs in QEMU's working directory (``/`` once ``-daemonize``\\ d, as
QEMU chdirs there; the launcher's otherwise) with QEMU's environment, and is
looked up on that environment's ``PATH``.  When it cannot be parsed or started,
QEMU prints libslirp's message and the guest's connection is closed (not
refused: the guest's ``nc`` exits 0); fakeqemu does the same.  All of this was
measured with a Debian 6.1 kernel and busybox under QEMU 7.2: the guest's
``nc`` received ``err`` from ``sh -c 'echo out; echo err >&2'``, ``pwd``
printed ``/`` for a daemonized QEMU, and the -D log read
``qemu-system-x86_64: Slirp: fork_exec: Failed to execute child process
“nonexistent-command-xyz” (No such file or directory)``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
from twisted.internet.interfaces import IHalfCloseableDescriptor, IHalfCloseableProtocol
from twisted.internet.protocol import Factory
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.python.failure import Failure
from zope.interface import implementer

from fakeqemu._machine import Machine
from fakeqemu._shellwords import ShellParseError, parse_argv
from fakeqemu._usernet import GuestForwardSpec

FORWARDS_DIRECTORY = "tcp"
# QEMU messages (without the program prefix), as the runner prints them.
ReportCallback = Callable[[list[str]], None]


@attrs.frozen
class CommandLine:
    """A forward's command as it is run: the program found, its words, where and with what."""

    executable: str
    argv: list[str]
    cwd: str
    env: Mapping[str, str]


class CommandLauncher(Protocol):
    """Starts a forward's command with its standard streams on a connection to ``command_side``."""

    def launch(self, command: CommandLine, command_side: TwistedProtocol) -> None:
        """Start the command; raise OSError if it cannot be executed."""

    def connection_ended(self) -> None:
        """A command's connection closed (its command has likely exited)."""


def find_executable(name: str, env: Mapping[str, str]) -> str | None:
    """``argv[0]`` as GLib's G_SPAWN_SEARCH_PATH finds it: as given with a slash, else on PATH."""
    if "/" in name:
        return name
    return shutil.which(name, path=env.get("PATH", os.defpath))


@implementer(IHalfCloseableProtocol)
class ForwardSide(TwistedProtocol):
    """One end of a forwarded connection (the guest's or the command's): events to its relay."""

    def __init__(self, relay: ForwardedConnection, role: str) -> None:
        self._relay = relay
        self.role = role
        self.lost = False
        self._pending = b""
        self._pending_eof = False

    def connectionMade(self) -> None:
        pending, self._pending = self._pending, b""
        if pending:
            self.send(pending)
        if self._pending_eof:
            self.send_eof()
        self._relay.side_connected(self)

    def dataReceived(self, data: bytes) -> None:
        self._relay.side_received(self, data)

    def readConnectionLost(self) -> None:
        self._relay.side_eof(self)

    def writeConnectionLost(self) -> None:
        """Our sending side is shut down; the connection ends once the peer is done too."""

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.lost = True
        self._relay.side_lost(self)

    def send(self, data: bytes) -> None:
        """Bytes for the process at this end."""
        if self.transport is None:
            self._pending += data
        elif not self.lost:
            self.transport.write(data)

    def send_eof(self) -> None:
        """The other end sends nothing more: shut our sending side down (a half-close)."""
        if self.transport is None:
            self._pending_eof = True
            return
        if self.lost:
            return
        if IHalfCloseableDescriptor.providedBy(self.transport):
            self.transport.loseWriteConnection()  # type: ignore[attr-defined]  # checked above
        else:
            # A transport that cannot half-close (an in-memory one) closes.
            self.transport.loseConnection()

    def finish(self) -> None:
        """Close the connection once what was written is sent."""
        if self.transport is not None and not self.lost:
            self.transport.loseConnection()

    def close(self) -> None:
        """Drop the connection at once."""
        if self.transport is not None and not self.lost:
            self.transport.abortConnection()  # type: ignore[attr-defined]  # a socket's can


@attrs.frozen
class ForwardCommands:
    """How a VM runs its guestfwd rules' commands: started by ``launcher`` in QEMU's
    directory and environment, their failures told to ``report`` as QEMU prints them."""

    launcher: CommandLauncher
    cwd: str
    env: Mapping[str, str]
    report: ReportCallback


class ForwardedConnection:
    """A guest's connection through one guestfwd rule, relayed to the command serving it."""

    def __init__(self, machine: Machine, spec: GuestForwardSpec, commands: ForwardCommands):
        self._machine = machine
        self._spec = spec
        self._commands = commands
        self.guest = ForwardSide(self, "guest")
        self.command = ForwardSide(self, "command")
        self._detach: Callable[[], None] | None = None
        self._eofs: set[str] = set()
        # No command runs: the guest's bytes are dropped until it closes.
        self._refused = False

    def _peer(self, side: ForwardSide) -> ForwardSide:
        return self.command if side is self.guest else self.guest

    def side_connected(self, side: ForwardSide) -> None:
        """The guest connected: run the command, as libslirp does for each connection."""
        if side is not self.guest:
            return
        self._detach = self._machine.wiring.attach_forward(self)
        if self._detach is None:
            self.guest.close()
            return
        try:
            argv = parse_argv(self._spec.command)
        except ShellParseError as e:
            self._commands.report(
                [f"Slirp: fork_exec invalid command: {self._spec.command}\nerror: {e}"]
            )
            self._refuse()
            return
        commands = self._commands
        executable = find_executable(argv[0], commands.env)
        try:
            if executable is None:
                raise FileNotFoundError(2, os.strerror(2))
            command = CommandLine(executable, argv, commands.cwd, commands.env)
            commands.launcher.launch(command, self.command)
        except OSError as e:
            commands.report(
                [
                    "Slirp: fork_exec: Failed to execute child process "
                    f"\u201c{argv[0]}\u201d ({e.strerror})"
                ]
            )
            self._refuse()

    def _refuse(self) -> None:
        """No command for this connection: the guest reads end-of-file, as measured."""
        self._refused = True
        self.guest.send_eof()

    def side_received(self, side: ForwardSide, data: bytes) -> None:
        """Relay bytes; a hung guest neither sends nor receives."""
        if not self._machine.guest_hung and not self._refused:
            self._peer(side).send(data)

    def side_eof(self, side: ForwardSide) -> None:
        """One end shut its sending side: pass the half-close on; both done, close."""
        self._eofs.add(side.role)
        self._peer(side).send_eof()
        if self._eofs == {"guest", "command"} or self._refused:
            self.guest.finish()
            self.command.finish()

    def side_lost(self, side: ForwardSide) -> None:
        """One end is gone: the other goes too, once its pending bytes are written."""
        if side is self.guest and self._detach is not None:
            self._detach()
        if side is self.command:
            self._commands.launcher.connection_ended()
        self._peer(side).finish()

    def write(self, data: bytes) -> None:
        """Nothing reaches a forwarded connection from the machine itself."""

    def close(self) -> None:
        """The guest rebooted or the machine is gone: both connections drop."""
        self.guest.close()
        self.command.close()


class ForwardFactory(Factory):
    """Accepts guest connections on one guestfwd rule's socket."""

    def __init__(self, connection: Callable[[], ForwardedConnection]) -> None:
        """``connection`` makes a new relay for each guest connection."""
        self._connection = connection

    def buildProtocol(self, addr: object) -> ForwardSide:
        return self._connection().guest


class SpawningLauncher:
    """Runs a forward's command as libslirp does: a socketpair end as stdin, stdout, stderr.

    The command runs in a new session.  GLib double-forks it so that nobody
    must reap it; fakeqemu starts it as its own child instead and collects it
    when its connection ends (or, if it is still running then, when the next
    command starts), so it leaves no zombie behind where init does not reap.
    """

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor
        self._children: list[subprocess.Popen[bytes]] = []

    def launch(self, command: CommandLine, command_side: TwistedProtocol) -> None:
        """Start ``command``; raise OSError if it cannot be executed; adopt our end."""
        self._reap()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            child = subprocess.Popen(
                command.argv,
                executable=command.executable,
                stdin=theirs.fileno(),
                stdout=theirs.fileno(),
                stderr=theirs.fileno(),
                cwd=command.cwd,
                env=dict(command.env),
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._children.append(child)
        ours.setblocking(False)
        self._reactor.adoptStreamConnection(ours.fileno(), socket.AF_UNIX, _Given(command_side))
        ours.close()  # the reactor holds its own copy

    def _reap(self) -> None:
        """Collect the commands that have ended."""
        self._children = [child for child in self._children if child.poll() is None]

    def connection_ended(self) -> None:
        """A command's connection closed: it has likely exited; collect it."""
        self._reap()


class _Given(Factory):
    """A factory for the one protocol that already exists."""

    def __init__(self, protocol: TwistedProtocol) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: object) -> TwistedProtocol:
        return self._protocol
