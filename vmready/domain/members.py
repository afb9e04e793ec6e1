"""Cluster members: daemons sharing one store, each holding a lease it renews.

A member is one daemon: its name, the address of its members' mutual-TLS API,
the SHA-256 fingerprint of the server certificate it presents there, and the
time its lease runs out.  The store keeps the members (``store.members``); the
lease is renewed by the member itself.  A member whose lease has run out is
*unreachable*: its instances are not lost and not stopped, their state is
unknown until it comes back.  No I/O here.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["MemberRecord", "MemberState", "MembersView"]


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
