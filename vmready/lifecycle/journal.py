"""What the lifecycle writes down and announces: the action history, ``instance-state`` events.

``Journal.begin`` starts an action's record (``ActionContext``): its history
steps, its task walk and its events.  Every step that changes the instance
waits for the store's commit before its event; history notes are written in
order without waiting.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from vmready.domain import ACTIONS, InstanceRecord, PowerState, TaskState, VMState
from vmready.lifecycle.events import EventBus, instance_state_context
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.unawaited import log_failed_write
from vmready.store import AsyncStore, Store


@attrs.define(kw_only=True, eq=False)
class Journal:
    """The action history and the ``instance-state`` events, for every part."""

    log = Logger()

    clock: IReactorTime
    store: AsyncStore
    events: EventBus
    metrics: LifecycleMetrics

    async def begin(self, name: str, action: str, task: TaskState) -> ActionContext:
        """The action's history record and its first step, written before it does anything."""
        request_id = str(uuid.uuid4())
        started_at = self.clock.seconds()

        def start(engine: Store) -> tuple[int, int]:
            action_id = engine.actions.start_action(name, action, request_id)
            return action_id, engine.actions.start_step(action_id, task.value)

        action_id, step_id = await self.store.run(start)
        return ActionContext(self, name, action, task, action_id, step_id, started_at)

    def publish_state(self, record: InstanceRecord) -> None:
        """An ``instance-state`` event with everything a watcher needs to show the instance."""
        self.events.lifecycle("instance-state", record.name, instance_state_context(record))

    def history(self, name: str, action: str, detail: str, ok: bool = True) -> None:
        """A one-step action in the history, for things that happen outside an action.

        Written in order with every other call, without waiting: history
        announces nothing.
        """
        request_id = str(uuid.uuid4())

        def write(engine: Store) -> None:
            action_id = engine.actions.start_action(name, action, request_id)
            if ok:
                # A success has no error: the reason goes in the step's name.
                engine.actions.add_step(action_id, f"{action}: {detail}", "success")
                engine.actions.finish_action(action_id, "success")
            else:
                engine.actions.add_step(action_id, action, "error", detail)
                engine.actions.finish_action(action_id, "error", detail)

        self.logged(self.store.run(write), "the action history")

    def logged(self, written: Deferred[Any], what: str) -> None:
        """A write nobody waits for: its failure is logged (``log_failed_write``), not lost."""
        written.addErrback(log_failed_write, self.log, what)


class ActionContext:
    """One running action: its history record, its task walk, its events (``Journal.begin``)."""

    def __init__(
        self,
        journal: Journal,
        name: str,
        action: str,
        task: TaskState,
        action_id: int,
        step_id: int,
        started_at: float,
    ) -> None:
        self.journal = journal
        self.store = journal.store
        self.name = name
        self.action = action
        self.task = task
        self.action_id = action_id
        self._step_id = step_id
        # Whether the task was ended (finished, abandoned or failed): nothing more to do.
        self.ended = False
        # When it was claimed (its duration is counted once, by the first end it reaches).
        self.started_at = started_at
        self._counted = False
        # What the task reported for its operation's metadata, and where it goes (report_to).
        self._progress: dict[str, Any] | None = None
        self._report: Callable[[dict[str, Any]], None] | None = None

    def _count(self, result: str) -> None:
        """The action ended with ``result``: counted and timed in the metrics, once."""
        if self._counted:
            return
        self._counted = True
        duration = self.journal.clock.seconds() - self.started_at
        self.journal.metrics.action_ended(self.action, result, duration)

    async def advance(self, task: TaskState) -> None:
        """Move to the next task_state: store CAS, history step, event."""
        self._end_step("success")
        record = await self.store.instances.advance_task(self.name, self.task, task)
        self.task = task
        self._step_id = await self.store.actions.start_step(self.action_id, task.value)
        self.journal.publish_state(record)

    def _end_step(self, result: str, error: str | None = None) -> None:
        """The current step ended; written in order, nobody waits for it."""
        self.journal.logged(
            self.store.actions.finish_step(self._step_id, result, error), "a history step"
        )

    def progress(self, metadata: dict[str, Any]) -> None:
        """Where the task is, for whoever follows its operation (the metadata of the operation)."""
        self._progress = metadata
        if self._report is not None:
            self._report(metadata)

    def report_to(self, report: Callable[[dict[str, Any]], None]) -> None:
        """Send progress to ``report`` (the operation), what was reported before it too."""
        self._report = report
        if self._progress is not None:
            report(self._progress)

    def note(self, step: str, result: str = "success", error: str | None = None) -> None:
        """Record an instantaneous step (e.g. a forced stop after a timeout), in order."""
        self.journal.logged(
            self.store.actions.add_step(self.action_id, step, result, error), "a history step"
        )

    async def finish(
        self,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
        *,
        store_power: bool = True,
    ) -> InstanceRecord:
        """End the task where ``states.ACTIONS`` says the action ends, its VM in ``power_state``.

        ``store_power=False`` leaves the stored power state as it is (it only
        chooses the end state).
        """
        vm_state = ACTIONS[self.action].end_state(power_state)
        self._end_step("success")
        record = await self._end_task(
            vm_state, power_state if store_power else None, config_updates, "success"
        )
        self.ended = True
        self._count("success")
        self.journal.publish_state(record)
        return record

    async def abandon(
        self, vm_state: VMState, power_state: PowerState | None, reason: str
    ) -> None:
        """The action failed but left the instance as it was: back to ``vm_state``, no error.

        The failure is in the action history and the operation; the instance
        does not go to error (a failed snapshot of a VM that runs on, say).
        """
        self._end_step("error", reason)
        record = await self._end_task(vm_state, power_state, None, "error", reason)
        self.ended = True
        self._count("error")
        self.journal.publish_state(record)

    def _end_task(
        self,
        vm_state: VMState,
        power_state: PowerState | None,
        config_updates: dict[str, str | None] | None,
        result: str,
        error: str | None = None,
    ) -> Deferred[InstanceRecord]:
        """End the task and close the action in one write: the moment the instance is free
        for another action, this one is over in its history too."""
        name, task, action_id = self.name, self.task, self.action_id

        def end(engine: Store) -> InstanceRecord:
            record = engine.instances.finish_task(
                name, task, vm_state, power_state, config_updates
            )
            engine.actions.finish_action(action_id, result, error)
            return record

        return self.store.run(end)

    async def complete(self) -> None:
        """Close the history record when the instance itself is about to go (delete)."""
        self._end_step("success")
        await self.store.actions.finish_action(self.action_id, "success")
        self._count("success")

    async def fail(self, reason: str) -> None:
        """End the task in vm_state error with ``reason``; the error persists."""
        self.ended = True
        self._end_step("error", reason)
        await self.store.actions.finish_action(self.action_id, "error", reason)
        self._count("error")
        if self.store.view.find_instance(self.name) is None:
            return
        record = await self.store.instances.set_error(self.name, reason, PowerState.NOSTATE)
        self.journal.publish_state(record)
        self.journal.events.lifecycle("instance-error", self.name, {"error": reason})
