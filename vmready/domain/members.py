"""Cluster members: daemons sharing one store, each holding a lease it renews.

A member is one daemon: its name, the address of its members' mutual-TLS API,
the fingerprint of the server certificate it presents there, and when its
lease runs out.  A member whose lease ran out is *unreachable*: its instances'
state is unknown until it comes back.  A lease is held by the daemon whose
fingerprint its row carries: another daemon under the same name is refused
while it runs (``LeaseHeld``), and the holder whose name was taken over learns
it at its next renewal (``LeaseLost``) and stops.  No I/O here; the rules are
in docs/architecture.md.
"""

from __future__ import annotations

import datetime
import enum

import attrs

from vmready.domain.model import Unavailable

# How much of a holder's certificate fingerprint a refusal shows: enough to tell two apart.
_FINGERPRINT_SHOWN = 16


def lease_time(seconds: float) -> str:
    """A lease's end as the API and messages write times: RFC 3339 in UTC, to the second."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


class MemberState(enum.StrEnum):
    """Whether a member holds its lease."""

    ONLINE = "online"
    UNREACHABLE = "unreachable"


@attrs.frozen
class MemberRecord:
    """One member row as stored."""

    name: str
    # host:port of its mutual-TLS API (the remote operator API other members forward to).
    address: str
    # The SHA-256 fingerprint of the server certificate it presents there.
    fingerprint: str
    joined_at: float
    # When its lease runs out, on the store's clock.
    lease_expires: float
    # The fencing token: counts the joins of the name (each daemon start, each takeover).
    epoch: int = 0

    def state_at(self, now: float) -> MemberState:
        """Online while the lease holds, unreachable once it ran out."""
        return MemberState.ONLINE if now < self.lease_expires else MemberState.UNREACHABLE


@attrs.frozen
class MembersView:
    """Every member, as read at one moment of the store's clock, with its instance counts."""

    members: tuple[MemberRecord, ...]
    # The store's clock when it was read: leases are compared with it, not a host's clock.
    now: float
    instance_counts: dict[str, int] = attrs.field(factory=dict)

    def find(self, name: str) -> MemberRecord | None:
        """The member called name, or None."""
        for member in self.members:
            if member.name == name:
                return member
        return None

    def state_of(self, name: str) -> MemberState | None:
        """The state of member name, None if there is no such member."""
        member = self.find(name)
        return None if member is None else member.state_at(self.now)

    def online(self) -> list[MemberRecord]:
        """The members holding their lease, by name."""
        return sorted(
            (member for member in self.members if member.state_at(self.now) is MemberState.ONLINE),
            key=lambda member: member.name,
        )

    def least_loaded(self) -> MemberRecord | None:
        """The online member with the fewest instances (by name on a tie), None if none is."""
        online = self.online()
        if not online:
            return None
        return min(
            online, key=lambda member: (self.instance_counts.get(member.name, 0), member.name)
        )


def _holder(member: MemberRecord) -> str:
    """``at ADDRESS (certificate ab12…)``: which daemon holds a member's lease."""
    fingerprint = member.fingerprint
    shown = fingerprint[:_FINGERPRINT_SHOWN]
    if len(fingerprint) > _FINGERPRINT_SHOWN:
        shown += "…"
    address = member.address or "an address not yet known"
    return f"at {address} (certificate {shown})"


class LeaseHeld(Exception):
    """Joining as a member whose lease another daemon (another certificate) still holds."""

    def __init__(self, holder: MemberRecord) -> None:
        super().__init__(
            f"member name {holder.name} is held by another daemon {_holder(holder)} until "
            f"{lease_time(holder.lease_expires)}; give this daemon another --member-name, "
            "or stop that one"
        )
        self.holder = holder


class LeaseLost(Exception):
    """A renewal found this daemon's lease gone: taken over by another daemon, or removed.

    ``holder`` is the daemon that holds it now (None: the member's row is gone).
    """

    def __init__(self, name: str, holder: MemberRecord | None) -> None:
        if holder is None:
            told = f"member {name} is no longer in the store"
        else:
            told = (
                f"member name {name} was taken over by another daemon {_holder(holder)} "
                "after this daemon's lease ran out"
            )
        super().__init__(f"{told}; stopping: its instances are not this daemon's any more")
        self.name = name
        self.holder = holder


class Fenced(Unavailable):
    """The store refused a write made under a lease epoch the member's row has moved past.

    Every write of a cluster member checks, in its own transaction, that the
    member's row still has the epoch this daemon joined with: a daemon that
    was frozen while another took its name over learns it at its first
    write, and nothing it writes is kept.  ``holder``: the row now (None: gone).
    """

    def __init__(self, name: str, epoch: int, holder: MemberRecord | None) -> None:
        if holder is None:
            told = f"member {name} is no longer in the store"
        else:
            told = (
                f"member name {name} was taken over by another daemon {_holder(holder)} "
                f"(lease epoch {holder.epoch}; this daemon joined at epoch {epoch})"
            )
        super().__init__(f"the store refused this daemon's write: {told}")
        self.name = name
        self.epoch = epoch
        self.holder = holder


class ActingRefused(Unavailable):
    """A step on a VM refused: this daemon's lease may have run out and no renewal confirms it.

    A daemon acts on its member's instances only while its lease surely holds
    (confirmed less than a lease ago, on its own clock): one woken from a
    freeze, or cut off from the store, might act on instances another daemon
    holds by then.  ``reason`` says why the lease could not be confirmed.
    """

    def __init__(self, vm: str, what: str, name: str, reason: str) -> None:
        super().__init__(f"not acting on VM {vm} ({what}): the lease of member {name} {reason}")
        self.vm = vm
        self.what = what
        self.name = name


class MemberRetired(Exception):
    """Joining under a name ``cluster remove`` retired: a name is never silently reused."""

    def __init__(self, name: str, retired_at: float) -> None:
        super().__init__(
            f"member name {name} was retired at {lease_time(retired_at)} "
            "('vmready cluster remove'); a retired name is not reused: give this daemon "
            "another --member-name"
        )
        self.name = name
