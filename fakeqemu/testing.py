"""Run fakeqemu inside a test: no subprocess, no sockets, an injected clock.

``InMemoryVM`` builds the same ``Machine`` and ``QMPServerFactory`` the
fakeqemu process uses, from a QEMU command line, and connects client
protocols to it with ``twisted.internet.testing``'s in-memory transports
(``iosim``).  ``FakeGuest`` plays the guest end of a virtio serial port.
State files written by ``migrate`` land in ``InMemoryVM.files``, and
``-incoming "exec:cat PATH"`` reads ``files[PATH]``.

For a VM on a real reactor (real unix sockets, still in-process), build a
:class:`fakeqemu.RunningVM` directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.interfaces import IProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.test.iosim import FakeTransport, IOPump, connect

from fakeqemu._cmdline import parse_command_line
from fakeqemu._guest import GuestControlProtocol, GuestPortProtocol
from fakeqemu._machine import Machine
from fakeqemu._qmp import QMPServerFactory

__all__ = ["FakeGuest", "InMemoryVM"]


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


class _ClientTransport(FakeTransport):
    """A client's in-memory transport that is ``disconnecting`` only once its own side hangs up.

    iosim also marks a client's transport ``disconnecting`` when the server
    closed the connection; a real transport does not, and a client that tells
    "I hung up" from "the other end went away" by it (vmready's ``RunningVM``:
    a VM that exited, or a monitor it let go) must see what it would see on a
    real socket.
    """

    _hung_up = False

    @property  # type: ignore[override]
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
    ) -> None:
        self.config = parse_command_line(argv)
        self.clock = clock if clock is not None else Clock()
        self.files: dict[str, bytes] = {} if files is None else files
        self.exits: list[tuple[int, list[str]]] = []
        self.machine = Machine(self.config, self.clock, self._exited)
        self.qmp_factory = QMPServerFactory(self.machine, self._write_file)
        self._pumps: list[IOPump] = []
        if self.config.incoming_path is not None:
            # ``exec:cat PATH``: a missing or empty file makes an empty stream, and
            # QEMU 7.2 then waits in inmigrate for one that never comes.
            data = self.files.get(self.config.incoming_path)
            if data:
                self.machine.load_incoming(data)

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
        port = self.machine.find_port(port_name)
        if port is None:
            raise KeyError(f"no virtio serial port named {port_name!r}")
        guest = FakeGuest()
        self._connect(GuestPortProtocol(self.machine, port), guest)
        return guest

    def connect_control(self) -> FakeGuest:
        """Open the guest's power-management channel."""
        guest = FakeGuest()
        self._connect(GuestControlProtocol(self.machine), guest)
        return guest

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
