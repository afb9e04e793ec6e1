"""The QMP client vmready uses for every monitor conversation (daemon, tests, conformance).

A ``QMPClientProtocol`` reads QEMU's greeting, negotiates capabilities, sends
commands with ids and matches the replies, hands asynchronous events to
subscribers, and fails every outstanding command with ``QMPDisconnected`` when
the monitor goes away.  QEMU's error replies become ``QMPError`` carrying the
error class and description.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, TimeoutError, succeed
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from vmready.domain import IVMReadyReactor, Listeners

__all__ = [
    "QMPClientProtocol",
    "QMPDisconnected",
    "QMPError",
    "QMPEvent",
    "QMPProtocolError",
    "connect_qmp",
]


class QMPError(Exception):
    """QEMU answered a command with an error."""

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(f"{command}: {error_class}: {desc}")
        self.command = command
        self.error_class = error_class
        self.desc = desc


class QMPDisconnected(Exception):
    """The monitor connection closed before the command was answered."""


class QMPProtocolError(Exception):
    """The peer sent something that is not QMP."""


@attrs.frozen
class QMPEvent:
    """An asynchronous QMP event."""

    name: str
    data: dict[str, Any]
    timestamp: float


@attrs.frozen
class _Pending:
    command: str
    deferred: Deferred[Any]


EventListener = Callable[[QMPEvent], None]


class QMPClientProtocol(LineOnlyReceiver):
    """A QMP monitor client over any stream transport."""

    delimiter = b"\n"
    # A 64 KiB ring buffer read in base64 plus framing; keep a wide margin.
    MAX_LENGTH = 16 * 1024 * 1024
    log = Logger()

    def __init__(self) -> None:
        self.greeting: dict[str, Any] | None = None
        self.negotiated = False
        self._ready_waiters: list[Deferred[None]] = []
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._listeners: Listeners[QMPEvent] = Listeners(
            self.log, "QMP event listener failed on {event}"
        )
        self._lost: Failure | None = None
        self._closed_waiters: list[Deferred[None]] = []

    # -- public API -------------------------------------------------------

    def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Deferred[Any]:
        """Run ``command``; fires with its ``return`` value or fails with QMPError."""
        if self._lost is not None:
            return _failed(QMPDisconnected(f"QMP monitor is disconnected; cannot run {command}"))
        if not self.negotiated:
            return self.when_ready().addCallback(lambda _: self._send(command, arguments))
        return self._send(command, arguments)

    def when_ready(self) -> Deferred[None]:
        """Fires once the greeting arrived and capabilities are negotiated."""
        if self._lost is not None:
            return _failed(QMPDisconnected("QMP monitor is disconnected"))
        if self.negotiated:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._ready_waiters.append(waiter)
        return waiter

    def subscribe(self, listener: EventListener, first: bool = False) -> Callable[[], None]:
        """Call ``listener`` with every event; returns the unsubscriber.

        ``first``: before every listener already there (a recorder that must
        see an event before anything reacts to it).
        """
        return self._listeners.subscribe(listener, first)

    def when_closed(self) -> Deferred[None]:
        """Fires once the connection is gone."""
        if self._lost is not None:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._closed_waiters.append(waiter)
        return waiter

    @property
    def is_open(self) -> bool:
        """Whether the monitor connection is still open."""
        return self._lost is None and self.transport is not None

    def close(self) -> None:
        """Hang up."""
        if self.transport is not None:
            self.transport.loseConnection()

    # -- internals --------------------------------------------------------

    def _send(self, command: str, arguments: dict[str, Any] | None) -> Deferred[Any]:
        if self._lost is not None:
            return _failed(QMPDisconnected(f"QMP monitor is disconnected; cannot run {command}"))
        self._next_id += 1
        request: dict[str, Any] = {"execute": command, "id": self._next_id}
        if arguments:
            request["arguments"] = arguments
        deferred: Deferred[Any] = Deferred()
        self._pending[self._next_id] = _Pending(command, deferred)
        self.sendLine(json.dumps(request).encode("utf-8"))
        return deferred

    def lineReceived(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
            self._protocol_error(f"QMP peer sent a line that is not JSON: {line[:80]!r}")
            return
        if not isinstance(message, dict):
            self._protocol_error(
                f"QMP peer sent a JSON value that is not an object: {line[:80]!r}"
            )
            return
        if "QMP" in message:
            self._greeted(message["QMP"])
        elif "event" in message:
            self._event(message)
        elif "return" in message or "error" in message:
            self._reply(message)
        else:
            self.log.warn("ignoring unrecognised QMP message {message!r}", message=message)

    def _greeted(self, greeting: dict[str, Any]) -> None:
        if self.greeting is not None:
            self._protocol_error("QMP peer sent a second greeting")
            return
        self.greeting = greeting
        self._send("qmp_capabilities", None).addCallbacks(self._negotiated, self._not_negotiated)

    def _negotiated(self, _: object) -> None:
        self.negotiated = True
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _not_negotiated(self, reason: Failure) -> None:
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            waiter.errback(reason)

    def _event(self, message: dict[str, Any]) -> None:
        stamp = message.get("timestamp", {})
        data = message.get("data", {})
        name = message["event"]
        timestamp = _timestamp(stamp)
        if not isinstance(name, str) or not isinstance(data, dict) or timestamp is None:
            self._protocol_error(f"QMP peer sent a malformed event: {str(message)[:120]}")
            return
        event = QMPEvent(name=name, data=data, timestamp=timestamp)
        self._listeners.notify(event, event=event.name)

    def _reply(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        error = message.get("error")
        if "error" in message and not isinstance(error, dict):
            self._protocol_error(f"QMP peer sent a malformed error reply: {str(message)[:120]}")
            return
        pending = None
        if isinstance(request_id, int) and not isinstance(request_id, bool):  # True is not 1
            pending = self._pending.pop(request_id, None)
        if pending is None:
            self.log.warn("QMP reply matches no command: {message!r}", message=message)
            return
        if error is not None:
            pending.deferred.errback(
                QMPError(
                    pending.command,
                    str(error.get("class", "GenericError")),
                    str(error.get("desc", "")),
                )
            )
        else:
            pending.deferred.callback(message["return"])

    def _protocol_error(self, description: str) -> None:
        self.log.error("{description}; closing the monitor", description=description)
        self._lost = Failure(QMPProtocolError(description))
        if self.transport is not None:
            self.transport.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        self._protocol_error(f"QMP peer sent a line over {self.MAX_LENGTH} bytes")

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        cause = (
            self._lost.getErrorMessage() if self._lost is not None else reason.getErrorMessage()
        )
        self._lost = reason
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            entry.deferred.errback(
                QMPDisconnected(
                    f"QMP monitor disconnected before answering {entry.command}: {cause}"
                )
            )
        self._not_negotiated(
            Failure(QMPDisconnected(f"QMP monitor disconnected during negotiation: {cause}"))
        )
        waiters, self._closed_waiters = self._closed_waiters, []
        for waiter in waiters:
            waiter.callback(None)


def _timestamp(stamp: Any) -> float | None:
    """An event's ``{"seconds": …, "microseconds": …}`` as seconds; None if it is not one."""
    if not isinstance(stamp, dict):
        return None
    parts = [stamp.get("seconds", 0), stamp.get("microseconds", 0)]
    if not all(isinstance(part, int) and not isinstance(part, bool) for part in parts):
        return None
    try:
        seconds = parts[0] + parts[1] / 1_000_000
    except OverflowError:  # integers past a float's range
        return None
    return float(seconds) if math.isfinite(seconds) else None


def _failed(error: Exception) -> Deferred[Any]:
    d: Deferred[Any] = Deferred()
    d.errback(error)
    return d


def connect_qmp(
    reactor: IVMReadyReactor, socket_path: str, timeout: float = 10.0
) -> Deferred[QMPClientProtocol]:
    """Connect to the monitor at ``socket_path`` and finish negotiation."""
    return Deferred.fromCoroutine(_connect_qmp(reactor, socket_path, timeout))


async def _connect_qmp(
    reactor: IVMReadyReactor, socket_path: str, timeout: float
) -> QMPClientProtocol:
    endpoint = UNIXClientEndpoint(reactor, socket_path, timeout=int(max(timeout, 1)))
    protocol = QMPClientProtocol()
    try:
        await connectProtocol(endpoint, protocol)
    except Exception as e:
        raise QMPDisconnected(f"cannot connect to QMP monitor at {socket_path}: {e}") from e
    clock: IReactorTime = reactor
    try:
        await protocol.when_ready().addTimeout(timeout, clock)
    except TimeoutError:
        protocol.close()
        raise QMPDisconnected(
            f"no QMP greeting from {socket_path} within {timeout:g}s "
            "(is another client holding the monitor?)"
        ) from None
    except Exception:
        protocol.close()
        raise
    return protocol
