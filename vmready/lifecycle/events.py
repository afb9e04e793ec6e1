"""The daemon's event bus: lifecycle and operation events, LXD-shaped, to any subscriber.

On a cluster member the bus also carries the events of the other members'
instances (``lifecycle.relay``): they arrive with the member that published
them as their ``location`` and their original timestamp, marked ``relayed`` so
they are never sent on again.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Protocol

import attrs
from twisted.logger import Logger

from vmready.domain import InstanceRecord
from vmready.lifecycle.faults import SERVER_SOURCE, FaultLog

LIFECYCLE = "lifecycle"
OPERATION = "operation"
EVENT_TYPES = frozenset({LIFECYCLE, OPERATION})

Listener = Callable[["Event"], None]


def rfc3339(timestamp: float) -> str:
    """A Unix timestamp as LXD writes times (Go's RFC 3339 with a fraction), in UTC.

    Go trims the fraction's trailing zeros; a float clock holds microseconds.
    """
    stamp = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    whole = stamp.strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{stamp.microsecond:06d}".rstrip("0")
    return f"{whole}.{fraction}Z" if fraction else f"{whole}Z"


@attrs.frozen
class Event:
    """One event as ``/1.0/events`` streams it."""

    type: str
    timestamp: float
    metadata: dict[str, Any]
    # The cluster member whose daemon published it ("": a single host, nothing to say).
    location: str = ""
    # Published by another member and injected here: never relayed again.
    relayed: bool = False

    def to_json(self) -> dict[str, Any]:
        """LXD's envelope: type, RFC 3339 timestamp, metadata, project (and location).

        ``location`` is there on a cluster member only, as LXD's clustered
        events carry it: the member whose instance it is about.
        """
        envelope: dict[str, Any] = {
            "type": self.type,
            "timestamp": rfc3339(self.timestamp),
            "metadata": self.metadata,
            "project": "default",
        }
        if self.location:
            envelope["location"] = self.location
        return envelope


class EventGate(Protocol):
    """Decides when an event published here reaches the subscribers (``EventBus.gate``)."""

    def offer(self, event: Event, deliver: Callable[[Event], None]) -> None:
        """Call ``deliver(event)`` now, later, or never."""


class EventBus:
    """Fan-out of events to subscribers, optionally filtered by type."""

    log = Logger()

    def __init__(self, clock: Callable[[], float], location: str = "") -> None:
        self._clock = clock
        # The cluster member this daemon is, stamped on its own events ("": a single host).
        self.location = location
        self._subscribers: list[tuple[Listener, frozenset[str] | None]] = []
        # The faults the events announced and not yet cleared (``vmready info`` shows them).
        self.faults = FaultLog()
        # What this daemon's own events pass first (a cluster member's lease: ``announcing``).
        self.gate: EventGate | None = None

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
        event = Event(type, self._clock(), metadata, self.location)
        if self.gate is None:
            self._deliver(event)
        else:
            self.gate.offer(event, self._deliver)
        return event

    def now(self) -> float:
        """The time events published here are stamped with."""
        return self._clock()

    def publish_relayed(self, event: Event) -> Event:
        """Send an event another member published, as it was (its time, its location).

        Marked relayed: the relay that sends this daemon's events to the other
        members leaves it alone, so no event goes round twice.
        """
        relayed = attrs.evolve(event, relayed=True)
        self._deliver(relayed)
        return relayed

    def _deliver(self, event: Event) -> None:
        self.faults.observe(event.type, event.timestamp, event.metadata)
        for listener, types in list(self._subscribers):
            if types is not None and event.type not in types:
                continue
            try:
                listener(event)
            except Exception:
                self.log.failure("event subscriber failed on a {type} event", type=event.type)

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


def instance_state_context(record: InstanceRecord) -> dict[str, Any]:
    """What an ``instance-state`` event says: everything a watcher needs to show the instance."""
    return {
        "status": record.status.name,
        "status_code": int(record.status.code),
        "display_status": record.display_status,
        "vm_state": record.vm_state.value,
        "task_state": record.task_state.value if record.task_state else None,
        "power_state": record.power_state.value,
        "error": record.error or "",
    }
