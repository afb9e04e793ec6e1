"""Telling systemd how the daemon is doing: the ``sd_notify`` protocol, without libsystemd.

A unit with ``Type=notify`` starts the daemon with ``$NOTIFY_SOCKET`` naming a
unix datagram socket (a path, or ``@name`` in the abstract namespace); each
datagram is newline-separated ``KEY=value`` lines.  vmready sends ``READY=1``
once its operator API serves, ``STATUS=...`` as it reconciles its instances,
``STOPPING=1`` when it stops, and ``WATCHDOG=1`` at half ``$WATCHDOG_USEC``
from the reactor (a hung reactor stops pinging, and systemd restarts it).
Without ``$NOTIFY_SOCKET`` nothing is sent.  The parsing and the datagram's
bytes are pure functions; ``Notifier`` is the one place that sends.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, MutableMapping

from twisted.logger import Logger

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"
# Reconciling thousands of instances: one STATUS a second says enough.
PROGRESS_PERIOD = 1.0


def notify_address(value: str | None) -> str | bytes | None:
    """The socket ``$NOTIFY_SOCKET`` names; None for none, or one this client cannot reach.

    ``@name`` is the abstract namespace (a leading NUL byte on the wire); an
    absolute path is a socket in the file system.  systemd 254's ``vsock:``
    addresses (for a manager outside a VM) are not supported: nothing is sent.
    """
    if not value:
        return None
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half ``$WATCHDOG_USEC``), or None for no watchdog.

    As ``sd_watchdog_enabled``: a ``$WATCHDOG_PID`` naming another process
    means the watchdog is not this process's to feed.
    """
    try:
        usec = int(environ.get(WATCHDOG_USEC, ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = environ.get(WATCHDOG_PID)
    if owner is not None:
        try:
            if int(owner) != pid:
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def datagram(fields: Mapping[str, str]) -> bytes:
    """One notification: ``KEY=value`` lines; a value is one line (newlines become spaces)."""
    lines = (f"{key}={' '.join(value.splitlines())}" for key, value in fields.items())
    return "\n".join(lines).encode()


def forget_environment(environ: MutableMapping[str, str]) -> None:
    """Drop the variables once read: QEMU and other children must not notify for vmready."""
    for name in (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID):
        environ.pop(name, None)


class Notifier:
    """Sends notifications to the service manager; a failure to send is logged, never raised."""

    log = Logger()

    def __init__(self, address: str | bytes | None = None, watchdog: float | None = None) -> None:
        self.address = address
        # Seconds between WATCHDOG=1 pings; None: no watchdog was asked for.
        self.watchdog = watchdog if address is not None else None
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], pid: int) -> Notifier:
        """The notifier ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC`` ask for (silent without)."""
        return cls(notify_address(environ.get(NOTIFY_SOCKET)), watchdog_interval(environ, pid))

    def ready(self, status: str) -> None:
        """The daemon serves: systemd may start what depends on it."""
        self.send({"READY": "1", "STATUS": status})

    def status(self, text: str) -> None:
        """What ``systemctl status`` shows the daemon doing."""
        self.send({"STATUS": text})

    def stopping(self, status: str) -> None:
        """The daemon began to stop."""
        self.send({"STOPPING": "1", "STATUS": status})

    def ping(self) -> None:
        """Alive: the reactor ran this."""
        self.send({"WATCHDOG": "1"})

    def send(self, fields: Mapping[str, str]) -> None:
        """One datagram to the manager (nothing without an address)."""
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(datagram(fields), self.address)
        except OSError as e:
            if not self._warned:  # once: a manager gone away would otherwise flood the log
                self._warned = True
                self.log.warn(
                    "cannot notify the service manager at {address!r}: {error}",
                    address=self.address,
                    error=e.strerror or str(e),
                )


class ReconcileProgress:
    """``STATUS=reconciling N of M instances`` as they are reconciled, at most once a period."""

    def __init__(
        self,
        notifier: Notifier,
        total: int,
        seconds: Callable[[], float],
        period: float = PROGRESS_PERIOD,
    ) -> None:
        self.notifier = notifier
        self.total = total
        self.done = 0
        self._seconds = seconds
        self._period = period
        self._last = seconds()
        notifier.status(self.text())

    def text(self) -> str:
        """The status line as things stand."""
        return f"reconciling {self.done} of {self.total} instances"

    def one_done(self, _: object = None) -> None:
        """One more instance reconciled (a callback for its ``reconciled`` Deferred)."""
        self.done += 1
        now = self._seconds()
        if self.done < self.total and now - self._last < self._period:
            return
        self._last = now
        self.notifier.status(self.text())
