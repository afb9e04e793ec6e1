"""The instance store: instances, their action history and snapshots, in SQLite or PostgreSQL.

``Store`` is the entry point (the module is named for its first engine):
``Store.open`` opens, creating or migrating, an SQLite file or a
``postgresql://`` database.  Its tables (``Tables``) are one object per
concern, each the only place its operations are written; on a ``Store`` each
call runs at once, on ``store.asyncstore.AsyncStore`` each is a Deferred.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar, Generic

from vmready.store import pgschema, schema
from vmready.store.actions import ActionHistory
from vmready.store.certificates import AgentCertificates
from vmready.store.database import Database, SQLiteDatabase
from vmready.store.instances import Instances
from vmready.store.members import Members
from vmready.store.postgres import PostgresDatabase, display_location, is_postgres_location
from vmready.store.snapshots import Snapshots
from vmready.store.table import Later, M, Sync
from vmready.store.trust import TrustTable


class Tables(Generic[M]):
    """The store's tables over one database: each call at once (``Sync``) or queued (``Async``)."""

    def __init__(self, database: Database, member: str | None, later: Later | None) -> None:
        self.instances: Instances[M] = Instances(database, member, later)
        self.certificates: AgentCertificates[M] = AgentCertificates(database, member, later)
        self.actions: ActionHistory[M] = ActionHistory(database, member, later)
        self.snapshots: Snapshots[M] = Snapshots(database, member, later)
        self.members: Members[M] = Members(database, member, later)
        self.trust: TrustTable[M] = TrustTable(database, member, later)


class Store(Tables[Sync]):
    """vmready's store, on SQLite or PostgreSQL; open it with ``Store.open``."""

    SCHEMA_VERSION: ClassVar[int] = schema.SCHEMA_VERSION
    MIGRATIONS: ClassVar[list[tuple[int, str]]] = schema.MIGRATIONS
    POSTGRES_MIGRATIONS: ClassVar[list[tuple[int, str]]] = pgschema.MIGRATIONS

    def __init__(self, path: str, database: Database, schema_version: int) -> None:
        super().__init__(database, None, None)
        # Where the store is, as it may be shown: a file's path, or a URL without its password.
        self.path = path
        self.schema_version = schema_version
        # "sqlite" or "postgresql".
        self.engine_name = database.engine_name
        # Whether other daemons can hear of its changes (LISTEN/NOTIFY, store.notifications).
        self.notifies = database.NOTIFIES
        # The connection: transactions, batches (store.executor), what a call changed.
        self.database = database

    @classmethod
    def open(cls, location: str, clock: Callable[[], float] = time.time) -> Store:
        """Open (creating or migrating) the store, or raise StoreError with one line.

        ``location``: an SQLite file's path, or a ``postgresql://`` (``postgres://``)
        URL.  ``clock`` stamps rows; on PostgreSQL leases take the server's clock.
        """
        if is_postgres_location(location):
            pool, version = pgschema.connect(
                location, clock, cls.POSTGRES_MIGRATIONS, cls.SCHEMA_VERSION
            )
            return cls(display_location(location), PostgresDatabase(pool, clock), version)
        connection, version = schema.connect(location, clock, cls.MIGRATIONS, cls.SCHEMA_VERSION)
        return cls(location, SQLiteDatabase(connection, clock), version)

    def close(self) -> None:
        """Close the database connection."""
        self.database.close()
