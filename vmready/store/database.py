"""The connection the store's tables share: transactions, the clock, instance rows by name.

Synchronous on purpose: this is the engine, run on the store's one database
thread (``store.executor``), never on the reactor's.  Every write that reads
before it writes runs inside ``BEGIN IMMEDIATE``, so the database, not the
caller, decides which of two racing writers wins.  Inside a ``batch`` (many
queued calls committed together) each call and each transaction is a
SAVEPOINT instead: one call's error undoes that call alone.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vmready.domain.model import InstanceRecord, NotFound, StoreError
from vmready.domain.states import PowerState, TaskState, VMState

__all__ = ["INSTANCE_COLUMNS", "Database", "dump", "instance_not_found"]

INSTANCE_COLUMNS = (
    "name, uuid, vm_state, task_state, power_state, config, devices, error, created_at,"
    " updated_at, member"
)


class TransactionLost(StoreError):
    """SQLite rolled a whole batch back by itself: none of its calls was kept."""


class Database:
    """One open SQLite connection and the clock that stamps its rows."""

    def __init__(self, connection: sqlite3.Connection, clock: Callable[[], float]) -> None:
        self.db = connection
        self.clock = clock
        # How deep in savepoints we are; 0: no batch, each transaction is its own.
        self._depth = 0

    def close(self) -> None:
        """Close the database connection."""
        self.db.close()

    @contextlib.contextmanager
    def transaction(self, immediate: bool = True) -> Iterator[None]:
        """One transaction; IMMEDIATE takes the write lock first so reads see what is written.

        Inside a batch it is a savepoint: atomic, committed with the batch.
        """
        if self._depth:
            with self.savepoint():
                yield
            return
        self.db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Many calls in one transaction, committed (one fsync) when the block ends."""
        self.db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
            self.db.execute("COMMIT")
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
        try:
            yield
        except BaseException as e:
            if not self.db.in_transaction:
                raise TransactionLost(f"the store's transaction was rolled back: {e}") from e
            self.db.execute(f"ROLLBACK TO {name}")
            self.db.execute(f"RELEASE {name}")
            raise
        else:
            self.db.execute(f"RELEASE {name}")
        finally:
            self._depth -= 1

    def now(self) -> float:
        """The store's clock: what leases are stamped and compared with.

        SQLite's store is on one host, so its clock is the daemon's.
        """
        return self.clock()

    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        row = self.db.execute(
            f"SELECT {INSTANCE_COLUMNS} FROM instances WHERE name = ?", (name,)
        ).fetchone()
        return None if row is None else instance_from_row(row)

    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        record = self.find_instance(name)
        if record is None:
            raise instance_not_found(name)
        return record


def instance_from_row(row: sqlite3.Row) -> InstanceRecord:
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


def dump(value: Mapping[str, Any]) -> str:
    """A JSON column's text: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def instance_not_found(name: str) -> NotFound:
    """The 404 for an instance by name."""
    return NotFound(f"Instance {name} not found")
