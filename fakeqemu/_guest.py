"""The guest's side of a fakeqemu VM, reachable as unix sockets.

``<guest dir>/virtio-ports/<port name>`` stands for the guest's
``/dev/virtio-ports/<port name>``: what a connected client writes lands in the
port's ring buffer (or goes to its ``socket`` chardev's client, whose bytes
arrive on it; ``ringbuf-write`` data never does, as in QEMU).  One client may
hold a port at a time, as one process may open a virtio port in Linux.
``<guest dir>/console`` stands for the guest's ``/dev/ttyS0``, the serial port
``-serial chardev:ID`` connects: what a client writes goes to that chardev (a
``file`` chardev's file, say); several clients may hold it at once, as several
processes may open a tty.  ``<guest dir>/control`` is the guest's power
management: it receives ``POWERDOWN`` when the host presses the ACPI button and
accepts ``poweroff``, ``reboot`` and ``panic``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from fakeqemu._machine import Machine
from fakeqemu._wiring import SerialPort

PORTS_DIRECTORY = "virtio-ports"
CONTROL_SOCKET = "control"
CONSOLE_SOCKET = "console"
SHARES_DIRECTORY = "9p"


class _AttachedEnd(Protocol, abc.ABC):
    """A connection the machine attaches when it is made, and detaches when it is lost.

    ``_attach`` returns the detacher, or None when the machine refuses the
    connection (it is then closed at once).  The machine writes to it with
    ``write`` and hangs it up with ``close``.
    """

    def __init__(self, machine: Machine) -> None:
        self._machine = machine
        self._detach: Callable[[], None] | None = None

    @abc.abstractmethod
    def _attach(self) -> Callable[[], None] | None:
        """Ask the machine to take this connection; its detacher, or None (refused)."""

    def connectionMade(self) -> None:
        self._detach = self._attach()
        if self._detach is None:
            assert self.transport is not None
            self.transport.loseConnection()

    def write(self, data: bytes) -> None:
        """Bytes from the machine for the other end."""
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        """The machine's end is gone (reset or machine exit)."""
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()


# How long a second opener of a busy port waits for the holder's close to be read.
CLOSE_SETTLE = 1.0


class GuestPortProtocol(_AttachedEnd):
    """One guest process holding a virtio serial port open.

    A second opener is refused (closed), like a second ``open()`` of a virtio
    port, and what it managed to send is dropped.  But a guest that closes the
    port and opens it again at once (an agent announcing a line) reaches
    fakeqemu as two sockets whose order the event loop does not keep: the new
    one may be accepted before the old one's end is read, even before the old
    one is accepted.  In Linux the close is over before the open begins; so a
    second opener waits, for at most ``CLOSE_SETTLE`` seconds, for the holder
    to go, and takes the port then; only if the holder stays is it refused.
    """

    def __init__(self, machine: Machine, port: SerialPort, queue: list[GuestPortProtocol]) -> None:
        super().__init__(machine)
        self._port = port
        self._queue = queue
        self._refusal: IDelayedCall | None = None
        self._early = bytearray()

    def connectionMade(self) -> None:
        if self._port.guest is not None and self._machine.exited is None:
            self._queue.append(self)
            self._refusal = self._machine.clock.callLater(CLOSE_SETTLE, self._refuse)
            return
        super().connectionMade()

    def _refuse(self) -> None:
        self._refusal = None
        self._queue.remove(self)
        if self.transport is not None:
            self.transport.loseConnection()

    def admit(self) -> None:
        """The holder went while this one waited: it has the port now."""
        if self._refusal is not None:
            self._refusal.cancel()
            self._refusal = None
        super().connectionMade()
        early, self._early = bytes(self._early), bytearray()
        if early and self._detach is not None:
            self._machine.wiring.guest_wrote(self._port, early)

    def _attach(self) -> Callable[[], None] | None:
        if not self._machine.wiring.open_port(self._port, self):
            return None  # busy, or the machine is gone
        return self._detached

    def _detached(self) -> None:
        self._machine.wiring.close_port(self._port, self)
        if self._queue and self._port.guest is None:
            self._queue.pop(0).admit()

    def dataReceived(self, data: bytes) -> None:
        if self._refusal is not None:
            self._early += data
        elif self._detach is not None:
            self._machine.wiring.guest_wrote(self._port, data)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if self._refusal is not None:
            self._refusal.cancel()
            self._refusal = None
            self._queue.remove(self)
        super().connectionLost(reason)


class GuestControlProtocol(LineOnlyReceiver, _AttachedEnd):
    """The guest OS's power management: ACPI notifications in (``write``), power actions out."""

    delimiter = b"\n"
    MAX_LENGTH = 256

    def _attach(self) -> Callable[[], None] | None:
        if self._machine.exited is not None:
            return None
        return self._machine.attach_controller(self)

    def lineReceived(self, line: bytes) -> None:
        word = line.strip().decode("ascii", "replace")
        if self._machine.guest_hung:
            self.sendLine(b"error: the guest kernel panicked and hangs (no pvpanic device)")
            return
        actions = self._machine.guest_actions()
        action = actions.get(word)
        if action is None:
            known = ", ".join(sorted(actions))
            self.sendLine(f"error: unknown action {word!r} (known: {known})".encode())
            return
        self.sendLine(b"ok")
        action()

    def lineLengthExceeded(self, line: bytes) -> None:
        self.sendLine(b"error: line too long")


class GuestConsoleProtocol(_AttachedEnd):
    """One guest process holding the serial console (ttyS0) open."""

    def _attach(self) -> Callable[[], None] | None:
        return self._machine.wiring.attach_console(self)

    def dataReceived(self, data: bytes) -> None:
        if self._detach is not None:
            self._machine.wiring.console_wrote(data)


class EachConnection(Factory):
    """A guest or host socket's factory: ``make`` builds each connection's protocol."""

    def __init__(self, make: Callable[[], Protocol]) -> None:
        self._make = make

    def buildProtocol(self, addr: object) -> Protocol:
        return self._make()


def guest_port_factory(machine: Machine, port: SerialPort) -> EachConnection:
    """What serves one port's socket: its openers share one list of those waiting for the
    holder's close to be read (see GuestPortProtocol)."""
    waiting: list[GuestPortProtocol] = []
    return EachConnection(lambda: GuestPortProtocol(machine, port, waiting))


class HostChardevProtocol(_AttachedEnd):
    """A host process connected to a ``socket`` chardev (vmready's daemon, say)."""

    def __init__(self, machine: Machine, chardev_id: str) -> None:
        super().__init__(machine)
        self._chardev_id = chardev_id

    def _attach(self) -> Callable[[], None] | None:
        return self._machine.wiring.chardev_connected(self._chardev_id, self)

    def dataReceived(self, data: bytes) -> None:
        self._machine.wiring.host_wrote(self._chardev_id, self, data)
