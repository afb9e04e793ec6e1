"""The PostgreSQL store when things go wrong between it and the server, on a real server.

A connection lost during ``COMMIT`` (the outcome unknown: never tried again,
the view read again), lost before it (tried again, kept once), the
connection parameters that bound every wait (connect timeout, TCP
keepalives, lock timeout: the URL's own win), a row another connection keeps
locked, and a deadlock with another connection that fails only the call that
deadlocked.  Every interleaving is made deterministic by waiting until
PostgreSQL shows a backend waiting (``pg_stat_activity``), never by sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.postgres import postgres_location, postgres_server
from tests.reactor import reactor
from tests.store.test_postgres import JOIN_LIMIT, _database_of, _in_thread, _raw
from vmready.domain.model import Conflict
from vmready.domain.states import ACTIONS, PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import (
    CallDeadlocked,
    DatabaseThread,
    OutcomeUnknown,
    StoreWriteFailed,
)
from vmready.store.notifications import INSTANCES_CHANNEL, NotificationListener
from vmready.store.postgres import PostgresConnection
from vmready.store.sqlite import Store

# Longer than any wait these tests make of PostgreSQL: past it the test fails instead of hanging.
WAIT_LIMIT = 60.0


def _waiting_backend(location: str, wait_event: str, column: str = "wait_event") -> int:
    """The pid of the database's backend whose ``column`` is ``wait_event`` (polled; 60 s at most).

    ``wait_event = 'SyncRep'``: a COMMIT waiting for the standby;
    ``wait_event_type = 'Lock'``: a statement waiting for another's row lock.
    """
    pause = threading.Event()
    give_up = time.monotonic() + WAIT_LIMIT
    with _raw(location) as raw:
        while time.monotonic() < give_up:
            row = raw.execute(
                "SELECT pid FROM pg_stat_activity"
                f" WHERE datname = current_database() AND {column} = %s",
                (wait_event,),
            ).fetchone()
            if row is not None:
                return int(row[0])
            pause.wait(0.01)
    raise SynchronousTestCase.failureException(f"no backend waited for {wait_event}")


def _terminate(pid: int) -> None:
    with _raw(postgres_server().url()) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


class Gate:
    """A call that holds the database thread until opened: the calls queued meanwhile batch."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def work(self, _engine: Store) -> None:
        self.entered.set()
        self.opened.wait(JOIN_LIMIT)

    def hold(self, store: AsyncStore) -> Deferred[None]:
        """Submit the gate; return once the database thread runs it."""
        held = store.run(self.work)
        self.entered.wait(JOIN_LIMIT)
        return held


def _threaded(location: str) -> tuple[Store, AsyncStore, DatabaseThread]:
    engine = Store.open(location)
    store = AsyncStore.threaded(reactor, engine)
    executor = store.executor
    assert isinstance(executor, DatabaseThread)
    return engine, store, executor


def _active(location: str, *names: str) -> None:
    """Instances ``names``, active and running, written by a store of their own."""
    setup = Store.open(location)
    try:
        for name in names:
            setup.instances.create_instance(name, {}, {})
            setup.instances.finish_task(
                name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
            )
    finally:
        setup.close()


class UnknownOutcomeTests(TestCase):
    """The connection is lost while the server answers COMMIT, or before."""

    async def test_aConnectionLostDuringCommitIsNeverRetriedAndTheViewIsReadAgain(self) -> None:
        """A batch whose COMMIT committed but was never confirmed fails, unknown, and is kept once.

        Made deterministic with synchronous replication (tests.postgres names
        a standby that never connects): the test database's sessions set
        ``synchronous_commit = on``, so the store's COMMIT writes the commit
        record locally (the transaction is committed) and then waits for the
        standby (``wait_event = 'SyncRep'``).  Terminating that backend then
        cuts the connection before the server confirms the COMMIT, exactly
        a network lost at the worst moment; the setting is reset first, so
        the next connection commits normally.  Tried again, the claim would
        find its own committed task (a 409) and the action would be recorded
        twice.
        """
        location = postgres_location(self)
        database = _database_of(location)
        _active(location, "vm1")
        with _raw(postgres_server().url()) as admin:
            admin.execute(f"ALTER DATABASE {database} SET synchronous_commit = on")
        engine, store, _executor = _threaded(location)
        self.addCleanup(store.close)
        gate = Gate()
        held = gate.hold(store)
        stop = ACTIONS["stop"]
        claimed = store.instances.claim_task(
            "vm1", "stop", stop.allowed_from, TaskState.POWERING_OFF
        )
        recorded = store.actions.start_action("vm1", "stop", "req-1")
        gate.opened.set()
        await held
        pid = _waiting_backend(location, "SyncRep")
        with _raw(postgres_server().url()) as admin:
            admin.execute(f"ALTER DATABASE {database} RESET synchronous_commit")
        _terminate(pid)

        error: Any = await self.assertFailure(claimed, OutcomeUnknown)
        self.assertIsInstance(error, StoreWriteFailed)
        self.assertEqual(error.http_status, 503)
        self.assertIn(f"the store could not confirm a write to {engine.path}: ", error.message)
        self.assertIn("the outcome is unknown", error.message)
        self.assertEqual(len(error.message.splitlines()), 1)
        # At once, the view has not the claim yet: it is stale, and being read again.
        self.assertTrue(store.stale)
        self.assertIsNone(store.view.get_instance("vm1").task_state)
        await self.assertFailure(recorded, OutcomeUnknown)
        self.assertIsNotNone(store.health.failing_since)

        # It had committed, once.
        with _raw(location) as raw:
            rows = raw.execute("SELECT task_state FROM instances WHERE name = 'vm1'").fetchall()
            (actions,) = raw.execute("SELECT count(*) FROM actions").fetchone() or (0,)
        self.assertEqual((rows, actions), ([("powering-off",)], 1))
        # The next call in line comes after the reread: the view now shows what committed.
        history = await store.actions.list_actions("vm1")
        self.assertEqual([action.request_id for action in history], ["req-1"])
        self.assertFalse(store.stale)
        self.assertEqual(store.view.get_instance("vm1").task_state, TaskState.POWERING_OFF)
        self.assertIsNone(store.health.failing_since)
        # And the claim it holds is the store's: a second one is the usual 409.
        await self.assertFailure(
            store.instances.claim_task("vm1", "stop", stop.allowed_from, TaskState.POWERING_OFF),
            Conflict,
        )

    async def test_aConnectionLostBeforeCommitIsTriedAgainAndKeptOnce(self) -> None:
        """A batch cut off before COMMIT left nothing: tried again, it is recorded once.

        The batch records an action, then waits for a row another connection
        keeps locked; its backend is terminated during that wait (before
        COMMIT was ever sent), the lock released: the batch runs again on a
        new connection and commits, the action once.
        """
        location = postgres_location(self)
        _active(location, "vm1")
        _engine, store, _executor = _threaded(location)
        self.addCleanup(store.close)
        locker = _raw(location)
        self.addCleanup(locker.close)
        locker.execute("BEGIN")
        locker.execute("SELECT 1 FROM instances WHERE name = 'vm1' FOR UPDATE")
        gate = Gate()
        held = gate.hold(store)
        recorded = store.actions.start_action("vm1", "configure", "req-1")
        updated = store.instances.update_config("vm1", {"user.a": "1"})
        gate.opened.set()
        await held
        _terminate(_waiting_backend(location, "Lock", "wait_event_type"))
        locker.execute("ROLLBACK")

        action_id = await recorded
        record = await updated
        self.assertEqual(record.config, {"user.a": "1"})
        with _raw(location) as raw:
            ids = raw.execute("SELECT id FROM actions").fetchall()
        self.assertEqual(ids, [(action_id,)])
        self.assertFalse(store.stale)


class ConnectionParameterTests(TestCase):
    """Every connection bounds its waits: connect timeout, keepalives, lock timeout."""

    def _connection(self, engine: Store) -> PostgresConnection:
        connection = engine.database.db
        assert isinstance(connection, PostgresConnection)
        return connection

    def _opened(self, location: str) -> tuple[PostgresConnection, dict[str, str | None]]:
        """The pool's connection of a store opened at location, and its bounds."""
        engine = Store.open(location)
        self.addCleanup(engine.close)
        connection = self._connection(engine)
        parameters = connection.info.get_parameters()
        return connection, {key: parameters.get(key) for key in _BOUNDS}

    def test_thePoolsConnectionHasTheDefaults(self) -> None:
        connection, bounds = self._opened(postgres_location(self))
        self.assertEqual(
            bounds,
            {
                "connect_timeout": "10",
                "keepalives": "1",
                "keepalives_idle": "10",
                "keepalives_interval": "5",
                "keepalives_count": "3",
                "tcp_user_timeout": "30000",
                "application_name": "vmready",
            },
        )
        self.assertEqual(_show(connection, "lock_timeout"), "10s")
        self.assertEqual(_show(connection, "idle_in_transaction_session_timeout"), "5s")
        self.assertEqual(_show(connection, "application_name"), "vmready")

    def test_theURLsOwnParametersWin(self) -> None:
        location = (
            f"{postgres_location(self)}&connect_timeout=3&keepalives_idle=30"
            "&application_name=mine&options=-c%20lock_timeout%3D250ms"
        )
        connection, bounds = self._opened(location)
        self.assertEqual(
            bounds,
            {
                "connect_timeout": "3",
                "keepalives": "1",
                "keepalives_idle": "30",
                "keepalives_interval": "5",
                "keepalives_count": "3",
                "tcp_user_timeout": "30000",
                "application_name": "mine",
            },
        )
        self.assertEqual(_show(connection, "lock_timeout"), "250ms")

    async def test_theListenersConnectionHasThemToo(self) -> None:
        location = postgres_location(self)
        listener = NotificationListener(
            reactor, location, [INSTANCES_CHANNEL], lambda *_: None, lambda: None
        )
        await listener.start()
        self.addCleanup(listener.stop)
        with _raw(location) as raw:
            names = raw.execute(
                "SELECT application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        self.assertEqual(names, [("vmready-listener",)])

    async def test_aRowLockedLongerThanTheLockTimeoutFailsTheWriteThenItSucceeds(self) -> None:
        """Another member keeps a row locked: the write fails in one line instead of waiting."""
        location = postgres_location(self)
        _active(location, "vm1")
        engine, store, executor = _threaded(f"{location}&options=-c%20lock_timeout%3D100ms")
        self.addCleanup(store.close)
        executor.retry_for = 0.3
        locker = _raw(location)
        self.addCleanup(locker.close)
        locker.execute("BEGIN")
        locker.execute("SELECT 1 FROM instances WHERE name = 'vm1' FOR UPDATE")

        error: Any = await self.assertFailure(
            store.instances.update_config("vm1", {"user.a": "1"}), StoreWriteFailed
        )
        self.assertTrue(
            error.message.startswith(
                f"the store could not write {engine.path}: canceling statement due to lock timeout"
            ),
            error.message,
        )
        self.assertIn("nothing of this change was kept", error.message)
        self.assertEqual(len(error.message.splitlines()), 1)
        self.assertEqual(store.view.get_instance("vm1").config, {})

        locker.execute("ROLLBACK")
        record = await store.instances.update_config("vm1", {"user.a": "1"})
        self.assertEqual(record.config, {"user.a": "1"})
        self.assertIsNone(store.health.failing_since)


_BOUNDS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "application_name",
)


def _show(connection: PostgresConnection, setting: str) -> str:
    (value,) = connection.execute(f"SHOW {setting}").fetchone()
    return str(value)


class DeadlockTests(TestCase):
    """A call of a batch and another connection lock two rows in opposite orders."""

    async def test_onlyTheCallThatDeadlockedFailsAndTheBatchCommits(self) -> None:
        """The store's batch locks ``a`` then wants ``b``; the other holds ``b`` and wants ``a``.

        Order made certain: the other connection locks ``b``; the batch's first
        call locks ``a`` and a gate inside the batch holds it there until the
        other connection is seen waiting for ``a``; then the batch's last call
        asks for ``b``: a deadlock.  The other connection's ``deadlock_timeout``
        is an hour, so the store's backend (100 ms) is the one that finds the
        deadlock and has its statement ended.  After ROLLBACK TO its savepoint
        the transaction is usable (PostgreSQL aborts the subtransaction, not
        the transaction): the call fails alone, the batch commits, and then the
        other connection gets ``a``.
        """
        location = postgres_location(self)
        _active(location, "a", "b")
        _engine, store, executor = _threaded(f"{location}&options=-c%20deadlock_timeout%3D100ms")
        self.addCleanup(store.close)
        other = _raw(location)
        self.addCleanup(other.close)
        other.execute("SET deadlock_timeout = '1h'")
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM instances WHERE name = 'b' FOR UPDATE")

        gate, inside = Gate(), Gate()
        held = gate.hold(store)
        batches = executor.batches
        first = store.instances.update_config("a", {"user.k": "1"})
        paused = store.run(inside.work)
        second = store.instances.update_config("b", {"user.k": "2"})
        gate.opened.set()
        await held
        inside.entered.wait(JOIN_LIMIT)  # the batch holds a's lock

        def wants_a() -> None:
            other.execute("SELECT 1 FROM instances WHERE name = 'a' FOR UPDATE").fetchall()
            other.execute("ROLLBACK")

        thread, outcome = _in_thread(wants_a)
        _waiting_backend(location, "Lock", "wait_event_type")  # the other waits for the batch
        inside.opened.set()

        record = await first
        await paused
        error: Any = await self.assertFailure(second, CallDeadlocked)
        thread.join(JOIN_LIMIT)
        self.assertEqual(outcome, [None])
        self.assertEqual(record.config, {"user.k": "1"})
        self.assertIsInstance(error, StoreWriteFailed)
        self.assertEqual(error.http_status, 503)
        self.assertIn("this change and another writer waited for each other's rows", error.message)
        self.assertIn("deadlock detected", error.message)
        self.assertIn("nothing of this change was kept, try again", error.message)
        self.assertEqual(len(error.message.splitlines()), 1)
        # The gate's commit, then one for the batch (not tried again); nothing failing.
        self.assertEqual(executor.batches, batches + 2)
        self.assertIsNone(store.health.failing_since)
        self.assertEqual(store.view.get_instance("a").config, {"user.k": "1"})
        self.assertEqual(store.view.get_instance("b").config, {})
        with _raw(location) as raw:
            rows = raw.execute("SELECT name, config FROM instances ORDER BY name").fetchall()
        self.assertEqual(rows, [("a", '{"user.k":"1"}'), ("b", "{}")])
        # The call can be made again.
        again = await store.instances.update_config("b", {"user.k": "2"})
        self.assertEqual(again.config, {"user.k": "2"})
