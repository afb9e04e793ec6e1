"""The store off the reactor thread: ``AsyncStore`` on its ``DatabaseThread``.

These tests run the real database thread against the real reactor: a
``threading.Event`` the thread waits on holds a write back on purpose, so the
test can look at the reactor (and the store's readers) while it is pending.
Each class runs on SQLite and, as its ``…OnPostgreSQL`` subclass, on a real
PostgreSQL server.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import threading
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.postgres import postgres_location
from tests.reactor import reactor
from vmready.domain.model import Conflict, NotFound
from vmready.domain.states import ACTIONS, PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.database import TransactionLost
from vmready.store.sqlite import Store

# A held database thread is released by the test well before this; never hang a run.
HOLD_LIMIT = 30.0


def _committed_config(location: str, name: str) -> dict[str, Any]:
    """What another connection sees of an instance's config: only what is committed."""
    other = Store.open(location)
    try:
        record = other.instances.find_instance(name)
    finally:
        other.close()
    return {} if record is None else dict(record.config)


class ThreadedStoreTestCase(TestCase):
    """An AsyncStore on its own database thread over a fresh file (or PostgreSQL database)."""

    def new_location(self) -> str:
        directory = tempfile.mkdtemp(prefix="vmready-store-")
        self.addCleanup(shutil.rmtree, directory, True)
        return os.path.join(directory, "vmready.sqlite")

    def setUp(self) -> None:
        self.path = self.new_location()
        engine = Store.open(self.path)
        engine.instances.create_instance("vm1", {}, {})
        engine.instances.finish_task("vm1", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING)
        self.store = AsyncStore.threaded(reactor, engine)
        self.gate = threading.Event()
        # Whatever happens, the thread is let go and the store closed.
        self.addCleanup(self.store.close)
        self.addCleanup(self.gate.set)

    def hold(self) -> Deferred[bool]:
        """Block the database thread until ``self.gate`` is set; return once it is blocked."""
        holding = threading.Event()

        def block(_engine: Store) -> bool:
            holding.set()
            return self.gate.wait(HOLD_LIMIT)

        held = self.store.run(block)
        holding.wait(HOLD_LIMIT)
        return held


class WritesOffTheReactorTests(ThreadedStoreTestCase):
    async def test_aWriteWhoseDiskIsStuckLetsTheReactorRunAndCompletesAfterwards(self) -> None:
        held = self.hold()
        written = self.store.instances.update_config("vm1", {"user.a": "1"})
        ticks = 0
        for _ in range(5):
            # Timers keep firing while the write waits for its (blocked) thread.
            await deferLater(reactor, 0.01, lambda: None)
            ticks += 1
        self.assertEqual(ticks, 5)
        self.assertFalse(written.called)
        self.gate.set()
        self.assertTrue(await held)
        record = await written
        self.assertEqual(record.config["user.a"], "1")
        self.assertEqual(_committed_config(self.path, "vm1")["user.a"], "1")

    async def test_nothingQueuedIsLostWhenTheStoreCloses(self) -> None:
        self.hold()
        writes = [
            self.store.instances.update_config("vm1", {f"user.k{n}": str(n)}) for n in range(50)
        ]
        self.gate.set()
        await self.store.close()
        self.assertEqual(len([w for w in writes if w.called]), 50)
        config = _committed_config(self.path, "vm1")
        self.assertEqual({config[f"user.k{n}"] for n in range(50)}, {str(n) for n in range(50)})


class ReadYourWritesTests(ThreadedStoreTestCase):
    async def test_aReadQueuedAfterAWriteSeesIt(self) -> None:
        self.hold()
        self.store.instances.update_config("vm1", {"user.a": "1"})
        read = self.store.run(
            lambda engine: engine.instances.get_instance("vm1").config.get("user.a")
        )
        self.gate.set()
        self.assertEqual(await read, "1")

    async def test_instanceReadsShowTheCommittedRowFromTheMomentTheWriteFires(self) -> None:
        self.hold()
        written = self.store.instances.update_config("vm1", {"user.a": "1"})
        # Pending: the reactor's reads show the committed row, not the promise of one.
        self.assertNotIn("user.a", self.store.view.get_instance("vm1").config)
        seen: list[str | None] = []
        written.addCallback(
            lambda _: seen.append(self.store.view.get_instance("vm1").config.get("user.a"))
        )
        self.gate.set()
        await written
        self.assertEqual(seen, ["1"])
        self.assertEqual(self.store.view.list_instances()[0].config["user.a"], "1")

    async def test_aDeletedInstanceIsGoneWithItsCertificate(self) -> None:
        await self.store.certificates.set_agent_certificate("vm1", "ab" * 32)
        found = self.store.view.instance_for_fingerprint("ab" * 32)
        self.assertEqual(found.name if found else None, "vm1")
        await self.store.instances.delete_instance("vm1")
        self.assertIsNone(self.store.view.find_instance("vm1"))
        self.assertIsNone(self.store.view.instance_for_fingerprint("ab" * 32))
        self.assertRaises(NotFound, self.store.view.get_instance, "vm1")

    async def test_clearingReadyEverywhereIsWhatReadsSeeAfterwards(self) -> None:
        await self.store.instances.update_config("vm1", {"volatile.last_state.ready": "true"})
        self.assertTrue(self.store.view.get_instance("vm1").ready)
        self.assertEqual(await self.store.instances.clear_ready_everywhere(), 1)
        self.assertNotIn("volatile.last_state.ready", self.store.view.get_instance("vm1").config)
        # The committed row, read by the engine itself, is exactly what the reactor reads.
        stored = await self.store.run(lambda engine: engine.instances.get_instance("vm1"))
        self.assertEqual(self.store.view.get_instance("vm1"), stored)


class BatchingTests(ThreadedStoreTestCase):
    async def test_queuedCallsShareOneCommitAndEachKeepsItsOwnOutcome(self) -> None:
        stop = ACTIONS["stop"]
        self.hold()
        before = self.store.executor.batches  # type: ignore[attr-defined]
        claimed = self.store.instances.claim_task("vm1", "stop", stop.allowed_from, stop.tasks[0])
        # The same claim again: the compare-and-swap refuses it, inside the same batch.
        again = self.store.instances.claim_task("vm1", "stop", stop.allowed_from, stop.tasks[0])
        wrong = self.store.instances.advance_task("vm1", TaskState.SPAWNING, TaskState.POWERING_ON)
        updated = self.store.instances.update_config("vm1", {"user.b": "2"})
        missing = self.store.instances.update_config("nope", {"user.b": "2"})
        self.gate.set()
        # Outcomes arrive in order: once the last has, every one has.
        await self.assertFailure(missing, NotFound)
        self.assertIs(self.successResultOf(claimed).task_state, stop.tasks[0])
        self.failureResultOf(again, Conflict)
        self.failureResultOf(wrong, Conflict)
        self.assertEqual(self.successResultOf(updated).config["user.b"], "2")
        # The held call was one batch; everything queued behind it, one more: one commit.
        self.assertEqual(self.store.executor.batches - before, 2)  # type: ignore[attr-defined]
        committed = self.store.view.get_instance("vm1")
        self.assertEqual((committed.task_state, committed.config["user.b"]), (stop.tasks[0], "2"))
        self.assertEqual(_committed_config(self.path, "vm1")["user.b"], "2")

    async def test_aFailingCallInABatchUndoesItsOwnWritesOnly(self) -> None:
        def half_then_fail(engine: Store) -> None:
            engine.instances.update_config("vm1", {"user.half": "1"})
            raise Conflict("changed its mind")

        self.hold()
        failed = self.store.run(half_then_fail)
        kept = self.store.instances.update_config("vm1", {"user.kept": "1"})
        self.gate.set()
        await self.assertFailure(failed, Conflict)
        await kept
        config = _committed_config(self.path, "vm1")
        self.assertEqual((config.get("user.half"), config.get("user.kept")), (None, "1"))


class SQLiteBatchTests(ThreadedStoreTestCase):
    async def test_aBatchSQLiteRolledBackFailsEveryCallAndRunsNoMore(self) -> None:
        """A full disk or an I/O error ends SQLite's transaction: no call of it was kept."""

        def write_then_lose_it_all(engine: Store) -> None:
            engine.instances.update_config("vm1", {"user.second": "1"})
            engine.database.db.execute("ROLLBACK")  # what SQLite does on SQLITE_FULL
            raise sqlite3.OperationalError("database or disk is full")

        self.hold()
        first = self.store.instances.update_config("vm1", {"user.first": "1"})
        lost = self.store.run(write_then_lose_it_all)
        after = self.store.instances.update_config("vm1", {"user.after": "1"})
        self.gate.set()
        calls: list[Deferred[Any]] = [first, lost, after]
        for call in calls:
            await self.assertFailure(call, TransactionLost)
        config = _committed_config(self.path, "vm1")
        self.assertEqual(
            [config.get(key) for key in ("user.first", "user.second", "user.after")],
            [None, None, None],
        )
        self.assertEqual(self.store.view.get_instance("vm1").config.get("user.first"), None)
        kept = await self.store.instances.update_config(
            "vm1", {"user.later": "1"}
        )  # the store goes on
        self.assertEqual(kept.config["user.later"], "1")


class InlineStoreTests(SynchronousTestCase):
    """Inline (replays, unit tests): each call has happened when it returns."""

    def test_callsHaveHappenedWhenTheyReturn(self) -> None:
        engine = Store.open(":memory:")
        self.addCleanup(engine.close)
        store = AsyncStore.inline(engine)
        record = self.successResultOf(store.instances.create_instance("vm1", {}, {}))
        self.assertEqual(store.view.get_instance("vm1"), record)
        self.failureResultOf(store.instances.create_instance("vm1", {}, {}), Conflict)


class RenameReadsTests(ThreadedStoreTestCase):
    async def test_aRenamedInstanceIsReadUnderItsNewNameWithItsCertificate(self) -> None:
        await self.store.certificates.set_agent_certificate("vm1", "ab" * 32)
        await self.store.instances.claim_task(
            "vm1", "stop", frozenset({VMState.ACTIVE}), TaskState.POWERING_OFF
        )
        await self.store.instances.finish_task(
            "vm1", TaskState.POWERING_OFF, VMState.STOPPED, PowerState.SHUTDOWN
        )
        renamed = await self.store.instances.rename_instance(
            "vm1", "web", frozenset({VMState.STOPPED}), "r"
        )
        self.assertEqual(renamed.name, "web")
        self.assertIsNone(self.store.view.find_instance("vm1"))
        self.assertEqual(self.store.view.get_instance("web"), renamed)
        self.assertEqual(self.store.view.instance_for_fingerprint("ab" * 32), renamed)
        self.assertEqual([r.name for r in self.store.view.list_instances()], ["web"])


class OnPostgreSQL(ThreadedStoreTestCase):
    def new_location(self) -> str:
        return postgres_location(self)


class WritesOffTheReactorTestsOnPostgreSQL(OnPostgreSQL, WritesOffTheReactorTests):
    """The same tests on a real PostgreSQL server."""


class ReadYourWritesTestsOnPostgreSQL(OnPostgreSQL, ReadYourWritesTests):
    """The same tests on a real PostgreSQL server."""


class BatchingTestsOnPostgreSQL(OnPostgreSQL, BatchingTests):
    """The same tests on a real PostgreSQL server."""


class RenameReadsTestsOnPostgreSQL(OnPostgreSQL, RenameReadsTests):
    """The same tests on a real PostgreSQL server."""
