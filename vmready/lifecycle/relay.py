"""Events across cluster members: this daemon's events out, the other members' events in.

Members share one PostgreSQL store and hear each other through its
LISTEN/NOTIFY (``store.notifications``).  Two channels matter here:

- the *instances* channel: a trigger NOTIFYs each committed write of an
  instance row (``{"op", "name", "old_name", "member"}``).  A row another
  member wrote is read again (``AsyncStore.refresh_instance``), so every member
  lists every instance as committed; after the listener lost its connection
  (notifications in the gap are lost) every row is (``reload_instances``).
- the *events* channel: each event this daemon's ``EventBus`` publishes about
  one of its instances goes out as one NOTIFY (``Members.publish_event``),
  and each one from another member is published on the local bus with its
  original time and member (``EventBus.publish_relayed``), so ``/1.0/events``,
  ``vmready monitor`` and ``vmready wait`` on any member see them all.

What is relayed: lifecycle events about instances (``source``
``/1.0/instances/…``) and operation events.  Not relayed: events about the
daemon itself (source ``/1.0``: ``store-write-failed``, the members' own
``member-…`` changes): each member sees its store and its peers for itself,
and a relayed one would be taken for a fault of the member that received it.

Order.  The local bus publishes an event only once the write it announces
committed, so the NOTIFY that relays it (a later transaction) reaches the
other members after the instance row's own notification: PostgreSQL delivers
notifications in commit order.  A receiving member re-reads that row on its
database thread, which takes a while; an event is published locally only once
every re-read asked for before it arrived is done (``InboundOrder``).
Otherwise ``vmready wait`` could subscribe, read the instance's stale row,
and then wait for an event it had already missed.

A NOTIFY payload is limited (< 8000 bytes): an event whose JSON is bigger is
relayed with its context's long strings cut, then without its context at all,
and the payload says so (``"trimmed": true``; the event's context, or an
operation's metadata, then holds ``"trimmed": true`` too).

The encoding, the decoding and the ordering are plain functions and a small
class, without I/O; ``EventRelay`` wires them to the bus and the store.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import InstanceRecord
from vmready.lifecycle.events import (
    EVENT_TYPES,
    LIFECYCLE,
    OPERATION,
    Event,
    EventBus,
    instance_state_context,
)
from vmready.store import EVENTS_CHANNEL, INSTANCES_CHANNEL, MAX_PAYLOAD_BYTES

# What the relay listens to (``store.notifications.NotificationListener``'s channels).
CHANNELS = (INSTANCES_CHANNEL, EVENTS_CHANNEL)
# The payload's format, should it ever change while members of two versions share a store.
PAYLOAD_VERSION = 1
# What a string in a trimmed context keeps.
TRIMMED_STRING_CHARS = 200
_INSTANCE_SOURCE = "/1.0/instances/"


class EventPublisher(Protocol):
    """Where the relay's NOTIFY goes (the store's ``members`` table)."""

    def publish_event(self, payload: str) -> Deferred[None]: ...


class RelayView(Protocol):
    """The instance rows the relay compares (the store's ``view``)."""

    def list_instances(self) -> list[InstanceRecord]: ...

    def owns(self, record: InstanceRecord) -> bool: ...


class RelayStore(Protocol):
    """What the relay needs of the store (``store.asyncstore.AsyncStore``)."""

    @property
    def member(self) -> str | None: ...

    @property
    def members(self) -> EventPublisher: ...

    @property
    def view(self) -> RelayView: ...

    def refresh_instance(self, name: str) -> Deferred[Any]: ...

    def reload_instances(self) -> Deferred[None]: ...


def relayable(event: Event) -> bool:
    """Whether the other members are told of ``event``: this daemon's, about an instance."""
    if event.relayed:
        return False
    if event.type == LIFECYCLE:
        return str(event.metadata.get("source", "")).startswith(_INSTANCE_SOURCE)
    return event.type == OPERATION


def encode_event(event: Event, member: str, seq: int = 0) -> tuple[str, bool] | None:
    """The NOTIFY payload relaying ``event`` from ``member``, within ``MAX_PAYLOAD_BYTES``,
    and whether it had to be trimmed.

    ``seq`` numbers the member's payloads: PostgreSQL folds identical payloads
    sent in one transaction into one, and two events alike to the microsecond
    must still both arrive.

    None when even the trimmed event does not fit (no vmready event is that
    big without its context).
    """
    document: dict[str, Any] = {
        "v": PAYLOAD_VERSION,
        "member": member,
        "seq": seq,
        "type": event.type,
        "timestamp": event.timestamp,
        "metadata": event.metadata,
    }
    payload = _dumped(document)
    if _fits(payload):
        return payload, False
    for trim in (_shorten_strings, _drop):
        document = {**document, "metadata": _trimmed(event, trim), "trimmed": True}
        payload = _dumped(document)
        if _fits(payload):
            return payload, True
    return None


def _dumped(document: dict[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def _fits(payload: str) -> bool:
    return len(payload.encode("utf-8")) <= MAX_PAYLOAD_BYTES


def _trimmed(event: Event, trim: Callable[[Any], Any]) -> dict[str, Any]:
    """The event's metadata with its free-form part (a lifecycle context, an operation's
    task metadata and error) trimmed by ``trim`` and marked trimmed."""
    metadata = dict(event.metadata)
    if event.type == LIFECYCLE:
        context = trim(metadata.get("context") or {})
        metadata["context"] = {**(context if isinstance(context, dict) else {}), "trimmed": True}
    else:
        inner = trim(metadata.get("metadata") or {})
        metadata["metadata"] = {**(inner if isinstance(inner, dict) else {}), "trimmed": True}
        metadata["err"] = trim(metadata.get("err", ""))
        metadata["description"] = _shorten_strings(metadata.get("description", ""))
    return metadata


def _shorten_strings(value: Any) -> Any:
    """``value`` with every string in it cut to ``TRIMMED_STRING_CHARS`` (marked with …)."""
    if isinstance(value, str):
        if len(value) <= TRIMMED_STRING_CHARS:
            return value
        return value[: TRIMMED_STRING_CHARS - 1] + "…"
    if isinstance(value, dict):
        return {_shorten_strings(key): _shorten_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_shorten_strings(item) for item in value]
    return value


def _drop(value: Any) -> Any:
    """Nothing of ``value`` is kept (an error string becomes empty)."""
    return "" if isinstance(value, str) else {}


def decode_event(payload: str) -> tuple[str, Event] | None:
    """The member and the event a relayed payload carries; None if it is not one.

    The event keeps its original timestamp and has its member as location.
    """
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("v") != PAYLOAD_VERSION:
        return None
    member, type_, timestamp, metadata = (
        document.get(key) for key in ("member", "type", "timestamp", "metadata")
    )
    if not (isinstance(member, str) and member and type_ in EVENT_TYPES):
        return None
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        return None
    if not math.isfinite(timestamp) or not isinstance(metadata, dict):
        return None
    return member, Event(str(type_), float(timestamp), metadata, location=member)


@attrs.frozen
class InstanceChange:
    """One committed write of an instance row, as the instances channel tells it."""

    op: str
    name: str
    # The name before an UPDATE that renamed it (None: not a rename).
    old_name: str | None
    # The member whose instance it is ("": a single host's instance).
    member: str

    def names(self) -> list[str]:
        """The rows to read again: the name, and the name it had before a rename."""
        if self.old_name and self.old_name != self.name:
            return [self.old_name, self.name]
        return [self.name]


def decode_instance_change(payload: str) -> InstanceChange | None:
    """What an instances-channel payload says; None if it is not one."""
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    op, name, old_name, member = (
        document.get(key) for key in ("op", "name", "old_name", "member")
    )
    if op not in ("INSERT", "UPDATE", "DELETE") or not isinstance(name, str) or not name:
        return None
    if old_name is not None and not isinstance(old_name, str):
        return None
    if not isinstance(member, str):
        return None
    return InstanceChange(op, name, old_name, member)


class InboundOrder:
    """Holds each received event until every re-read asked for before it is done.

    Re-reads (``reading``) and events (``event``) come in the order the
    notifications arrived; ``read_done`` marks one re-read finished.  Each call
    returns the events now due, in arrival order.  No I/O: the relay does it.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[Event | int] = collections.deque()
        self._next_token = 0
        self._done: set[int] = set()

    def reading(self) -> int:
        """A re-read began; its token, for ``read_done``."""
        token = self._next_token
        self._next_token += 1
        self._queue.append(token)
        return token

    def read_done(self, token: int, found: Sequence[Event] = ()) -> list[Event]:
        """The re-read ``token`` is over (either way); the events now due.

        ``found``: events the re-read itself gives (what changed while
        notifications were lost), due where the re-read stood: after what
        arrived before it, before what arrived while it ran.
        """
        if found:
            items = list(self._queue)
            at = items.index(token)
            items[at : at + 1] = found
            self._queue = collections.deque(items)
        else:
            self._done.add(token)
        return self._due()

    def event(self, event: Event) -> list[Event]:
        """An event arrived; the events now due (it, unless a re-read holds it back)."""
        self._queue.append(event)
        return self._due()

    @property
    def waiting(self) -> int:
        """Events held back."""
        return sum(1 for item in self._queue if isinstance(item, Event))

    def _due(self) -> list[Event]:
        due = []
        while self._queue:
            head = self._queue[0]
            if isinstance(head, int):
                if head not in self._done:
                    break
                self._done.discard(head)
            else:
                due.append(head)
            self._queue.popleft()
        return due


class EventRelay:
    """Relays this member's events to the others and theirs to this one's bus.

    ``start`` subscribes to the bus; ``deliver`` (``on_instances``,
    ``on_event``) and ``resync`` are what the notification listener calls (on
    the reactor thread) for a notification on one of ``CHANNELS`` and after a
    reconnection.
    """

    log = Logger()

    def __init__(self, bus: EventBus, store: RelayStore, member: str) -> None:
        self.bus = bus
        self.store = store
        self.member = member
        self._order = InboundOrder()
        self._unsubscribe: Callable[[], None] | None = None
        # Counted for whoever asks how the relay fares (and the tests).
        self.sent = 0
        self.received = 0
        self.trimmed = 0
        self.dropped = 0

    def start(self) -> None:
        """Send every relayable event the bus publishes from now on."""
        if self._unsubscribe is None:
            self._unsubscribe = self.bus.subscribe(self._outgoing)

    def stop(self) -> None:
        """Send no more (what was handed to the store still goes)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # -- out -----------------------------------------------------------------

    def _outgoing(self, event: Event) -> None:
        if not relayable(event):
            return
        encoded = encode_event(event, self.member, self.sent)
        if encoded is None:
            self.dropped += 1
            self.log.warn(
                "not relaying a {type} event to the other members: too big even trimmed "
                "({source})",
                type=event.type,
                source=event.metadata.get("source") or event.metadata.get("description"),
            )
            return
        payload, trimmed = encoded
        if trimmed:
            self.trimmed += 1
        self.sent += 1
        self.store.members.publish_event(payload).addErrback(self._publish_failed, event)

    def _publish_failed(self, failure: Failure, event: Event) -> None:
        self.log.warn(
            "could not relay a {type} event to the other members: {error}",
            type=event.type,
            error=failure.getErrorMessage(),
        )

    # -- in ------------------------------------------------------------------

    def deliver(self, channel: str, payload: str) -> None:
        """A notification on ``channel`` (one of ``CHANNELS``)."""
        if channel == INSTANCES_CHANNEL:
            self.on_instances(payload)
        elif channel == EVENTS_CHANNEL:
            self.on_event(payload)

    def on_instances(self, payload: str) -> None:
        """An instance row was written and committed: read it again if another member did."""
        change = decode_instance_change(payload)
        if change is None:
            self.log.warn(
                "ignoring an instance notification that is not one: {payload!r}",
                payload=payload[:200],
            )
            return
        if change.member == self.member:
            return  # our own write: what we read already follows it
        for name in change.names():
            self._reread(self.store.refresh_instance(name), f"instance {name}")

    def resync(self) -> None:
        """Notifications were lost (the listener reconnected): read every row again.

        The events other members published meanwhile are lost with them; what
        they announced is not: each other member's instance whose state the
        reading finds changed is announced here with an ``instance-state``
        event (``instance-deleted`` if it is gone), its context saying
        ``"resynced": true``, so a ``vmready wait`` on this member sees it.
        """
        before = {
            r.name: r for r in self.store.view.list_instances() if not self.store.view.owns(r)
        }
        token = self._order.reading()

        def done(result: object) -> None:
            found: list[Event] = []
            if isinstance(result, Failure):
                self.log.warn(
                    "could not read every instance again after losing notifications: {error}",
                    error=result.getErrorMessage(),
                )
            else:
                found = self._changed_meanwhile(before)
            self._publish(self._order.read_done(token, found))

        self.store.reload_instances().addBoth(done)

    def _changed_meanwhile(self, before: dict[str, InstanceRecord]) -> list[Event]:
        """Events for the other members' instances the rows read again show changed."""
        found: list[Event] = []
        after = {
            r.name: r for r in self.store.view.list_instances() if not self.store.view.owns(r)
        }
        now = self.bus.now()
        for name in sorted(before.keys() | after.keys()):
            old, new = before.get(name), after.get(name)
            if new is None:
                action, context, shown = "instance-deleted", {}, before[name]
            elif old is not None and _shown_state(old) == _shown_state(new):
                continue
            else:
                action, context, shown = "instance-state", instance_state_context(new), new
            metadata = {
                "action": action,
                "source": f"/1.0/instances/{name}",
                "context": {**context, "resynced": True},
            }
            found.append(Event(LIFECYCLE, now, metadata, location=shown.member))
        return found

    def on_event(self, payload: str) -> None:
        """An event was relayed: publish it here if another member sent it."""
        decoded = decode_event(payload)
        if decoded is None:
            self.log.warn(
                "ignoring a relayed event that is not one: {payload!r}", payload=payload[:200]
            )
            return
        member, event = decoded
        if member == self.member:
            return  # ours, back from the store: published here already
        self.received += 1
        self._publish(self._order.event(event))

    def _reread(self, reading: Deferred[Any], what: str) -> None:
        token = self._order.reading()

        def done(result: object) -> None:
            if isinstance(result, Failure):
                self.log.warn(
                    "could not read {what} again after another member wrote it: {error}",
                    what=what,
                    error=result.getErrorMessage(),
                )
            self._publish(self._order.read_done(token))

        reading.addBoth(done)

    def _publish(self, events: list[Event]) -> None:
        for event in events:
            self.bus.publish_relayed(event)


def _shown_state(record: InstanceRecord) -> tuple[Any, ...]:
    """What an ``instance-state`` event would say of ``record``, to tell whether it changed."""
    return (record.vm_state, record.task_state, record.power_state, record.ready, record.error)
