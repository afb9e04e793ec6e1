"""The daemon's end of a VM's ``vmready.connect`` port: where CONNECT lines are written.

QEMU's ``ringbuf-write`` only appends to the buffer the host itself reads, so
CONNECT travels on a second virtio serial port, ``vmready.connect``, a socket
chardev QEMU serves on ``<run dir>/connect.sock``; the agent reads it from
``/dev/virtio-ports/vmready.connect``.  QEMU accepts one client at a time, so
a new daemon takes over once the old one's connection is gone.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import HypervisorError

CONNECT_TIMEOUT = 5.0
# The agent never writes on this port; whatever arrives is dropped, counted up to this.
_IGNORED_LIMIT = 64 * 1024


class _Writer(Protocol):
    """One connection to the chardev socket; it only writes."""

    def __init__(self) -> None:
        self.lost: Deferred[None] = Deferred()
        self.ignored = 0

    def dataReceived(self, data: bytes) -> None:
        self.ignored = min(self.ignored + len(data), _IGNORED_LIMIT)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if not self.lost.called:
            self.lost.callback(None)


class ConnectPort:
    """Writes CONNECT lines to one VM's ``vmready.connect`` port, connecting as needed."""

    log = Logger()

    def __init__(self, reactor: IReactorUNIX, path: str, name: str) -> None:
        self.reactor = reactor
        self.path = path
        self.name = name
        self._writer: _Writer | None = None
        self._closed = False

    async def write(self, line: bytes) -> None:
        """Send ``line`` to the guest (HypervisorError if the port's socket is unreachable)."""
        if self._closed:
            raise HypervisorError(f"the connect port of {self.name} is closed")
        writer = self._writer
        if writer is None or writer.transport is None or writer.lost.called:
            writer = await self._connect()
        assert writer.transport is not None
        writer.transport.write(line)

    async def _connect(self) -> _Writer:
        endpoint = UNIXClientEndpoint(self.reactor, self.path, timeout=CONNECT_TIMEOUT)
        writer = _Writer()
        try:
            await connectProtocol(endpoint, writer)
        except Exception as e:
            raise HypervisorError(
                f"cannot reach the vmready.connect port of {self.name} at {self.path}: {e}"
            ) from None
        self._writer = writer
        return writer

    def close(self) -> None:
        """Hang up (the VM is gone, or the daemon stops): the guest reads end-of-file."""
        self._closed = True
        writer, self._writer = self._writer, None
        if writer is not None and writer.transport is not None:
            writer.transport.loseConnection()
