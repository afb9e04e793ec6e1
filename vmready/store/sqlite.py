"""The instance store: instances, their action history and snapshots, in SQLite.

Synchronous on purpose: the daemon calls it on the reactor thread and every
query touches a handful of rows.  The database runs in WAL mode with
``synchronous=NORMAL``, so a committed transaction survives ``kill -9`` of the
daemon at any point.  Every write that reads before it writes runs inside
``BEGIN IMMEDIATE``, and claiming a task is a compare-and-swap in a single
``UPDATE … WHERE task_state IS NULL``, so the database, not the caller, decides
which of two racing actions wins.

The schema is versioned: ``MIGRATIONS`` is an ordered list of (version, SQL);
opening a store applies the pending ones in one transaction and refuses a store
written by a newer vmready.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from vmready.domain.model import (
    ActionRecord,
    ActionStep,
    BadRequest,
    Conflict,
    InstanceRecord,
    NotFound,
    StoreError,
    task_conflict,
)
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState

__all__ = ["MIGRATIONS", "RESULTS", "Store"]

BUSY_TIMEOUT_SECONDS = 5.0

# The results an action or a step may finish with (Nova's "Success" / "Error").
RESULTS = frozenset({"success", "error"})

_SCHEMA_TABLE = "vmready_schema"

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE vmready_schema (
            version INTEGER PRIMARY KEY,
            applied_at REAL NOT NULL
        );
        CREATE TABLE instances (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            uuid TEXT NOT NULL UNIQUE,
            vm_state TEXT NOT NULL,
            task_state TEXT,
            power_state TEXT NOT NULL,
            config TEXT NOT NULL,
            devices TEXT NOT NULL,
            error TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE actions (
            id INTEGER PRIMARY KEY,
            instance TEXT NOT NULL,
            action TEXT NOT NULL,
            request_id TEXT NOT NULL,
            started_at REAL NOT NULL,
            finished_at REAL,
            result TEXT,
            error TEXT
        );
        CREATE INDEX actions_by_instance ON actions (instance, started_at);
        CREATE INDEX actions_unfinished ON actions (id) WHERE finished_at IS NULL;
        CREATE TABLE steps (
            id INTEGER PRIMARY KEY,
            action_id INTEGER NOT NULL REFERENCES actions (id) ON DELETE CASCADE,
            name TEXT NOT NULL,
            started_at REAL NOT NULL,
            finished_at REAL,
            result TEXT,
            error TEXT
        );
        CREATE INDEX steps_by_action ON steps (action_id, id);
        CREATE TABLE snapshots (
            id INTEGER PRIMARY KEY,
            instance TEXT NOT NULL REFERENCES instances (name) ON DELETE CASCADE,
            name TEXT NOT NULL,
            stateful INTEGER NOT NULL,
            created_at REAL NOT NULL,
            metadata TEXT NOT NULL,
            UNIQUE (instance, name)
        );
        """,
    ),
    (
        2,
        """
        CREATE TABLE agent_certificates (
            instance TEXT PRIMARY KEY REFERENCES instances (name) ON DELETE CASCADE,
            fingerprint TEXT NOT NULL UNIQUE,
            issued_at REAL NOT NULL
        );
        """,
    ),
]

_INSTANCE_COLUMNS = (
    "name, uuid, vm_state, task_state, power_state, config, devices, error, created_at, updated_at"
)
_ACTION_COLUMNS = "id, instance, action, request_id, started_at, finished_at, result, error"
_STEP_COLUMNS = "action_id, name, started_at, finished_at, result, error"


class Store:
    """vmready's SQLite store; open it with ``Store.open``."""

    SCHEMA_VERSION: ClassVar[int] = 2
    MIGRATIONS: ClassVar[list[tuple[int, str]]] = MIGRATIONS

    def __init__(
        self,
        path: str,
        connection: sqlite3.Connection,
        clock: Callable[[], float],
        schema_version: int,
    ) -> None:
        self.path = path
        self.schema_version = schema_version
        self._db = connection
        self._clock = clock

    @classmethod
    def open(cls, path: str, clock: Callable[[], float] = time.time) -> Store:
        """Open (creating or migrating) the store at path, or raise StoreError with one line."""
        unusable = _unusable_location(path)
        if unusable is not None:
            raise StoreError(f"cannot open store {path}: {unusable}")
        try:
            connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {path}: {exc}") from None
        try:
            version = cls._prepare(connection, path, clock)
        except BaseException:
            connection.close()
            raise
        return cls(path, connection, clock, version)

    @classmethod
    def _prepare(cls, db: sqlite3.Connection, path: str, clock: Callable[[], float]) -> int:
        """Configure the connection and bring the schema up to date; return its version."""
        try:
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
            db.execute("PRAGMA foreign_keys = ON")
            # Refuse before anything writes: switching to WAL rewrites the header.
            cls._check_version(_read_schema_version(db, path), path)
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal" and path != ":memory:":
                raise StoreError(f"cannot open store {path}: journal mode stays {mode}, not wal")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("BEGIN IMMEDIATE")
            try:
                # Another process may have migrated between the check and the lock.
                current = _read_schema_version(db, path)
                cls._check_version(current, path)
                for version, script in cls.MIGRATIONS:
                    if version > current:
                        _migrate(db, path, version, script, clock())
                        current = version
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {path}: {exc}") from None
        return current

    @classmethod
    def _check_version(cls, version: int, path: str) -> None:
        """Refuse a store written by a newer vmready."""
        if version > cls.SCHEMA_VERSION:
            raise StoreError(
                f"store {path} has schema version {version}, newer than this vmready"
                f" understands ({cls.SCHEMA_VERSION}); upgrade vmready"
            )

    def close(self) -> None:
        """Close the database connection."""
        self._db.close()

    # Instances

    def create_instance(
        self,
        name: str,
        config: dict[str, str],
        devices: dict[str, dict[str, str]],
        instance_uuid: str | None = None,
    ) -> InstanceRecord:
        """Add an instance, building with a spawning task; Conflict if the name is taken.

        ``instance_uuid``: this uuid instead of a new one (a replayed session's).
        """
        _check_config(config)
        _check_devices(devices)
        now = self._clock()
        with self._transaction():
            if self._find(name) is not None:
                raise Conflict(f"Instance {name} already exists")
            self._db.execute(
                f"INSERT INTO instances ({_INSTANCE_COLUMNS})"
                " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, ?)",
                (
                    name,
                    instance_uuid or str(uuid.uuid4()),
                    VMState.BUILDING.value,
                    TaskState.SPAWNING.value,
                    PowerState.NOSTATE.value,
                    _dump(config),
                    _dump(devices),
                    now,
                    now,
                ),
            )
            return self._get(name)

    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        return self._get(name)

    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        return self._find(name)

    def list_instances(self) -> list[InstanceRecord]:
        """Every instance, ordered by name."""
        rows = self._db.execute(f"SELECT {_INSTANCE_COLUMNS} FROM instances ORDER BY name")
        return [_instance(row) for row in rows]

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> InstanceRecord:
        """Start task if there is none and vm_state is in allowed_from; else the 409 saying why."""
        states = sorted(state.value for state in allowed_from)
        placeholders = ", ".join("?" for _ in states)
        with self._transaction():
            claimed = self._db.execute(
                "UPDATE instances SET task_state = ?, updated_at = ?"
                f" WHERE name = ? AND task_state IS NULL AND vm_state IN ({placeholders})",
                (task.value, self._clock(), name, *states),
            ).rowcount
            current = self._get(name)
        if claimed:
            return current
        raise task_conflict(action, name, current.task_state, current.vm_state)

    def advance_task(self, name: str, expected: TaskState, task: TaskState) -> InstanceRecord:
        """Move from task_state expected to task; Conflict if the instance is not in expected."""
        with self._transaction():
            advanced = self._db.execute(
                "UPDATE instances SET task_state = ?, updated_at = ?"
                " WHERE name = ? AND task_state = ?",
                (task.value, self._clock(), name, expected.value),
            ).rowcount
            current = self._get(name)
        if advanced:
            return current
        raise _stale_task(name, expected, current)

    def finish_task(
        self,
        name: str,
        expected: TaskState,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord:
        """End task expected: rest in vm_state, optionally set power_state and config; atomic."""
        with self._transaction():
            current = self._get(name)
            if current.task_state is not expected:
                raise _stale_task(name, expected, current)
            config = _updated(current.config, config_updates or {})
            error = current.error if vm_state is VMState.ERROR else None
            self._db.execute(
                "UPDATE instances SET task_state = NULL, vm_state = ?, power_state = ?,"
                " config = ?, error = ?, updated_at = ? WHERE name = ? AND task_state = ?",
                (
                    vm_state.value,
                    (power_state or current.power_state).value,
                    _dump(config),
                    error,
                    self._clock(),
                    name,
                    expected.value,
                ),
            )
            return self._get(name)

    def set_error(
        self, name: str, reason: str, power_state: PowerState | None = None
    ) -> InstanceRecord:
        """Put the instance in vm_state error with reason, ending any task."""
        with self._transaction():
            self._update_existing(
                name,
                "vm_state = ?, task_state = NULL, error = ?,"
                " power_state = COALESCE(?, power_state), updated_at = ?",
                (
                    VMState.ERROR.value,
                    reason,
                    None if power_state is None else power_state.value,
                    self._clock(),
                ),
            )
            return self._get(name)

    def set_power_state(self, name: str, power_state: PowerState) -> InstanceRecord:
        """Record what the hypervisor reports; an unchanged power state writes nothing."""
        with self._transaction():
            current = self._get(name)
            if current.power_state is power_state:
                return current
            self._update_existing(
                name, "power_state = ?, updated_at = ?", (power_state.value, self._clock())
            )
            return self._get(name)

    def update_config(self, name: str, updates: dict[str, str | None]) -> InstanceRecord:
        """Set config keys (None deletes the key) in one read-modify-write transaction."""
        with self._transaction():
            current = self._get(name)
            config = _updated(current.config, updates)
            self._update_existing(
                name, "config = ?, updated_at = ?", (_dump(config), self._clock())
            )
            return self._get(name)

    def settle(
        self,
        name: str,
        allowed_from: frozenset[VMState],
        vm_state: VMState,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord | None:
        """Move an idle instance to ``vm_state`` without an action (a VM exited, the poller).

        One conditional ``UPDATE … WHERE task_state IS NULL AND vm_state IN (…)``:
        an instance with a task in progress, or in a state not listed (error, say),
        is left untouched and None is returned.
        """
        states = sorted(state.value for state in allowed_from)
        placeholders = ", ".join("?" for _ in states)
        with self._transaction():
            current = self.find_instance(name)
            if current is None:
                return None
            config = _updated(current.config, config_updates or {})
            changed = self._db.execute(
                "UPDATE instances SET vm_state = ?, power_state = ?, config = ?, "
                "error = NULL, updated_at = ? "
                f"WHERE name = ? AND task_state IS NULL AND vm_state IN ({placeholders})",
                (vm_state.value, power_state.value, _dump(config), self._clock(), name, *states),
            ).rowcount
            return self._get(name) if changed else None

    def clear_ready_everywhere(self) -> int:
        """Remove the ready key from every instance (daemon start); return how many had it."""
        needle = json.dumps(READY_KEY)
        cleared = 0
        with self._transaction():
            # instr() only narrows the scan; the decoded config decides.
            rows = self._db.execute(
                "SELECT name, config FROM instances WHERE instr(config, ?) > 0", (needle,)
            ).fetchall()
            now = self._clock()
            for row in rows:
                config: dict[str, str] = json.loads(row["config"])
                if config.pop(READY_KEY, None) is None:
                    continue
                self._db.execute(
                    "UPDATE instances SET config = ?, updated_at = ? WHERE name = ?",
                    (_dump(config), now, row["name"]),
                )
                cleared += 1
        return cleared

    def delete_instance(self, name: str) -> None:
        """Remove the instance and its snapshots; its action history stays."""
        deleted = self._db.execute("DELETE FROM instances WHERE name = ?", (name,)).rowcount
        if not deleted:
            raise _instance_not_found(name)

    # Agent certificates

    def set_agent_certificate(self, name: str, fingerprint: str) -> None:
        """Record (or replace) the fingerprint of the client certificate issued to an instance."""
        with self._transaction():
            self._get(name)
            self._db.execute(
                "INSERT INTO agent_certificates (instance, fingerprint, issued_at)"
                " VALUES (?, ?, ?)"
                " ON CONFLICT (instance) DO UPDATE SET"
                " fingerprint = excluded.fingerprint, issued_at = excluded.issued_at",
                (name, fingerprint, self._clock()),
            )

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked)."""
        row = self._db.execute(
            "SELECT instance FROM agent_certificates WHERE fingerprint = ?", (fingerprint,)
        ).fetchone()
        return None if row is None else self._find(row[0])

    # Action history

    def start_action(self, name: str, action: str, request_id: str) -> int:
        """Record the start of an action on instance name; return its id."""
        cursor = self._db.execute(
            "INSERT INTO actions (instance, action, request_id, started_at) VALUES (?, ?, ?, ?)",
            (name, action, request_id, self._clock()),
        )
        return _row_id(cursor)

    def start_step(self, action_id: int, step: str) -> int:
        """Record the start of a step of an action; return its id."""
        try:
            cursor = self._db.execute(
                "INSERT INTO steps (action_id, name, started_at) VALUES (?, ?, ?)",
                (action_id, step, self._clock()),
            )
        except sqlite3.IntegrityError:
            raise NotFound(f"Action {action_id} not found") from None
        return _row_id(cursor)

    def finish_step(self, step_id: int, result: str, error: str | None = None) -> None:
        """Record how a step ended ("success" or "error")."""
        _check_result(result)
        finished = self._db.execute(
            "UPDATE steps SET finished_at = ?, result = ?, error = ? WHERE id = ?",
            (self._clock(), result, error, step_id),
        ).rowcount
        if not finished:
            raise NotFound(f"Action step {step_id} not found")

    def add_step(self, action_id: int, step: str, result: str, error: str | None = None) -> None:
        """Record a step that started and ended at once."""
        _check_result(result)
        now = self._clock()
        try:
            self._db.execute(
                "INSERT INTO steps (action_id, name, started_at, finished_at, result, error)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (action_id, step, now, now, result, error),
            )
        except sqlite3.IntegrityError:
            raise NotFound(f"Action {action_id} not found") from None

    def finish_action(self, action_id: int, result: str, error: str | None = None) -> None:
        """Record how an action ended ("success" or "error")."""
        _check_result(result)
        finished = self._db.execute(
            "UPDATE actions SET finished_at = ?, result = ?, error = ? WHERE id = ?",
            (self._clock(), result, error, action_id),
        ).rowcount
        if not finished:
            raise NotFound(f"Action {action_id} not found")

    def list_actions(self, name: str) -> list[ActionRecord]:
        """The action history of instance name (kept after delete), newest first."""
        return self._actions("instance = ?", (name,), "started_at DESC, id DESC")

    def unfinished_actions(self) -> list[ActionRecord]:
        """Actions that never finished (the daemon died during them), oldest first."""
        return self._actions("finished_at IS NULL", (), "id")

    # Snapshots

    def create_snapshot(
        self, instance: str, name: str, stateful: bool, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        """Record a snapshot of instance; Conflict if the instance already has one called name."""
        encoded = _dump(metadata)
        with self._transaction():
            self._get(instance)
            taken = self._db.execute(
                "SELECT 1 FROM snapshots WHERE instance = ? AND name = ?", (instance, name)
            ).fetchone()
            if taken is not None:
                raise Conflict(f"Snapshot {name} of instance {instance} already exists")
            self._db.execute(
                "INSERT INTO snapshots (instance, name, stateful, created_at, metadata)"
                " VALUES (?, ?, ?, ?, ?)",
                (instance, name, int(stateful), self._clock(), encoded),
            )
            row = self._db.execute(
                "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
                " WHERE instance = ? AND name = ?",
                (instance, name),
            ).fetchone()
        return _snapshot(row)

    def find_snapshot(self, instance: str, name: str) -> dict[str, Any] | None:
        """Snapshot ``name`` of instance, or None."""
        row = self._db.execute(
            "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
            " WHERE instance = ? AND name = ?",
            (instance, name),
        ).fetchone()
        return None if row is None else _snapshot(row)

    def list_snapshots(self, instance: str) -> list[dict[str, Any]]:
        """The snapshots of instance, oldest first; NotFound if there is no such instance."""
        with self._transaction(immediate=False):
            self._get(instance)
            rows = self._db.execute(
                "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
                " WHERE instance = ? ORDER BY created_at, id",
                (instance,),
            ).fetchall()
        return [_snapshot(row) for row in rows]

    # Internals

    @contextlib.contextmanager
    def _transaction(self, immediate: bool = True) -> Iterator[None]:
        """One transaction; IMMEDIATE takes the write lock first so reads see what is written."""
        self._db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _find(self, name: str) -> InstanceRecord | None:
        row = self._db.execute(
            f"SELECT {_INSTANCE_COLUMNS} FROM instances WHERE name = ?", (name,)
        ).fetchone()
        return None if row is None else _instance(row)

    def _get(self, name: str) -> InstanceRecord:
        record = self._find(name)
        if record is None:
            raise _instance_not_found(name)
        return record

    def _update_existing(self, name: str, assignments: str, values: tuple[Any, ...]) -> None:
        updated = self._db.execute(
            f"UPDATE instances SET {assignments} WHERE name = ?", (*values, name)
        ).rowcount
        if not updated:
            raise _instance_not_found(name)

    def _actions(self, where: str, values: tuple[Any, ...], order: str) -> list[ActionRecord]:
        with self._transaction(immediate=False):
            actions = self._db.execute(
                f"SELECT {_ACTION_COLUMNS} FROM actions WHERE {where} ORDER BY {order}", values
            ).fetchall()
            steps = self._db.execute(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE action_id IN"
                f" (SELECT id FROM actions WHERE {where}) ORDER BY id",
                values,
            ).fetchall()
        by_action: dict[int, list[ActionStep]] = {row["id"]: [] for row in actions}
        for step in steps:
            by_action[step["action_id"]].append(
                ActionStep(
                    name=step["name"],
                    started_at=step["started_at"],
                    finished_at=step["finished_at"],
                    result=step["result"],
                    error=step["error"],
                )
            )
        return [
            ActionRecord(
                id=row["id"],
                instance=row["instance"],
                action=row["action"],
                request_id=row["request_id"],
                started_at=row["started_at"],
                finished_at=row["finished_at"],
                result=row["result"],
                error=row["error"],
                steps=tuple(by_action[row["id"]]),
            )
            for row in actions
        ]


def _unusable_location(path: str) -> str | None:
    """Why path cannot hold a store, in words sqlite's "unable to open" does not give."""
    if path == ":memory:":
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(directory):
        return f"directory {directory} does not exist"
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    # WAL mode creates the -wal and -shm files beside the database.
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable"
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        return "permission denied"
    return None


def _read_schema_version(db: sqlite3.Connection, path: str) -> int:
    """The store's schema version: 0 for an empty database, refusing anything not vmready's."""
    try:
        tables = {
            row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.DatabaseError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_NOTADB:
            raise StoreError(
                f"store {path} is not a vmready database (the file is not SQLite)"
            ) from None
        raise
    if _SCHEMA_TABLE not in tables:
        if tables:
            raise StoreError(
                f"store {path} is not a vmready database"
                f" (an SQLite database without a {_SCHEMA_TABLE} table)"
            )
        return 0
    (version,) = db.execute(f"SELECT MAX(version) FROM {_SCHEMA_TABLE}").fetchone()
    return int(version or 0)


def _migrate(db: sqlite3.Connection, path: str, version: int, script: str, now: float) -> None:
    """Run one migration's statements and record its version (inside the caller's transaction)."""
    try:
        for statement in _statements(script):
            db.execute(statement)
    except sqlite3.Error as exc:
        raise StoreError(
            f"cannot open store {path}: migration to schema version {version} failed: {exc}"
        ) from None
    db.execute(f"INSERT INTO {_SCHEMA_TABLE} (version, applied_at) VALUES (?, ?)", (version, now))


def _statements(script: str) -> list[str]:
    """Split an SQL script into statements (executescript would commit our transaction)."""
    statements: list[str] = []
    current = ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip() != ";":
                statements.append(current.strip())
            current = ""
    return statements


def _instance(row: sqlite3.Row) -> InstanceRecord:
    task_state = row["task_state"]
    return InstanceRecord(
        name=row["name"],
        uuid=row["uuid"],
        vm_state=VMState(row["vm_state"]),
        task_state=None if task_state is None else TaskState(task_state),
        power_state=PowerState(row["power_state"]),
        config=json.loads(row["config"]),
        devices=json.loads(row["devices"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        error=row["error"],
    )


def _snapshot(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "instance": row["instance"],
        "name": row["name"],
        "stateful": bool(row["stateful"]),
        "created_at": row["created_at"],
        "metadata": json.loads(row["metadata"]),
    }


def _dump(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _updated(config: dict[str, str], updates: Mapping[str, str | None]) -> dict[str, str]:
    """config with updates applied: a None value deletes the key."""
    result = dict(config)
    for key, value in updates.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    _check_config(result)
    return result


def _check_config(config: Mapping[str, Any]) -> None:
    for key, value in config.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadRequest(f"Config key {key!r} must map to a string, not {value!r}")


def _check_devices(devices: Mapping[str, Any]) -> None:
    for device, settings in devices.items():
        if not isinstance(settings, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in settings.items()
        ):
            raise BadRequest(f"Device {device!r} must map names to strings")


def _check_result(result: str) -> None:
    if result not in RESULTS:
        raise ValueError(f"result must be 'success' or 'error', not {result!r}")


def _stale_task(name: str, expected: TaskState, current: InstanceRecord) -> Conflict:
    """The 409 for a task step whose compare-and-swap found another task_state."""
    return Conflict(
        f"Instance {name} is in task_state {current.task_state or 'none'}, not {expected}"
    )


def _instance_not_found(name: str) -> NotFound:
    return NotFound(f"Instance {name} not found")


def _row_id(cursor: sqlite3.Cursor) -> int:
    row_id = cursor.lastrowid
    assert row_id is not None, "an INSERT always sets lastrowid"
    return row_id
