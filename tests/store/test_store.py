"""Tests for vmready.store.sqlite, the store, on both its engines.

Each engine-independent class (instances, tasks, settle, config, actions,
snapshots, certificates, trust, rename) runs on SQLite as written, and again
on a real PostgreSQL server as its ``…OnPostgreSQL`` subclass (``OnPostgreSQL``
first in the bases: it only changes where ``open`` opens).  What is about
SQLite's file (its schema checks, WAL, kill -9 of a writer) stays SQLite's;
PostgreSQL's own (connection errors, migrations under a lock, row locks
between two daemons) is in ``test_postgres``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import psycopg
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

import vmready
from tests.postgres import postgres_location
from vmready.domain.model import (
    ActionRecord,
    ActionStep,
    BadRequest,
    Conflict,
    Forbidden,
    InstanceRecord,
    NotFound,
    StoreError,
)
from vmready.domain.states import ACTIONS, READY_KEY, PowerState, TaskState, VMState
from vmready.store.schema import MIGRATIONS
from vmready.store.sqlite import Store

_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(vmready.__file__)))

# Opens the store at argv[1] and prints the StoreError message (or "opened").
_OPEN_CHILD = """
import sys
from vmready.domain.model import StoreError
from vmready.store.sqlite import Store
try:
    Store.open(sys.argv[1]).close()
except StoreError as e:
    print(e)
else:
    print("opened")
"""

# Builds instances named <argv[2]>-NNNNN, printing "<name> <stage>" after every
# commit (stages in STAGES order); after argv[3] instances it waits on stdin, so it
# is still there to be killed.
_WRITER_CHILD = """
import sys
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.store.sqlite import Store

store = Store.open(sys.argv[1])
prefix = sys.argv[2]
for i in range(int(sys.argv[3])):
    name = f"{prefix}-{i:05d}"
    store.instances.create_instance(name, {"limits.cpu": "2", "user.n": str(i)}, {})
    print(name, "created", flush=True)
    action = store.actions.start_action(name, "create", f"req-{i}")
    print(name, "action-started", flush=True)
    store.actions.add_step(action, "spawning", "success")
    print(name, "step-added", flush=True)
    store.instances.finish_task(
        name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING, {READY_KEY: "true"}
    )
    print(name, "active", flush=True)
    store.actions.finish_action(action, "success")
    print(name, "action-finished", flush=True)
sys.stdin.read()
"""

STAGES = ("created", "action-started", "step-added", "active", "action-finished")


def _child_environment() -> dict[str, str]:
    """The environment for a child Python that imports this checkout's vmready."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SOURCE_ROOT, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def _raw(path: str) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection, to look at the file behind the store's back."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        yield connection
    finally:
        connection.close()


def _insert_old_instance(path: str, name: str) -> None:
    """An instance row as a store of schema version 1 to 4 wrote it (no member column)."""
    with _raw(path) as raw:
        raw.execute(
            "INSERT INTO instances (name, uuid, vm_state, task_state, power_state, config,"
            " devices, error, created_at, updated_at)"
            " VALUES (?, ?, 'stopped', NULL, 'shutdown', '{}', '{}', NULL, 1.0, 1.0)",
            (name, f"uuid-{name}"),
        )


def _store_at_version(path: str, version: int) -> None:
    """A store at ``path`` as vmready left it at schema ``version``, closed."""

    class Older(Store):
        SCHEMA_VERSION = version
        MIGRATIONS: ClassVar[list[tuple[int, str]]] = MIGRATIONS[:version]

    Older.open(path).close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def claim(store: Store, name: str, action: str, task: TaskState) -> InstanceRecord:
    """``store`` claims ``name`` for ``action`` from the states the action starts from."""
    return store.instances.claim_task(name, action, ACTIONS[action].allowed_from, task)


class _StoreTestCase(SynchronousTestCase):
    """Opens stores at ``self.location``, with a clock the test drives.

    An SQLite file in a fresh directory; ``OnPostgreSQL`` makes it a fresh
    PostgreSQL database instead.
    """

    # What the engine raises for a violated constraint.
    integrity_error: type[Exception] = sqlite3.IntegrityError

    def setUp(self) -> None:
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)
        self.path = os.path.join(self.directory, "vmready.sqlite")
        self.location = self.new_location()
        self.clock = Clock()
        self.clock.advance(1000)

    def new_location(self) -> str:
        """Where this test's store is."""
        return self.path

    def open(self) -> Store:
        store = Store.open(self.location, clock=self.clock.seconds)
        self.addCleanup(store.close)
        return store

    def active(self, store: Store, name: str, config: dict[str, str] | None = None) -> None:
        """Create name and finish its build, leaving it active with no task."""
        store.instances.create_instance(name, config or {}, {})
        store.instances.finish_task(name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING)

    def claimed(self, name: str, action: str, task: TaskState) -> Store:
        """A store whose active instance ``name`` is claimed for ``action``."""
        store = self.open()
        self.active(store, name)
        claim(store, name, action, task)
        return store


class OnPostgreSQL(_StoreTestCase):
    """The same tests, on a fresh database of the test run's PostgreSQL server."""

    integrity_error = psycopg.IntegrityError

    def new_location(self) -> str:
        return postgres_location(self)


_NEXT = Store.SCHEMA_VERSION + 1


class SchemaTests(_StoreTestCase):
    """Opening a store creates, migrates, or refuses it with one clear line."""

    def test_newStoreHasTheSchemaAndRecordsItsVersion(self) -> None:
        store = self.open()
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        self.assertEqual(Store.SCHEMA_VERSION, 6)
        self.assertEqual(store.path, self.path)
        with _raw(self.path) as raw:
            versions = raw.execute("SELECT version, applied_at FROM vmready_schema").fetchall()
            tables = {
                row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
        self.assertEqual(
            versions,
            [(1, 1000.0), (2, 1000.0), (3, 1000.0), (4, 1000.0), (5, 1000.0), (6, 1000.0)],
        )
        self.assertEqual(
            tables,
            {
                "vmready_schema",
                "instances",
                "actions",
                "steps",
                "snapshots",
                "agent_certificates",
                "trusted_certificates",
                "trust_tokens",
                "members",
                "retired_members",
            },
        )

    def test_migrationsAreOrderedAndEndAtTheSchemaVersion(self) -> None:
        versions = [version for version, _ in MIGRATIONS]
        self.assertEqual(versions, list(range(1, Store.SCHEMA_VERSION + 1)))

    def test_journalModeIsWAL(self) -> None:
        self.open()
        with _raw(self.path) as raw:
            self.assertEqual(raw.execute("PRAGMA journal_mode").fetchone(), ("wal",))

    def test_reopenKeepsDataAndDoesNotMigrateAgain(self) -> None:
        first = Store.open(self.path, clock=self.clock.seconds)
        created = first.instances.create_instance("web", {"limits.memory": "512"}, {})
        first.close()
        second = self.open()
        self.assertEqual(second.instances.get_instance("web"), created)
        with _raw(self.path) as raw:
            self.assertEqual(
                raw.execute("SELECT count(*) FROM vmready_schema").fetchone(),
                (Store.SCHEMA_VERSION,),
            )

    def test_pendingMigrationIsAppliedAndKeepsData(self) -> None:
        Store.open(self.path).close()
        with _raw(self.path) as raw:
            raw.execute(
                "INSERT INTO instances (name, uuid, vm_state, power_state, config, devices,"
                " created_at, updated_at) VALUES"
                " ('old', 'u', 'stopped', 'shutdown', '{}', '{}', 1, 1)"
            )

        class NextStore(Store):
            SCHEMA_VERSION = _NEXT
            MIGRATIONS: ClassVar[list[tuple[int, str]]] = [
                *MIGRATIONS,
                (
                    _NEXT,
                    "CREATE TABLE extra (x TEXT); ALTER TABLE instances ADD COLUMN note TEXT;",
                ),
            ]

        store = NextStore.open(self.path)
        self.addCleanup(store.close)
        self.assertEqual(store.schema_version, _NEXT)
        self.assertEqual(store.instances.get_instance("old").vm_state, VMState.STOPPED)
        with _raw(self.path) as raw:
            self.assertEqual(
                raw.execute("SELECT version FROM vmready_schema ORDER BY version").fetchall(),
                [(version,) for version in range(1, _NEXT + 1)],
            )
            self.assertEqual(raw.execute("SELECT note FROM instances").fetchall(), [(None,)])

    def test_failedMigrationChangesNothing(self) -> None:
        Store.open(self.path).close()

        class BrokenStore(Store):
            SCHEMA_VERSION = _NEXT
            MIGRATIONS: ClassVar[list[tuple[int, str]]] = [
                *MIGRATIONS,
                (_NEXT, "CREATE TABLE extra (x TEXT); ALTER TABLE nowhere ADD COLUMN y TEXT;"),
            ]

        error = self.assertRaises(StoreError, BrokenStore.open, self.path)
        self.assertEqual(
            str(error),
            f"cannot open store {self.path}: migration to schema version {_NEXT} failed:"
            " no such table: nowhere",
        )
        store = self.open()
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        with _raw(self.path) as raw:
            self.assertEqual(
                raw.execute("SELECT name FROM sqlite_master WHERE name = 'extra'").fetchall(), []
            )

    def test_newerSchemaIsRefusedAndLeftUntouched(self) -> None:
        store = Store.open(self.path)
        store.instances.create_instance("web", {}, {})
        store.close()
        with _raw(self.path) as raw:
            raw.execute("INSERT INTO vmready_schema VALUES (7, 0)")
        before = _read(self.path)
        error = self.assertRaises(StoreError, Store.open, self.path)
        self.assertEqual(
            str(error),
            f"store {self.path} has schema version 7, newer than this vmready understands"
            f" ({Store.SCHEMA_VERSION});"
            " upgrade vmready",
        )
        self.assertEqual(len(str(error).splitlines()), 1)
        self.assertEqual(_read(self.path), before)
        with _raw(self.path) as raw:
            self.assertEqual(
                raw.execute("SELECT max(version) FROM vmready_schema").fetchone(), (7,)
            )

    def test_unwritableDirectoryIsRefused(self) -> None:
        os.chmod(self.directory, 0o555)
        self.addCleanup(os.chmod, self.directory, 0o755)
        command = [sys.executable, "-c", _OPEN_CHILD, self.path]
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                self.skipTest("root writes any directory and setpriv is missing to drop that")
            caps = "-dac_override,-dac_read_search"
            command = [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, env=_child_environment(), check=False
        )
        self.assertEqual(
            (result.stdout, result.stderr),
            (f"cannot open store {self.path}: directory {self.directory} is not writable\n", ""),
        )
        self.assertFalse(os.path.exists(self.path))

    def test_missingDirectoryIsRefused(self) -> None:
        path = os.path.join(self.directory, "absent", "vmready.sqlite")
        error = self.assertRaises(StoreError, Store.open, path)
        self.assertEqual(
            str(error),
            f"cannot open store {path}: directory {os.path.dirname(path)} does not exist",
        )

    def test_directoryAsStorePathIsRefused(self) -> None:
        error = self.assertRaises(StoreError, Store.open, self.directory)
        self.assertEqual(str(error), f"cannot open store {self.directory}: it is a directory")

    def test_fileThatIsNotSQLiteIsRefusedAndLeftUntouched(self) -> None:
        contents = b"name: web\nstate: running\n" * 100
        with open(self.path, "wb") as f:
            f.write(contents)
        error = self.assertRaises(StoreError, Store.open, self.path)
        self.assertEqual(
            str(error), f"store {self.path} is not a vmready database (the file is not SQLite)"
        )
        self.assertEqual(_read(self.path), contents)
        self.assertEqual(os.listdir(self.directory), ["vmready.sqlite"])

    def test_someOtherSQLiteDatabaseIsRefused(self) -> None:
        with _raw(self.path) as raw:
            raw.execute("CREATE TABLE customers (name TEXT)")
        error = self.assertRaises(StoreError, Store.open, self.path)
        self.assertEqual(
            str(error),
            f"store {self.path} is not a vmready database"
            " (an SQLite database without a vmready_schema table)",
        )
        with _raw(self.path) as raw:
            tables = raw.execute("SELECT name FROM sqlite_master").fetchall()
        self.assertEqual(tables, [("customers",)])

    def test_emptyFileBecomesAStore(self) -> None:
        open(self.path, "wb").close()
        store = self.open()
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        self.assertEqual(store.instances.list_instances(), [])

    def test_versionOneStoreGainsAgentCertificatesAndKeepsItsInstances(self) -> None:
        _store_at_version(self.path, 1)
        _insert_old_instance(self.path, "web")
        store = self.open()
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        self.assertEqual(store.instances.get_instance("web").name, "web")
        store.certificates.set_agent_certificate("web", "ab" * 32)
        found = store.certificates.instance_for_fingerprint("ab" * 32)
        assert found is not None
        self.assertEqual(found.name, "web")

    def test_version2HistoriesAreKeptByUuidWhereTheyCanBe(self) -> None:
        """Migrated actions belong to the instance of their name only if it existed then."""
        _store_at_version(self.path, 2)
        with _raw(self.path) as raw:
            # An action of an earlier "web" (t=5), then today's web (created at t=10) and its own.
            raw.execute(
                "INSERT INTO instances (name, uuid, vm_state, power_state, config, devices,"
                " created_at, updated_at) VALUES"
                " ('web', 'u2', 'stopped', 'shutdown', '{}', '{}', 10, 10)"
            )
            insert = "INSERT INTO actions (instance, action, request_id, started_at) VALUES"
            before = raw.execute(f"{insert} ('web', 'create', 'req-1', 5)").lastrowid
            after = raw.execute(f"{insert} ('web', 'stop', 'req-2', 20)").lastrowid
        store = self.open()
        self.assertEqual([a.id for a in store.actions.list_actions("web")], [after])
        with _raw(self.path) as raw:
            orphan = raw.execute(
                "SELECT instance_uuid FROM actions WHERE id = ?", (before,)
            ).fetchone()
        self.assertEqual(orphan, (None,))

    def test_versionThreeStoreGainsTheTrustTablesAndKeepsItsData(self) -> None:
        _store_at_version(self.path, 3)
        _insert_old_instance(self.path, "web")
        with _raw(self.path) as raw:
            raw.execute("INSERT INTO agent_certificates VALUES ('web', ?, 1.0)", ("ee" * 32,))
        store = self.open()
        self.assertEqual(store.schema_version, Store.SCHEMA_VERSION)
        self.assertEqual(store.instances.get_instance("web").name, "web")
        self.assertEqual(store.certificates.agent_fingerprints(), {"web": "ee" * 32})
        self.assertEqual(store.trust.trusted_certificates(), [])
        store.trust.add_token("x", "h", 1.0, 2.0)


class InstanceTests(_StoreTestCase):
    """Creating, reading, listing and deleting instances."""

    def test_newInstanceIsBuildingWithASpawningTask(self) -> None:
        store = self.open()
        record = store.instances.create_instance(
            "web", {"limits.memory": "512"}, {"root": {"type": "disk", "path": "/"}}
        )
        self.assertEqual(
            (record.name, record.vm_state, record.task_state, record.power_state),
            ("web", VMState.BUILDING, TaskState.SPAWNING, PowerState.NOSTATE),
        )
        self.assertEqual(record.config, {"limits.memory": "512"})
        self.assertEqual(record.devices, {"root": {"type": "disk", "path": "/"}})
        self.assertEqual((record.created_at, record.updated_at), (1000.0, 1000.0))
        self.assertIsNone(record.error)
        self.assertEqual(uuid.UUID(record.uuid).version, 4)
        self.assertEqual(record.display_status, "BUILD")

    def test_getReturnsWhatWasCreated(self) -> None:
        store = self.open()
        created = store.instances.create_instance("web", {"user.a": "1"}, {})
        self.assertEqual(store.instances.get_instance("web"), created)
        self.assertEqual(store.instances.find_instance("web"), created)

    def test_eachInstanceHasItsOwnUUID(self) -> None:
        store = self.open()
        first = store.instances.create_instance("a", {}, {})
        second = store.instances.create_instance("b", {}, {})
        self.assertNotEqual(first.uuid, second.uuid)

    def test_unknownInstanceIsNotFound(self) -> None:
        store = self.open()
        error = self.assertRaises(NotFound, store.instances.get_instance, "ghost")
        self.assertEqual((error.message, error.http_status), ("Instance ghost not found", 404))
        self.assertIsNone(store.instances.find_instance("ghost"))

    def test_listIsOrderedByName(self) -> None:
        store = self.open()
        for name in ("web", "db", "cache"):
            store.instances.create_instance(name, {}, {})
        self.assertEqual(
            [r.name for r in store.instances.list_instances()], ["cache", "db", "web"]
        )

    def test_duplicateNameIsAConflictAndKeepsTheFirst(self) -> None:
        store = self.open()
        first = store.instances.create_instance("web", {"user.a": "1"}, {})
        error = self.assertRaises(
            Conflict, store.instances.create_instance, "web", {"user.a": "2"}, {}
        )
        self.assertEqual((error.message, error.http_status), ("Instance web already exists", 409))
        self.assertEqual(store.instances.list_instances(), [first])

    def test_configValuesMustBeStrings(self) -> None:
        store = self.open()
        bad: Any = {"limits.cpu": 2}
        self.assertRaises(BadRequest, store.instances.create_instance, "web", bad, {})
        self.assertIsNone(store.instances.find_instance("web"))

    def test_deleteRemovesTheInstance(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        store.instances.delete_instance("web")
        self.assertIsNone(store.instances.find_instance("web"))
        self.assertRaises(NotFound, store.instances.delete_instance, "web")

    def test_deleteKeepsTheActionHistory(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        action = store.actions.start_action("web", "delete", "req-1")
        store.actions.add_step(action, "deleting", "success")
        store.actions.finish_action(action, "success")
        store.instances.delete_instance("web")
        [history] = store.actions.list_actions("web")
        self.assertEqual((history.action, history.result), ("delete", "success"))
        self.assertEqual([step.name for step in history.steps], ["deleting"])

    def test_aNameUsedAgainStartsAHistoryOfItsOwn(self) -> None:
        """Histories are kept by the instance's uuid: a delete and re-create never mix them."""
        store = self.open()
        store.instances.create_instance("web", {}, {})
        first = store.actions.start_action("web", "delete", "req-1")
        store.actions.finish_action(first, "success")
        store.instances.delete_instance("web")
        store.instances.create_instance("web", {}, {})
        self.assertEqual(store.actions.list_actions("web"), [])
        second = store.actions.start_action("web", "stop", "req-2")
        self.assertEqual([a.id for a in store.actions.list_actions("web")], [second])
        store.instances.delete_instance("web")
        # Gone: the history of the last instance of that name.
        self.assertEqual([a.id for a in store.actions.list_actions("web")], [second])

    def test_deleteTakesTheSnapshotsWithIt(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        store.snapshots.create_snapshot("web", "snap0", False, {})
        store.instances.delete_instance("web")
        store.instances.create_instance("web", {}, {})
        self.assertEqual(store.snapshots.list_snapshots("web"), [])


class TaskTests(_StoreTestCase):
    """Tasks are claimed, advanced and finished by compare-and-swap in the database."""

    def test_claimSetsTheTaskAndTouchesUpdatedAt(self) -> None:
        store = self.open()
        self.active(store, "web")
        self.clock.advance(5)
        record = claim(store, "web", "rebuild", TaskState.REBUILDING)
        self.assertEqual(
            (record.vm_state, record.task_state), (VMState.ACTIVE, TaskState.REBUILDING)
        )
        self.assertEqual(record.updated_at, 1005.0)
        self.assertEqual(store.instances.get_instance("web"), record)

    def test_secondClaimLosesWithTheTaskStateConflict(self) -> None:
        store = self.claimed("x", "rebuild", TaskState.REBUILDING)
        error = self.assertRaises(Conflict, claim, store, "x", "resize", TaskState.RESIZE_QUEUED)
        self.assertEqual(
            (error.message, error.http_status),
            ("Cannot resize instance x: it is rebuilding (a rebuild is in progress)", 409),
        )
        self.assertEqual(store.instances.get_instance("x").task_state, TaskState.REBUILDING)

    def test_twoConnectionsClaimingTheSameInstanceOneWins(self) -> None:
        first = self.open()
        second = self.open()
        self.active(first, "x")
        claim(second, "x", "rebuild", TaskState.REBUILDING)
        error = self.assertRaises(Conflict, claim, first, "x", "resize", TaskState.RESIZE_QUEUED)
        self.assertEqual(
            error.message, "Cannot resize instance x: it is rebuilding (a rebuild is in progress)"
        )
        self.assertEqual(first.instances.get_instance("x").task_state, TaskState.REBUILDING)

    def test_racingClaimsFromManyConnectionsExactlyOneWins(self) -> None:
        self.active(self.open(), "x")
        contenders = 2 * [
            ("rebuild", TaskState.REBUILDING),
            ("resize", TaskState.RESIZE_QUEUED),
            ("stop", TaskState.POWERING_OFF),
            ("restart", TaskState.REBOOTING),
            ("freeze", TaskState.PAUSING),
            ("delete", TaskState.DELETING),
        ]
        start = threading.Barrier(len(contenders))
        outcomes: dict[int, InstanceRecord | BaseException] = {}

        def contend(index: int) -> None:
            action, task = contenders[index]
            try:
                store = Store.open(self.location)
            except BaseException as error:
                outcomes[index] = error
                start.abort()
                return
            try:
                start.wait(timeout=60)
                outcomes[index] = claim(store, "x", action, task)
            except BaseException as error:
                outcomes[index] = error
            finally:
                store.close()

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(contenders))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        winners = [i for i, outcome in outcomes.items() if isinstance(outcome, InstanceRecord)]
        self.assertEqual(len(winners), 1, outcomes)
        [winner] = winners
        won_task = contenders[winner][1]
        self.assertEqual(outcomes[winner], self.open().instances.get_instance("x"))
        self.assertEqual(self.open().instances.get_instance("x").task_state, won_task)
        losers = sorted(set(range(len(contenders))) - {winner})
        doing = {
            TaskState.REBUILDING: "rebuilding (a rebuild is in progress)",
            TaskState.RESIZE_QUEUED: "resizing (a resize is in progress)",
            TaskState.POWERING_OFF: "stopping (a stop is in progress)",
            TaskState.REBOOTING: "restarting (a restart is in progress)",
            TaskState.PAUSING: "freezing (a freeze is in progress)",
            TaskState.DELETING: "deleting (a delete is in progress)",
        }
        self.assertEqual(
            [getattr(outcomes[i], "message", repr(outcomes[i])) for i in losers],
            [f"Cannot {contenders[i][0]} instance x: it is {doing[won_task]}" for i in losers],
        )

    def test_claimFromTheWrongVMStateGivesTheVMStateConflict(self) -> None:
        store = self.claimed("x", "stop", TaskState.POWERING_OFF)
        store.instances.finish_task(
            "x", TaskState.POWERING_OFF, VMState.STOPPED, PowerState.SHUTDOWN
        )
        error = self.assertRaises(Conflict, claim, store, "x", "restart", TaskState.REBOOTING)
        self.assertEqual(error.message, "Cannot restart instance x: it is stopped")
        self.assertIsNone(store.instances.get_instance("x").task_state)

    def test_claimOnAnUnknownInstanceIsNotFound(self) -> None:
        store = self.open()
        error = self.assertRaises(
            NotFound,
            store.instances.claim_task,
            "ghost",
            "start",
            frozenset(VMState),
            TaskState.POWERING_ON,
        )
        self.assertEqual(error.message, "Instance ghost not found")

    def test_advanceMovesToTheNextTask(self) -> None:
        store = self.claimed("x", "resize", TaskState.RESIZE_QUEUED)
        self.clock.advance(1)
        record = store.instances.advance_task("x", TaskState.RESIZE_QUEUED, TaskState.RESIZE_PREP)
        self.assertEqual((record.task_state, record.updated_at), (TaskState.RESIZE_PREP, 1001.0))

    def test_advanceFromAStaleTaskIsAConflictAndChangesNothing(self) -> None:
        store = self.claimed("x", "resize", TaskState.RESIZE_QUEUED)
        store.instances.advance_task("x", TaskState.RESIZE_QUEUED, TaskState.RESIZE_PREP)
        error = self.assertRaises(
            Conflict,
            store.instances.advance_task,
            "x",
            TaskState.RESIZE_QUEUED,
            TaskState.RESIZE_PREP,
        )
        self.assertEqual(
            error.message,
            "Instance x moved on: it is at step resize-prep, not at step resize-queued",
        )
        self.assertEqual(store.instances.get_instance("x").task_state, TaskState.RESIZE_PREP)

    def test_finishEndsTheTaskAndAppliesStatesAndConfig(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {"limits.cpu": "1", "volatile.old": "gone"}, {})
        self.clock.advance(3)
        record = store.instances.finish_task(
            "x",
            TaskState.SPAWNING,
            VMState.ACTIVE,
            PowerState.RUNNING,
            {"limits.cpu": "2", "volatile.old": None, READY_KEY: "false"},
        )
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state),
            (VMState.ACTIVE, None, PowerState.RUNNING),
        )
        self.assertEqual(record.config, {"limits.cpu": "2", READY_KEY: "false"})
        self.assertEqual(record.updated_at, 1003.0)
        self.assertEqual(store.instances.get_instance("x"), record)

    def test_finishWithoutPowerStateKeepsIt(self) -> None:
        store = self.claimed("x", "freeze", TaskState.PAUSING)
        record = store.instances.finish_task("x", TaskState.PAUSING, VMState.PAUSED)
        self.assertEqual(record.power_state, PowerState.RUNNING)

    def test_finishFromAStaleTaskIsAConflictAndChangesNothing(self) -> None:
        store = self.open()
        self.active(store, "x")
        before = store.instances.get_instance("x")
        error = self.assertRaises(
            Conflict,
            store.instances.finish_task,
            "x",
            TaskState.REBUILDING,
            VMState.STOPPED,
            PowerState.SHUTDOWN,
            {"user.a": "1"},
        )
        self.assertEqual(
            error.message, "Instance x moved on: it is no longer in a task, not at step rebuilding"
        )
        self.assertEqual(store.instances.get_instance("x"), before)

    def test_setErrorKeepsTheReasonAndEndsTheTask(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {}, {})
        record = store.instances.set_error(
            "x", "VM process exited with status 1", PowerState.CRASHED
        )
        self.assertEqual(
            (record.vm_state, record.task_state, record.power_state, record.error),
            (VMState.ERROR, None, PowerState.CRASHED, "VM process exited with status 1"),
        )
        self.assertEqual(record.status.name, "Error")

    def test_errorSurvivesReopen(self) -> None:
        store = Store.open(self.location)
        store.instances.create_instance("x", {}, {})
        store.instances.set_error("x", "boom")
        store.close()
        record = self.open().instances.get_instance("x")
        self.assertEqual((record.vm_state, record.error), (VMState.ERROR, "boom"))

    def test_setErrorWithoutPowerStateKeepsIt(self) -> None:
        store = self.open()
        self.active(store, "x")
        self.assertEqual(store.instances.set_error("x", "boom").power_state, PowerState.RUNNING)

    def test_finishingOutOfErrorClearsTheError(self) -> None:
        store = self.open()
        self.active(store, "x")
        store.instances.set_error("x", "boom")
        claim(store, "x", "rebuild", TaskState.REBUILDING)
        self.assertEqual(store.instances.get_instance("x").error, "boom")
        record = store.instances.finish_task(
            "x", TaskState.REBUILDING, VMState.ACTIVE, PowerState.RUNNING
        )
        self.assertEqual((record.vm_state, record.error), (VMState.ACTIVE, None))

    def test_finishingIntoErrorKeepsTheError(self) -> None:
        store = self.open()
        self.active(store, "x")
        store.instances.set_error("x", "boom")
        claim(store, "x", "rebuild", TaskState.REBUILDING)
        record = store.instances.finish_task("x", TaskState.REBUILDING, VMState.ERROR)
        self.assertEqual((record.vm_state, record.error), (VMState.ERROR, "boom"))

    def test_setPowerStateRecordsIt(self) -> None:
        store = self.open()
        self.active(store, "x")
        self.clock.advance(2)
        record = store.instances.set_power_state("x", PowerState.SHUTDOWN)
        self.assertEqual((record.power_state, record.updated_at), (PowerState.SHUTDOWN, 1002.0))
        self.assertEqual(store.instances.get_instance("x").power_state, PowerState.SHUTDOWN)

    def test_unchangedPowerStateDoesNotTouchTheInstance(self) -> None:
        store = self.open()
        self.active(store, "x")
        before = store.instances.get_instance("x")
        self.clock.advance(2)
        self.assertEqual(store.instances.set_power_state("x", PowerState.RUNNING), before)

    def test_statesOfAnUnknownInstanceAreNotFound(self) -> None:
        store = self.open()
        self.assertRaises(NotFound, store.instances.set_error, "ghost", "boom")
        self.assertRaises(NotFound, store.instances.set_power_state, "ghost", PowerState.RUNNING)
        self.assertRaises(
            NotFound,
            store.instances.advance_task,
            "ghost",
            TaskState.SPAWNING,
            TaskState.REBUILDING,
        )
        self.assertRaises(
            NotFound, store.instances.finish_task, "ghost", TaskState.SPAWNING, VMState.ACTIVE
        )


class SettleTests(_StoreTestCase):
    """Changes outside an action: one conditional write that never beats a task or an error."""

    RUNNING = frozenset({VMState.ACTIVE, VMState.PAUSED, VMState.RESIZED})

    def test_settleMovesAnIdleRunningInstance(self) -> None:
        store = self.open()
        self.active(store, "web", {"volatile.last_state.ready": "true"})
        record = store.instances.settle(
            "web",
            self.RUNNING,
            VMState.STOPPED,
            PowerState.SHUTDOWN,
            {"volatile.last_state.ready": "false"},
        )
        assert record is not None
        self.assertEqual(
            (record.vm_state, record.power_state, record.config["volatile.last_state.ready"]),
            (VMState.STOPPED, PowerState.SHUTDOWN, "false"),
        )

    def test_settleLeavesAnInstanceWithATaskAlone(self) -> None:
        store = self.open()
        self.active(store, "web")
        store.instances.claim_task(
            "web", "rebuild", frozenset({VMState.ACTIVE}), TaskState.REBUILDING
        )
        self.assertIsNone(
            store.instances.settle("web", self.RUNNING, VMState.STOPPED, PowerState.SHUTDOWN)
        )
        self.assertEqual(store.instances.get_instance("web").task_state, TaskState.REBUILDING)

    def test_settleNeverOverwritesAnError(self) -> None:
        store = self.open()
        self.active(store, "web")
        store.instances.set_error("web", "disk on fire")
        self.assertIsNone(
            store.instances.settle("web", self.RUNNING, VMState.STOPPED, PowerState.SHUTDOWN)
        )
        record = store.instances.get_instance("web")
        self.assertEqual((record.vm_state, record.error), (VMState.ERROR, "disk on fire"))

    def test_settleOfAMissingInstanceIsNone(self) -> None:
        store = self.open()
        self.assertIsNone(
            store.instances.settle("nope", self.RUNNING, VMState.STOPPED, PowerState.SHUTDOWN)
        )

    def test_settleInErrorSaysWhy(self) -> None:
        store = self.open()
        self.active(store, "web")
        record = store.instances.settle(
            "web", frozenset(VMState), VMState.ERROR, PowerState.CRASHED, error="its VM died"
        )
        assert record is not None
        self.assertEqual(
            (record.vm_state, record.power_state, record.error, record.task_state),
            (VMState.ERROR, PowerState.CRASHED, "its VM died", None),
        )

    def test_settleInErrorLeavesAnInstanceATaskClaimedSinceAlone(self) -> None:
        """A VM death read before a restart claimed the instance is the restart's to see: the
        claim is not ended under it (which let a start run beside the restart)."""
        store = self.open()
        self.active(store, "web")
        store.instances.claim_task(
            "web", "restart", frozenset({VMState.ACTIVE}), TaskState.REBOOTING
        )
        self.assertIsNone(
            store.instances.settle(
                "web", frozenset(VMState), VMState.ERROR, PowerState.CRASHED, error="died"
            )
        )
        record = store.instances.get_instance("web")
        self.assertEqual(
            (record.vm_state, record.task_state, record.error),
            (VMState.ACTIVE, TaskState.REBOOTING, None),
        )


class ConfigTests(_StoreTestCase):
    """Config updates and the ready key."""

    def test_updateConfigSetsAndDeletesKeys(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {"user.keep": "1", "user.drop": "2"}, {})
        record = store.instances.update_config(
            "x", {"user.drop": None, "user.new": "3", "user.absent": None}
        )
        self.assertEqual(record.config, {"user.keep": "1", "user.new": "3"})
        self.assertEqual(store.instances.get_instance("x").config, record.config)

    def test_updateConfigOfAnUnknownInstanceIsNotFound(self) -> None:
        store = self.open()
        self.assertRaises(NotFound, store.instances.update_config, "ghost", {"user.a": "1"})

    def test_readyKeyMakesARunningInstanceReady(self) -> None:
        store = self.open()
        self.active(store, "x")
        self.assertEqual(
            store.instances.update_config("x", {READY_KEY: "true"}).status.name, "Ready"
        )

    def test_clearReadyEverywhereRemovesTheKeyAndCountsThem(self) -> None:
        store = self.open()
        self.active(store, "a", {READY_KEY: "true", "user.a": "1"})
        self.active(store, "b", {READY_KEY: "false"})
        self.active(store, "c", {"user.note": f"{READY_KEY} is mentioned only in a value"})
        self.active(store, "d")
        self.assertEqual(store.instances.clear_ready_everywhere(), 2)
        self.assertEqual(
            {r.name: r.config for r in store.instances.list_instances()},
            {
                "a": {"user.a": "1"},
                "b": {},
                "c": {"user.note": f"{READY_KEY} is mentioned only in a value"},
                "d": {},
            },
        )
        self.assertEqual(store.instances.get_instance("a").status.name, "Running")
        self.assertEqual(store.instances.clear_ready_everywhere(), 0)


class ActionHistoryTests(_StoreTestCase):
    """Nova-style instance actions with their steps."""

    def test_actionWithStepsInOrderAndTimestampsFromTheClock(self) -> None:
        store = self.open()
        action = store.actions.start_action("x", "resize", "req-7")
        self.clock.advance(1)
        step = store.actions.start_step(action, "resize-queued")
        self.clock.advance(2)
        store.actions.finish_step(step, "success")
        store.actions.add_step(action, "resize-prep", "error", "no memory")
        self.clock.advance(3)
        store.actions.finish_action(action, "error", "no memory")
        self.assertEqual(
            store.actions.list_actions("x"),
            [
                ActionRecord(
                    id=action,
                    instance="x",
                    action="resize",
                    request_id="req-7",
                    started_at=1000.0,
                    finished_at=1006.0,
                    result="error",
                    error="no memory",
                    steps=(
                        ActionStep("resize-queued", 1001.0, 1003.0, "success", None),
                        ActionStep("resize-prep", 1003.0, 1003.0, "error", "no memory"),
                    ),
                )
            ],
        )

    def test_actionsAreListedNewestFirstPerInstance(self) -> None:
        store = self.open()
        first = store.actions.start_action("x", "create", "req-1")
        store.actions.start_action("y", "create", "req-2")
        self.clock.advance(1)
        second = store.actions.start_action("x", "stop", "req-3")
        third = store.actions.start_action("x", "start", "req-4")
        self.assertEqual([a.id for a in store.actions.list_actions("x")], [third, second, first])
        self.assertEqual(store.actions.list_actions("nobody"), [])

    def test_unfinishedActionsAreTheOnesWithoutAnEnd(self) -> None:
        store = self.open()
        done = store.actions.start_action("x", "create", "req-1")
        store.actions.finish_action(done, "success")
        open_x = store.actions.start_action("x", "stop", "req-2")
        store.actions.start_step(open_x, "powering-off")
        open_y = store.actions.start_action("y", "create", "req-3")
        unfinished = store.actions.unfinished_actions()
        self.assertEqual([a.id for a in unfinished], [open_x, open_y])
        self.assertEqual(
            unfinished[0].steps, (ActionStep("powering-off", 1000.0, None, None, None),)
        )

    def test_stepsOfAnUnknownActionAreNotFound(self) -> None:
        store = self.open()
        self.assertRaises(NotFound, store.actions.start_step, 99, "spawning")
        self.assertRaises(NotFound, store.actions.add_step, 99, "spawning", "success")
        self.assertRaises(NotFound, store.actions.finish_step, 99, "success")
        self.assertRaises(NotFound, store.actions.finish_action, 99, "success")

    def test_resultIsSuccessOrError(self) -> None:
        store = self.open()
        action = store.actions.start_action("x", "create", "req-1")
        self.assertRaises(ValueError, store.actions.finish_action, action, "Success")
        self.assertRaises(ValueError, store.actions.add_step, action, "spawning", "ok")
        self.assertEqual(store.actions.unfinished_actions()[0].steps, ())


class SnapshotTests(_StoreTestCase):
    """Snapshot records, unique per instance."""

    def test_createdSnapshotIsListed(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {}, {})
        created = store.snapshots.create_snapshot("x", "snap0", True, {"devices": ["vmready"]})
        self.clock.advance(1)
        store.snapshots.create_snapshot("x", "snap1", False, {})
        self.assertEqual(
            created,
            {
                "instance": "x",
                "name": "snap0",
                "stateful": True,
                "created_at": 1000.0,
                "metadata": {"devices": ["vmready"]},
            },
        )
        self.assertEqual(
            [s["name"] for s in store.snapshots.list_snapshots("x")], ["snap0", "snap1"]
        )
        self.assertEqual(store.snapshots.list_snapshots("x")[0], created)

    def test_deletedSnapshotIsReturnedAndForgottenAndOthersStay(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {}, {})
        store.instances.create_instance("y", {}, {})
        created = store.snapshots.create_snapshot("x", "snap0", True, {"devices": ["vmready"]})
        store.snapshots.create_snapshot("x", "snap1", False, {})
        store.snapshots.create_snapshot("y", "snap0", False, {})
        self.assertEqual(store.snapshots.delete_snapshot("x", "snap0"), created)
        self.assertEqual([s["name"] for s in store.snapshots.list_snapshots("x")], ["snap1"])
        self.assertEqual([s["name"] for s in store.snapshots.list_snapshots("y")], ["snap0"])
        self.assertIsNone(store.snapshots.find_snapshot("x", "snap0"))
        # The name is free again.
        store.snapshots.create_snapshot("x", "snap0", False, {})

    def test_deletingASnapshotThatIsNotThereIsNotFound(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {}, {})
        error = self.assertRaises(NotFound, store.snapshots.delete_snapshot, "x", "snap0")
        self.assertEqual(error.message, "Snapshot snap0 of instance x not found")
        self.assertRaises(NotFound, store.snapshots.delete_snapshot, "nobody", "snap0")

    def test_snapshotNamesAreUniquePerInstance(self) -> None:
        store = self.open()
        store.instances.create_instance("x", {}, {})
        store.instances.create_instance("y", {}, {})
        store.snapshots.create_snapshot("x", "snap0", False, {})
        error = self.assertRaises(
            Conflict, store.snapshots.create_snapshot, "x", "snap0", True, {}
        )
        self.assertEqual(error.message, "Snapshot snap0 of instance x already exists")
        store.snapshots.create_snapshot("y", "snap0", True, {})
        self.assertEqual([s["stateful"] for s in store.snapshots.list_snapshots("x")], [False])

    def test_snapshotsOfAnUnknownInstanceAreNotFound(self) -> None:
        store = self.open()
        self.assertRaises(NotFound, store.snapshots.create_snapshot, "ghost", "snap0", False, {})
        self.assertRaises(NotFound, store.snapshots.list_snapshots, "ghost")


class DurabilityTests(_StoreTestCase):
    """What a writer reported committed survives kill -9 of that writer."""

    ROUNDS = len(STAGES) + 1

    def test_killDashNineLosesNothingThatWasCommitted(self) -> None:
        reported: dict[str, int] = {}
        last_reported: set[str] = set()
        for round_number in range(self.ROUNDS):
            # Each round is killed at a different stage of the writer's loop.
            lines = self._runAndKill(f"r{round_number}", 40 + round_number)
            for line in lines:
                name, stage_name = line.split()
                reported[name] = STAGES.index(stage_name)
            last_reported.add(lines[-1].split()[0])

        store = self.open()
        with _raw(self.path) as raw:
            self.assertEqual(raw.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
        found = {record.name: record for record in store.instances.list_instances()}
        for name, stage in reported.items():
            self.assertIn(name, found)
            progress = self._progress(store, found[name])
            if name in last_reported:
                # The writer may have committed once more between its last line and the kill.
                self.assertIn(progress, (stage, stage + 1), name)
            else:
                self.assertEqual(progress, stage, name)
        unreported = {
            name: self._progress(store, found[name]) for name in set(found) - set(reported)
        }
        self.assertLessEqual(len(unreported), self.ROUNDS)
        self.assertEqual(set(unreported.values()) | {0}, {0})

    def _progress(self, store: Store, record: InstanceRecord) -> int:
        """How far the writer's loop got for record, as an index into STAGES, checking states."""
        self.assertEqual(record.config["user.n"], str(int(record.name.split("-")[1])))
        actions = store.actions.list_actions(record.name)
        progress = STAGES.index("created")
        if actions:
            [action] = actions
            progress = STAGES.index("action-started")
            if action.steps:
                self.assertEqual([step.name for step in action.steps], ["spawning"])
                progress = STAGES.index("step-added")
        if record.vm_state is VMState.ACTIVE:
            self.assertEqual(progress, STAGES.index("step-added"))
            self.assertEqual(
                (record.task_state, record.power_state, record.ready),
                (None, PowerState.RUNNING, True),
            )
            progress = STAGES.index("active")
            if actions[0].finished_at is not None:
                self.assertEqual(actions[0].result, "success")
                progress = STAGES.index("action-finished")
        else:
            self.assertEqual(
                (record.vm_state, record.task_state), (VMState.BUILDING, TaskState.SPAWNING)
            )
            self.assertIsNone(actions[0].finished_at if actions else None)
        return progress

    def _runAndKill(self, prefix: str, commits: int) -> list[str]:
        """Run a writer until it has reported commits commits, SIGKILL it, return its lines."""
        stderr_path = os.path.join(self.directory, f"{prefix}.stderr")
        with open(stderr_path, "wb") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c", _WRITER_CHILD, self.path, prefix, "100000"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=_child_environment(),
            )
        # A watchdog, not a timing assertion: a hung writer fails the test instead of hanging it.
        watchdog = threading.Timer(120, child.kill)
        watchdog.start()
        try:
            stdout: IO[bytes] | None = child.stdout
            assert stdout is not None
            lines: list[bytes] = []
            while len(lines) < commits:
                line = stdout.readline()
                if not line:
                    break
                lines.append(line)
            child.send_signal(signal.SIGKILL)
            lines.extend(stdout.readlines())
            child.wait()
        finally:
            watchdog.cancel()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
        self.assertEqual(child.returncode, -signal.SIGKILL, _read(stderr_path).decode())
        self.assertGreaterEqual(len(lines), commits, _read(stderr_path).decode())
        # A line cut off by the kill is not a report.
        return [line.decode() for line in lines if line.endswith(b"\n")]


class AgentCertificateTests(_StoreTestCase):
    """Which instance a client certificate fingerprint belongs to."""

    def test_unknownFingerprintIsNoInstance(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        self.assertIsNone(store.certificates.instance_for_fingerprint("00" * 32))

    def test_reissuingReplacesTheOldFingerprint(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        store.certificates.set_agent_certificate("web", "aa" * 32)
        store.certificates.set_agent_certificate("web", "bb" * 32)
        self.assertIsNone(store.certificates.instance_for_fingerprint("aa" * 32))
        found = store.certificates.instance_for_fingerprint("bb" * 32)
        assert found is not None
        self.assertEqual(found.name, "web")

    def test_deletingTheInstanceRevokesItsCertificate(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        store.certificates.set_agent_certificate("web", "aa" * 32)
        store.instances.delete_instance("web")
        store.instances.create_instance("web", {}, {})
        self.assertIsNone(store.certificates.instance_for_fingerprint("aa" * 32))

    def test_certificateForAnUnknownInstanceIsRefused(self) -> None:
        store = self.open()
        self.assertRaises(NotFound, store.certificates.set_agent_certificate, "ghost", "aa" * 32)

    def test_oneFingerprintBelongsToOneInstance(self) -> None:
        store = self.open()
        store.instances.create_instance("web", {}, {})
        store.instances.create_instance("db", {}, {})
        store.certificates.set_agent_certificate("web", "aa" * 32)
        self.assertRaises(
            self.integrity_error, store.certificates.set_agent_certificate, "db", "aa" * 32
        )


class TrustStoreTests(_StoreTestCase):
    """The remote API's trusted certificates and one-time tokens."""

    def test_tokenTrustsOnceAndIsGone(self) -> None:
        store = self.open()
        store.trust.add_token("laptop", "h1", 100.0, 200.0)
        entry = store.trust.redeem_token("h1", "ab" * 32, 150.0)
        self.assertEqual(
            (entry.name, entry.fingerprint, entry.added_at), ("laptop", "ab" * 32, 150.0)
        )
        self.assertEqual(store.trust.trusted_certificates(), [entry])
        error = self.assertRaises(Forbidden, store.trust.redeem_token, "h1", "cd" * 32, 151.0)
        self.assertEqual(
            error.message, "the trust token is unknown: used already, revoked or never issued"
        )

    def test_expiredTokenIsRefusedAndDeleted(self) -> None:
        store = self.open()
        store.trust.add_token("laptop", "h1", 100.0, 200.0)
        error = self.assertRaises(Forbidden, store.trust.redeem_token, "h1", "ab" * 32, 200.0)
        self.assertEqual(error.message, "the trust token for laptop has expired")
        self.assertEqual(store.trust.trusted_certificates(), [])
        # The name is free again.
        store.trust.add_token("laptop", "h2", 300.0, 400.0)

    def test_namesAreUnique(self) -> None:
        store = self.open()
        store.trust.add_token("laptop", "h1", 100.0, 200.0)
        error = self.assertRaises(Conflict, store.trust.add_token, "laptop", "h2", 100.0, 200.0)
        self.assertEqual(error.message, "a trust token for laptop is pending already")
        store.trust.redeem_token("h1", "ab" * 32, 150.0)
        error = self.assertRaises(Conflict, store.trust.add_token, "laptop", "h3", 160.0, 200.0)
        self.assertEqual(error.message, "a certificate named laptop is trusted already")

    def test_removeAndSurviveReopen(self) -> None:
        store = self.open()
        store.trust.add_token("a", "h1", 100.0, 200.0)
        store.trust.add_token("b", "h2", 100.0, 200.0)
        store.trust.redeem_token("h1", "aa" * 32, 110.0)
        store.trust.redeem_token("h2", "bb" * 32, 120.0)
        removed = store.trust.remove_certificate("aa" * 32)
        self.assertEqual(removed.name, "a")
        error = self.assertRaises(NotFound, store.trust.remove_certificate, "aa" * 32)
        self.assertEqual(error.message, f"no trusted certificate has fingerprint {'aa' * 32}")
        store.close()
        reopened = Store.open(self.location)
        self.addCleanup(reopened.close)
        self.assertEqual([e.name for e in reopened.trust.trusted_certificates()], ["b"])


class RenameTests(_StoreTestCase):
    """``rename_instance``: the row, its snapshots and certificate under the new name, at once."""

    STOPPED = frozenset({VMState.STOPPED})

    def stopped(self, store: Store, name: str) -> InstanceRecord:
        store.instances.create_instance(name, {"user.a": "1"}, {})
        store.actions.finish_action(store.actions.start_action(name, "create", "req-0"), "success")
        return store.instances.finish_task(
            name, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )

    def test_theRowItsSnapshotsCertificateAndHistoryMoveToTheNewName(self) -> None:
        store = self.open()
        before = self.stopped(store, "web")
        store.snapshots.create_snapshot("web", "s1", False, {"config": {"user.a": "1"}})
        store.snapshots.create_snapshot("web", "s2", False, {})
        store.certificates.set_agent_certificate("web", "aa" * 32)
        self.clock.advance(5)
        record = store.instances.rename_instance("web", "api", self.STOPPED, "req-1")
        self.assertEqual(
            (record.name, record.uuid, record.config, record.updated_at),
            ("api", before.uuid, {"user.a": "1"}, 1005.0),
        )
        self.assertIsNone(store.instances.find_instance("web"))
        self.assertEqual([s["name"] for s in store.snapshots.list_snapshots("api")], ["s1", "s2"])
        snapshot = store.snapshots.find_snapshot("api", "s1")
        self.assertEqual(snapshot and snapshot["metadata"], {"config": {"user.a": "1"}})
        found = store.certificates.instance_for_fingerprint("aa" * 32)
        self.assertEqual(found.name if found else None, "api")
        self.assertEqual(store.certificates.agent_fingerprints(), {"api": "aa" * 32})
        history = store.actions.list_actions("api")
        self.assertEqual([a.action for a in history], ["rename", "create"])
        self.assertEqual(
            (history[0].result, history[0].request_id, [s.name for s in history[0].steps]),
            ("success", "req-1", ["rename: web -> api"]),
        )
        # Deleting the renamed instance takes its snapshots and certificate with it.
        store.instances.delete_instance("api")
        self.assertIsNone(store.certificates.instance_for_fingerprint("aa" * 32))
        self.assertEqual(store.snapshots.find_snapshot("api", "s1"), None)

    def test_aTakenNameARunningInstanceOrATaskChangeNothing(self) -> None:
        store = self.open()
        self.stopped(store, "web")
        self.stopped(store, "db")
        self.active(store, "run")
        store.snapshots.create_snapshot("web", "s1", False, {})
        with self.assertRaises(Conflict) as taken:
            store.instances.rename_instance("web", "db", self.STOPPED, "r")
        self.assertEqual(taken.exception.message, "Cannot rename web to db: instance db exists")
        with self.assertRaises(Conflict) as running:
            store.instances.rename_instance("run", "api", self.STOPPED, "r")
        self.assertEqual(
            running.exception.message,
            "Cannot rename instance run: it is running; only a stopped instance can be renamed",
        )
        store.instances.claim_task(
            "web", "start", frozenset({VMState.STOPPED}), TaskState.POWERING_ON
        )
        with self.assertRaises(Conflict) as busy:
            store.instances.rename_instance("web", "api", self.STOPPED, "r")
        self.assertIn("Cannot rename instance web: it is starting", busy.exception.message)
        self.assertRaises(
            NotFound, store.instances.rename_instance, "ghost", "api", self.STOPPED, "r"
        )
        self.assertEqual([r.name for r in store.instances.list_instances()], ["db", "run", "web"])
        self.assertEqual([s["name"] for s in store.snapshots.list_snapshots("web")], ["s1"])
        self.assertEqual([a.action for a in store.actions.list_actions("web")], ["create"])

    def test_theRenameSurvivesReopening(self) -> None:
        store = self.open()
        self.stopped(store, "web")
        store.snapshots.create_snapshot("web", "s1", False, {})
        store.instances.rename_instance("web", "api", self.STOPPED, "r")
        store.close()
        reopened = self.open()
        self.assertEqual([r.name for r in reopened.instances.list_instances()], ["api"])
        self.assertEqual([s["name"] for s in reopened.snapshots.list_snapshots("api")], ["s1"])


# Creates a stopped instance "n0" with two snapshots and a certificate, then renames it
# n0 -> n1 -> n2 … as fast as it can, printing each new name once committed, until killed.
_RENAMER_CHILD = """
import sys
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.store.sqlite import Store

store = Store.open(sys.argv[1])
store.instances.create_instance("n0", {"user.a": "1"}, {})
store.instances.finish_task("n0", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN)
store.snapshots.create_snapshot("n0", "s1", False, {})
store.snapshots.create_snapshot("n0", "s2", False, {})
store.certificates.set_agent_certificate("n0", "cd" * 32)
print("n0", flush=True)
i = 0
while True:
    store.instances.rename_instance(f"n{i}", f"n{i + 1}", frozenset({VMState.STOPPED}), f"r{i}")
    i += 1
    print(f"n{i}", flush=True)
"""


class RenameDurabilityTests(_StoreTestCase):
    def test_killDashNineDuringRenamesLeavesTheInstanceWholeUnderOneName(self) -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", _RENAMER_CHILD, self.path],
            stdout=subprocess.PIPE,
            env=_child_environment(),
            text=True,
        )
        assert child.stdout is not None
        # Killed somewhere in its 30th rename or so, mid-transaction or between two.
        reported = [child.stdout.readline().strip() for _ in range(30)]
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # Whatever it printed until the kill: the last name it saw committed.
        reported += child.stdout.read().split()
        child.stdout.close()
        last = int(reported[-1][1:])
        store = self.open()
        [record] = store.instances.list_instances()
        # The committed rename it reported, or the one after it, committed before the kill.
        self.assertIn(record.name, (f"n{last}", f"n{last + 1}"))
        self.assertEqual(
            [s["name"] for s in store.snapshots.list_snapshots(record.name)], ["s1", "s2"]
        )
        self.assertEqual(store.certificates.agent_fingerprints(), {record.name: "cd" * 32})
        renames = [a for a in store.actions.list_actions(record.name) if a.action == "rename"]
        self.assertEqual(len(renames), int(record.name[1:]))
        with _raw(self.path) as raw:
            self.assertEqual(raw.execute("PRAGMA integrity_check").fetchall(), [("ok",)])
            self.assertEqual(raw.execute("PRAGMA foreign_key_check").fetchall(), [])


class InstanceTestsOnPostgreSQL(OnPostgreSQL, InstanceTests):
    """The same tests on a real PostgreSQL server."""


class TaskTestsOnPostgreSQL(OnPostgreSQL, TaskTests):
    """The same tests on a real PostgreSQL server."""


class SettleTestsOnPostgreSQL(OnPostgreSQL, SettleTests):
    """The same tests on a real PostgreSQL server."""


class ConfigTestsOnPostgreSQL(OnPostgreSQL, ConfigTests):
    """The same tests on a real PostgreSQL server."""


class ActionHistoryTestsOnPostgreSQL(OnPostgreSQL, ActionHistoryTests):
    """The same tests on a real PostgreSQL server."""


class SnapshotTestsOnPostgreSQL(OnPostgreSQL, SnapshotTests):
    """The same tests on a real PostgreSQL server."""


class AgentCertificateTestsOnPostgreSQL(OnPostgreSQL, AgentCertificateTests):
    """The same tests on a real PostgreSQL server."""


class TrustStoreTestsOnPostgreSQL(OnPostgreSQL, TrustStoreTests):
    """The same tests on a real PostgreSQL server."""


class RenameTestsOnPostgreSQL(OnPostgreSQL, RenameTests):
    """The same tests on a real PostgreSQL server."""
