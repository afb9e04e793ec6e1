"""The daemon as a cluster member: hearing the others, its lease, its events relayed.

Only a daemon with ``--member-name`` has one.  It hears the other members
(LISTEN) before anything else (``hear``), so no write of another member's
after the store was first read goes unheard; it becomes a member before its
APIs serve (``become``: the remote API trusts the others through the
membership), and takes its lease once its remote API is bound (``join``).
With a host fence (``--fence vms``) the fence starts once the lease is
taken, is told of each renewal and of the loss, and is left holding on a
clean stop, which then does not give the lease up (``daemon.hostfence``).
"""

from __future__ import annotations

import time

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger

from vmready.api import TrustRegistry
from vmready.daemon.clusteroptions import bound_member_address
from vmready.daemon.hostfence import HostFence
from vmready.daemon.rereads import Reread
from vmready.domain import IVMReadyReactor, LeaseHeld, LeaseLost, MemberRetired
from vmready.fence import fence_margin
from vmready.lifecycle import CHANNELS, EventBus, EventRelay, Membership, OwnViews
from vmready.store import MEMBERS_CHANNEL, TRUST_CHANNEL, AsyncStore, NotificationListener


class ClusterMember:
    """Member ``name`` of the cluster sharing the store at ``store_location``."""

    log = Logger()

    def __init__(
        self,
        reactor: IVMReadyReactor,
        store: AsyncStore,
        store_location: str,
        events: EventBus,
        trust: TrustRegistry,
        name: str,
        fence: HostFence | None = None,
    ) -> None:
        self.reactor = reactor
        # Kills this member's VMs once its lease may have run out (None: no host fence).
        self.fence = fence
        self.store = store
        self.events = events
        self.trust = trust
        # The trust store read again when told, and again until a read succeeds.
        self.trust_reads = Reread(reactor, trust.refresh, "the trusted certificates")
        self.name = name
        # Events go out at the end of their turn, each with its instance's view then.
        self.relay = EventRelay(events, store, name, lambda send: reactor.callLater(0, send))
        self.listener = NotificationListener(
            reactor,
            store_location,
            (*CHANNELS, MEMBERS_CHANNEL, TRUST_CHANNEL),
            self._notified,
            self._resync,
        )
        self.membership: Membership | None = None
        # What only this member knows of its instances (set once the lifecycle is built);
        # told the others with its events only while it holds its lease.
        self.own_views: OwnViews | None = None
        # Whether this member holds its lease (given up on a clean stop).
        self._joined = False
        self._listening: Deferred[None] | None = None

    def hear(self) -> None:
        """Hear the others (LISTEN) from now on, and tell them this member's events.

        Once LISTEN is in effect every row is read again (``join`` waits for it).
        """
        self.relay.start()
        store = self.store
        self._listening = self.listener.start().addCallback(lambda _: store.reload_instances())
        # Hearing the others from now on, this member asks for their instances' views.
        self._listening.addCallback(lambda _: self.relay.ask_views())

    def become(self, address: str, fingerprint: str, lease_seconds: float) -> Membership:
        """This member's membership, before its APIs serve (``address``: "" until bound)."""
        self.membership = Membership(
            self.name,
            address,
            fingerprint,
            self.store,
            self.events,
            self.reactor,
            lease_seconds,
            # The lease is timed for acting on this host's own clock, which never jumps.
            monotonic=time.monotonic,
            # With a fence, nothing acts once the fence may kill.
            acting_margin=fence_margin(lease_seconds) if self.fence is not None else 0.0,
        )
        return self.membership

    async def join(self, https_address: str, bound: IListeningPort | None) -> Deferred[LeaseLost]:
        """Hear the others, then take this member's lease; raises (and logs) what refused it.

        Its address is ``--member-address``, else ``https_address`` as
        ``bound`` (the remote API) listens.  ``LeaseHeld``: another daemon is
        this member; ``MemberRetired``: the name was retired.  Returns what fires
        if the lease is lost later.
        """
        membership = self.membership
        assert membership is not None and self._listening is not None
        address = None
        if not membership.address:
            assert bound is not None
            host = bound.getHost()
            assert isinstance(host, IPv4Address | IPv6Address)
            address = bound_member_address(https_address, host.port)
        try:
            await self._listening
            await membership.start(address)
        except (LeaseHeld, MemberRetired) as e:
            # Another daemon is this member, or the name is retired: one line, touching nothing.
            self.log.error("{refusal}; stopping", refusal=str(e))
            raise
        except Exception as e:
            self.log.error(
                "cannot join the cluster as member {member} on {store}: {error}; stopping",
                member=self.name,
                store=self.store.engine.path,
                error=e,
            )
            raise
        self._joined = True
        # Its agents' links start over with the daemon: what it told before is replaced.
        self.relay.own = self.own_views
        self.relay.send_views()
        if self.fence is not None:
            self._fence(membership, self.fence)
        return membership.lost.addCallback(self._lost)

    def _fence(self, membership: Membership, fence: HostFence) -> None:
        """Start the host fence at the lease just taken; tell it of each renewal, and the loss."""
        guard = membership.guard
        until = guard.until()
        assert until is not None  # the lease was just confirmed
        fence.start(until)
        guard.watch(lambda: fence.hold(guard.until()), fence.lose)

    def _lost(self, lost: LeaseLost) -> LeaseLost:
        """Another daemon holds this member's lease now: it is not this one's to give up,
        and what it knows of the instances is not theirs to hear."""
        self._joined = False
        self.relay.own = None
        return lost

    async def stop(self) -> None:
        """Relay no more, give the lease up (the others see this member gone at once), unhear.

        A fenced member leaves its lease to run out and its fence holding, so
        that its VMs outlive a restart that comes in time.
        """
        self.relay.stop()
        self.trust_reads.stop()
        fenced = self.fence is not None
        if self.membership is not None and self._joined:
            # A fenced member's lease runs out by itself: its fence keeps the VMs until then.
            await self.membership.stop(give_up=not fenced)
        if self.fence is not None:
            self.fence.leave()
        await self.listener.stop()

    def _notified(self, channel: str, payload: str) -> None:
        """A notification: members or trust changed, or the relay's (rows, events)."""
        if channel == MEMBERS_CHANNEL:
            self._members_changed()
        elif channel == TRUST_CHANNEL:
            self._trust_changed()
        else:
            self.relay.deliver(channel, payload)

    def _resync(self) -> None:
        """The listener was cut off and is back: whatever it missed is read again."""
        self.relay.resync()
        self._members_changed()
        self._trust_changed()

    def _trust_changed(self) -> None:
        """A client certificate was trusted or removed (maybe through another member): read
        the trust store now; one gone is revoked here too (its requests end)."""
        self.trust_reads.now()

    def _members_changed(self) -> None:
        """A member joined, came back, moved or left: read the members now, not at renewal."""
        membership = self.membership
        if membership is None or not self._joined:
            return
        Deferred.fromCoroutine(membership.refresh()).addErrback(
            lambda failure: self.log.warn(
                "cannot read the cluster's members again: {error}",
                error=failure.getErrorMessage(),
            )
        )
