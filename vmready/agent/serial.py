"""The agent's serial port: found, opened, driven by the reactor, reopened when it closes.

In a real guest the port is the virtio character device
``/dev/virtio-ports/com.canonical.lxd`` (or the legacy
``org.linuxcontainers.lxd``), opened non-blocking and read and written through
a ``FileDescriptor``.  A fakeqemu guest exposes the same name as a unix socket
(``<qmp>.guest/virtio-ports/<name>``), which is connected to instead.

``SerialKeeper`` keeps the port open: when it closes (a fakeqemu VM reset or
stop closes the socket) it is reopened with a growing delay; after the last
delay it gives up and says why in one line.  A connection that closes at once
(fakeqemu lets one client hold a port; a second is shut out) does not reset
the delays, so a busy port ends in giving up too, not in a loop.
"""

from __future__ import annotations

import os
import stat
import termios
import tty
from collections.abc import Callable, Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet import fdesc
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IAddress, IDelayedCall
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from vmready.agent.host import describe_failure

__all__ = [
    "LEGACY_PORT_NAME",
    "PORT_NAME",
    "REOPEN_DELAYS",
    "SerialDevice",
    "SerialKeeper",
    "SerialOpenError",
    "SerialPortMissing",
    "choose_port",
    "open_serial",
]

PORT_NAME = "com.canonical.lxd"
LEGACY_PORT_NAME = "org.linuxcontainers.lxd"
# Seconds between reopening attempts; after the last one the agent gives up.
REOPEN_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# A port that stayed open this long was really ours: its loss starts the delays afresh.
STABLE_AFTER = 2.0

log = Logger()


class SerialPortMissing(Exception):
    """No serial port to open; the message says where the agent looked."""


def choose_port(virtio_ports: str) -> str:
    """The port to use in ``virtio_ports``: ``com.canonical.lxd``, else the legacy name."""
    for name in (PORT_NAME, LEGACY_PORT_NAME):
        path = os.path.join(virtio_ports, name)
        if os.path.exists(path):
            return path
    raise SerialPortMissing(f"neither {PORT_NAME} nor {LEGACY_PORT_NAME} in {virtio_ports}")


@implementer(IAddress)
class _DeviceAddress:
    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"<serial device {self.path}>"


class SerialDevice(FileDescriptor):
    """A character device (virtio port, tty) as a reactor-driven transport."""

    def __init__(self, fd: int, path: str, protocol: Protocol, reactor: Any) -> None:
        super().__init__(reactor)
        self._fd = fd
        self._address = _DeviceAddress(path)
        self.protocol = protocol
        fdesc.setNonBlocking(fd)
        self.connected = 1
        protocol.makeConnection(self)
        self.startReading()

    def fileno(self) -> int:
        return self._fd

    def getHost(self) -> IAddress:
        return self._address

    def getPeer(self) -> IAddress:
        return self._address

    def doRead(self) -> Any:
        return fdesc.readFromFD(self._fd, self.protocol.dataReceived)

    def writeSomeData(self, data: bytes) -> Any:
        return fdesc.writeToFD(self._fd, data)

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self.protocol.connectionLost(reason)


def _open_device(reactor: Any, path: str, protocol: Protocol) -> None:
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if os.isatty(fd):
            # A serial line (or a test's pty): no echo, no line editing, bytes as they are.
            tty.setraw(fd, termios.TCSANOW)
    except BaseException:
        os.close(fd)
        raise
    SerialDevice(fd, path, protocol, reactor)


class SerialOpenError(Exception):
    """The port could not be opened; the message says which and why."""


def open_serial(reactor: Any, path: str, protocol: Protocol) -> Deferred[None]:
    """Connect ``protocol`` to the port at ``path``: a unix socket or a character device."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISSOCK(mode):
            endpoint = UNIXClientEndpoint(reactor, path, timeout=5)
            connecting: Deferred[None] = connectProtocol(endpoint, protocol).addCallback(
                lambda _: None
            )
            return connecting
        if not stat.S_ISCHR(mode):
            raise SerialOpenError(f"{path} is neither a character device nor a unix socket")
        _open_device(reactor, path, protocol)
    except OSError as e:
        return fail(SerialOpenError(f"cannot open {path}: {e.strerror or e}"))
    except SerialOpenError as e:
        return fail(e)
    return succeed(None)


def _why(reason: Failure) -> str:
    if reason.check(ConnectionDone):
        return "closed by the other end"
    if reason.check(ConnectionLost):
        return "connection lost"
    return describe_failure(reason)


class _PortProtocol(Protocol):
    def __init__(self, keeper: SerialKeeper) -> None:
        self.keeper = keeper
        self.gone: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.keeper.on_data(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.gone = reason
        self.keeper._lost(self, reason)


Locate = Callable[[], str]
Opener = Callable[[Any, str, Protocol], Deferred[None]]


class SerialKeeper(Service):
    """Holds the serial port open for the agent, reopening it when it closes."""

    def __init__(
        self,
        reactor: Any,
        locate: Locate,
        on_data: Callable[[bytes], None],
        on_open: Callable[[], None],
        on_give_up: Callable[[str], None],
        delays: Sequence[float] = REOPEN_DELAYS,
        stable_after: float = STABLE_AFTER,
        opener: Opener = open_serial,
    ) -> None:
        """``locate`` names the port to open (it may raise SerialPortMissing)."""
        self.reactor = reactor
        self.locate = locate
        self.on_data = on_data
        self.on_open = on_open
        self.on_give_up = on_give_up
        self.delays = tuple(delays)
        self.stable_after = stable_after
        self.opener = opener
        self.path: str | None = None
        self._protocol: _PortProtocol | None = None
        self._opened_at = 0.0
        self._failures = 0
        self._retry: IDelayedCall | None = None
        self._closed: Deferred[None] | None = None

    @property
    def is_open(self) -> bool:
        """The port is open now."""
        return self._protocol is not None

    def startService(self) -> None:
        super().startService()
        self._open()

    def write(self, data: bytes) -> bool:
        """Write to the port if it is open; False if the bytes were dropped."""
        if self._protocol is None or self._protocol.transport is None:
            return False
        self._protocol.transport.write(data)
        return True

    def stopService(self) -> Deferred[None]:
        """Close the port once what was written is flushed (at most 2 s: nobody may read it)."""
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        protocol = self._protocol
        if protocol is None or protocol.transport is None:
            return succeed(None)
        closed: Deferred[None] = Deferred()
        self._closed = closed
        protocol.transport.loseConnection()
        deadline = self.reactor.callLater(2.0, self._force_close, protocol)
        closed.addBoth(self._cancel_call, deadline)
        return closed

    @staticmethod
    def _cancel_call(result: object, call: IDelayedCall) -> object:
        if call.active():
            call.cancel()
        return result

    def _force_close(self, protocol: _PortProtocol) -> None:
        transport = protocol.transport
        if transport is None or protocol.gone is not None:
            return
        abort = getattr(transport, "abortConnection", None)
        if abort is not None:
            abort()
        elif isinstance(transport, FileDescriptor):
            transport.connectionLost(Failure(ConnectionDone("closed unflushed at exit")))

    def _open(self) -> None:
        self._retry = None
        try:
            path = self.locate()
        except SerialPortMissing as e:
            self._failed(str(e))
            return
        if path != self.path:
            name = os.path.basename(path)
            legacy = " (legacy name)" if name == LEGACY_PORT_NAME else ""
            log.info("serial port: {path}{legacy}", path=path, legacy=legacy)
            self.path = path
        protocol = _PortProtocol(self)
        opening = self.opener(self.reactor, path, protocol)
        opening.addCallbacks(
            lambda _: self._opened(protocol, path), lambda f: self._failed(describe_failure(f))
        )

    def _opened(self, protocol: _PortProtocol, path: str) -> None:
        if protocol.gone is not None:  # closed before we heard it opened: someone holds it
            self._failed(f"{path} closed at once ({_why(protocol.gone)})")
            return
        assert protocol.transport is not None
        if not self.running:
            protocol.transport.loseConnection()
            return
        self._protocol = protocol
        self._opened_at = self.reactor.seconds()
        self.on_open()

    def _lost(self, protocol: _PortProtocol, reason: Failure) -> None:
        if protocol is not self._protocol:
            return
        self._protocol = None
        if self._closed is not None:
            closed, self._closed = self._closed, None
            closed.callback(None)
            return
        if not self.running:
            return
        if self.reactor.seconds() - self._opened_at >= self.stable_after:
            self._failures = 0
        self._failed(f"{self.path} {_why(reason)}")

    def _failed(self, reason: str) -> None:
        if not self.running:
            return
        if self._failures >= len(self.delays):
            self.on_give_up(
                f"serial port unusable after {len(self.delays) + 1} attempts: {reason}"
            )
            return
        delay = self.delays[self._failures]
        self._failures += 1
        log.warn(
            "serial port: {reason}; reopening in {delay}s ({attempt} of {attempts})",
            reason=reason,
            delay=delay,
            attempt=self._failures,
            attempts=len(self.delays),
        )
        self._retry = self.reactor.callLater(delay, self._open)
