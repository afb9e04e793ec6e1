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

Views.  What only this member knows of its instance (agent status, agent
history, faults: ``lifecycle.liveviews``) goes with each event about it, as
it stands at the end of the turn that published the event (the history is
recorded after the event): events wait for that turn's end (``later``), and
go in the order they were published.  A receiving member keeps the view on
arrival, before the event is published there, so what a subscriber reads is
never behind the event.  A member that joins or resyncs asks for every view
(``ask_views``); each member answers with all of its own (``send_views``), as
it does once when it joins.

A NOTIFY payload is limited (< 8000 bytes): an event whose JSON is bigger is
relayed first without its view (which the others then forget), then with its
context's long strings cut, then without its context at all, and the payload
says so (``"trimmed": true``; the event's context, or an operation's
metadata, then holds ``"trimmed": true`` too).

The payloads (``lifecycle.relaypayloads``) and the ordering are plain
functions and a small class, without I/O; ``EventRelay`` wires them to the
bus and the store.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import InstanceRecord
from vmready.lifecycle.events import (
    LIFECYCLE,
    OPERATION,
    Event,
    EventBus,
    instance_state_context,
)
from vmready.lifecycle.liveviews import (
    OwnViews,
    RemoteViews,
    view_from_json,
    view_json,
    views_from_json,
)
from vmready.lifecycle.relaypayloads import (
    decode_instance_change,
    encode_event,
    encode_resend,
    encode_views,
    event_of,
    relay_document,
)
from vmready.store import EVENTS_CHANNEL, INSTANCES_CHANNEL

# What the relay listens to (``store.notifications.NotificationListener``'s channels).
CHANNELS = (INSTANCES_CHANNEL, EVENTS_CHANNEL)
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

    def __init__(
        self,
        bus: EventBus,
        store: RelayStore,
        member: str,
        later: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.bus = bus
        self.store = store
        self.member = member
        # This member's views of its instances, sent with their events (None: none sent).
        self.own: OwnViews | None = None
        # The other members' views of theirs, as they told them.
        self.views = RemoteViews()
        # Runs a call at the end of this reactor turn: events go out then, each with its
        # instance's view as the turn left it (None: at once, without waiting).
        self._later = later
        self._outbox: list[Event] = []
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
        """Send no more (what was handed to the store, or waits for this turn's end, goes)."""
        self._flush()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # -- out -----------------------------------------------------------------

    def _outgoing(self, event: Event) -> None:
        if not relayable(event):
            return
        if self._later is None:
            self._send(event)
            return
        self._outbox.append(event)
        if len(self._outbox) == 1:
            self._later(self._flush)

    def _flush(self) -> None:
        """Send the events waiting for the turn's end, in the order they were published."""
        waiting, self._outbox = self._outbox, []
        for event in waiting:
            self._send(event)

    def send_views(self) -> None:
        """Tell the other members this member's view of every instance it runs."""
        if self.own is None:
            return
        self._flush()  # after the events before it, as their views are older
        for payload in encode_views(self.member, self.own.every(), self.sent):
            self.sent += 1
            self.store.members.publish_event(payload).addErrback(self._views_failed)

    def ask_views(self) -> None:
        """Ask every other member for its views (this one joined, or lost notifications)."""
        payload = encode_resend(self.member, self.sent)
        self.sent += 1
        self.store.members.publish_event(payload).addErrback(self._views_failed)

    def _views_failed(self, failure: Failure) -> None:
        self.log.warn(
            "could not tell the other members about instance views: {error}",
            error=failure.getErrorMessage(),
        )

    def _live(self, event: Event) -> dict[str, Any] | None:
        """This member's view of the instance ``event`` is about, if it runs it."""
        source = str(event.metadata.get("source", ""))
        if self.own is None or event.type != LIFECYCLE or not source.startswith(_INSTANCE_SOURCE):
            return None
        view = self.own.of(source[len(_INSTANCE_SOURCE) :])
        return None if view is None else view_json(view)

    def _send(self, event: Event) -> None:
        encoded = encode_event(event, self.member, self.sent, self._live(event))
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
        # The views told meanwhile are lost too: forgotten, and asked for again.
        self.views.clear()
        self.ask_views()
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
        """A payload on the events channel from another member: an event, published here
        (with the view it carries kept first), views told, or views asked for."""
        document = relay_document(payload)
        if document is not None and document["member"] == self.member:
            return  # ours, back from the store: published here already
        decoded = None if document is None else event_of(document)
        if document is not None and decoded is None:
            if document.get("resend") is True:
                self.send_views()
                return
            if isinstance(views := document.get("views"), dict):
                self.views.told_all(views_from_json(document["member"], views))
                return
        if document is None or decoded is None:
            self.log.warn(
                "ignoring a relayed event that is not one: {payload!r}", payload=payload[:200]
            )
            return
        member, event = decoded
        self.received += 1
        self._learn(member, event, document.get("live"))
        self._publish(self._order.event(event))

    def _learn(self, member: str, event: Event, live: Any) -> None:
        """Keep the view an event about an instance carried: the member's after the event.

        Kept on arrival, before the event is published here (it may wait for a
        row read again): what its subscribers read then is never behind it.
        """
        source = str(event.metadata.get("source", ""))
        if event.type != LIFECYCLE or not source.startswith(_INSTANCE_SOURCE):
            return
        name = source[len(_INSTANCE_SOURCE) :]
        action = event.metadata.get("action")
        if action == "instance-deleted":
            self.views.forget(name)
            return
        if action == "instance-renamed":
            old_name = (event.metadata.get("context") or {}).get("old_name")
            self.views.forget(str(old_name))
        view = None if live is None else view_from_json(member, live)
        self.views.told(name, view)

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
