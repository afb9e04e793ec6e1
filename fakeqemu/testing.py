"""Run fakeqemu inside a test: no subprocess, no sockets, an injected clock.

``InMemoryVM`` builds the same ``Machine`` and ``QMPServerFactory`` the
fakeqemu process uses, from a QEMU command line, and connects client
protocols to it with ``twisted.internet.testing``'s in-memory transports
(``iosim``).  ``FakeGuest`` plays the guest end of a virtio serial port, of
the serial console, or of a connection through a ``guestfwd`` rule; the
command such a connection would run is not started: it is recorded in
``InMemoryVM.commands`` with a ``FakeGuest`` standing for its stdin/stdout.
State files written by ``migrate`` land in ``InMemoryVM.files``, and
``-incoming "exec:cat PATH"`` reads ``files[PATH]``.

The command line is checked as QEMU checks it, on the real file system: a
``-chardev file`` is created (console output is appended to it), images,
kernels and 9p exports must exist.

For a VM on a real reactor (real unix sockets, still in-process), build a
:class:`fakeqemu.RunningVM` directly.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence

import attrs
from twisted.internet.interfaces import IProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.test.iosim import FakeTransport, IOPump, connect

from fakeqemu._chardev import open_chardev_files
from fakeqemu._cmdline import parse_command_line
from fakeqemu._guest import (
    GuestConsoleProtocol,
    GuestControlProtocol,
    GuestPortProtocol,
    HostChardevProtocol,
)
from fakeqemu._guestfwd import CommandLine, ForwardCommands, ForwardedConnection
from fakeqemu._machine import Machine
from fakeqemu._qmp import QMPServerFactory

__all__ = ["FakeGuest", "ForwardedCommand", "InMemoryVM"]


class FakeGuest(Protocol):
    """The guest's side of a port or of the control channel: records what arrives."""

    def __init__(self) -> None:
        self.received = b""
        self.open = False

    def connectionMade(self) -> None:
        self.open = True

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.open = False

    def write(self, data: bytes) -> None:
        """What a guest process writes to the port."""
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        """The guest process closes the port."""
        assert self.transport is not None
        self.transport.loseConnection()


@attrs.frozen
class ForwardedCommand:
    """A command a guestfwd connection started: what would run, and its stdin/stdout."""

    executable: str
    argv: list[str]
    cwd: str
    env: Mapping[str, str]
    process: FakeGuest


class _InMemoryLauncher:
    """Starts no process: connects the command's end of the relay to a FakeGuest."""

    def __init__(self, vm: InMemoryVM) -> None:
        self._vm = vm

    def launch(self, command: CommandLine, command_side: Protocol) -> None:
        process = FakeGuest()
        self._vm._connect(command_side, process)
        self._vm.commands.append(
            ForwardedCommand(
                command.executable, command.argv, command.cwd, dict(command.env), process
            )
        )

    def connection_ended(self) -> None:
        """No process to collect."""


class _ClientTransport(FakeTransport):
    """A client's in-memory transport that is ``disconnecting`` only once its own side hangs up.

    iosim also marks a client's transport ``disconnecting`` when the server
    closed the connection; a real transport does not, and a client that tells
    "I hung up" from "the other end went away" by it (vmready's ``RunningVM``:
    a VM that exited, or a monitor it let go) must see what it would see on a
    real socket.
    """

    _hung_up = False

    @property  # type: ignore[override]  # iosim's attribute, made read-only here (see below)
    def disconnecting(self) -> bool:
        return self._hung_up

    @disconnecting.setter
    def disconnecting(self, value: bool) -> None:
        """Ignored: iosim's pump sets it when the peer closed, which is not this side's doing."""

    def loseConnection(self) -> None:
        self._hung_up = True

    def abortConnection(self) -> None:
        self._hung_up = True


class InMemoryVM:
    """A fakeqemu VM from a QEMU command line, driven entirely in memory."""

    def __init__(
        self,
        argv: Sequence[str],
        clock: Clock | None = None,
        files: dict[str, bytes] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = parse_command_line(argv)
        self.clock = clock if clock is not None else Clock()
        self.files: dict[str, bytes] = {} if files is None else files
        self.exits: list[tuple[int, list[str]]] = []
        # What a guestfwd connection would have run, in order.
        self.commands: list[ForwardedCommand] = []
        # QEMU's messages, without the program prefix (a forward's command that cannot start).
        self.messages: list[str] = []
        self._environ = dict(os.environ if environ is None else environ)
        self.machine = Machine(
            self.config,
            self.clock,
            self._exited,
            open_chardev_files(self.config.file_chardevs, self.config.cwd),
        )
        self.qmp_factory = QMPServerFactory(self.machine, self._write_file)
        self._pumps: list[IOPump] = []
        # Openers of a busy port waiting for its holder to go, by port name.
        self._port_queues: dict[str, list[GuestPortProtocol]] = {}
        if self.config.incoming_path is not None:
            # ``exec:cat PATH``: a missing or empty file makes an empty stream, and
            # QEMU 7.2 then waits in inmigrate for one that never comes.
            data = self.files.get(self.config.incoming_path)
            if data:
                self.machine.migration.load_incoming(data)

    def _write_file(self, path: str, data: bytes) -> None:
        self.files[path] = data

    def _exited(self, status: int, lines: list[str]) -> None:
        self.exits.append((status, lines))
        self.qmp_factory.disconnect_all()
        self.flush()

    def _connect(self, server: IProtocol, client: IProtocol) -> IOPump:
        pump: IOPump = connect(
            server,
            FakeTransport(server, isServer=True),
            client,
            _ClientTransport(client, isServer=False),
            clock=self.clock,
        )
        self._pumps.append(pump)
        return pump

    def connect_qmp(self, client: IProtocol) -> IOPump:
        """Connect a QMP client protocol to this VM's monitor; returns the pump."""
        return self._connect(self.qmp_factory.buildProtocol(None), client)

    def connect_guest(self, port_name: str) -> FakeGuest:
        """Open the port a guest sees as ``/dev/virtio-ports/<port_name>``."""
        port = self.machine.wiring.find_port(port_name)
        if port is None:
            raise KeyError(f"no virtio serial port named {port_name!r}")
        guest = FakeGuest()
        queue = self._port_queues.setdefault(port_name, [])
        self._connect(GuestPortProtocol(self.machine, port, queue), guest)
        return guest

    def connect_control(self) -> FakeGuest:
        """Open the guest's power-management channel."""
        guest = FakeGuest()
        self._connect(GuestControlProtocol(self.machine), guest)
        return guest

    def connect_console(self) -> FakeGuest:
        """Open the guest's serial console (ttyS0), as ``<guest dir>/console`` does."""
        if self.config.serial_chardev is None:
            raise KeyError("no -serial chardev:ID on the command line")
        guest = FakeGuest()
        self._connect(GuestConsoleProtocol(self.machine), guest)
        return guest

    def connect_chardev(self, chardev_id: str) -> FakeGuest:
        """Connect as a host process to the ``socket`` chardev ``chardev_id`` (its unix socket)."""
        if chardev_id not in self.machine.wiring.socket_chardevs:
            raise KeyError(f"no socket chardev {chardev_id!r} on the command line")
        client = FakeGuest()
        self._connect(HostChardevProtocol(self.machine, chardev_id), client)
        return client

    def connect_forward(self, address: str) -> FakeGuest:
        """Connect as the guest to ``IP:PORT`` through its guestfwd rule (``tcp/IP:PORT``).

        The command the connection runs is appended to ``commands``; its
        ``process`` is the FakeGuest on the other end of the relay.
        """
        forwards = {f.socket_name: f for f in self.config.guest_forwards}
        if address not in forwards:
            raise KeyError(f"no guestfwd rule for {address!r}")
        cwd = "/" if self.config.daemonize else self.config.cwd
        commands = ForwardCommands(
            _InMemoryLauncher(self), cwd, self._environ, self.messages.extend
        )
        connection = ForwardedConnection(self.machine, forwards[address], commands)
        guest = FakeGuest()
        self._connect(connection.guest, guest)
        return guest

    def share_path(self, mount_tag: str) -> str:
        """The host directory a 9p export with ``mount_tag`` shows the guest."""
        for share in self.config.shares:
            if share.mount_tag == mount_tag:
                return os.path.abspath(self.config.host_path(share.fsdev.path))
        raise KeyError(f"no 9p export with mount tag {mount_tag!r}")

    def flush(self) -> None:
        """Move every pending byte in every direction until all is quiet."""
        progress = True
        while progress:
            progress = False
            for pump in list(self._pumps):
                if pump.pump():
                    progress = True

    def advance(self, seconds: float = 0) -> None:
        """Advance the clock and deliver what that caused."""
        self.clock.advance(seconds)
        self.flush()


def raw_qmp_transport(vm: InMemoryVM) -> tuple[Protocol, StringTransport]:
    """A monitor connection whose output a test reads as raw bytes (for wire-format tests)."""
    server = vm.qmp_factory.buildProtocol(None)
    transport = StringTransport()
    server.makeConnection(transport)
    return server, transport


__all__ += ["raw_qmp_transport"]


_QCOW2_CLUSTER_BITS = 16
_QCOW2_CLUSTER = 1 << _QCOW2_CLUSTER_BITS
_QCOW2_BACKING_FORMAT = 0xE2792ACA


def write_qcow2(
    path: str,
    size: int = 16 << 20,
    backing_file: str | None = None,
    backing_format: str | None = None,
) -> None:
    """Write an empty qcow2 v3 image, laid out as ``qemu-img create -f qcow2`` lays it out.

    Real QEMU opens it (``qemu-img check`` finds it clean), so a test can make
    images, overlays and broken backing chains without ``qemu-img``.
    ``backing_file`` is stored as given (relative names are relative to ``path``'s
    directory, as QEMU resolves them).
    """
    l1_entries = max(1, -(-size // (_QCOW2_CLUSTER * (_QCOW2_CLUSTER // 8))))
    refcount_table, refcount_block, l1_table = (_QCOW2_CLUSTER * n for n in (1, 2, 3))
    extensions = b""
    if backing_format is not None:
        name = backing_format.encode()
        extensions += struct.pack(">II", _QCOW2_BACKING_FORMAT, len(name))
        extensions += name + b"\0" * (-len(name) % 8)
    extensions += struct.pack(">II", 0, 0)
    header_length = 112
    backing = backing_file.encode() if backing_file is not None else b""
    backing_offset = header_length + len(extensions) if backing_file is not None else 0
    header = struct.pack(
        ">4sIQIIQIIQQIIQQQQII",
        b"QFI\xfb",
        3,
        backing_offset,
        len(backing),
        _QCOW2_CLUSTER_BITS,
        size,
        0,
        l1_entries,
        l1_table,
        refcount_table,
        1,
        0,
        0,
        0,
        0,
        0,
        4,
        header_length,
    )
    image = bytearray(l1_table + 8 * l1_entries)
    image[: len(header)] = header
    image[header_length : header_length + len(extensions)] = extensions
    image[backing_offset : backing_offset + len(backing)] = backing
    struct.pack_into(">Q", image, refcount_table, refcount_block)
    for cluster in range(4):  # header, refcount table, refcount block, L1 table
        struct.pack_into(">H", image, refcount_block + 2 * cluster, 1)
    with open(path, "wb") as f:
        f.write(image)


def write_kernel(path: str, size: int = 64 * 1024) -> None:
    """Write a file with a Linux x86 boot header (``HdrS``, protocol 2.15, loadable high).

    It passes the checks QEMU's ``-kernel`` loader makes, and QEMU starts with it
    (the "guest" then runs zeros); fakeqemu never runs it.
    """
    kernel = bytearray(size)
    kernel[0x1F1] = 4  # setup sectors
    kernel[0x1FE:0x200] = b"\x55\xaa"
    kernel[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", kernel, 0x206, 0x020F)
    kernel[0x211] = 0x01  # LOADED_HIGH
    struct.pack_into("<I", kernel, 0x22C, 0x7FFFFFFF)  # initrd_addr_max
    with open(path, "wb") as f:
        f.write(kernel)


__all__ += ["write_kernel", "write_qcow2"]
