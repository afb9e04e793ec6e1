"""The connection the store's tables share: transactions, the clock, instance rows by name.

Synchronous on purpose: the engine, run on the store's one database thread
(``store.executor``).  Inside a ``batch`` each call and each transaction is a
SAVEPOINT, undone alone.  The tables run on SQLite and PostgreSQL with one SQL
text; what the engines do differently (how a write transaction begins and
locks the row it reads, inserted ids, the ready key's JSON, the leases'
clock) is in ``Database``'s subclasses, ``SQLiteDatabase`` here and
``store.postgres.PostgresDatabase``.  Inside ``recording()`` each write of an
instance row or agent certificate notes its change (``record``), forgotten if
its savepoint is undone, for the committed view in memory.
"""

from __future__ import annotations

import abc
import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from vmready.domain import (
    Fenced,
    InstanceRecord,
    MemberRecord,
    NotFound,
    PowerState,
    StoreError,
    TaskState,
    VMState,
)

MEMBER_COLUMNS = "name, address, fingerprint, joined_at, lease_expires, epoch"
INSTANCE_COLUMNS = (
    "name, uuid, vm_state, task_state, power_state, config, devices, error, created_at,"
    " updated_at, member"
)


class TransactionLost(StoreError):
    """SQLite rolled a whole batch back by itself: none of its calls was kept."""


class CommitUnknown(StoreError):
    """The connection was lost while the server answered COMMIT: it may have committed.

    Not a write failure to try again (that could apply the change twice), and
    not "nothing kept": whoever keeps rows in memory must read them again.
    """


class Cursor(Protocol):
    """What the tables read of a statement's result (``sqlite3.Cursor``, psycopg's)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What the tables use of a connection: ``sqlite3.Connection`` or ``PostgresConnection``.

    Rows are read by position (both engines' rows index by number).
    """

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor: ...

    def close(self) -> None: ...


class InstanceRows(Protocol):
    """What is told of each change a call made to the instance rows (once it committed)."""

    def committed(self, record: InstanceRecord) -> None:
        """The row now stands as ``record``."""

    def removed(self, name: str) -> None:
        """The row is gone (and its agent certificate with it)."""

    def renamed(self, old_name: str, record: InstanceRecord) -> None:
        """The row called ``old_name`` is now ``record`` (its certificate moved with it)."""

    def certified(self, name: str, fingerprint: str) -> None:
        """The instance's agent now has this certificate (and no other)."""

    def ready_cleared(self, names: list[str], stamp: float) -> None:
        """These rows lost their ready key at ``stamp``."""


# One change to the instance rows, told to whoever keeps them (InstanceRows).
Change = Callable[[InstanceRows], None]


class Database(abc.ABC):
    """One open connection, what its engine does differently, and the clock of its rows.

    Abstract: ``SQLiteDatabase`` and ``store.postgres.PostgresDatabase`` say
    how their engine returns new ids and reads and edits the config's JSON.
    """

    # "sqlite" or "postgresql".
    engine_name: ClassVar[str]
    # How a transaction that writes begins.
    BEGIN_WRITE: ClassVar[str] = "BEGIN"
    # How a transaction that only reads begins (one snapshot for all its statements).
    BEGIN_READ: ClassVar[str] = "BEGIN"
    # Appended to a SELECT whose rows the transaction goes on to write.
    LOCK_ROWS: ClassVar[str] = ""
    # What the engine raises for a violated constraint (UNIQUE, FOREIGN KEY).
    integrity_errors: ClassVar[tuple[type[Exception], ...]] = ()
    # Whether other daemons hear of its changes (NOTIFY, store.notifications).
    NOTIFIES: ClassVar[bool] = False

    def __init__(self, connection: Connection, clock: Callable[[], float]) -> None:
        self.db = connection
        self.clock = clock
        # How deep in savepoints we are; 0: no batch, each transaction is its own.
        self._depth = 0
        # While recording(): the changes to the instance rows noted so far.
        self._changes: list[Change] | None = None
        # The member this connection writes as and the lease epoch it joined at (set by
        # its join, ``Members.renew_lease``): every write checks it (``check_fence``).
        self.fence: tuple[str, int] | None = None

    def close(self) -> None:
        """Close the database connection."""
        self.db.close()

    @contextlib.contextmanager
    def transaction(self, immediate: bool = True, fenced: bool = True) -> Iterator[None]:
        """One transaction; IMMEDIATE takes the write lock first so reads see what is written.

        Inside a batch it is a savepoint: atomic, committed with the batch.  A
        write (``immediate``) of a member checks its fence first (``fenced``;
        only the lease's own writes do not).
        """
        if self._depth:
            with self.savepoint():
                if immediate and fenced:
                    self.check_fence()
                yield
            return
        self.db.execute(self.BEGIN_WRITE if immediate else self.BEGIN_READ)
        noted = self._noted()
        try:
            if immediate and fenced:
                self.check_fence()
            yield
            self.commit()
        except BaseException:
            self._forget_since(noted)
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Many calls in one transaction, committed (one fsync) when the block ends."""
        self.db.execute(self.BEGIN_WRITE)
        self._depth = 1
        try:
            yield
            self.commit()
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        finally:
            self._depth = 0

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """One call (or transaction) of a batch: undone alone if it raises.

        Unless SQLite ended the whole transaction itself (a full disk, an I/O
        error): then nothing of the batch was kept, and ``TransactionLost`` says
        so, for the batch to end there rather than run its next calls unguarded.
        """
        name = f"call{self._depth}"
        self.db.execute(f"SAVEPOINT {name}")
        self._depth += 1
        noted = self._noted()
        try:
            yield
        except BaseException as e:
            self._forget_since(noted)
            if not self.db.in_transaction:
                raise TransactionLost(f"the store's transaction was rolled back: {e}") from e
            self.db.execute(f"ROLLBACK TO {name}")
            self.db.execute(f"RELEASE {name}")
            raise
        else:
            self.db.execute(f"RELEASE {name}")
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Change]]:
        """Note what the calls inside change of the instance rows, in order, into the list."""
        changes: list[Change] = []
        self._changes = changes
        try:
            yield changes
        finally:
            self._changes = None

    def record(self, change: Change) -> None:
        """A write's change to the instance rows, noted while ``recording()``."""
        if self._changes is not None:
            self._changes.append(change)

    def _noted(self) -> int:
        return 0 if self._changes is None else len(self._changes)

    def _forget_since(self, noted: int) -> None:
        """What was rolled back changed nothing."""
        if self._changes is not None:
            del self._changes[noted:]

    def check_fence(self) -> None:
        """``Fenced`` unless this member's row still has the epoch it joined at.

        Inside the write's transaction, the row locked (``LOCK_ROWS``; SQLite's
        writers are serialised anyway): a takeover waits until this write
        commits, and a write after a takeover sees it and is refused.
        """
        if self.fence is None:
            return
        name, epoch = self.fence
        row = self.db.execute(
            f"SELECT {MEMBER_COLUMNS} FROM members WHERE name = ?{self.LOCK_ROWS}", (name,)
        ).fetchone()
        holder = None if row is None else member_from_row(row)
        if holder is None or holder.epoch != epoch:
            raise Fenced(name, epoch, holder)

    def commit(self) -> None:
        """End the open transaction, keeping it.

        SQLite's outcome is always known (the file is here); PostgreSQL's is
        not when the connection is lost during COMMIT (``CommitUnknown``).
        """
        self.db.execute("COMMIT")

    def now(self) -> float:
        """The store's clock: what leases are stamped and compared with.

        SQLite's store is on one host, so its clock is the daemon's.
        """
        return self.clock()

    def find_instance(self, name: str, lock: bool = False) -> InstanceRecord | None:
        """The instance called name, or None.

        ``lock``: the transaction goes on to write the row from what it read;
        on PostgreSQL another writer of the row waits until it commits.
        """
        row = self.db.execute(
            f"SELECT {INSTANCE_COLUMNS} FROM instances WHERE name = ?"
            f"{self.LOCK_ROWS if lock else ''}",
            (name,),
        ).fetchone()
        return None if row is None else instance_from_row(row)

    def get_instance(self, name: str, lock: bool = False) -> InstanceRecord:
        """The instance called name, or NotFound (``lock``: as ``find_instance``)."""
        record = self.find_instance(name, lock)
        if record is None:
            raise instance_not_found(name)
        return record

    def notify(self, channel: str, payload: str) -> None:
        """Tell every member listening on ``channel`` (at commit); PostgreSQL only.

        NotImplementedError on SQLite, whose store has one daemon: nobody to tell.
        """
        raise NotImplementedError(f"the {self.engine_name} store has no other members")

    @abc.abstractmethod
    def insert(self, sql: str, parameters: Sequence[Any]) -> int:
        """Run an INSERT into a table with an ``id`` column; the new row's id."""

    @abc.abstractmethod
    def has_key(self, key: str) -> tuple[str, str]:
        """An SQL condition (with one ``?``) true where the config has ``key``; its value."""

    @abc.abstractmethod
    def without_key(self, key: str) -> tuple[str, str]:
        """An SQL expression (with one ``?``): the config without ``key``; its value."""


class SQLiteDatabase(Database):
    """SQLite: IMMEDIATE transactions serialise writers; its JSON functions on config text."""

    engine_name = "sqlite"
    BEGIN_WRITE = "BEGIN IMMEDIATE"
    BEGIN_READ = "BEGIN"
    integrity_errors = (sqlite3.IntegrityError,)

    def insert(self, sql: str, parameters: Sequence[Any]) -> int:
        row_id = self.db.execute(sql, parameters).lastrowid  # type: ignore[attr-defined]  # sqlite3's cursor has it
        assert row_id is not None, "an INSERT always sets lastrowid"
        return int(row_id)

    def has_key(self, key: str) -> tuple[str, str]:
        return "json_extract(config, ?) IS NOT NULL", f'$."{key}"'

    def without_key(self, key: str) -> tuple[str, str]:
        return "json_remove(config, ?)", f'$."{key}"'


def instance_from_row(row: Sequence[Any]) -> InstanceRecord:
    """The record of a row of ``INSTANCE_COLUMNS``, by position (a start reads 10,000)."""
    (
        name,
        uuid,
        vm_state,
        task_state,
        power_state,
        config,
        devices,
        error,
        created,
        updated,
        member,
    ) = row
    return InstanceRecord(
        name=name,
        uuid=uuid,
        vm_state=VMState(vm_state),
        task_state=None if task_state is None else TaskState(task_state),
        power_state=PowerState(power_state),
        config=json.loads(config),
        devices={} if devices == "{}" else json.loads(devices),
        created_at=created,
        updated_at=updated,
        error=error,
        member=member,
    )


def member_from_row(row: Sequence[Any]) -> MemberRecord:
    """The record of a row of ``MEMBER_COLUMNS``."""
    return MemberRecord(
        name=row[0],
        address=row[1],
        fingerprint=row[2],
        joined_at=float(row[3]),
        lease_expires=float(row[4]),
        epoch=int(row[5]),
    )


def dump(value: Mapping[str, Any]) -> str:
    """A JSON column's text: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def instance_not_found(name: str) -> NotFound:
    """The 404 for an instance by name."""
    return NotFound(f"Instance {name} not found")
