"""``/1.0/events``: one client's stream of newline-delimited JSON events, kept bounded."""

from __future__ import annotations

import json

from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.web import http
from zope.interface import implementer

from vmready.lifecycle.events import Event

__all__ = ["EventStream"]


@implementer(IPushProducer)
class EventStream:
    """Feeds one ``/1.0/events`` client; one that stops reading is cut off, not buffered.

    The transport pauses us when its buffer is full.  Events that arrive while
    paused are still written (so none is silently skipped), but past
    ``MAX_PAUSED_BYTES`` of them the stream is closed: the client reconnects
    and re-reads state, and the daemon's memory stays bounded.
    """

    MAX_PAUSED_BYTES = 4 * 1024 * 1024
    log = Logger()

    def __init__(self, request: http.Request) -> None:
        self.request = request
        self.paused = False
        self.paused_bytes = 0
        self.closed = False

    def pauseProducing(self) -> None:
        """The client's buffer is full."""
        self.paused = True

    def resumeProducing(self) -> None:
        """The client caught up."""
        self.paused = False
        self.paused_bytes = 0

    def stopProducing(self) -> None:
        """The connection is going away."""
        self.closed = True

    def deliver(self, event: Event) -> None:
        """Write one event as a JSON line, or end a stream whose reader fell too far behind."""
        if self.closed:
            return
        line = json.dumps(event.to_json()).encode("utf-8") + b"\n"
        if self.paused:
            self.paused_bytes += len(line)
            if self.paused_bytes > self.MAX_PAUSED_BYTES:
                self.closed = True
                self.log.warn("closing an event stream whose reader stopped reading")
                self.request.loseConnection()
                return
        self.request.write(line)
