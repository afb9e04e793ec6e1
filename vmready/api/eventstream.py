"""``/1.0/events`` consumers, kept bounded: one ``BoundedFeed`` per client, either form.

A consumer's transport pauses its feed when the transport's buffer is full
(twisted's producer API).  Events that arrive while it is paused are held by
the feed, in order, and written when the transport resumes it; past
``MAX_PENDING_BYTES`` held, the consumer is disconnected with a logged reason
(it reconnects and reads the state again) rather than the daemon's memory
growing.  So one consumer costs at most the transport's buffer plus the limit.

``EventStream`` is the newline-delimited JSON form (a plain ``GET``); the
WebSocket form, which LXD's clients speak, is ``api.eventsocket``.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import cast

from twisted.internet.interfaces import IPushProducer, ITCPTransport
from twisted.logger import Logger
from twisted.web import http
from twisted.web.iweb import IRequest
from zope.interface import implementer

from vmready.lifecycle import Event

# The bytes of events one paused consumer may have waiting before it is cut off.
MAX_PENDING_BYTES = 4 * 1024 * 1024


def wants_websocket(request: IRequest) -> bool:
    """Whether the request asks to be upgraded to a WebSocket (``api.eventsocket``)."""
    upgrade = request.getHeader(b"Upgrade")
    return upgrade is not None and b"websocket" in upgrade.lower()


class _LastEncoded:
    """The event last encoded, and its bytes.

    The bus hands each event to every consumer in turn, so the consumers
    after the first find it here: an event is encoded once, not once per
    consumer (seven streams on each of three members and many state changes
    under ``benchmarks/api_load.py``: encoding the same events again was a
    fifth of a member's time). An event is never changed once published.
    """

    event: Event | None = None
    encoded = b""


_last = _LastEncoded()


def encode_event(event: Event) -> bytes:
    """One event as both forms send it: its JSON envelope."""
    if _last.event is not event:
        _last.encoded = json.dumps(event.to_json()).encode("utf-8")
        _last.event = event
    return _last.encoded


@implementer(IPushProducer)
class BoundedFeed:
    """One consumer's events: written while it reads, held (up to ``limit`` bytes) while not.

    ``write`` hands one message to the transport; ``disconnect(reason)`` ends
    the consumer's connection; ``consumer`` names it in the log line.
    """

    log = Logger()

    def __init__(
        self,
        write: Callable[[bytes], None],
        disconnect: Callable[[str], None],
        consumer: str,
        limit: int = MAX_PENDING_BYTES,
    ) -> None:
        self._write = write
        self._disconnect = disconnect
        self.consumer = consumer
        self.limit = limit
        self.paused = False
        self.closed = False
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        # The most ever held at once, and all ever handed to the transport.
        self.high_water = 0
        self.written_bytes = 0

    def pauseProducing(self) -> None:
        """The consumer's transport buffer is full: hold events from now on."""
        self.paused = True

    def resumeProducing(self) -> None:
        """The consumer caught up: write what was held, in order, while it keeps up."""
        self.paused = False
        while self.pending and not self.paused and not self.closed:
            message = self.pending.popleft()
            self.pending_bytes -= len(message)
            self._send(message)

    def stopProducing(self) -> None:
        """The connection is going away: hold nothing more."""
        self.closed = True
        self.pending.clear()
        self.pending_bytes = 0

    def offer(self, message: bytes) -> None:
        """Write one message, or hold it while paused; past the limit, cut the consumer off."""
        if self.closed:
            return
        if not self.paused and not self.pending:
            self._send(message)
            return
        self.pending.append(message)
        self.pending_bytes += len(message)
        self.high_water = max(self.high_water, self.pending_bytes)
        if self.pending_bytes > self.limit:
            held = self.pending_bytes
            self.stopProducing()
            reason = (
                f"it stopped reading: {held} bytes of events were waiting for it "
                f"(limit {self.limit})"
            )
            self.log.warn(
                "closing the event stream of {consumer}: {reason}",
                consumer=self.consumer,
                reason=reason,
            )
            self._disconnect(reason)

    def _send(self, message: bytes) -> None:
        self.written_bytes += len(message)
        self._write(message)


class EventStream(BoundedFeed):
    """The newline-delimited JSON form of ``/1.0/events``: one event per line."""

    def __init__(
        self, request: http.Request, consumer: str = "a client", limit: int = MAX_PENDING_BYTES
    ) -> None:
        super().__init__(request.write, lambda reason: _abort(request), consumer, limit)

    def deliver(self, event: Event) -> None:
        """Write one event as a JSON line (or hold it, or cut the reader off)."""
        self.offer(encode_event(event) + b"\n")


def _abort(request: http.Request) -> None:
    """End the connection now: a reader that stopped would never take what is buffered."""
    transport = request.transport
    if transport is not None:
        # Every stream transport (TCP, unix, TLS) is an ITCPTransport here.
        cast(ITCPTransport, transport).abortConnection()
