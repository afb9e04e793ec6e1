"""PostgreSQL under the store's tables: the connection, and what it does unlike SQLite.

The tables write one SQL text for both engines, with SQLite's ``?``
placeholders; ``PostgresConnection`` turns them into psycopg's ``%s``.  It is
the store's one connection, taken from a ``psycopg_pool.ConnectionPool``, used
by one thread at a time (the store's database thread), in autocommit mode so
that ``Database`` opens and commits its transactions itself, as on SQLite.
When the server goes away the connection is given back (the pool throws a
broken one away and opens another), the failing call raises psycopg's
``OperationalError``, which the executor counts as a write failure (the batch
is tried again, then fails with ``StoreWriteFailed``), and the next call runs
on a new connection once the server is back.

``PostgresDatabase`` holds what differs: transactions begin with a plain
``BEGIN`` (READ COMMITTED, with ``SELECT … FOR UPDATE`` where a write reads
first), reads that span several statements see one snapshot (REPEATABLE
READ), ids come back through ``RETURNING``, the ready key is removed with
jsonb operators, and leases are stamped with the server's clock, the one
clock every member shares.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool

from vmready.store.database import Cursor, Database

__all__ = [
    "PostgresConnection",
    "PostgresDatabase",
    "display_location",
    "is_postgres_location",
]

_SCHEMES = ("postgresql://", "postgres://")
# How long a call waits for the pool to hand over a connection (the server may be down).
CONNECTION_WAIT = 2.0
_IN_TRANSACTION = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


def is_postgres_location(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is an SQLite file's path)."""
    return location.startswith(_SCHEMES)


def display_location(location: str) -> str:
    """``location`` as it may be shown and logged: any password replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(location)
    except ValueError:
        return location.split("://", 1)[0] + "://***"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = "&".join(
        f"{key}=***" if key == "password" else piece
        for piece in parts.query.split("&")
        if piece
        for key in [piece.split("=", 1)[0]]
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


@functools.lru_cache(maxsize=1024)
def _translated(statement: str) -> str:
    """SQLite's ``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled)."""
    return statement.replace("%", "%%").replace("?", "%s")


class PostgresConnection:
    """The store's connection to PostgreSQL, from a pool, replaced when the server drops it."""

    def __init__(self, pool: ConnectionPool[Any], wait: float = CONNECTION_WAIT) -> None:
        self.pool = pool
        self._wait = wait
        self._connection: psycopg.Connection[Any] | None = None

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (a lost connection has none: it was rolled back)."""
        connection = self._connection
        return (
            connection is not None
            and connection.info.transaction_status in _IN_TRANSACTION
            and not connection.broken
        )

    def execute(self, statement: str, parameters: Sequence[Any] = (), /) -> Cursor:
        connection = self._connected()
        try:
            if parameters:
                return connection.execute(_translated(statement), parameters)
            return connection.execute(statement)
        except psycopg.OperationalError:
            self._drop_if_lost(connection)
            raise

    def executemany(self, statement: str, parameters: Iterable[Sequence[Any]], /) -> Cursor:
        connection = self._connected()
        cursor = connection.cursor()
        try:
            cursor.executemany(_translated(statement), parameters)
        except psycopg.OperationalError:
            self._drop_if_lost(connection)
            raise
        return cursor

    def close(self) -> None:
        """Give the connection back and close the pool."""
        if self._connection is not None:
            self._give_back(self._connection)
        self.pool.close()

    def _connected(self) -> psycopg.Connection[Any]:
        if self._connection is None:
            self._connection = self.pool.getconn(timeout=self._wait)
        return self._connection

    def _drop_if_lost(self, connection: psycopg.Connection[Any]) -> None:
        """A connection the server dropped goes back to the pool, which replaces it."""
        if connection.broken or connection.closed:
            self._give_back(connection)

    def _give_back(self, connection: psycopg.Connection[Any]) -> None:
        self._connection = None
        self.pool.putconn(connection)


class PostgresDatabase(Database):
    """PostgreSQL: READ COMMITTED writes that lock what they read, the server's clock."""

    engine_name = "postgresql"
    BEGIN_WRITE = "BEGIN"
    BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ"
    LOCK_ROWS = " FOR UPDATE"
    integrity_errors = (psycopg.IntegrityError,)

    def now(self) -> float:
        """The server's clock: members on several hosts stamp and compare leases on one clock."""
        (now,) = self.db.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()
        return float(now)

    def insert(self, sql: str, parameters: Sequence[Any]) -> int:
        (row_id,) = self.db.execute(f"{sql} RETURNING id", parameters).fetchone()
        return int(row_id)

    def has_key(self, key: str) -> tuple[str, str]:
        return "jsonb_exists(config::jsonb, CAST(? AS text))", key

    def without_key(self, key: str) -> tuple[str, str]:
        return "(config::jsonb - CAST(? AS text))::text", key

    def notify(self, channel: str, payload: str) -> None:
        """``pg_notify``: sent to the listeners when the transaction holding it commits."""
        self.db.execute("SELECT pg_notify(?, ?)", (channel, payload)).fetchall()
