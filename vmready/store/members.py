"""Cluster members: each daemon's row, its lease, and the instances each one runs."""

from __future__ import annotations

from vmready.domain.members import MemberRecord, MembersView
from vmready.store.database import Database

__all__ = ["Members"]

_MEMBER_COLUMNS = "name, address, fingerprint, joined_at, lease_expires"


class Members:
    """The ``members`` table."""

    def __init__(self, database: Database) -> None:
        self._database = database

    def renew_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> float:
        """Join as member ``name`` or renew its lease; return when the lease now runs out.

        The address and fingerprint are written each time: a member that comes
        back on another address, or with a new certificate, is found there.
        """
        with self._database.transaction():
            now = self._database.now()
            expires = now + lease_seconds
            self._database.db.execute(
                f"INSERT INTO members ({_MEMBER_COLUMNS}) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET address = excluded.address,"
                " fingerprint = excluded.fingerprint, lease_expires = excluded.lease_expires",
                (name, address, fingerprint, now, expires),
            )
        return expires

    def give_up_lease(self, name: str) -> None:
        """Member ``name`` stops cleanly: its lease ends now (its row and instances stay)."""
        with self._database.transaction():
            self._database.db.execute(
                "UPDATE members SET lease_expires = ? WHERE name = ?",
                (self._database.now(), name),
            )

    def remove_member(self, name: str) -> None:
        """Forget member ``name`` (it must run no instance any more)."""
        with self._database.transaction():
            self._database.db.execute("DELETE FROM members WHERE name = ?", (name,))

    def list_members(self) -> MembersView:
        """Every member and how many instances each runs, at one moment of the store's clock."""
        with self._database.transaction(immediate=False):
            now = self._database.now()
            rows = self._database.db.execute(
                f"SELECT {_MEMBER_COLUMNS} FROM members ORDER BY name"
            ).fetchall()
            counts = {
                row[0]: int(row[1])
                for row in self._database.db.execute(
                    "SELECT member, COUNT(*) FROM instances GROUP BY member"
                )
            }
        members = tuple(
            MemberRecord(
                name=row[0],
                address=row[1],
                fingerprint=row[2],
                joined_at=float(row[3]),
                lease_expires=float(row[4]),
            )
            for row in rows
        )
        return MembersView(members, now, counts)
