"""The daemon's event bus: lifecycle and operation events, LXD-shaped, to any subscriber."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import attrs
from twisted.logger import Logger

from vmready.lifecycle.faults import SERVER_SOURCE, FaultLog

LIFECYCLE = "lifecycle"
OPERATION = "operation"
EVENT_TYPES = frozenset({LIFECYCLE, OPERATION})

Listener = Callable[["Event"], None]


@attrs.frozen
class Event:
    """One event as ``/1.0/events`` streams it."""

    type: str
    timestamp: float
    metadata: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """LXD's envelope: type, RFC 3339 timestamp, metadata, project."""
        stamp = datetime.datetime.fromtimestamp(self.timestamp, tz=datetime.UTC)
        return {
            "type": self.type,
            "timestamp": stamp.isoformat().replace("+00:00", "Z"),
            "metadata": self.metadata,
            "project": "default",
        }


class EventBus:
    """Fan-out of events to subscribers, optionally filtered by type."""

    log = Logger()

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._subscribers: list[tuple[Listener, frozenset[str] | None]] = []
        # The faults the events announced and not yet cleared (``vmready info`` shows them).
        self.faults = FaultLog()

    def subscribe(
        self, listener: Listener, types: frozenset[str] | None = None
    ) -> Callable[[], None]:
        """Deliver future events (of ``types``, or all) to ``listener``; returns an undo."""
        entry = (listener, types)
        self._subscribers.append(entry)

        def unsubscribe() -> None:
            if entry in self._subscribers:
                self._subscribers.remove(entry)

        return unsubscribe

    def publish(self, type: str, metadata: dict[str, Any]) -> Event:
        """Send one event to every interested subscriber."""
        event = Event(type, self._clock(), metadata)
        self.faults.observe(type, event.timestamp, metadata)
        for listener, types in list(self._subscribers):
            if types is not None and type not in types:
                continue
            try:
                listener(event)
            except Exception:
                self.log.failure("event subscriber failed on a {type} event", type=type)
        return event

    def lifecycle(
        self, action: str, instance: str, context: dict[str, Any] | None = None
    ) -> Event:
        """An LXD lifecycle event about an instance (``instance-started``, ``instance-ready``…)."""
        return self.publish(
            LIFECYCLE,
            {"action": action, "source": f"/1.0/instances/{instance}", "context": context or {}},
        )

    def server(self, action: str, context: dict[str, Any] | None = None) -> Event:
        """A lifecycle event about the daemon itself (``store-write-failed``…), source ``/1.0``."""
        return self.publish(
            LIFECYCLE, {"action": action, "source": SERVER_SOURCE, "context": context or {}}
        )
