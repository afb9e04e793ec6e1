"""A claimed task that no action will run is given back, so the instance is not stuck in it.

The store's faults are injected where its calls run, after a real write (the
claim really is kept in the SQLite store, then its caller is told the outcome
is unknown, as when PostgreSQL's connection is lost during the COMMIT) or
before one (the action's history cannot be written).  No VM is needed: the action never
starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import TestCase

from tests.reactor import reactor
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import Executor, InlineExecutor, OutcomeUnknown, StoreWriteFailed
from vmready.store.sqlite import Store

T = TypeVar("T")


def _unknown(_: object) -> Any:
    raise OutcomeUnknown("the connection was lost during COMMIT: outcome unknown")


class _ClaimKeptButUnknown(InlineExecutor):
    """The first call (the action's claim) really is written; its caller hears that the
    outcome is unknown.  The rest run at once."""

    calls = 0

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        self.calls += 1
        done = super().submit(work)
        return done.addCallback(_unknown) if self.calls == 1 else done


class _ClaimHeld(InlineExecutor):
    """The first call (the action's claim) waits for ``gate`` and never runs (the test fails
    it: nothing was kept); the rest run at once, really."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.gate: Deferred[Any] = Deferred()

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        self.calls += 1
        return self.gate if self.calls == 1 else super().submit(work)


class _HistoryRefused(AsyncStore):
    """The action's history cannot be written (the store fails after the claim)."""

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        failed: Deferred[T] = Deferred()
        failed.errback(StoreWriteFailed("the disk is full; nothing of this change was kept"))
        return failed


class _HistoryGated(AsyncStore):
    """The action-history writes wait for ``history_gate``."""

    history_gate: Deferred[None]

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        return self.history_gate.addCallback(lambda _: super(_HistoryGated, self).run(work))


class GiveBackTests(TestCase):
    def lifecycle(
        self,
        store_class: type[AsyncStore] = AsyncStore,
        executor: Executor | None = None,
        hypervisor: str | None = None,
    ) -> Lifecycle:
        directory = tempfile.mkdtemp(prefix="vmready-claims-")
        self.addCleanup(shutil.rmtree, directory, True)
        engine = Store.open(os.path.join(directory, "vmready.sqlite"))
        self.addCleanup(engine.close)
        engine.instances.create_instance("web1", {}, {})
        engine.instances.finish_task(
            "web1", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        store = store_class(engine, executor or InlineExecutor(), cached=True)
        lifecycle = Lifecycle(
            reactor,
            store,
            HypervisorDriver(reactor, "fakeqemu", hypervisor),
            EventBus(reactor.seconds),
            os.path.join(directory, "run"),
        )
        self.addCleanup(lifecycle.operations.stop)
        return lifecycle

    async def test_aClaimWhoseOutcomeIsUnknownIsGivenBack(self) -> None:
        lifecycle = self.lifecycle(executor=_ClaimKeptButUnknown())
        with self.assertRaises(OutcomeUnknown):
            await lifecycle.act("web1", "start")
        record = lifecycle.store.engine.instances.get_instance("web1")
        self.assertEqual((record.task_state, record.vm_state), (None, VMState.STOPPED))
        self.assertIsNone(lifecycle.store.view.get_instance("web1").task_state)

    async def test_aClaimWhoseActionCannotBeRecordedIsGivenBack(self) -> None:
        lifecycle = self.lifecycle(_HistoryRefused)
        with self.assertRaises(StoreWriteFailed):
            await lifecycle.act("web1", "start")
        record = lifecycle.store.engine.instances.get_instance("web1")
        self.assertEqual((record.task_state, record.vm_state), (None, VMState.STOPPED))
        self.assertEqual(lifecycle.operations.list(), [])

    async def test_givingBackAnUnknownClaimNeverEndsAnotherRequestsClaim(self) -> None:
        """Two starts at once: the first's claim is lost (outcome unknown, nothing kept),
        the second's is kept; giving the first back must leave the second's task alone."""
        claim = _ClaimHeld()
        lifecycle = self.lifecycle(_HistoryGated, claim)
        store = lifecycle.store
        assert isinstance(store, _HistoryGated)
        store.history_gate = Deferred()
        first = Deferred.fromCoroutine(lifecycle.act("web1", "start"))
        second = Deferred.fromCoroutine(lifecycle.act("web1", "start"))
        claim.gate.errback(OutcomeUnknown("the connection was lost during COMMIT"))
        self.failureResultOf(first, OutcomeUnknown)
        # The second claimed once the first was resolved; it is waiting on its history now.
        self.assertEqual(
            store.engine.instances.get_instance("web1").task_state, TaskState.POWERING_ON
        )
        store.history_gate.errback(StoreWriteFailed("the disk is full; nothing was kept"))
        self.failureResultOf(second, StoreWriteFailed)
        self.assertIsNone(store.engine.instances.get_instance("web1").task_state)

    async def test_aCancelledRequestStillRunsTheActionItClaimed(self) -> None:
        """The client goes away (Klein cancels its handler) once the claim committed, while
        the action's history is being written: the action still runs to its end, so the
        task is not left claimed with nothing to run it."""
        # A hypervisor that cannot start: the action ends quickly, in an error.
        lifecycle = self.lifecycle(_HistoryGated, hypervisor="/nonexistent/fakeqemu")
        store = lifecycle.store
        assert isinstance(store, _HistoryGated)
        store.history_gate = Deferred()
        request = Deferred.fromCoroutine(lifecycle.act("web1", "start"))
        self.assertEqual(
            store.engine.instances.get_instance("web1").task_state, TaskState.POWERING_ON
        )
        request.cancel()
        self.failureResultOf(request, CancelledError)
        store.history_gate.callback(None)
        (operation,) = lifecycle.operations.list()
        await operation.when_done()
        self.assertIsNone(store.engine.instances.get_instance("web1").task_state)
        self.assertEqual(store.engine.actions.unfinished_actions(), [])
