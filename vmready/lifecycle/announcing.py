"""A cluster member's events about its instances go out only while its lease surely holds.

A daemon woken from a freeze first runs the reactor's backlog: writes it
committed before the freeze are answered, and the events announcing them
would go out at once, after another daemon may have taken its name over.
The store refuses its next write and the guard its next step on a VM, but an
event is neither: it would be the old daemon still speaking for the member.

``AnnouncementHold`` sits between the ``EventBus`` and its subscribers (the
operators' streams and the relay to the other members).  While the lease
surely holds (``LeaseGuard.may_act``) an event goes through at once.  Once in
doubt, the member's own events (lifecycle events about an instance,
operation events) are held in order and a renewal is asked for: a renewal
that confirms the lease sends them, a lost lease drops them (the daemon
stops, and the member's new daemon speaks for it).  While the store is out of
reach they wait for the next renewal that succeeds, at most ``max_held`` of
them (the oldest go first); before the member joined, for its join.  Events
about the daemon itself (source ``/1.0``: ``store-write-failed``, members
joining or leaving) are always sent: they say what this daemon sees, not
what the member did.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import ActingRefused
from vmready.lifecycle.events import LIFECYCLE, Event
from vmready.lifecycle.faults import SERVER_SOURCE
from vmready.lifecycle.leaseguard import LeaseGuard

# Held events kept while the store is out of reach; past it the oldest are dropped.
DEFAULT_MAX_HELD = 10_000


def speaks_for_the_member(event: Event) -> bool:
    """Whether ``event`` says what the member did (to an instance), not what this daemon sees."""
    if event.type != LIFECYCLE:
        return True
    return event.metadata.get("source") != SERVER_SOURCE


class AnnouncementHold:
    """Holds the member's events while its lease is in doubt (``EventBus.gate``)."""

    log = Logger()

    def __init__(self, guard: LeaseGuard, max_held: int = DEFAULT_MAX_HELD) -> None:
        self.guard = guard
        self.max_held = max_held
        self._held: collections.deque[tuple[Event, Callable[[Event], None]]] = collections.deque()
        self._renewing = False
        # Held events dropped: the lease was lost, or too many waited for the store.
        self.dropped = 0
        guard.watch(self._confirmed, self._revoked)

    @property
    def held(self) -> int:
        """How many events wait for the lease to be confirmed."""
        return len(self._held)

    def offer(self, event: Event, deliver: Callable[[Event], None]) -> None:
        """Send ``event`` through ``deliver`` now, or once the lease is confirmed again."""
        if not speaks_for_the_member(event):
            deliver(event)
            return
        if self.guard.lost:
            self.dropped += 1
            return
        if not self._held and self.guard.may_act():
            deliver(event)
            return
        if len(self._held) >= self.max_held:
            self._held.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % self.max_held == 0:
                self.log.warn(
                    "{dropped} event(s) of member {name} dropped: more than {most} waited "
                    "for its lease to be confirmed",
                    dropped=self.dropped,
                    name=self.guard.name,
                    most=self.max_held,
                )
        self._held.append((event, deliver))
        self._ask_renewal(event)

    def _ask_renewal(self, event: Event) -> None:
        if self._renewing or self.guard.confirmed_at is None:
            return  # a renewal is on its way, or the member has not joined: its join confirms
        self._renewing = True
        source = str(event.metadata.get("source", ""))
        subject = source.rsplit("/", 1)[-1] or "its instances"
        asked = Deferred.fromCoroutine(self.guard.before_acting(subject, "announcing its events"))
        asked.addCallbacks(self._renewed, self._not_renewed)

    def _renewed(self, _: object) -> None:
        self._renewing = False
        self._confirmed()

    def _not_renewed(self, failure: Failure) -> None:
        # Lost: ``_revoked`` dropped them.  Out of reach: they wait for the next renewal.
        self._renewing = False
        failure.trap(ActingRefused)

    def _confirmed(self) -> None:
        """A renewal confirmed the lease: what was held goes out, in order."""
        while self._held and self.guard.may_act():
            event, deliver = self._held.popleft()
            deliver(event)

    def _revoked(self) -> None:
        """The lease is lost: what was held is not this daemon's to say any more."""
        if self._held:
            self.log.warn(
                "{count} event(s) of member {name} not sent: its lease was lost before they "
                "could be",
                count=len(self._held),
                name=self.guard.name,
            )
        self.dropped += len(self._held)
        self._held.clear()
