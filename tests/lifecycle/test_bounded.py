"""Bounded reconciliation, and events that wait for the store's commit.

Power sync and start-up reconciliation visit instances ``sync_concurrency``
at a time: a driver whose adopt calls wait for the test shows how many are
ever in flight.  With the store on its database thread, held on purpose, no
event goes out before the write it announces is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import threading
from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.reactor import reactor
from vmready.domain.model import Conflict
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.cmdline import VMSpec
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import LIFECYCLE, Event, EventBus
from vmready.store.asyncstore import AsyncStore
from vmready.store.sqlite import Store

INSTANCES = 40
LIMIT = 4


class HeldDriver:
    """A hypervisor driver whose adopt waits until the test lets it go; nothing runs."""

    kind = "fakeqemu"

    def __init__(self) -> None:
        self.adopting: list[tuple[str, Deferred[None]]] = []
        self.most = 0

    def in_flight(self) -> int:
        return sum(1 for _name, held in self.adopting if not held.called)

    def adopt(self, spec: VMSpec) -> Deferred[None]:
        held: Deferred[None] = Deferred()
        self.adopting.append((spec.name, held))
        self.most = max(self.most, self.in_flight())
        return held

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        return succeed(False)

    def release_all(self) -> None:
        """Let every adopt answer "no VM runs", one at a time, as each new one arrives."""
        index = 0
        while index < len(self.adopting):
            _name, held = self.adopting[index]
            if not held.called:
                held.callback(None)
            index += 1


def _running_instances(store: Store, count: int) -> None:
    for n in range(count):
        name = f"vm{n:03}"
        store.instances.create_instance(name, {READY_KEY: "true"}, {})
        store.instances.finish_task(name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING)


class BoundedTests(SynchronousTestCase):
    def setUp(self) -> None:
        base = tempfile.mkdtemp(prefix="vmready-bounded-")
        self.addCleanup(shutil.rmtree, base, True)
        self.store = Store.open(":memory:")
        self.addCleanup(self.store.close)
        _running_instances(self.store, INSTANCES)
        self.driver = HeldDriver()
        self.clock = Clock()
        self.lifecycle = Lifecycle(
            self.clock,
            self.store,
            self.driver,  # type: ignore[arg-type]
            EventBus(self.clock.seconds),
            os.path.join(base, "run"),
            sync_concurrency=LIMIT,
        )

    def assertAllVisitedNeverMoreThanTheLimit(self, done: Deferred[None]) -> None:
        self.assertEqual(self.driver.in_flight(), LIMIT)
        self.assertNoResult(done)
        self.driver.release_all()
        self.successResultOf(done)
        self.assertEqual(self.driver.most, LIMIT)
        self.assertEqual(len(self.driver.adopting), INSTANCES)
        states = {record.vm_state for record in self.store.instances.list_instances()}
        self.assertEqual(states, {VMState.STOPPED})

    def test_powerSyncVisitsAtMostTheLimitAtOnce(self) -> None:
        done = Deferred.fromCoroutine(self.lifecycle.power_sync.sync_power_states())
        self.assertAllVisitedNeverMoreThanTheLimit(done)

    def test_powerSyncActsOnTheInstanceAsItIsWhenItsTurnComes(self) -> None:
        """An action begun while the round waits for its turn: the round leaves it alone."""
        done = Deferred.fromCoroutine(self.lifecycle.power_sync.sync_power_states())
        last = f"vm{INSTANCES - 1:03}"
        store = self.lifecycle.store
        self.successResultOf(
            store.instances.claim_task(
                last, "stop", frozenset({VMState.ACTIVE}), TaskState.POWERING_OFF
            )
        )
        self.driver.release_all()
        self.successResultOf(done)
        self.assertNotIn(last, [name for name, _held in self.driver.adopting])
        record = store.view.get_instance(last)
        self.assertEqual(
            (record.vm_state, record.task_state), (VMState.ACTIVE, TaskState.POWERING_OFF)
        )
        self.assertEqual(len(self.driver.adopting), INSTANCES - 1)

    def test_startUpReconciliationVisitsAtMostTheLimitAtOnce(self) -> None:
        done = Deferred.fromCoroutine(self.lifecycle.recovery.recover())
        self.assertAllVisitedNeverMoreThanTheLimit(done)

    def test_readyIsClearedBeforeAnyInstanceIsReconciled(self) -> None:
        records = self.successResultOf(Deferred.fromCoroutine(self.lifecycle.recovery.prepare()))
        self.assertEqual(len(records), INSTANCES)
        self.assertFalse(any(record.ready for record in self.store.instances.list_instances()))
        self.assertEqual(self.driver.adopting, [])

    def test_anActionWaitsForItsInstancesReconciliation(self) -> None:
        records = self.successResultOf(Deferred.fromCoroutine(self.lifecycle.recovery.prepare()))
        reconciling = Deferred.fromCoroutine(self.lifecycle.recovery.reconcile(records))
        last = records[-1].name  # beyond the first LIMIT: not even started
        acting = Deferred.fromCoroutine(self.lifecycle.act(last, "stop"))
        self.assertNoResult(acting)
        self.assertIsNone(self.store.instances.get_instance(last).task_state)
        self.driver.release_all()
        self.successResultOf(reconciling)
        # Reconciled (no VM: stopped), the stop is then refused as any stop of a stopped VM.
        self.assertEqual(self.store.instances.get_instance(last).vm_state, VMState.STOPPED)
        self.failureResultOf(acting, Conflict)


def _committed(path: str, name: str) -> tuple[str, dict[str, Any]]:
    """What another connection sees of an instance: only what is committed."""
    with sqlite3.connect(path) as other:
        row = other.execute(
            "SELECT vm_state, config FROM instances WHERE name = ?", (name,)
        ).fetchone()
    return row[0], json.loads(row[1])


class EventsAfterCommitTests(TestCase):
    """The daemon's store (its own thread), held: events wait for the commit."""

    def setUp(self) -> None:
        base = tempfile.mkdtemp(prefix="vmready-events-")
        self.addCleanup(shutil.rmtree, base, True)
        self.path = os.path.join(base, "vmready.sqlite")
        engine = Store.open(self.path)
        _running_instances(engine, 1)
        self.store = AsyncStore.threaded(reactor, engine)
        self.gate = threading.Event()
        self.addCleanup(self.store.close)
        self.addCleanup(self.gate.set)
        events = EventBus(reactor.seconds)
        self.lifecycle = Lifecycle(
            reactor,
            self.store,
            HeldDriver(),  # type: ignore[arg-type]
            events,
            os.path.join(base, "run"),
        )
        # Each event, with what the database had committed when it went out.
        self.seen: list[tuple[str, tuple[str, dict[str, Any]]]] = []
        events.subscribe(self._event, frozenset({LIFECYCLE}))

    def _event(self, event: Event) -> None:
        self.seen.append((event.metadata["action"], _committed(self.path, "vm000")))

    async def held(self, work: Deferred[Any]) -> Any:
        """Run ``work`` with the database thread blocked a while: nothing announced meanwhile."""
        for _ in range(3):
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.seen, [])
        self.gate.set()
        return await work

    def hold(self) -> None:
        self.store.run(lambda _engine: self.gate.wait(30))

    async def test_instanceReadyOnlyOnceReadyIsCommitted(self) -> None:
        await self.store.instances.update_config("vm000", {READY_KEY: "false"})
        self.lifecycle.running.vms["vm000"] = SimpleNamespace(gone=False)  # type: ignore[assignment]
        self.hold()
        await self.held(Deferred.fromCoroutine(self.lifecycle.guestside.set_ready("vm000", True)))
        actions = [action for action, _committed in self.seen]
        self.assertEqual(actions, ["instance-state", "instance-ready"])
        for _action, (_state, config) in self.seen:
            self.assertEqual(config[READY_KEY], "true")

    async def test_anErrorIsAnnouncedOnlyOnceCommitted(self) -> None:
        self.hold()
        record = self.store.view.get_instance("vm000")
        failing = Deferred.fromCoroutine(
            self.lifecycle.watching.fail(record, "gone", PowerState.CRASHED, idle=True)
        )
        await self.held(failing)
        self.assertEqual(
            [(action, state) for action, (state, _config) in self.seen],
            [("instance-state", "error"), ("instance-error", "error")],
        )

    async def test_anUpdateIsAnnouncedOnlyOnceCommitted(self) -> None:
        self.hold()
        await self.held(
            Deferred.fromCoroutine(
                self.lifecycle.configuring.update_config("vm000", {"user.a": "1"})
            )
        )
        self.assertEqual(
            [(a, c["user.a"]) for a, (_s, c) in self.seen], [("instance-updated", "1")]
        )
