"""Whether a cluster member's lease is still known to hold, on this daemon's own clock.

The store grants a lease of ``lease_seconds`` from the moment it commits a
renewal, which is after this daemon sent it: a lease confirmed by a renewal
sent at ``t`` (this daemon's monotonic clock) holds at least until
``t + lease_seconds``.  Past that, another daemon may have taken the name
over, and this one must not act on the member's instances until a renewal
confirms the lease again (``before_acting``, which the hypervisor driver asks
before each step that changes a VM).  ``may_act`` is the rule, without I/O;
the clock is a function, ``task.Clock().seconds`` in tests.  With a host
fence (``twistd vmready --fence vms``) the daemon stops acting ``margin``
seconds before that, when the fence kills its VMs (``until``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from twisted.internet.defer import DeferredLock
from twisted.logger import Logger

from vmready.domain import ActingRefused, LeaseLost


class LeaseGuard:
    """When member ``name``'s lease was last confirmed, and whether this daemon may act now.

    ``renew`` renews the lease (``Membership.renew_lease``, one store write:
    LeaseLost when another daemon holds it now); a successful renewal calls
    ``confirm``.  A renewal answered more than a lease after it was sent
    confirms nothing (the store's lease may have run out since it committed):
    the step is refused.
    """

    log = Logger()

    def __init__(
        self,
        name: str,
        lease_seconds: float,
        now: Callable[[], float],
        renew: Callable[[], Awaitable[object]],
        margin: float = 0.0,
    ) -> None:
        self.name = name
        self.lease_seconds = lease_seconds
        # Seconds before the lease's end from which nothing acts (a host fence kills then).
        self.margin = margin
        self.now = now
        self._renew = renew
        # This clock's time when the last renewal that succeeded was sent (None: never, or
        # the lease was lost).
        self.confirmed_at: float | None = None
        self.lost = False
        # One renewal at a time for the steps waiting on it: the others find it done.
        self._renewing = DeferredLock()
        # Told of every confirmation and of the loss (``watch``).
        self._on_confirmed: list[Callable[[], None]] = []
        self._on_revoked: list[Callable[[], None]] = []

    def watch(self, confirmed: Callable[[], None], revoked: Callable[[], None]) -> None:
        """Call ``confirmed`` after each successful renewal, ``revoked`` once the lease is lost."""
        self._on_confirmed.append(confirmed)
        self._on_revoked.append(revoked)

    def confirm(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (``now()`` before sending) succeeded."""
        if self.lost:
            return
        if self.confirmed_at is None or sent_at > self.confirmed_at:
            self.confirmed_at = sent_at
        for confirmed in list(self._on_confirmed):
            confirmed()

    def revoke(self) -> None:
        """The lease is lost: no step may run any more, whatever a late renewal says."""
        was_lost, self.lost = self.lost, True
        self.confirmed_at = None
        if not was_lost:
            for revoked in list(self._on_revoked):
                revoked()

    def until(self) -> float | None:
        """Until when (this clock) steps may run: a lease after the last confirmed renewal was
        sent, less the margin; None if never confirmed, or lost."""
        if self.confirmed_at is None:
            return None
        return self.confirmed_at + self.lease_seconds - self.margin

    def may_act(self) -> bool:
        """Whether the lease surely still holds: confirmed less than its length ago."""
        until = self.until()
        return until is not None and self.now() < until

    def since(self) -> str:
        """How long ago the lease was last confirmed, in words."""
        if self.confirmed_at is None:
            return "never confirmed"
        return f"last confirmed {self.now() - self.confirmed_at:.1f}s ago"

    async def before_acting(self, vm: str, what: str) -> None:
        """Return once this daemon may do ``what`` to VM ``vm``: its lease surely holds.

        Past a lease length since the last confirmed renewal (a daemon woken
        from a freeze, a store out of reach) the lease is renewed first;
        ``ActingRefused`` if that finds it lost (the membership's ``lost``
        fires: the daemon stops) or fails.  Steps waiting at once share one renewal.
        """
        if self.may_act():
            return
        await self._renewing.acquire()
        try:
            await self._renew_before(vm, what)
        finally:
            self._renewing.release()

    async def _renew_before(self, vm: str, what: str) -> None:
        if self.may_act():
            return  # renewed while this step waited for the renewal in flight
        if self.lost:
            raise ActingRefused(vm, what, self.name, "was lost")
        since = self.since()
        self.log.warn(
            "the lease of member {name} was {since} (lease {lease:g}s): renewing it "
            "before {what} on VM {vm}",
            name=self.name,
            since=since,
            lease=self.lease_seconds,
            what=what,
            vm=vm,
        )
        try:
            await self._renew()
        except LeaseLost as e:
            raise ActingRefused(vm, what, self.name, f"was lost: {e}") from e
        except Exception as e:
            raise ActingRefused(
                vm,
                what,
                self.name,
                f"may have run out ({since}, lease {self.lease_seconds:g}s) and renewing "
                f"it failed: {e}",
            ) from e
        if not self.may_act():
            raise ActingRefused(vm, what, self.name, "was renewed too late to be sure it holds")
