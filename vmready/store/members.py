"""Cluster members: each daemon's row, its lease, and the instances each one runs."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from vmready.domain.members import MemberRecord, MemberState, MembersView
from vmready.domain.model import Conflict, NotFound
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

    def remove_member(self, name: str) -> MemberRecord:
        """Retire member ``name``: its row goes (and with it its certificate's trust).

        Refused while its lease holds (Conflict: it may be serving, and would
        join again at its next renewal) or while instances are still stamped
        with it (Conflict: they would belong to nobody, and vmready cannot move
        them); NotFound for a member the store does not have.  Judged on the
        store's clock, in the transaction that deletes, the row locked: a
        renewal racing the removal waits for it.
        """
        with self._database.transaction():
            db = self._database.db
            row = db.execute(
                f"SELECT {_MEMBER_COLUMNS} FROM members WHERE name = ?{self._database.LOCK_ROWS}",
                (name,),
            ).fetchone()
            if row is None:
                known = [r[0] for r in db.execute("SELECT name FROM members ORDER BY name")]
                raise NotFound(
                    f"no cluster member is called {name!r} (members: {', '.join(known) or 'none'})"
                )
            member = _member(row)
            if member.state_at(self._database.now()) is MemberState.ONLINE:
                raise Conflict(
                    f"cluster member {name} is online (its lease runs until "
                    f"{_utc(member.lease_expires)}): stop its daemon first, then remove it"
                )
            (count,) = db.execute(
                "SELECT COUNT(*) FROM instances WHERE member = ?", (name,)
            ).fetchone()
            if count:
                noun = "instance" if count == 1 else "instances"
                raise Conflict(
                    f"cluster member {name} still has {count} {noun}: start it again and "
                    f"delete them first (vmready cannot move instances to another member)"
                )
            db.execute("DELETE FROM members WHERE name = ?", (name,))
        return member

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


def _member(row: Sequence[Any]) -> MemberRecord:
    return MemberRecord(
        name=row[0],
        address=row[1],
        fingerprint=row[2],
        joined_at=float(row[3]),
        lease_expires=float(row[4]),
    )


def _utc(seconds: float) -> str:
    """RFC 3339 in UTC, to the second (as the API writes lease times)."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
