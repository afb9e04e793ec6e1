"""This daemon as a cluster member: its lease, the members it sees, where an instance runs.

Several daemons sharing one store are *members*; each renews a lease in the
store every third of its length (``Membership.start``), and a member whose
lease ran out is unreachable: its instances are not lost and not stopped,
their state is unknown until it comes back.  Each renewal also reads every
member again (``view``), so this daemon knows where each instance runs
(``owner``), whether its host is unreachable (``is_unreachable``,
``unreachable_reason``) and where a new one goes (``choose_target``); a
change of another member's state is announced as a server lifecycle event,
``cluster-member-unreachable`` or ``cluster-member-online``.

Leases are judged on the store's clock (PostgreSQL's, for several hosts), not
this host's: each view carries the store's time when it was read, and
between reads that time is carried forward on this daemon's clock
(``store_now``), so a lease running out between two renewals is seen when it
does.

The lease is this daemon's alone (its certificate's fingerprint is in the
row): ``start`` is refused with ``LeaseHeld`` while another daemon holds a
lease on the same name, and each renewal renews only a lease this daemon
still holds.  Two failures differ:

- the store cannot be reached (or refuses the write): logged once, and tried
  again every ``interval``; the daemon goes on running its instances (their
  VMs are its own whatever the store says).  Once the store answers again, a
  lease that ran out meanwhile is renewed as long as no other daemon took the
  name over; the others saw this member unreachable in between.
- the lease is lost (``LeaseLost``: another daemon took the name over after
  this one's lease ran out, or its row was removed): renewals stop, the one
  line is logged, and ``lost`` fires with it; the daemon must stop, since the
  instances of that name are the other daemon's now.  It need not wait for
  its renewal to learn it: its join fenced the store's connection with the
  lease epoch (``store.members``), and its first write after the takeover is
  refused (``Fenced``, a 503 to whoever asked), which loses the lease too.

Nor does it act on its host before it learns: the store cannot refuse a VM
start or a SIGKILL.  ``guard`` knows when a renewal that succeeded was sent,
on this daemon's own monotonic clock (``monotonic``); once a lease length
has passed since, a step on a VM (``guard.before_acting``, asked by the
hypervisor driver) first renews the lease; the step runs if the renewal succeeds, and
is refused (``ActingRefused``) if the lease was lost (the daemon stops, as
on any ``LeaseLost``) or the store cannot be reached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from vmready.domain import (
    Fenced,
    InstanceRecord,
    LeaseLost,
    MemberRecord,
    MemberState,
    MembersView,
    NotFound,
    Unavailable,
    lease_time,
)
from vmready.lifecycle.announcing import AnnouncementHold
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.leaseguard import LeaseGuard
from vmready.store import AsyncStore

DEFAULT_LEASE_SECONDS = 15.0
MEMBER_UNREACHABLE = "cluster-member-unreachable"
MEMBER_ONLINE = "cluster-member-online"


class Membership:
    """This daemon as member ``name`` of the cluster sharing ``store``.

    ``address`` is host:port of its mutual-TLS API (where other members
    forward requests to), ``fingerprint`` the SHA-256 fingerprint of the
    server certificate it presents there (and as a client when it forwards).
    ``monotonic`` times the lease for ``guard`` (``clock.seconds`` unless given);
    ``acting_margin``: seconds before the lease's end from which ``guard`` refuses
    steps (a host fence kills the VMs then).
    """

    log = Logger()

    def __init__(
        self,
        name: str,
        address: str,
        fingerprint: str,
        store: AsyncStore,
        events: EventBus,
        clock: IReactorTime,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        monotonic: Callable[[], float] | None = None,
        acting_margin: float = 0.0,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"a lease lasts more than 0 seconds, not {lease_seconds!r}")
        self.name = name
        self.address = address
        self.fingerprint = fingerprint
        self.store = store
        self.events = events
        self.clock = clock
        self.lease_seconds = lease_seconds
        # The members as last read (none until the first renewal).
        self.view = MembersView((), 0.0)
        # This daemon's clock when ``view`` was read: store time is carried forward from it.
        self._read_at = clock.seconds()
        self._loop: LoopingCall | None = None
        self._failing = False
        # Fires (once) with the LeaseLost that stopped the renewals: the daemon must stop.
        self.lost: Deferred[LeaseLost] = Deferred()
        store.fenced_by = self._fenced
        # Whether the lease surely holds now: steps on VMs ask it (``before_acting``).
        self.guard = LeaseGuard(
            name, lease_seconds, monotonic or clock.seconds, self.renew_lease, acting_margin
        )
        # Nor does it speak for the member's instances once in doubt (``announcing``).
        events.gate = AnnouncementHold(self.guard)

    # -- the lease ------------------------------------------------------------

    @property
    def interval(self) -> float:
        """Seconds between two renewals: a third of the lease, so two may fail in a row."""
        return self.lease_seconds / 3

    async def start(self, address: str | None = None) -> None:
        """Join (or come back): renew the lease and read the members, then every ``interval``.

        ``address``: where the mutual-TLS API was bound, when it was not known
        as this membership was made.  Fires once the first renewal and read
        committed; if that fails, the error is raised and nothing keeps running
        (the daemon cannot join): ``LeaseHeld`` when another daemon holds this
        member's lease.
        """
        if address is not None:
            self.address = address
        sent = self.guard.now()
        await self.store.members.renew_lease(
            self.name, self.address, self.fingerprint, self.lease_seconds
        )
        self.guard.confirm(sent)
        self._update(await self.store.members.list_members(), announce=False)
        self.log.info(
            "joined the cluster as member {name} ({address}); lease {lease}s, "
            "{count} member(s) known",
            name=self.name,
            address=self.address,
            lease=self.lease_seconds,
            count=len(self.view.members),
        )
        loop = self._loop = LoopingCall(self._renew_logged)
        loop.clock = self.clock
        loop.start(self.interval, now=False)

    async def stop(self, give_up: bool = True) -> None:
        """Stop renewing and give up the lease: the others see this member unreachable at once.

        A store that refuses is logged (the lease then simply runs out).  With
        ``give_up`` false the lease is left to run out (a host fence keeps the
        VMs until then, for a daemon started again in time to take them over).
        """
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        if not give_up:
            return
        try:
            await self.store.members.give_up_lease(self.name, self.fingerprint)
        except Exception as e:
            self.log.warn(
                "could not give up the lease of member {name}: {error} (it runs out by itself)",
                name=self.name,
                error=e,
            )

    def _renew_logged(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._renew_once())

    async def _renew_once(self) -> None:
        try:
            await self.renew()
        except LeaseLost:
            return  # reported by renew(); the renewals stopped
        except Exception as e:
            if not self._failing:
                self.log.error(
                    "renewing the lease of cluster member {name} failed: {error}; "
                    "trying again every {interval:g}s",
                    name=self.name,
                    error=e,
                    interval=self.interval,
                )
            self._failing = True
            return
        if self._failing:
            self._failing = False
            self.log.info("renewed the lease of cluster member {name} again", name=self.name)

    async def renew(self) -> MembersView:
        """One renewal and read of the members, announcing who changed state; the new view.

        ``LeaseLost`` if another daemon holds the lease now: renewals stop, and
        ``lost`` fires with it.
        """
        await self.renew_lease()
        return await self.refresh()

    async def renew_lease(self) -> None:
        """Renew the lease alone (``guard`` asks it before a step on a VM); ``LeaseLost`` if
        another daemon holds it now: renewals stop, and ``lost`` fires with it."""
        sent = self.guard.now()
        try:
            await self.store.members.renew_held_lease(
                self.name, self.address, self.fingerprint, self.lease_seconds
            )
        except LeaseLost as e:
            self._lose(e)
            raise
        self.guard.confirm(sent)

    def _fenced(self, fenced: Fenced) -> None:
        """The store refused a write of this daemon: its name was taken over (or removed)."""
        if fenced.name == self.name:
            self._lose(LeaseLost(self.name, fenced.holder))

    def _lose(self, lost: LeaseLost) -> None:
        """The lease is another daemon's now: stop renewing it and acting, and say so (once)."""
        self.guard.revoke()
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        if self.lost.called:
            return
        self.log.error("{lost}", lost=str(lost))
        self.lost.callback(lost)

    async def refresh(self) -> MembersView:
        """Read the members again (without renewing), announcing who changed state."""
        self._update(await self.store.members.list_members(), announce=True)
        return self.view

    def _update(self, view: MembersView, announce: bool) -> None:
        before = self.view
        self.view, self._read_at = view, self.clock.seconds()
        own = view.find(self.name)
        if self._loop is not None and (own is None or own.fingerprint != self.fingerprint):
            # Another daemon holds this name now (or the row is gone): stop at once, not at
            # the next renewal.
            self._lose(LeaseLost(self.name, own))
            return
        if not announce:
            return
        for member in view.members:
            if member.name == self.name:
                continue
            state = member.state_at(view.now)
            previous = before.find(member.name)
            if previous is not None and previous.state_at(before.now) is state:
                continue
            if previous is None and state is MemberState.UNREACHABLE:
                # A row seen for the first time, already out of its lease: nothing changed.
                continue
            context = {
                "member": member.name,
                "address": member.address,
                "lease_expires_at": lease_time(member.lease_expires),
            }
            if state is MemberState.UNREACHABLE:
                self.log.warn(
                    "cluster member {member} ({address}) is unreachable: its lease ran out "
                    "at {at}",
                    member=member.name,
                    address=member.address,
                    at=context["lease_expires_at"],
                )
                self.events.server(MEMBER_UNREACHABLE, context)
            else:
                self.log.info(
                    "cluster member {member} ({address}) is online",
                    member=member.name,
                    address=member.address,
                )
                self.events.server(MEMBER_ONLINE, context)

    # -- what the view says -------------------------------------------------

    def store_now(self) -> float:
        """The store's clock now: the view's time carried forward on this daemon's clock."""
        return self.view.now + max(0.0, self.clock.seconds() - self._read_at)

    def current(self) -> MembersView:
        """The members as last read, judged at the store's time now (``store_now``)."""
        return MembersView(self.view.members, self.store_now(), self._instance_counts())

    def _instance_counts(self) -> dict[str, int]:
        # From the instances this daemon knows now: fresher than the last read's counts.
        counts = Counter(record.member for record in self.store.view.list_instances())
        return {member: count for member, count in counts.items() if member}

    def state_of(self, member: MemberRecord) -> MemberState:
        """Whether ``member`` holds its lease now; this member is always online to itself."""
        if member.name == self.name:
            return MemberState.ONLINE
        return member.state_at(self.store_now())

    def find(self, name: str) -> MemberRecord | None:
        """The member called ``name`` as last read, or None."""
        return self.view.find(name)

    def member_for_fingerprint(self, fingerprint: str) -> MemberRecord | None:
        """The member whose certificate has ``fingerprint`` (its client certificate too)."""
        for member in self.view.members:
            if member.fingerprint == fingerprint:
                return member
        return None

    def is_local(self, record: InstanceRecord) -> bool:
        """Whether this member runs ``record`` (or no member does: it predates the cluster)."""
        return record.member in ("", self.name)

    def owner(self, record: InstanceRecord) -> MemberRecord | None:
        """The member that runs ``record``; None: of no member, or of one not known."""
        if not record.member:
            return None
        return self.view.find(record.member)

    def is_unreachable(self, record: InstanceRecord) -> bool:
        """Whether ``record``'s member lost its lease, or is no member the store knows."""
        return self.unreachable_reason(record) is not None

    def unreachable_reason(self, record: InstanceRecord) -> str | None:
        """Why ``record``'s host cannot be reached now (``host unreachable: …``), or None."""
        if self.is_local(record):
            return None
        member = self.owner(record)
        if member is None:
            return f"host unreachable: member {record.member} is not a known cluster member"
        if self.state_of(member) is MemberState.ONLINE:
            return None
        return (
            f"host unreachable: member {member.name}'s lease ran out at "
            f"{lease_time(member.lease_expires)}"
        )

    def choose_target(self, requested: str | None) -> MemberRecord:
        """Where a new instance goes: the member named (404 unknown, 503 unreachable), else
        the online member running the fewest instances (503 if none is online)."""
        view = self.current()
        if requested is not None:
            member = view.find(requested)
            if member is None:
                known = ", ".join(m.name for m in view.members) or "none"
                raise NotFound(f"no cluster member is called {requested!r} (members: {known})")
            if self.state_of(member) is not MemberState.ONLINE:
                raise Unavailable(
                    f"cluster member {member.name} is unreachable: its lease ran out at "
                    f"{lease_time(member.lease_expires)}"
                )
            return member
        online = [m for m in view.members if self.state_of(m) is MemberState.ONLINE]
        if not online:
            raise Unavailable("no cluster member is online to launch the instance on")
        return min(online, key=lambda m: (view.instance_counts.get(m.name, 0), m.name))
