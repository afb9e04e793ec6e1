"""Cluster members: each daemon's row, its lease, and the instances each one runs.

A row is held by one daemon, known by its certificate's fingerprint: joining
(``renew_lease``) is refused while another daemon's lease runs, and a later
renewal (``renew_held_lease``) renews only a lease this daemon still holds.

Each join bumps the row's ``epoch`` (the fencing token) and fences the
joining connection with it (``Database.fence``): every later write of that
daemon checks, in its own transaction, that the row still has that epoch,
so a daemon frozen while another took its name over can write nothing once
it wakes, not even before its next renewal.  A name ``remove_member``
retired is kept (``retired_members``) and never joined again.
"""

from __future__ import annotations

import datetime

from vmready.domain import (
    Conflict,
    LeaseHeld,
    LeaseLost,
    MemberRecord,
    MemberRetired,
    MemberState,
    MembersView,
    NotFound,
)
from vmready.store.database import MEMBER_COLUMNS, member_from_row
from vmready.store.notifications import EVENTS_CHANNEL, MAX_PAYLOAD_BYTES
from vmready.store.table import M, Table, operation


class Members(Table[M]):
    """The ``members`` table."""

    @operation
    def renew_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> float:
        """Join as member ``name`` (or come back as it); return when the lease now runs out.

        The daemon is known by its certificate's ``fingerprint``: the row's
        own daemon renews (at a new address too, if it moved); another daemon
        is refused with ``LeaseHeld`` while the lease runs, and takes the name
        over (its row, and so its instances) once it ran out or was given up:
        a host reinstalled with a new certificate keeps its name.
        """
        with self._database.transaction(fenced=False):
            self._refuse_retired(name)
            now = self._database.now()
            expires = now + lease_seconds
            inserted = self._database.db.execute(
                f"INSERT INTO members ({MEMBER_COLUMNS}) VALUES (?, ?, ?, ?, ?, 1)"
                " ON CONFLICT (name) DO NOTHING",
                (name, address, fingerprint, now, expires),
            )
            if inserted.rowcount == 1:
                epoch = 1
            else:
                # Another daemon joining as ``name`` at once waits here until this one commits.
                holder = self._find(name, lock=True)
                assert holder is not None  # the row the INSERT conflicted with, locked now
                ours = holder.fingerprint == fingerprint
                if not ours and holder.state_at(now) is MemberState.ONLINE:
                    raise LeaseHeld(holder)
                # The same daemon started again keeps its joined_at; another takes the name over.
                joined = holder.joined_at if ours else now
                epoch = holder.epoch + 1
                self._database.db.execute(
                    "UPDATE members SET address = ?, fingerprint = ?, joined_at = ?,"
                    " lease_expires = ?, epoch = ? WHERE name = ?",
                    (address, fingerprint, joined, expires, epoch, name),
                )
        self._database.fence = (name, epoch)
        return expires

    @operation
    def check_join(self, name: str, fingerprint: str) -> None:
        """``LeaseHeld`` if joining as ``name`` with ``fingerprint`` would be refused now.

        A check before a daemon starts (``renew_lease`` decides when it joins).
        """
        with self._database.transaction(immediate=False):
            self._refuse_retired(name)
            now = self._database.now()
            holder = self._find(name)
        if (
            holder is not None
            and holder.fingerprint != fingerprint
            and holder.state_at(now) is MemberState.ONLINE
        ):
            raise LeaseHeld(holder)

    @operation
    def renew_held_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> float:
        """Renew the lease this daemon holds (it joined); when it now runs out.

        Only while the row is still this daemon's (its ``fingerprint``): a
        lease that ran out is renewed if nobody took the name over meanwhile,
        and ``LeaseLost`` says who did (or that the row is gone).
        """
        fence = self._database.fence
        epoch = fence[1] if fence is not None and fence[0] == name else None
        with self._database.transaction(fenced=False):
            now = self._database.now()
            expires = now + lease_seconds
            # Only the lease this connection joined (when it did join: ``fence``).
            same_join = "" if epoch is None else f" AND epoch = {int(epoch)}"
            renewed = self._database.db.execute(
                "UPDATE members SET address = ?, lease_expires = ?"
                f" WHERE name = ? AND fingerprint = ?{same_join}",
                (address, expires, name, fingerprint),
            )
            if renewed.rowcount != 1:
                raise LeaseLost(name, self._find(name))
        return expires

    @operation
    def give_up_lease(self, name: str, fingerprint: str) -> None:
        """Member ``name`` stops cleanly: its lease ends now (its row and instances stay).

        Only the daemon holding it (``fingerprint``) gives it up: one whose
        name was taken over leaves the new holder's lease alone.
        """
        with self._database.transaction(fenced=False):
            self._database.db.execute(
                "UPDATE members SET lease_expires = ? WHERE name = ? AND fingerprint = ?",
                (self._database.now(), name, fingerprint),
            )

    @operation
    def publish_event(self, payload: str) -> None:
        """Tell every member listening on ``vmready_events`` (at commit); PostgreSQL only.

        ValueError for a payload PostgreSQL would refuse (7,900 bytes and over);
        NotImplementedError on SQLite, whose store has one daemon: nobody to tell.
        """
        size = len(payload.encode())
        if self._database.NOTIFIES and size > MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"an event of {size} bytes is too large to publish (at most {MAX_PAYLOAD_BYTES})"
            )
        self._database.notify(EVENTS_CHANNEL, payload)

    def _refuse_retired(self, name: str) -> None:
        """``MemberRetired`` if ``remove_member`` retired the name."""
        row = self._database.db.execute(
            "SELECT retired_at FROM retired_members WHERE name = ?", (name,)
        ).fetchone()
        if row is not None:
            raise MemberRetired(name, float(row[0]))

    def _find(self, name: str, lock: bool = False) -> MemberRecord | None:
        """Member ``name``'s row (``lock``: this transaction goes on to write it), or None."""
        row = self._database.db.execute(
            f"SELECT {MEMBER_COLUMNS} FROM members WHERE name = ?"
            f"{self._database.LOCK_ROWS if lock else ''}",
            (name,),
        ).fetchone()
        return None if row is None else member_from_row(row)

    @operation
    def remove_member(self, name: str) -> MemberRecord:
        """Retire member ``name``: its row goes (and with it its certificate's trust), its
        name is kept as retired (never joined again).

        Refused while its lease holds (Conflict: it may be serving, and would
        join again at its next renewal) or while instances are still stamped
        with it (Conflict: they would belong to nobody, and vmready cannot move
        them); NotFound for a member the store does not have.  Judged on the
        store's clock, in the transaction that deletes, the row locked: a
        renewal racing the removal waits for it.
        """
        with self._database.transaction(fenced=False):
            db = self._database.db
            row = db.execute(
                f"SELECT {MEMBER_COLUMNS} FROM members WHERE name = ?{self._database.LOCK_ROWS}",
                (name,),
            ).fetchone()
            if row is None:
                known = [r[0] for r in db.execute("SELECT name FROM members ORDER BY name")]
                raise NotFound(
                    f"no cluster member is called {name!r} (members: {', '.join(known) or 'none'})"
                )
            member = member_from_row(row)
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
            db.execute(
                "INSERT INTO retired_members (name, fingerprint, retired_at) VALUES (?, ?, ?)",
                (name, member.fingerprint, self._database.now()),
            )
        return member

    @operation
    def list_members(self) -> MembersView:
        """Every member and how many instances each runs, at one moment of the store's clock."""
        with self._database.transaction(immediate=False):
            now = self._database.now()
            rows = self._database.db.execute(
                f"SELECT {MEMBER_COLUMNS} FROM members ORDER BY name"
            ).fetchall()
            counts = {
                row[0]: int(row[1])
                for row in self._database.db.execute(
                    "SELECT member, COUNT(*) FROM instances GROUP BY member"
                )
            }
        return MembersView(tuple(member_from_row(row) for row in rows), now, counts)


def _utc(seconds: float) -> str:
    """RFC 3339 in UTC, to the second (as the API writes lease times)."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
