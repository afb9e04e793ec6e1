"""PostgreSQL under the store's tables: the connection, and what it does unlike SQLite.

``PostgresConnection`` is the store's one connection, taken from a pool, used
by the database thread in autocommit mode (``Database`` opens and commits its
transactions itself, as on SQLite), with SQLite's ``?`` placeholders turned
into psycopg's.  A connection lost during ``COMMIT`` raises ``CommitUnknown``
(the batch may have committed: it must not run again); lost any earlier, it is
an ``OperationalError``, a write failure the executor tries again.

``connection_string`` adds bounded waits to every connection unless the URL
(or ``PGCONNECT_TIMEOUT``, ``PGAPPNAME``, ``PGOPTIONS``) sets them:
``CONNECTION_DEFAULTS``' connect timeout and TCP keepalives (a dead peer is
noticed in about 25 s), ``lock_timeout=10s`` and
``idle_in_transaction_session_timeout=5s`` (a daemon frozen inside a write
loses its session and the locks it held, so its name can be taken over).
``PostgresDatabase`` holds what the engine does differently
(docs/architecture.md, "the store").
"""

from __future__ import annotations

import functools
import os
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool

from vmready.domain import StoreError
from vmready.store.database import CommitUnknown, Cursor, Database

_SCHEMES = ("postgresql://", "postgres://")
# How long a call waits for the pool to hand over a connection (the server may be down).
CONNECTION_WAIT = 2.0
_IN_TRANSACTION = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)
# What every connection gets unless the URL (or libpq's environment) sets it: see above.
CONNECTION_DEFAULTS: dict[str, str | int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
}
LOCK_TIMEOUT = "10s"
IDLE_IN_TRANSACTION_TIMEOUT = "5s"
# libpq's environment variables for the parameters above that have one.
_ENVIRONMENT = {
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "application_name": "PGAPPNAME",
    "options": "PGOPTIONS",
}


def one_line(error: BaseException) -> str:
    """psycopg's message (often several lines, with tabs) as one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def connection_string(
    location: str, application_name: str = "vmready", shown: str | None = None
) -> str:
    """``location``'s connection string with vmready's defaults where it sets nothing.

    StoreError (one line, naming ``shown``: the location without its password)
    if it cannot be parsed.
    """
    try:
        params = psycopg.conninfo.conninfo_to_dict(location)
    except psycopg.Error as e:
        shown = display_location(location) if shown is None else shown
        raise StoreError(f"cannot open store {shown}: {one_line(e)}") from None

    def operator_set(key: str) -> bool:
        variable = _ENVIRONMENT.get(key)
        return key in params or (variable is not None and bool(os.environ.get(variable)))

    defaults: dict[str, Any] = {
        key: value for key, value in CONNECTION_DEFAULTS.items() if not operator_set(key)
    }
    if not operator_set("application_name"):
        defaults["application_name"] = application_name
    # Later -c settings win: the operator's options (the URL's, else PGOPTIONS) go after ours.
    theirs = str(params.get("options") or os.environ.get("PGOPTIONS") or "")
    ours = (
        f"-c lock_timeout={LOCK_TIMEOUT}"
        f" -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT}"
    )
    defaults["options"] = f"{ours} {theirs}".strip()
    return psycopg.conninfo.make_conninfo(location, **defaults)


def is_postgres_location(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is an SQLite file's path)."""
    return location.startswith(_SCHEMES)


# The connection parameters that are secrets: never shown, logged or put in an error.
_SECRET_PARAMETERS = ("password", "sslpassword")


def display_location(location: str) -> str:
    """``location`` as it may be shown and logged: any password replaced by ``***``.

    The URL keeps its shape where it can; but libpq, not ``urllib``, decides
    what is the password (it takes ``#`` and ``?`` in one, where ``urllib``
    sees a fragment or a query), so whenever a secret libpq reads from the
    URL would still show, the URL is rebuilt from libpq's own reading.  A
    file path is shown as it is; another scheme's URL without its password.
    """
    if not is_postgres_location(location):
        if "://" not in location:
            return location
        return _masked_url(location) or location.split("://", 1)[0] + "://***"
    try:
        parameters = psycopg.conninfo.conninfo_to_dict(location)
    except psycopg.Error:
        # Not even libpq can read it: show nothing that might be a secret.
        return location.split("://", 1)[0] + "://***"
    secrets = [str(parameters[key]) for key in _SECRET_PARAMETERS if parameters.get(key)]
    shown = _masked_url(location)
    if shown is not None and not any(_shows(shown, secret) for secret in secrets):
        return shown
    return _rebuilt(location.split("://", 1)[0], parameters)


def _masked_url(location: str) -> str | None:
    """The URL with the password of its user part and its secret parameters masked."""
    try:
        parts = urllib.parse.urlsplit(location)
    except ValueError:
        return None
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = "&".join(
        f"{key}=***" if key in _SECRET_PARAMETERS else piece
        for piece in parts.query.split("&")
        if piece
        for key in [piece.split("=", 1)[0]]
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _shows(text: str, secret: str) -> bool:
    """Whether ``secret`` can be read in ``text``, as it is or percent-encoded."""
    return any(
        form in text
        for form in {secret, urllib.parse.quote(secret), urllib.parse.quote_plus(secret)}
    )


def _rebuilt(scheme: str, parameters: dict[str, Any]) -> str:
    """A URL of libpq's reading of a location, its secrets as ``***``."""
    rest = dict(parameters)
    user = rest.pop("user", None)
    password = rest.pop("password", None)
    host = rest.pop("host", None)
    port = rest.pop("port", None)
    dbname = rest.pop("dbname", None)
    netloc = ""
    if user or password:
        netloc = urllib.parse.quote(str(user or ""), safe="") + (":***" if password else "") + "@"
    if host and not str(host).startswith("/") and "," not in str(host):
        netloc += f"[{host}]" if ":" in str(host) else str(host)
        if port:
            netloc += f":{port}"
    else:
        if host:
            rest["host"] = host
        if port:
            rest["port"] = port
    query = "&".join(
        f"{key}=***" if key in _SECRET_PARAMETERS else f"{key}={urllib.parse.quote(str(value))}"
        for key, value in rest.items()
    )
    path = "/" + urllib.parse.quote(str(dbname), safe="") if dbname else ""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


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

    @property
    def info(self) -> psycopg.ConnectionInfo:
        """The connection's parameters and state as psycopg reports them (diagnostics, tests)."""
        return self._connected().info

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

    def commit(self) -> None:
        """``COMMIT``; ``CommitUnknown`` if the connection was lost before the server answered.

        A lost connection at ``COMMIT`` is an unknown outcome: the server may
        have committed (and been cut off before it could say so).  An error on
        a connection still up (a constraint checked at commit) is the server's
        answer: the transaction was rolled back, the error raised as it is.
        """
        connection = self._connected()
        try:
            connection.execute("COMMIT")
        except psycopg.OperationalError as e:
            lost = connection.broken or connection.closed
            self._drop_if_lost(connection)
            if lost:
                raise CommitUnknown(
                    f"the connection was lost during COMMIT ({one_line(e)}):"
                    " the change may or may not have been kept"
                ) from e
            raise

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
    NOTIFIES = True

    def __init__(self, connection: PostgresConnection, clock: Callable[[], float]) -> None:
        super().__init__(connection, clock)
        self.connection = connection

    def commit(self) -> None:
        """``COMMIT``, or ``CommitUnknown`` if the connection was lost during it."""
        self.connection.commit()

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
