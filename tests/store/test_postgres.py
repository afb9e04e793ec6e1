"""The store on PostgreSQL: what only that engine has, against a real server.

Opening (a server that is not there, a database that is not, a schema that
is newer, two daemons migrating one empty database at once), two daemons
writing one row (the row lock of a read-modify-write, the compare-and-swap
of a claim), the trigger's notifications, and a connection lost under the
database thread.  The row-lock tests hold one store's transaction open (a
``batch``) and wait until PostgreSQL shows the other store's backend waiting
for that lock, so the interleaving is the same every run.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import psycopg
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.postgres import postgres_location, postgres_server
from tests.reactor import reactor
from vmready.domain.model import Conflict, StoreError
from vmready.domain.states import ACTIONS, PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import DatabaseThread, StoreHealth, StoreWriteFailed
from vmready.store.pgschema import BASELINE_VERSION
from vmready.store.postgres import display_location
from vmready.store.sqlite import Store

# A thread the test waits for is done well before this; never hang a run.
JOIN_LIMIT = 60.0


def _database_of(location: str) -> str:
    return urllib.parse.urlsplit(location).path.lstrip("/")


def _raw(location: str) -> psycopg.Connection[Any]:
    """A plain autocommit connection, to look behind the store's back."""
    return psycopg.connect(location, autocommit=True)


def _versions(location: str) -> list[int]:
    """The schema versions the database records, in order."""
    with _raw(location) as raw:
        return [row[0] for row in raw.execute("SELECT version FROM vmready_schema ORDER BY 1")]


def _wait_until_blocked(location: str) -> None:
    """Return once some backend of the database waits for a lock (polled, no deadline)."""
    event = threading.Event()
    with _raw(location) as raw:
        while True:
            (waiting,) = raw.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone() or (0,)
            if waiting:
                return
            event.wait(0.01)


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run work on a thread; the list gets its result or its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


class OpeningTests(SynchronousTestCase):
    """Store.open on a postgresql:// URL: the engine, the schema, the one-line errors."""

    def test_aNewDatabaseIsCreatedAtTheSchemaVersionWithTheTrigger(self) -> None:
        location = postgres_location(self, migrated=False)
        store = Store.open(location, clock=lambda: 1000.0)
        self.addCleanup(store.close)
        self.assertEqual(
            (store.engine_name, store.notifies, store.schema_version, store.path),
            ("postgresql", True, Store.SCHEMA_VERSION, location),
        )
        with _raw(location) as raw:
            versions = raw.execute(
                "SELECT version, applied_at FROM vmready_schema ORDER BY version"
            ).fetchall()
            triggers = raw.execute(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'instances'::regclass"
                " AND NOT tgisinternal"
            ).fetchall()
        # The baseline, then each migration after it.
        self.assertEqual(
            versions,
            [(version, 1000.0) for version in range(BASELINE_VERSION, Store.SCHEMA_VERSION + 1)],
        )
        self.assertEqual(triggers, [("instances_notify",)])

    def test_aDatabaseThatRecordsEveryVersionSinceTheFirstOpens(self) -> None:
        """As the schema's first PostgreSQL stores recorded it, one row per version."""
        location = postgres_location(self)
        with _raw(location) as raw:
            raw.execute(
                "INSERT INTO vmready_schema (version, applied_at)"
                " SELECT v, 0 FROM generate_series(1, %s - 1) AS v",
                (BASELINE_VERSION,),
            )
        store = Store.open(location)
        self.addCleanup(store.close)
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        self.assertEqual(store.instances.create_instance("web", {}, {}).name, "web")

    def test_aVersionOlderThanTheFirstPostgreSQLSchemaIsRefusedAndLeftUntouched(self) -> None:
        location = postgres_location(self)
        with _raw(location) as raw:
            raw.execute("DELETE FROM vmready_schema WHERE version > %s", (BASELINE_VERSION,))
            raw.execute("UPDATE vmready_schema SET version = %s", (BASELINE_VERSION - 1,))
        error = self.assertRaises(StoreError, Store.open, location)
        self.assertEqual(
            str(error),
            f"store {location} has schema version {BASELINE_VERSION - 1}, older than any"
            f" PostgreSQL store this vmready opens ({BASELINE_VERSION})",
        )
        self.assertEqual(_versions(location), [BASELINE_VERSION - 1])

    def test_sqliteIsStillAPath(self) -> None:
        path = self.mktemp()
        store = Store.open(path)
        self.addCleanup(store.close)
        self.assertEqual((store.engine_name, store.notifies, store.path), ("sqlite", False, path))

    def test_anUnreachableServerIsOneLineNamingTheURLWithoutItsPassword(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-nopg-")  # short: a socket path has 107 bytes
        self.addCleanup(os.rmdir, directory)
        location = f"postgres://vmready:s3cret@/vmready?host={directory}"
        error = self.assertRaises(StoreError, Store.open, location)
        message = str(error)
        shown = f"postgres://vmready:***@/vmready?host={directory}"
        self.assertTrue(message.startswith(f"cannot open store {shown}: "), message)
        self.assertIn("No such file or directory", message)
        self.assertNotIn("s3cret", message)
        self.assertEqual(len(message.splitlines()), 1)

    def test_aPasswordInTheQueryIsMaskedToo(self) -> None:
        location = postgres_location(self)
        store = Store.open(f"{location}&password=s3cret")
        self.addCleanup(store.close)
        self.assertEqual(store.path, f"{location}&password=***")

    def test_aDatabaseThatDoesNotExistIsOneLine(self) -> None:
        location = postgres_server().url("nowhere")
        error = self.assertRaises(StoreError, Store.open, location)
        self.assertTrue(str(error).startswith(f"cannot open store {location}: "), str(error))
        self.assertIn('database "nowhere" does not exist', str(error))
        self.assertEqual(len(str(error).splitlines()), 1)

    def test_aNewerSchemaIsRefusedWithTheSQLiteLineAndLeftUntouched(self) -> None:
        location = postgres_location(self)
        with _raw(location) as raw:
            raw.execute("INSERT INTO vmready_schema VALUES (%s, 0)", (Store.SCHEMA_VERSION + 1,))
        error = self.assertRaises(StoreError, Store.open, location)
        newer = Store.SCHEMA_VERSION + 1
        self.assertEqual(
            str(error),
            f"store {location} has schema version {newer}, newer than this vmready understands"
            f" ({Store.SCHEMA_VERSION}); upgrade vmready",
        )
        self.assertEqual(
            _versions(location), [*range(BASELINE_VERSION, Store.SCHEMA_VERSION + 1), newer]
        )

    def test_someOtherDatabaseIsRefused(self) -> None:
        location = postgres_location(self, migrated=False)
        with _raw(location) as raw:
            raw.execute("CREATE TABLE customers (name TEXT)")
        error = self.assertRaises(StoreError, Store.open, location)
        self.assertEqual(
            str(error),
            f"store {location} is not a vmready database"
            " (a PostgreSQL database without a vmready_schema table)",
        )

    def test_aFailedMigrationChangesNothing(self) -> None:
        location = postgres_location(self, migrated=False)

        following = Store.SCHEMA_VERSION + 1

        class Broken(Store):
            SCHEMA_VERSION = following
            POSTGRES_MIGRATIONS = [
                *Store.POSTGRES_MIGRATIONS,
                (following, "CREATE TABLE extra (x TEXT); ALTER TABLE nowhere ADD COLUMN y TEXT;"),
            ]

        error = self.assertRaises(StoreError, Broken.open, location)
        self.assertEqual(
            str(error),
            f"cannot open store {location}: migration to schema version {following} failed:"
            ' relation "nowhere" does not exist',
        )
        with _raw(location) as raw:
            (tables,) = raw.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()"
            ).fetchone() or (0,)
        self.assertEqual(tables, 0)

    def test_twoStoresOpeningAnEmptyDatabaseAtOnceMigrateItOnce(self) -> None:
        location = postgres_location(self, migrated=False)
        start = threading.Barrier(2)

        def open_store() -> Store:
            start.wait(JOIN_LIMIT)
            return Store.open(location)

        runs = [_in_thread(open_store) for _ in range(2)]
        for thread, _ in runs:
            thread.join(JOIN_LIMIT)
        stores = [outcome[0] for _, outcome in runs]
        for store in stores:
            if isinstance(store, Store):
                self.addCleanup(store.close)
        self.assertEqual([type(store) for store in stores], [Store, Store], stores)
        self.assertEqual(
            _versions(location), list(range(BASELINE_VERSION, Store.SCHEMA_VERSION + 1))
        )

    def test_theServersClockStampsLeases(self) -> None:
        store = Store.open(postgres_location(self), clock=lambda: 1000.0)
        self.addCleanup(store.close)
        with _raw(postgres_server().url()) as raw:
            (server_now,) = raw.execute("SELECT EXTRACT(EPOCH FROM now())::float8").fetchone() or (
                0.0,
            )
        expires = store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        # Rows keep the store's clock; the lease is on the server's.
        self.assertGreater(expires, server_now)
        self.assertEqual(store.instances.create_instance("web", {}, {}).created_at, 1000.0)


class TwoDaemonsTests(SynchronousTestCase):
    """Two stores (two daemons) on one database, writing one row at once."""

    def setUp(self) -> None:
        self.location = postgres_location(self)
        self.first = Store.open(self.location)
        self.second = Store.open(self.location)
        self.addCleanup(self.first.close)
        self.addCleanup(self.second.close)
        self.first.instances.create_instance("x", {}, {})
        self.first.instances.finish_task(
            "x", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )

    def test_aConfigUpdateWaitsForTheOtherAndKeepsItsKey(self) -> None:
        with self.first.database.batch():
            self.first.instances.update_config("x", {"user.first": "1"})
            thread, outcome = _in_thread(
                lambda: self.second.instances.update_config("x", {"user.second": "2"})
            )
            # The second read the row FOR UPDATE: it waits for this transaction.
            _wait_until_blocked(self.location)
        thread.join(JOIN_LIMIT)
        self.assertEqual(outcome[0].config, {"user.first": "1", "user.second": "2"})
        self.assertEqual(
            self.first.instances.get_instance("x").config, {"user.first": "1", "user.second": "2"}
        )

    def test_aClaimRacingAnotherIsTheConflictSQLiteGives(self) -> None:
        stop, rebuild = ACTIONS["stop"], ACTIONS["rebuild"]
        with self.first.database.batch():
            self.first.instances.claim_task("x", "stop", stop.allowed_from, TaskState.POWERING_OFF)
            thread, outcome = _in_thread(
                lambda: self.second.instances.claim_task(
                    "x", "rebuild", rebuild.allowed_from, TaskState.REBUILDING
                )
            )
            _wait_until_blocked(self.location)
        thread.join(JOIN_LIMIT)
        [error] = outcome
        self.assertIsInstance(error, Conflict)
        self.assertEqual(
            error.message, "Cannot rebuild instance x: it is stopping (a stop is in progress)"
        )
        self.assertEqual(
            self.second.instances.get_instance("x").task_state, TaskState.POWERING_OFF
        )

    def test_claimsFromTwoThreadsHaveExactlyOneWinner(self) -> None:
        start = threading.Barrier(2)
        stop = ACTIONS["stop"]

        def claim(store: Store) -> Any:
            start.wait(JOIN_LIMIT)
            return store.instances.claim_task(
                "x", "stop", stop.allowed_from, TaskState.POWERING_OFF
            )

        runs = [_in_thread(functools.partial(claim, store)) for store in (self.first, self.second)]
        for thread, _ in runs:
            thread.join(JOIN_LIMIT)
        outcomes = [outcome[0] for _, outcome in runs]
        conflicts = [o for o in outcomes if isinstance(o, Conflict)]
        self.assertEqual(len(conflicts), 1, outcomes)
        self.assertEqual(
            conflicts[0].message, "Cannot stop instance x: it is stopping (a stop is in progress)"
        )


class LostConnectionTests(TestCase):
    """The server goes away under the database thread, and comes back."""

    async def test_aWriteFailsWhileTheServerIsDownAndTheNextOneSucceedsAfter(self) -> None:
        server = postgres_server()
        self.addCleanup(server.start)  # whatever happens, the other tests get their server
        engine = Store.open(postgres_location(self))
        engine.instances.create_instance("vm1", {}, {})
        store = AsyncStore.threaded(reactor, engine)
        self.addCleanup(store.close)
        changes: list[str | None] = []

        def changed(health: StoreHealth) -> None:
            changes.append(health.error)

        store.health.subscribe(changed)
        executor = store.executor
        assert isinstance(executor, DatabaseThread)
        await store.instances.update_config("vm1", {"user.before": "1"})
        server.stop()
        executor.retry_for = 0.3
        error: Any = await self.assertFailure(
            store.instances.update_config("vm1", {"user.down": "1"}), StoreWriteFailed
        )
        self.assertIn(f"the store could not write {engine.path}: ", error.message)
        self.assertIn("nothing of this change was kept", error.message)
        self.assertEqual(len(error.message.splitlines()), 1)
        self.assertIsNotNone(store.health.failing_since)
        self.assertEqual(len(changes), 1)
        server.start()
        executor.retry_for = 60.0
        record = await store.instances.update_config("vm1", {"user.after": "1"})
        self.assertEqual(record.config, {"user.before": "1", "user.after": "1"})
        self.assertIsNone(store.health.failing_since)
        self.assertEqual(changes[-1], None)

    async def test_aBackendKilledBetweenCallsIsReplacedWithoutAFailure(self) -> None:
        location = postgres_location(self)
        engine = Store.open(location)
        engine.instances.create_instance("vm1", {}, {})
        store = AsyncStore.threaded(reactor, engine)
        self.addCleanup(store.close)
        await store.instances.update_config("vm1", {"user.a": "1"})
        self.assertGreater(postgres_server().terminate_backends(_database_of(location)), 0)
        # The batch meets the dead connection, is tried again on a new one, and commits.
        record = await store.instances.update_config("vm1", {"user.b": "2"})
        self.assertEqual(record.config, {"user.a": "1", "user.b": "2"})


class EventsTests(TestCase):
    """publish_event and reload_instances of AsyncStore."""

    def setUp(self) -> None:
        self.location = postgres_location(self)
        self.engine = Store.open(self.location)
        self.store = AsyncStore.threaded(reactor, self.engine)
        self.addCleanup(self.store.close)

    async def test_aPayloadPostgreSQLWouldRefuseIsAValueError(self) -> None:
        await self.assertFailure(self.store.members.publish_event("x" * 7901), ValueError)

    def test_sqliteHasNobodyToTell(self) -> None:
        engine = Store.open(self.mktemp())
        store = AsyncStore.inline(engine)
        self.addCleanup(engine.close)
        self.failureResultOf(store.members.publish_event("{}"), NotImplementedError)

    async def test_reloadReadsWhatOthersWroteMeanwhile(self) -> None:
        other = Store.open(self.location)
        self.addCleanup(other.close)
        await self.store.instances.create_instance("mine", {}, {})
        other.instances.create_instance("theirs", {}, {})
        other.certificates.set_agent_certificate("theirs", "ab" * 32)
        other.instances.delete_instance("mine")
        self.assertEqual([r.name for r in self.store.view.list_instances()], ["mine"])
        await self.store.reload_instances()
        self.assertEqual([r.name for r in self.store.view.list_instances()], ["theirs"])
        found = self.store.view.instance_for_fingerprint("ab" * 32)
        self.assertEqual(found.name if found else None, "theirs")


class DisplayLocationTests(SynchronousTestCase):
    """A ``postgresql://`` URL as shown and logged: no secret libpq would read from it shows."""

    def test_secretsAreMaskedWhereLibpqFindsThem(self) -> None:
        cases = {
            "postgresql://vm:s3cret@db:5432/vmready?sslmode=require": (
                "postgresql://vm:***@db:5432/vmready?sslmode=require"
            ),
            "postgresql://vm@db/vmready?password=s3cret&sslpassword=k3y": (
                "postgresql://vm@db/vmready?password=***&sslpassword=***"
            ),
            # libpq takes '#' and '?' in a password, where urllib sees a fragment or a query.
            "postgresql://vm:s3#cret@db/vmready": "postgresql://vm:***@db/vmready",
            "postgresql://vm:s3?cret@db/vmready": "postgresql://vm:***@db/vmready",
            "postgresql://vm:s3%40cret@db/vmready": "postgresql://vm:***@db/vmready",
            "postgresql://vmready@/vmready?host=/run/postgresql": (
                "postgresql://vmready@/vmready?host=/run/postgresql"
            ),
            "postgresql://[::1]:5433/vmready": "postgresql://[::1]:5433/vmready",
        }
        for location, shown in cases.items():
            self.assertEqual(display_location(location), shown, location)

    def test_whatLibpqCannotReadShowsNothingButItsScheme(self) -> None:
        self.assertEqual(
            display_location("postgresql://vm:s3cret@db/x?nonsense=1"), "postgresql://***"
        )
