"""Each operation written once (``store.table``): at once on a Store, a Deferred on an AsyncStore,
and what every call changed kept in the committed view."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading

from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.reactor import reactor
from vmready.domain.model import Conflict, InstanceRecord, NotFound
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.instances import Instances
from vmready.store.sqlite import Store

# A held database thread is released by the test well before this; never hang a run.
HOLD_LIMIT = 30.0


class ModesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.engine = Store.open(":memory:")
        self.addCleanup(self.engine.close)

    def test_aStoresCallRunsAtOnceAndReturnsItsResult(self) -> None:
        record = self.engine.instances.create_instance("vm1", {"user.a": "1"}, {})
        self.assertEqual((record.name, record.config), ("vm1", {"user.a": "1"}))
        self.assertEqual(self.engine.instances.get_instance("vm1"), record)

    def test_anAsyncStoresCallIsADeferredOfTheSameOperation(self) -> None:
        store = AsyncStore.inline(self.engine)
        record = self.successResultOf(store.instances.create_instance("vm1", {}, {}))
        self.assertEqual(self.engine.instances.get_instance("vm1"), record)
        self.failureResultOf(store.instances.create_instance("vm1", {}, {}), Conflict)
        self.failureResultOf(store.snapshots.list_snapshots("nope"), NotFound)

    def test_anOperationKeepsItsNameAndDocstring(self) -> None:
        self.assertEqual(Instances.claim_task.__name__, "claim_task")
        self.assertTrue((Instances.claim_task.__doc__ or "").startswith("Start task"))

    def test_theStoresOwnMemberIsTheDefault(self) -> None:
        self.engine.instances.create_instance("other", {}, {}, member="host2")
        store = AsyncStore(self.engine, InlineExecutor(), cached=False, member="host1")
        created = self.successResultOf(store.instances.create_instance("mine", {}, {}))
        self.assertEqual(created.member, "host1")
        self.assertEqual(self.engine.instances.create_instance("plain", {}, {}).member, "")


class CommittedViewTests(SynchronousTestCase):
    """A cached store (as the daemon's): every call's changes reach the view, whatever the call."""

    def setUp(self) -> None:
        self.engine = Store.open(":memory:")
        self.addCleanup(self.engine.close)
        self.engine.instances.create_instance("vm1", {}, {})
        self.store = AsyncStore(self.engine, InlineExecutor(), cached=True)

    def test_anInstanceWrittenInsideRunIsWhatTheViewReads(self) -> None:
        written = self.successResultOf(
            self.store.run(lambda engine: engine.instances.update_config("vm1", {"user.a": "1"}))
        )
        self.assertEqual(self.store.view.get_instance("vm1"), written)

    def test_aWriteRolledBackInsideACallLeavesTheViewAlone(self) -> None:
        def change_its_mind(engine: Store) -> None:
            with contextlib.suppress(Conflict), engine.database.savepoint():
                engine.instances.create_instance("ghost", {}, {})
                raise Conflict("changed its mind")
            engine.instances.update_config("vm1", {"user.b": "2"})

        self.successResultOf(self.store.run(change_its_mind))
        self.assertEqual([r.name for r in self.store.view.list_instances()], ["vm1"])
        self.assertEqual(self.store.view.get_instance("vm1").config, {"user.b": "2"})
        self.assertIsNone(self.engine.instances.find_instance("ghost"))

    def test_aFailedCallChangesNothingTheViewReads(self) -> None:
        def fail_after_writing(engine: Store) -> None:
            engine.instances.update_config("vm1", {"user.a": "1"})
            raise Conflict("failed after writing")

        self.failureResultOf(self.store.run(fail_after_writing), Conflict)
        self.assertEqual(self.store.view.get_instance("vm1").config, {})

    def test_theViewFollowsEachKindOfChange(self) -> None:
        instances = self.store.instances
        self.successResultOf(self.store.certificates.set_agent_certificate("vm1", "ab" * 32))
        self.successResultOf(instances.finish_task("vm1", TaskState.SPAWNING, VMState.STOPPED))
        self.successResultOf(
            instances.rename_instance("vm1", "web", frozenset({VMState.STOPPED}), "r1")
        )
        found = self.store.view.instance_for_fingerprint("ab" * 32)
        self.assertEqual(found.name if found else None, "web")
        self.successResultOf(instances.delete_instance("web"))
        self.assertEqual(self.store.view.list_instances(), [])
        self.assertIsNone(self.store.view.instance_for_fingerprint("ab" * 32))


class ArgumentsTakenAtTheCallTests(TestCase):
    """On a database thread the engine reads a call's arguments later: they are taken at once."""

    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmready-table-")
        self.addCleanup(shutil.rmtree, directory, True)
        engine = Store.open(os.path.join(directory, "vmready.sqlite"))
        engine.instances.create_instance("vm1", {}, {})
        engine.instances.finish_task("vm1", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING)
        self.store = AsyncStore.threaded(reactor, engine)
        self.addCleanup(self.store.close)

    async def test_aDictChangedAfterTheCallIsWrittenAsItWasAtTheCall(self) -> None:
        gate = threading.Event()
        self.addCleanup(gate.set)
        held = self.store.run(lambda _engine: gate.wait(HOLD_LIMIT))
        updates: dict[str, str | None] = {"user.a": "1"}
        written = self.store.instances.update_config("vm1", updates)
        updates["user.a"] = "changed"
        updates["user.b"] = "added"
        gate.set()
        self.assertTrue(await held)
        record: InstanceRecord = await written
        self.assertEqual(record.config, {"user.a": "1"})
