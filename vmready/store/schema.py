"""The store's schema: its migrations, and opening (creating or migrating) a database.

The schema is versioned: ``MIGRATIONS`` is an ordered list of (version, SQL);
opening a store applies the pending ones in one transaction and refuses a store
written by a newer vmready.  The database runs in WAL mode with
``synchronous=NORMAL``, so a committed transaction survives ``kill -9`` of the
daemon at any point.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable

from vmready.domain import StoreError

BUSY_TIMEOUT_SECONDS = 5.0

# The version the newest migration brings a store to.
SCHEMA_VERSION = 6

_SCHEMA_TABLE = "vmready_schema"


def fencing_migration(real: str) -> str:
    """Migration 6, with the engine's type of a real number (PostgreSQL runs it too).

    The fencing token: each join of a member name bumps its epoch, every write
    checks it; each action row says which member wrote it, at which epoch.
    Retired names are kept, so that a retired member started again is refused.
    """
    return f"""
        ALTER TABLE members ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE actions ADD COLUMN member TEXT NOT NULL DEFAULT '';
        ALTER TABLE actions ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
        CREATE TABLE retired_members (
            name TEXT PRIMARY KEY,
            fingerprint TEXT NOT NULL,
            retired_at {real} NOT NULL
        );
        """


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
    (
        3,
        # Action history keyed by the instance's uuid, not its name: a name deleted and
        # used again starts a history of its own.  Existing actions belong to the instance
        # of that name only if they started after it was created; older ones keep no uuid.
        """
        ALTER TABLE actions ADD COLUMN instance_uuid TEXT;
        UPDATE actions SET instance_uuid = (
            SELECT uuid FROM instances
            WHERE instances.name = actions.instance AND actions.started_at >= instances.created_at
        );
        CREATE INDEX actions_by_uuid ON actions (instance_uuid, started_at);
        """,
    ),
    (
        4,
        # The remote operator API's trust store: client certificates by fingerprint, and
        # the one-time tokens that add them (only each secret's SHA-256 is kept).
        """
        CREATE TABLE trusted_certificates (
            fingerprint TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            added_at REAL NOT NULL
        );
        CREATE TABLE trust_tokens (
            secret_hash TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL,
            expires_at REAL NOT NULL
        );
        """,
    ),
    (
        5,
        # Cluster members (daemons sharing one store) and the member each instance runs on;
        # "" is a single host's own daemon.
        """
        CREATE TABLE members (
            name TEXT PRIMARY KEY,
            address TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            joined_at REAL NOT NULL,
            lease_expires REAL NOT NULL
        );
        ALTER TABLE instances ADD COLUMN member TEXT NOT NULL DEFAULT '';
        CREATE INDEX instances_by_member ON instances (member);
        """,
    ),
    (6, fencing_migration("REAL")),
]


def connect(
    path: str,
    clock: Callable[[], float],
    migrations: list[tuple[int, str]],
    schema_version: int,
) -> tuple[sqlite3.Connection, int]:
    """Open (creating or migrating) the database at path: the connection and its version.

    ``migrations`` bring it up to ``schema_version``; a store written with a
    newer version is refused.  Raise StoreError with one line.
    """
    unusable = _unusable_location(path)
    if unusable is not None:
        raise StoreError(f"cannot open store {path}: {unusable}")
    try:
        connection = sqlite3.connect(
            # Opened here, used on the store's database thread (one thread at a time).
            path,
            timeout=BUSY_TIMEOUT_SECONDS,
            isolation_level=None,
            check_same_thread=False,
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open store {path}: {exc}") from None
    try:
        version = _prepare(connection, path, clock, migrations, schema_version)
    except BaseException:
        connection.close()
        raise
    return connection, version


def _prepare(
    db: sqlite3.Connection,
    path: str,
    clock: Callable[[], float],
    migrations: list[tuple[int, str]],
    schema_version: int,
) -> int:
    """Configure the connection and bring the schema up to date; return its version."""
    try:
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        db.execute("PRAGMA foreign_keys = ON")
        # Refuse before anything writes: switching to WAL rewrites the header.
        check_version(_read_schema_version(db, path), path, schema_version)
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal" and path != ":memory:":
            raise StoreError(f"cannot open store {path}: journal mode stays {mode}, not wal")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated between the check and the lock.
            current = _read_schema_version(db, path)
            check_version(current, path, schema_version)
            for version, script in migrations:
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


def check_version(version: int, path: str, schema_version: int) -> None:
    """Refuse a store written by a newer vmready."""
    if version > schema_version:
        raise StoreError(
            f"store {path} has schema version {version}, newer than this vmready"
            f" understands ({schema_version}); upgrade vmready"
        )


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
