"""A test's end of a connection: what arrived on it, and when it closed."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure


class Received(Protocol):
    """Records what arrives; ``closed`` fires when the connection ends, ``reason`` says why."""

    def __init__(self) -> None:
        self.received = b""
        self.reason: Failure | None = None
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    @property
    def events(self) -> list[dict[str, Any]]:
        """What arrived as JSON lines (a streamed body such as ``/1.0/events``)."""
        return [json.loads(line) for line in self.received.splitlines() if line.strip()]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason
        if not self.closed.called:
            self.closed.callback(None)
