"""The agent's second port, ``vmready.connect``: where the host's CONNECT lines arrive.

The agent says its status on its serial port (``com.canonical.lxd``), wired
to a QEMU ring buffer the host drains.  The host cannot answer through that
buffer: QEMU's ``ringbuf-write`` only fills the buffer the host itself reads.
So the host writes ``CONNECT …`` lines to a second port, ``vmready.connect``,
backed by a unix socket the daemon connects to.

While no daemon is connected, a read on that port returns end-of-file at once
(and poll keeps saying so): that means "nobody is answering now", not "the
port is gone".  ``ConnectPortReader`` keeps the port open, stops reading on
end-of-file, and reads again after a short wait (0.5 s, growing to 2 s) —
forever, without busy-looping and without giving up.  What the daemon wrote
while nobody read waits in QEMU until the next read.  A fakeqemu guest's port
is a unix socket; when it closes the reader connects again after the same
waits.  A VM started by an older host has no such port: that is said once,
and the port is looked for again every ``MISSING_RECHECK`` seconds (udev may
make the link late).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Sequence
from typing import Callable

from vmready.agent.logs import logger
from vmready.agent.ports import CONNECT_PORT_NAME, FoundPort, SerialPortMissing

# Seconds to wait before reading again after end-of-file (no host connected).
READ_AGAIN_DELAYS = (0.5, 1.0, 2.0)
MISSING_RECHECK = 10.0
READ_SIZE = 4096

log = logger(__name__)

OnData = Callable[[bytes], None]


class _SocketReader(asyncio.Protocol):
    """A fakeqemu guest's port: a unix socket stream."""

    def __init__(self, reader: ConnectPortReader) -> None:
        self.reader = reader
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reader.ended(self)


class ConnectPortReader:
    """Reads ``vmready.connect`` for as long as the agent runs."""

    def __init__(
        self,
        locate: Callable[[], FoundPort],
        on_data: OnData,
        delays: Sequence[float] = READ_AGAIN_DELAYS,
        missing_recheck: float = MISSING_RECHECK,
    ) -> None:
        """``locate`` finds the port (SerialPortMissing when there is none)."""
        self.locate = locate
        self.on_data = on_data
        self.delays = tuple(delays)
        self.missing_recheck = missing_recheck
        self.running = False
        self.reads = 0
        self.path: str | None = None
        self._fd: int | None = None
        self._socket: _SocketReader | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._empty_reads = 0
        self._said_missing = False

    def start(self) -> None:
        """Find and open the port (in the running loop)."""
        self.running = True
        self._open()

    async def stop(self) -> None:
        """Close the port."""
        self.running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await self._task
        self._close()

    # -- opening ------------------------------------------------------------

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        if self.running:
            self._timer = asyncio.get_running_loop().call_later(delay, action)

    def _open(self) -> None:
        self._timer = None
        if not self.running:
            return
        try:
            found = self.locate()
        except SerialPortMissing as e:
            if not self._said_missing:
                self._said_missing = True
                log.info(
                    "no %s port (%s): the host cannot tell this agent where to connect; "
                    "looking again every %gs",
                    CONNECT_PORT_NAME,
                    e,
                    self.missing_recheck,
                )
            self._later(self.missing_recheck, self._open)
            return
        if found.path != self.path:
            log.info("connect port: %s", found.describe())
            self.path = found.path
        try:
            is_socket = stat.S_ISSOCK(os.stat(found.path).st_mode)
        except OSError as e:
            self._retry(f"cannot examine {found.path}: {e.strerror or e}")
            return
        if is_socket:
            self._task = asyncio.ensure_future(self._connect_socket(found.path))
            return
        try:
            # Read only: nothing is ever written here, and a reader alone sees the end-of-file.
            fd = os.open(found.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as e:
            self._retry(f"cannot open {found.path}: {e.strerror or e}")
            return
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)

    async def _connect_socket(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        protocol = _SocketReader(self)
        try:
            await loop.create_unix_connection(lambda: protocol, path)
        except OSError as e:
            self._task = None
            self._retry(f"cannot connect to {path}: {e.strerror or e}")
            return
        self._task = None
        self._socket = protocol

    def _retry(self, reason: str) -> None:
        delay = self._next_delay()
        log.debug("%s; trying the connect port again in %gs", reason, delay)
        self._later(delay, self._open)

    def _next_delay(self) -> float:
        delay = self.delays[min(self._empty_reads, len(self.delays) - 1)]
        self._empty_reads += 1
        return delay

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        protocol, self._socket = self._socket, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

    # -- reading ------------------------------------------------------------

    def received(self, data: bytes) -> None:
        """Bytes from the host."""
        self._empty_reads = 0
        self.on_data(data)

    def _readable(self) -> None:
        fd = self._fd
        if fd is None:
            return
        self.reads += 1
        try:
            data = os.read(fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._close()
            self._retry(f"reading {self.path} failed: {e.strerror or e}")
            return
        if data:
            self.received(data)
            return
        # No host connected: stop watching (poll would say so forever), read again later.
        loop = asyncio.get_running_loop()
        loop.remove_reader(fd)
        self._later(self._next_delay(), lambda: self._watch(fd))

    def _watch(self, fd: int) -> None:
        self._timer = None
        if self.running and self._fd == fd:
            asyncio.get_running_loop().add_reader(fd, self._readable)

    def ended(self, protocol: _SocketReader) -> None:
        """A fakeqemu port's socket closed: connect again after a wait."""
        if self._socket is protocol:
            self._socket = None
        if self.running:
            self._retry(f"{self.path} closed")
