"""Daemon-start recovery: every instance made to agree with the VMs that really run.

In two parts: ``prepare`` (bulk writes before the API serves) and
``reconcile`` (each instance, while it serves).
"""

from __future__ import annotations

import contextlib

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from vmready.domain import (
    READY_KEY,
    RUNNING_VM_STATES,
    HypervisorError,
    InstanceRecord,
    PowerState,
    TaskState,
    VMReadyError,
    VMState,
)
from vmready.lifecycle.actions import Actions
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.faults import Fault, error_time
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.hooks import Hypervisor
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.powersync import PowerSync, bounded
from vmready.lifecycle.resizerecovery import RESIZE_TASKS, ResizeRecovery
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import InstanceSpecs
from vmready.lifecycle.watching import Watching
from vmready.store import AsyncStore, Store

# Instances reconciled at once by power sync and at start-up (``--sync-concurrency``).
DEFAULT_SYNC_CONCURRENCY = 16
# The tasks a VM that still runs after a restart finishes: it ran (or was freed) as asked.
_TASKS_RESOLVED_BY_A_RUNNING_VM = frozenset(
    {
        TaskState.SPAWNING,
        TaskState.POWERING_ON,
        TaskState.REBOOTING,
        TaskState.PAUSING,
        TaskState.UNPAUSING,
    }
)


@attrs.define(kw_only=True, eq=False)
class Recovery:
    """Daemon-start recovery: Ready cleared, interrupted actions closed, each VM re-adopted.

    An interrupted task is finished or ends in error, saying why; a resize
    is completed or rolled back (``resizerecovery``).
    """

    log = Logger()

    store: AsyncStore
    events: EventBus
    journal: Journal
    driver: Hypervisor
    specs: InstanceSpecs
    running: RunningVMs
    watching: Watching
    guestside: GuestSide
    actions: Actions
    power_sync: PowerSync
    booting: Booting
    # At most this many instances reconciled at once.
    concurrency: int
    resizes: ResizeRecovery = attrs.field(init=False)
    # Instances whose start-up reconciliation has not run yet.
    _pending: dict[str, list[Deferred[None]]] = attrs.field(init=False, factory=dict)
    # Set when the daemon stops: what has not been reconciled yet is left for the next start.
    _stopping: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.resizes = ResizeRecovery(
            store=self.store,
            events=self.events,
            journal=self.journal,
            booting=self.booting,
            watching=self.watching,
        )

    def stop(self) -> None:
        """The daemon stops: what has not been reconciled yet is left for the next start."""
        self._stopping = True

    async def recover(self) -> None:
        """At daemon start: ``prepare`` then ``reconcile``, in one go."""
        await self.reconcile(await self.prepare())

    async def prepare(self) -> list[InstanceRecord]:
        """Before the API serves: clear Ready everywhere, close interrupted actions.

        Bulk writes, one transaction each; returns the instances ``reconcile``
        must visit, each marked pending until it has been (``reconciled``).
        """
        cleared = await self.store.instances.clear_ready_everywhere()
        self.log.info("cleared {key} on {count} instances", key=READY_KEY, count=cleared)
        reason = "daemon stopped during the action"
        member = self.store.member

        def close_interrupted(engine: Store) -> None:
            # A cluster member closes its own instances' actions, never another's in progress.
            for action in engine.actions.unfinished_actions(member):
                engine.actions.finish_action(action.id, "error", reason)

        await self.store.run(close_interrupted)
        records = self.store.view.owned_instances()
        for record in records:
            self._pending.setdefault(record.name, [])
        await self._restore_errors(records)
        return records

    async def _restore_errors(self, records: list[InstanceRecord]) -> None:
        """Each stored error stands again as a fault, at the time its action history gives."""
        errors = {r.name: r.error for r in records if r.vm_state is VMState.ERROR and r.error}
        if not errors:
            return
        histories = await self.store.run(
            lambda engine: {name: engine.actions.list_actions(name) for name in errors}
        )
        for name, error in errors.items():
            at = error_time(error, histories[name])
            if at is not None:
                self.events.faults.restore(name, Fault("error", error, at))

    async def reconcile(self, records: list[InstanceRecord]) -> None:
        """Re-adopt or resolve each VM (and issue missing agent identities), bounded.

        The API may serve meanwhile: an action on an instance waits for its
        reconciliation (``reconciled``), and nothing is Ready before its VM is
        adopted and its agent says so again.
        """
        await bounded(self.concurrency, self._reconcile_guarded, records)

    def reconciled(self, name: str) -> Deferred[None]:
        """Fires once the instance's start-up reconciliation is over (at once if it is)."""
        waiters = self._pending.get(name)
        if waiters is None:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        waiters.append(waiter)
        return waiter

    async def _reconcile_guarded(self, record: InstanceRecord) -> None:
        try:
            current = self.store.view.find_instance(record.name)
            if current is not None and not self._stopping:
                await self.guestside.ensure_agent_identity(current)
                try:
                    await self._recover_one(current)
                except VMReadyError as e:
                    await self._recovery_failed(current, e.message)
        except Exception:
            self.log.failure("recovering {name}", name=record.name)
        finally:
            for waiter in self._pending.pop(record.name, []):
                waiter.callback(None)

    async def _recovery_failed(self, record: InstanceRecord, why: str) -> None:
        """Whatever went wrong re-adopting an instance, it must not stay mid-task: error."""
        self.log.warn("recovering {name}: {error}", name=record.name, error=why)
        vm = self.running.vms.get(record.name)
        self.watching.detach(record.name)
        if vm is not None:
            await vm.detach()
        try:
            await self.driver.kill_owned(self.specs.spec_for(record))
        except HypervisorError as e:
            why = f"{why}; {e.message}"
        current = self.store.view.find_instance(record.name)
        if current is None:
            return
        task = current.task_state
        reason = f"daemon stopped during {task.value}; {why}" if task else why
        self.journal.history(record.name, "recover", reason, ok=False)
        await self.watching.fail(current, reason, PowerState.NOSTATE)

    async def _recover_one(self, record: InstanceRecord) -> None:
        task = record.task_state
        if task is None:
            should_run = record.vm_state in RUNNING_VM_STATES and (
                record.power_state is not PowerState.SHUTDOWN
            )
            if should_run:
                await self.power_sync.adopt_or_settle(
                    record, "VM was not running when the daemon started"
                )
            elif record.vm_state is not VMState.ERROR:
                # Stopped (or resized while stopped): it must not have a VM; stop any that runs.
                await self.driver.kill_owned(self.specs.spec_for(record))
            return
        reason = f"daemon stopped during {task.value}"
        try:
            adopted = await self.driver.adopt(self.specs.spec_for(record))
        except HypervisorError as e:
            await self.driver.kill_owned(self.specs.spec_for(record))
            self.journal.history(record.name, "recover", f"{reason}; {e.message}", ok=False)
            await self.watching.fail(record, f"{reason}; {e.message}", PowerState.NOSTATE)
            return
        if adopted is not None:
            self.watching.attach(record.name, adopted, advertise=True)
        if task is TaskState.DELETING:
            await self.watching.force_stop(record.name, adopted)
            await self.actions.forget(record, reason)
            return
        if task is TaskState.POWERING_OFF:
            await self.watching.force_stop(record.name, adopted)
            await self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
            return
        if task in RESIZE_TASKS:
            await self.resizes.recover(record, task, adopted)
            return
        if task is TaskState.SNAPSHOTTING:
            # The snapshot was not recorded (its row is written last); the VM may be paused
            # mid-save: let it run on. A partial directory is replaced by the next snapshot.
            if adopted is None:
                await self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
                return
            with contextlib.suppress(HypervisorError):
                await adopted.resume()
            power = await adopted.query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            await self._resolve(record, task, vm_state, power)
            return
        if adopted is not None and task in _TASKS_RESOLVED_BY_A_RUNNING_VM:
            power = await adopted.query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            await self._resolve(record, task, vm_state, power)
            return
        if task is TaskState.POWERING_ON and adopted is None:
            await self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
            return
        await self.watching.force_stop(record.name, adopted)
        await self._resolve_error(record, reason)

    async def _resolve_error(self, record: InstanceRecord, reason: str) -> None:
        """A task that cannot be finished after a restart ends in error, saying so."""
        self.journal.history(record.name, "recover", reason, ok=False)
        await self.watching.fail(record, reason, PowerState.NOSTATE)

    async def _resolve(
        self, record: InstanceRecord, task: TaskState, vm_state: VMState, power: PowerState
    ) -> None:
        detail = f"daemon stopped during {task.value}; now {vm_state}"
        self.journal.history(record.name, "recover", detail)
        finished = await self.store.instances.finish_task(record.name, task, vm_state, power)
        self.journal.publish_state(finished)
