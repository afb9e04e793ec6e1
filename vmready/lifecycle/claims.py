"""Claiming an instance's first task for an action, with its history record, or giving it back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import attrs
from twisted.internet.defer import DeferredLock
from twisted.logger import Logger

from vmready.domain import Conflict, InstanceRecord, TaskState, VMState
from vmready.lifecycle.journal import ActionContext, Journal
from vmready.store import AsyncStore, OutcomeUnknown, StoreWriteFailed


@attrs.define(kw_only=True, eq=False)
class Claims:
    """Claims of instances' tasks: the store's compare-and-swap, then the action's history.

    A claim that cannot be followed by its action (its outcome unknown, or its
    history record not written) is given back at once, so no instance keeps
    a task no action runs.
    """

    log = Logger()

    store: AsyncStore
    journal: Journal
    # Per instance, while a claim (and its giving back) is under way: claims wait in turn.
    _locks: dict[str, DeferredLock] = attrs.field(init=False, factory=dict)

    async def claim(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> tuple[InstanceRecord, ActionContext]:
        """Claim ``task`` for ``action`` (409 if the instance is not where it may start)."""
        async with self._claiming(name):
            try:
                record = await self.store.instances.claim_task(name, action, allowed_from, task)
            except OutcomeUnknown:
                # The claim may have been kept: no action will run it, so give it back.
                await self._give_back(name, task)
                raise
            try:
                context = await self.journal.begin(name, action, task)
            except StoreWriteFailed:
                # The claim was kept, the action's history could not be: no action runs.
                await self._give_back(name, task)
                raise
        return record, context

    @contextlib.asynccontextmanager
    async def _claiming(self, name: str) -> AsyncIterator[None]:
        """One claim of instance ``name`` at a time, with its history record or giving back.

        The store's compare-and-swap decides between claims; this keeps a
        claim given back (its outcome unknown) from ending another request's
        claim of the same task that the store took meanwhile.
        """
        lock = self._locks.setdefault(name, DeferredLock())
        await lock.acquire()
        try:
            yield
        finally:
            lock.release()
            if not lock.locked:
                self._locks.pop(name, None)

    async def _give_back(self, name: str, task: TaskState) -> None:
        """End a claimed task no action will run, leaving the instance where it was.

        A compare-and-swap on the task: if the claim was not kept after all,
        there is nothing to give back.  If the store still fails, the task stays
        until the daemon's next start resolves it (as for any interrupted task).
        """
        current = self.store.view.find_instance(name)
        if current is None:
            return
        try:
            await self.store.instances.finish_task(name, task, current.vm_state)
        except Conflict:
            return  # not claimed after all (or claimed by another action meanwhile)
        except StoreWriteFailed as e:
            self.log.warn(
                "instance {name} keeps task {task} until the daemon restarts: {error}",
                name=name,
                task=task.value,
                error=e.message,
            )
            return
        self.log.info(
            "gave back the {task} task of {name}: its action could not start",
            name=name,
            task=task.value,
        )
