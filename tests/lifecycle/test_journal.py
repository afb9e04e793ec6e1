"""``Journal``: an action's end, as another request sees the store.

The store is a real SQLite file; what is injected is a look at it after each
call the lifecycle makes (``_LookingAfterEachCall``), as another request
would see it between two calls: an instance free of its task must not still
have its action open, or an action begun by the next request overlaps it in
the history (the cluster's fault harness found one: a delete claimed between
a restart's two writes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from vmready.domain.states import PowerState, TaskState, VMState
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.sqlite import Store

T = TypeVar("T")


class _LookingAfterEachCall(InlineExecutor):
    """Each call at once, on a real store; after each, what another request would find."""

    def __init__(self, engine: Store) -> None:
        super().__init__()
        self.engine = engine
        self.free_with_an_open_action: list[str] = []

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        return super().submit(work).addCallback(self._look)

    def _look(self, result: T) -> T:
        for record in self.engine.instances.list_instances():
            open_actions = [
                action.action
                for action in self.engine.actions.list_actions(record.name)
                if action.finished_at is None
            ]
            if record.task_state is None and open_actions:
                self.free_with_an_open_action.append(f"{record.name}: {open_actions}")
        return result


class ActionEndTests(TestCase):
    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmready-journal-")
        self.addCleanup(shutil.rmtree, directory, True)
        self.engine = Store.open(os.path.join(directory, "vmready.sqlite"))
        self.addCleanup(self.engine.close)
        self.engine.instances.create_instance("web1", {}, {})  # claimed: spawning
        self.executor = _LookingAfterEachCall(self.engine)
        clock = Clock()
        self.journal = Journal(
            clock=clock,
            store=AsyncStore(self.engine, self.executor, cached=True),
            events=EventBus(clock.seconds),
            metrics=LifecycleMetrics(clock.seconds()),
        )

    def actions(self) -> list[tuple[str, str | None]]:
        return [(a.action, a.result) for a in self.engine.actions.list_actions("web1")]

    async def test_aFinishedActionIsClosedByTheTimeItsInstanceIsFree(self) -> None:
        action = await self.journal.begin("web1", "create", TaskState.SPAWNING)
        await action.finish(PowerState.SHUTDOWN)
        self.assertEqual(self.executor.free_with_an_open_action, [])
        self.assertEqual(self.actions(), [("create", "success")])
        self.assertIsNone(self.engine.instances.get_instance("web1").task_state)

    async def test_anAbandonedActionIsClosedByTheTimeItsInstanceIsFree(self) -> None:
        action = await self.journal.begin("web1", "create", TaskState.SPAWNING)
        await action.abandon(VMState.STOPPED, PowerState.SHUTDOWN, "it could not")
        self.assertEqual(self.executor.free_with_an_open_action, [])
        self.assertEqual(self.actions(), [("create", "error")])
