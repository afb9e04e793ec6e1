"""The agent's serial port: opened, driven by the event loop, reopened when it closes.

The port (``com.canonical.lxd``, or the legacy ``org.linuxcontainers.lxd``) is
found by ``ports.find_port``.  A virtio character device is opened
non-blocking, in raw mode if it is a tty, and read and written through
``loop.add_reader``/``add_writer``.  A fakeqemu guest exposes the same name as
a unix socket (``<qmp>.guest/virtio-ports/<name>``), which is connected to
instead.  A port the agent opened before its event loop ran (``firstword``,
where it said its first ``STARTED``) is adopted as it is: it never closed, so
the host saw no agent leave.

``SerialKeeper`` keeps the port open while the agent runs, so that its closing
tells the host the agent is gone.  A line written with ``announce`` is followed
by a *pulse*: the port is closed (once the line is flushed) and reopened at
once, and QEMU reports both as ``VSERPORT_CHANGE`` events, on which the host
reads the ring buffer.  What is written during a pulse is held and written
when the port is open again.  When the port closes by itself (a fakeqemu VM
reset or stop closes the socket) it is reopened with a growing delay; after the last
delay it gives up and says why in one line.  A connection that closes at once
(fakeqemu lets one client hold a port; a second is shut out) does not reset
the delays, so a busy port ends in giving up too, not in a loop.
"""

from __future__ import annotations

import abc
import asyncio
import os
import stat
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Callable

from vmready.agent.logs import logger
from vmready.agent.ports import FoundPort, SerialPortMissing

if TYPE_CHECKING:
    from vmready.agent.firstword import FirstWord

# Seconds between reopening attempts; after the last one the agent gives up.
REOPEN_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# A port that stayed open this long was really ours: its loss starts the delays afresh.
STABLE_AFTER = 2.0
# How long a closing port may take to flush what was written (nobody may read it).
FLUSH_TIMEOUT = 2.0
CONNECT_TIMEOUT = 5.0
READ_SIZE = 64 * 1024

log = logger(__name__)

OnData = Callable[[bytes], None]
OnLost = Callable[[str], None]


class SerialOpenError(Exception):
    """The port could not be opened; the message says which and why."""


class SerialChannel(abc.ABC):
    """An open port: ``write`` queues bytes; ``on_lost`` is told once, when it ends."""

    def __init__(self, on_data: OnData, on_lost: OnLost) -> None:
        self.on_data = on_data
        self.on_lost = on_lost
        self.ended = False
        self._closing = False

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        """Queue ``data`` for the port."""

    @abc.abstractmethod
    def close(self) -> None:
        """End once what was written is flushed."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End now, dropping anything unwritten."""

    def _end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.on_lost("closed by the agent" if self._closing else reason)


class _DeviceChannel(SerialChannel):
    """A character device (virtio port, tty) driven by the loop's reader and writer."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, fd: int, on_data: OnData, on_lost: OnLost
    ) -> None:
        super().__init__(on_data, on_lost)
        self.loop = loop
        self.fd = fd
        self._pending = bytearray()
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._finish(f"read failed: {e.strerror or e}")
            return
        if not data:
            self._finish("closed by the other end")
            return
        self.on_data(data)

    def write(self, data: bytes) -> None:
        if self.ended or self._closing:
            return
        self._pending += data
        self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                written = os.write(self.fd, self._pending)
                del self._pending[:written]
        except (BlockingIOError, InterruptedError):
            self.loop.add_writer(self.fd, self._flush)
            return
        except OSError as e:
            self._finish(f"write failed: {e.strerror or e}")
            return
        self.loop.remove_writer(self.fd)
        if self._closing:
            self._finish("closed by the agent")

    def close(self) -> None:
        if self.ended:
            return
        self._closing = True
        if not self._pending:
            self._finish("closed by the agent")

    def abort(self) -> None:
        self._finish("closed unflushed")

    def _finish(self, reason: str) -> None:
        if self.ended:
            return
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        os.close(self.fd)
        self._end(reason)


class _SocketChannel(SerialChannel, asyncio.Protocol):
    """A fakeqemu port: a unix socket stream."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("closed by the other end" if exc is None else f"connection lost ({exc})")

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.ended and not self._closing:
            self.transport.write(data)

    def close(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


async def open_serial(path: str, on_data: OnData, on_lost: OnLost) -> SerialChannel:
    """Open the port at ``path``: a unix socket or a character device; SerialOpenError."""
    loop = asyncio.get_running_loop()
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISSOCK(mode):
            channel = _SocketChannel(on_data, on_lost)
            await asyncio.wait_for(
                loop.create_unix_connection(lambda: channel, path), CONNECT_TIMEOUT
            )
            return channel
        if not stat.S_ISCHR(mode):
            raise SerialOpenError(f"{path} is neither a character device nor a unix socket")
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise SerialOpenError(f"cannot open {path}: {e.strerror or e}") from None
    except asyncio.TimeoutError:
        raise SerialOpenError(f"cannot open {path}: no answer in {CONNECT_TIMEOUT:g}s") from None
    try:
        if os.isatty(fd):
            # A serial line (or a test's pty): no echo, no line editing, bytes as they are.
            # Imported here: a virtio port is no tty, and termios is a shared library
            # whose loading costs under emulation.
            import termios
            import tty

            tty.setraw(fd, termios.TCSANOW)
    except BaseException:
        os.close(fd)
        raise
    return _DeviceChannel(loop, fd, on_data, on_lost)


async def adopt_serial(word: FirstWord, on_data: OnData, on_lost: OnLost) -> SerialChannel:
    """The port ``word`` opened before the event loop ran, driven by the loop from now on."""
    loop = asyncio.get_running_loop()
    fd, sock = word.hand_over()
    if sock is not None:
        channel = _SocketChannel(on_data, on_lost)
        sock.setblocking(False)
        try:
            await loop.create_unix_connection(lambda: channel, sock=sock)
        except OSError as e:
            sock.close()
            raise SerialOpenError(f"cannot adopt {word.found.path}: {e.strerror or e}") from None
        return channel
    if fd is None:
        raise SerialOpenError(f"{word.found.path} was handed over already")
    return _DeviceChannel(loop, fd, on_data, on_lost)


Locate = Callable[[], FoundPort]
Opener = Callable[[str, OnData, OnLost], Awaitable[SerialChannel]]


class SerialKeeper:
    """Holds the serial port open for the agent, reopening it when it closes."""

    def __init__(
        self,
        locate: Locate,
        on_data: OnData,
        on_open: Callable[[], None],
        on_give_up: Callable[[str], None],
        delays: Sequence[float] = REOPEN_DELAYS,
        stable_after: float = STABLE_AFTER,
        opener: Opener = open_serial,
    ) -> None:
        """``locate`` names the port to open (it may raise SerialPortMissing)."""
        self.locate = locate
        self.on_data = on_data
        self.on_open = on_open
        self.on_give_up = on_give_up
        self.delays = tuple(delays)
        self.stable_after = stable_after
        self.opener = opener
        self.path: str | None = None
        self.running = False
        self._channel: SerialChannel | None = None
        self._opened_at = 0.0
        self._failures = 0
        self._retry: asyncio.TimerHandle | None = None
        self._opening: asyncio.Task[None] | None = None
        self._closed: asyncio.Future[None] | None = None
        self._pulse: asyncio.Task[None] | None = None
        self._held: list[bytes] = []
        self._announce_held = False

    @property
    def is_open(self) -> bool:
        """The port is open now."""
        return self._channel is not None

    def start(self, adopt: FirstWord | None = None) -> None:
        """Open the port (in the running loop), or ``adopt`` the one the agent opened already.

        An adopted port said STARTED already: its adoption is no (re)opening to
        announce, so ``on_open`` is not called for it.
        """
        self.running = True
        if adopt is None:
            self._open()
            return
        log.info("serial port: %s", adopt.found.describe())  # the line any opening logs
        self.path = adopt.found.path

        def adopted(path: str, on_data: OnData, on_lost: OnLost) -> Awaitable[SerialChannel]:
            return adopt_serial(adopt, on_data, on_lost)

        self._opening = asyncio.ensure_future(self._connect(self.path, True, adopted))

    def write(self, data: bytes, announce: bool = False) -> bool:
        """Write to the port if it is open (or held during a pulse); False if dropped.

        ``announce``: close and reopen the port right after ``data`` (a pulse), so
        that the host hears of it at once instead of on its next safety read.
        """
        if self._pulse is not None:
            self._held.append(data)
            self._announce_held = self._announce_held or announce
            return True
        if self._channel is None:
            return False
        self._channel.write(data)
        if announce:
            self._pulse = asyncio.ensure_future(self._pulse_port())
        return True

    async def _pulse_port(self) -> None:
        """Close the port once flushed and reopen it without a new ``on_open``."""
        # Lost before the pulse began: the usual reopening (and its on_open) owns the port.
        had_channel = self._channel is not None
        try:
            await self._close_flushed()
            if had_channel and self.running and self.path is not None:
                self._opening = asyncio.ensure_future(self._connect(self.path, quiet=True))
                await self._opening
        finally:
            self._pulse = None
        held, self._held = self._held, []
        announce, self._announce_held = self._announce_held, False
        if held and self._channel is not None:
            self.write(b"".join(held), announce)

    async def _close_flushed(self) -> None:
        """Close the channel once what was written is flushed (at most ``FLUSH_TIMEOUT``)."""
        channel = self._channel
        if channel is None:
            return
        closed = self._closed = asyncio.get_running_loop().create_future()
        channel.close()
        try:
            await asyncio.wait_for(asyncio.shield(closed), FLUSH_TIMEOUT)
        except asyncio.TimeoutError:
            channel.abort()
            await closed

    async def stop(self) -> None:
        """Close the port once what was written is flushed (at most ``FLUSH_TIMEOUT``)."""
        # A pulse under way holds what was written meanwhile (STOPPED, say): let it reopen
        # and write that before the port closes for good.
        deadline = asyncio.get_running_loop().time() + FLUSH_TIMEOUT + CONNECT_TIMEOUT
        while self._pulse is not None:
            pulse = self._pulse
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                pulse.cancel()
                break
            await asyncio.wait([pulse], timeout=left)
        self.running = False
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._opening is not None:
            self._opening.cancel()
        await self._close_flushed()

    def _open(self) -> None:
        self._retry = None
        try:
            found = self.locate()
        except SerialPortMissing as e:
            self._failed(str(e))
            return
        if found.path != self.path:
            log.info("serial port: %s", found.describe())
            self.path = found.path
        self._opening = asyncio.ensure_future(self._connect(found.path))

    async def _connect(self, path: str, quiet: bool = False, opener: Opener | None = None) -> None:
        """Open the port at ``path`` (with ``opener``, default the keeper's); ``quiet`` (a
        pulse's reopening, an adoption): no ``on_open``."""
        attempt = _Attempt(self)
        try:
            channel = await (opener or self.opener)(path, self.on_data, attempt.lost)
        except SerialOpenError as e:
            self._failed(str(e))
            return
        finally:
            self._opening = None
        if attempt.lost_before_open:  # closed before we heard it opened: someone holds it
            self._failed(f"{path} closed at once ({attempt.lost_before_open})")
            return
        attempt.channel = channel
        if not self.running:
            channel.close()
            return
        self._channel = channel
        self._opened_at = asyncio.get_running_loop().time()
        if not quiet:
            self.on_open()

    def _lost(self, reason: str) -> None:
        self._channel = None
        if self._closed is not None:
            closed, self._closed = self._closed, None
            if not closed.done():
                closed.set_result(None)
            return
        if not self.running:
            return
        if asyncio.get_running_loop().time() - self._opened_at >= self.stable_after:
            self._failures = 0
        self._failed(f"{self.path} {reason}")

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
        log.warning(
            "serial port: %s; reopening in %ss (%d of %d)",
            reason,
            delay,
            self._failures,
            len(self.delays),
        )
        loop = asyncio.get_running_loop()
        self._retry = loop.call_later(delay, self._open)


class _Attempt:
    """One opening of the port: where its end is reported, once it is known to be open."""

    def __init__(self, keeper: SerialKeeper) -> None:
        self.keeper = keeper
        self.channel: SerialChannel | None = None
        self.lost_before_open = ""

    def lost(self, reason: str) -> None:
        if self.channel is None:
            self.lost_before_open = reason
        elif self.channel is self.keeper._channel:
            self.keeper._lost(reason)
