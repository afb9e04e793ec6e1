"""A claimed task that no action will run is given back, so the instance is not stuck in it.

The store's faults are injected after a real write (the claim really is kept
in the SQLite store, then its caller is told the outcome is unknown, as when
PostgreSQL's connection is lost during the COMMIT) or before one (the
action's history cannot be written).  No VM is needed: the action never
starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from tests.reactor import reactor
from vmready.domain.model import InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor, OutcomeUnknown, StoreWriteFailed
from vmready.store.sqlite import Store

T = TypeVar("T")


class _ClaimKeptButUnknown(AsyncStore):
    """Claims really are written; the caller hears that the outcome is unknown."""

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> Deferred[InstanceRecord]:
        def unknown(_: InstanceRecord) -> InstanceRecord:
            raise OutcomeUnknown("the connection was lost during COMMIT: outcome unknown")

        return super().claim_task(name, action, allowed_from, task).addCallback(unknown)


class _HistoryRefused(AsyncStore):
    """The action's history cannot be written (the store fails after the claim)."""

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        failed: Deferred[T] = Deferred()
        failed.errback(StoreWriteFailed("the disk is full; nothing of this change was kept"))
        return failed


class _Gated(AsyncStore):
    """The first claim waits for ``claim_gate`` (the test fails it: nothing was kept); the
    action-history writes wait for ``history_gate``; the rest runs at once, really."""

    claim_gate: Deferred[InstanceRecord]
    history_gate: Deferred[None]
    claims = 0

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> Deferred[InstanceRecord]:
        self.claims += 1
        if self.claims == 1:
            return self.claim_gate
        return super().claim_task(name, action, allowed_from, task)

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        return self.history_gate.addCallback(lambda _: super(_Gated, self).run(work))


class GiveBackTests(TestCase):
    def lifecycle(self, store_class: type[AsyncStore]) -> Lifecycle:
        directory = tempfile.mkdtemp(prefix="vmready-claims-")
        self.addCleanup(shutil.rmtree, directory, True)
        engine = Store.open(os.path.join(directory, "vmready.sqlite"))
        self.addCleanup(engine.close)
        engine.create_instance("web1", {}, {})
        engine.finish_task("web1", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN)
        store = store_class(engine, InlineExecutor(), cached=True)
        return Lifecycle(
            reactor,
            store,
            HypervisorDriver(reactor, "fakeqemu"),
            EventBus(reactor.seconds),
            os.path.join(directory, "run"),
        )

    async def test_aClaimWhoseOutcomeIsUnknownIsGivenBack(self) -> None:
        lifecycle = self.lifecycle(_ClaimKeptButUnknown)
        with self.assertRaises(OutcomeUnknown):
            await lifecycle.act("web1", "start")
        record = lifecycle.store.engine.get_instance("web1")
        self.assertEqual((record.task_state, record.vm_state), (None, VMState.STOPPED))
        self.assertIsNone(lifecycle.store.get_instance("web1").task_state)

    async def test_aClaimWhoseActionCannotBeRecordedIsGivenBack(self) -> None:
        lifecycle = self.lifecycle(_HistoryRefused)
        with self.assertRaises(StoreWriteFailed):
            await lifecycle.act("web1", "start")
        record = lifecycle.store.engine.get_instance("web1")
        self.assertEqual((record.task_state, record.vm_state), (None, VMState.STOPPED))
        self.assertEqual(lifecycle.operations.list(), [])

    async def test_givingBackAnUnknownClaimNeverEndsAnotherRequestsClaim(self) -> None:
        """Two starts at once: the first's claim is lost (outcome unknown, nothing kept),
        the second's is kept; giving the first back must leave the second's task alone."""
        lifecycle = self.lifecycle(_Gated)
        store = lifecycle.store
        assert isinstance(store, _Gated)
        store.claim_gate = Deferred()
        store.history_gate = Deferred()
        first = Deferred.fromCoroutine(lifecycle.act("web1", "start"))
        second = Deferred.fromCoroutine(lifecycle.act("web1", "start"))
        store.claim_gate.errback(OutcomeUnknown("the connection was lost during COMMIT"))
        self.failureResultOf(first, OutcomeUnknown)
        # The second claimed once the first was resolved; it is waiting on its history now.
        self.assertEqual(store.engine.get_instance("web1").task_state, TaskState.POWERING_ON)
        store.history_gate.errback(StoreWriteFailed("the disk is full; nothing was kept"))
        self.failureResultOf(second, StoreWriteFailed)
        self.assertIsNone(store.engine.get_instance("web1").task_state)
