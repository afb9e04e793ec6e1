"""Power sync and daemon-start recovery.

The store made to agree with the VMs that really run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults, succeed
from twisted.logger import Logger

from vmready.domain.model import (
    HypervisorError,
    InstanceRecord,
    VMReadyError,
)
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.actions import Actions
from vmready.lifecycle.faults import Fault, error_time
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.resizerecovery import RESIZE_TASKS, ResizeRecovery
from vmready.lifecycle.state import (
    _RUNNING_STATES,
    _TASKS_RESOLVED_BY_A_RUNNING_VM,
    LifecycleState,
)
from vmready.lifecycle.watching import MONITOR_LOST_KEY, Watching
from vmready.store.sqlite import Store

# Instances reconciled at once by power sync and at start-up (``--sync-concurrency``).
DEFAULT_SYNC_CONCURRENCY = 16


class Recovery:
    """Power sync and daemon-start recovery.

    The store made to agree with the VMs that really run.
    """

    log = Logger()

    def __init__(
        self,
        state: LifecycleState,
        actions: Actions,
        watching: Watching,
        guestside: GuestSide,
        concurrency: int = DEFAULT_SYNC_CONCURRENCY,
    ) -> None:
        self.state = state
        self.actions = actions
        self.watching = watching
        self.guestside = guestside
        self.resizes = ResizeRecovery(state, actions, watching)
        # At most this many instances reconciled at once (power sync, start-up).
        self.concurrency = concurrency
        # Instances whose start-up reconciliation has not run yet.
        self._pending: dict[str, list[Deferred[None]]] = {}
        # Set when the daemon stops: what has not been reconciled yet is left for the next start.
        self.stopping = False

    async def sync_power_states(self) -> None:
        """One reconciliation round, ``concurrency`` instances at a time; tasks left alone.

        Errors are left too, but for one whose VM's monitor was lost: its VM is
        adopted again once the monitor answers.  Instances whose certificate
        files could not be read are looked at again.
        """
        idle = [record for record in self.state.store.view.owned_instances() if _syncable(record)]
        await self._bounded(self._sync_guarded, idle)

    async def _bounded(
        self,
        work: Callable[[InstanceRecord], Coroutine[Any, Any, None]],
        records: list[InstanceRecord],
    ) -> None:
        """``work`` on every record, never more than ``concurrency`` at once."""
        limit = DeferredSemaphore(self.concurrency)

        def one(record: InstanceRecord) -> Deferred[None]:
            return limit.run(lambda: Deferred.fromCoroutine(work(record)))

        await gatherResults([one(record) for record in records], consumeErrors=True)

    async def _sync_guarded(self, listed: InstanceRecord) -> None:
        # Listed when the round began; the limit may have kept it waiting since, while an
        # action started or stopped it: act on what the store says now, as the round would.
        record = self.state.store.view.find_instance(listed.name)
        if record is None or not _syncable(record):
            return
        try:
            if record.name in self.guestside.unreadable:
                self.guestside.recheck_identity(record)  # cleared once readable again
            await self._sync_one(record)
        except VMReadyError as e:
            self.log.warn("power sync of {name}: {error}", name=record.name, error=e.message)

    async def _sync_one(self, record: InstanceRecord) -> None:
        if record.vm_state is VMState.ERROR:
            await self._readopt(record)
            return
        vm = self.state.vms.get(record.name)
        should_run = record.vm_state in _RUNNING_STATES and (
            record.power_state is not PowerState.SHUTDOWN
        )
        # QEMU announced SHUTDOWN (a guest power-off) and has not exited yet.
        shutting_down = (
            record.vm_state in _RUNNING_STATES and record.power_state is PowerState.SHUTDOWN
        )
        if vm is None or vm.gone:
            if should_run or shutting_down:
                await self._adopt_or_settle(record, "VM not running: no QEMU process answers")
            elif await self.state.driver.kill_owned(self.state.spec_for(record)):
                self.state.history(
                    record.name,
                    "power-sync",
                    "a VM was running while the instance is stopped; stopped it",
                )
            return
        if shutting_down:
            return  # its exit settles the instance (stopped, with the guest's reason)
        if not should_run:
            self.watching.detach(record.name)
            await vm.force_stop()
            self.state.history(
                record.name,
                "power-sync",
                "a VM was running while the instance is stopped; stopped it",
            )
            return
        try:
            power = await vm.query_power_state()
        except HypervisorError as e:
            # A monitor that stops answering is not a running VM anyone can manage.
            current = self.state.store.view.find_instance(record.name)
            if current is not None and current.task_state is None:
                self.watching.detach(record.name)
                self.state.history(record.name, "power-sync", e.message, ok=False)
                await self.watching.monitor_lost(current, e.message)
                await vm.detach()  # hang up on the monitor; the VM itself is left as it is
            return
        current = self.state.store.view.find_instance(record.name)
        if current is not None and current.task_state is None and power is not current.power_state:
            self.state.publish_state(
                await self.state.store.instances.set_power_state(record.name, power)
            )

    async def _adopt_or_settle(self, record: InstanceRecord, why: str) -> None:
        """Re-attach the instance's VM; if none runs, it is stopped; if it won't answer, error."""
        try:
            adopted = await self.state.driver.adopt(self.state.spec_for(record))
        except HypervisorError as e:
            current = self.state.store.view.find_instance(record.name)
            if current is not None and current.task_state is None:
                self.state.history(record.name, "power-sync", e.message, ok=False)
                await self.watching.monitor_lost(current, e.message)
            return
        if adopted is not None:
            self.watching.attach(record.name, adopted, advertise=True)
            return
        updated = await self.state.store.instances.settle(
            record.name,
            _RUNNING_STATES,
            VMState.STOPPED,
            PowerState.SHUTDOWN,
            {READY_KEY: "false"},
        )
        if updated is not None:
            self.state.history(record.name, "power-sync", why)
            self.state.publish_state(updated)
            self.state.events.lifecycle("instance-stopped", record.name, {"reason": why})

    async def _readopt(self, record: InstanceRecord) -> None:
        """An instance in error because its monitor was lost: adopt its VM once it answers."""
        if self.state.has_vm(record.name):
            return  # followed already (a start adopted it)
        try:
            adopted = await self.state.driver.adopt(self.state.spec_for(record))
        except HypervisorError:
            return  # still unreachable: the error stays, tried again next round
        if adopted is None:
            # The VM ended meanwhile: the error stays, with nothing left to adopt.
            self.state.history(record.name, "power-sync", "the VM is gone", ok=False)
            await self.state.store.instances.update_config(record.name, {MONITOR_LOST_KEY: None})
            self.state.publish_state(
                await self.state.store.instances.set_power_state(record.name, PowerState.CRASHED)
            )
            return
        try:
            power = await adopted.query_power_state()
        except HypervisorError:
            await adopted.detach()
            return
        vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
        updated = await self.state.store.instances.settle(
            record.name, frozenset({VMState.ERROR}), vm_state, power, {MONITOR_LOST_KEY: None}
        )
        if updated is None:
            await adopted.detach()  # an action took the instance meanwhile: it decides
            return
        self.watching.attach(record.name, adopted, advertise=True)
        detail = "its QMP monitor answers again; adopted the VM"
        self.state.history(record.name, "power-sync", detail)
        self.state.publish_state(updated)
        self.state.events.lifecycle("instance-monitor-restored", record.name, {"reason": detail})

    async def recover(self) -> None:
        """At daemon start: ``prepare`` then ``reconcile``, in one go."""
        await self.reconcile(await self.prepare())

    async def prepare(self) -> list[InstanceRecord]:
        """Before the API serves: clear Ready everywhere, close interrupted actions.

        Bulk writes, one transaction each; returns the instances ``reconcile``
        must visit, each marked pending until it has been (``reconciled``).
        """
        cleared = await self.state.store.instances.clear_ready_everywhere()
        self.log.info("cleared {key} on {count} instances", key=READY_KEY, count=cleared)
        reason = "daemon stopped during the action"
        member = self.state.store.member

        def close_interrupted(engine: Store) -> None:
            # A cluster member closes its own instances' actions, never another's in progress.
            for action in engine.actions.unfinished_actions(member):
                engine.actions.finish_action(action.id, "error", reason)

        await self.state.store.run(close_interrupted)
        records = self.state.store.view.owned_instances()
        for record in records:
            self._pending.setdefault(record.name, [])
        await self._restore_errors(records)
        return records

    async def _restore_errors(self, records: list[InstanceRecord]) -> None:
        """Each stored error stands again as a fault, at the time its action history gives."""
        errors = {r.name: r.error for r in records if r.vm_state is VMState.ERROR and r.error}
        if not errors:
            return
        histories = await self.state.store.run(
            lambda engine: {name: engine.actions.list_actions(name) for name in errors}
        )
        for name, error in errors.items():
            at = error_time(error, histories[name])
            if at is not None:
                self.state.events.faults.restore(name, Fault("error", error, at))

    async def reconcile(self, records: list[InstanceRecord]) -> None:
        """Re-adopt or resolve each VM (and issue missing agent identities), bounded.

        The API may serve meanwhile: an action on an instance waits for its
        reconciliation (``reconciled``), and nothing is Ready before its VM is
        adopted and its agent says so again.
        """
        await self._bounded(self._reconcile_guarded, records)

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
            current = self.state.store.view.find_instance(record.name)
            if current is not None and not self.stopping:
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
        vm = self.state.vms.get(record.name)
        self.watching.detach(record.name)
        if vm is not None:
            await vm.detach()
        try:
            await self.state.driver.kill_owned(self.state.spec_for(record))
        except HypervisorError as e:
            why = f"{why}; {e.message}"
        current = self.state.store.view.find_instance(record.name)
        if current is None:
            return
        task = current.task_state
        reason = f"daemon stopped during {task.value}; {why}" if task else why
        self.state.history(record.name, "recover", reason, ok=False)
        await self.watching.fail_idle(current, reason, PowerState.NOSTATE)

    async def _recover_one(self, record: InstanceRecord) -> None:
        task = record.task_state
        if task is None:
            should_run = record.vm_state in _RUNNING_STATES and (
                record.power_state is not PowerState.SHUTDOWN
            )
            if should_run:
                await self._adopt_or_settle(record, "VM was not running when the daemon started")
            elif record.vm_state is not VMState.ERROR:
                # Stopped (or resized while stopped): it must not have a VM; stop any that runs.
                await self.state.driver.kill_owned(self.state.spec_for(record))
            return
        reason = f"daemon stopped during {task.value}"
        try:
            adopted = await self.state.driver.adopt(self.state.spec_for(record))
        except HypervisorError as e:
            await self.state.driver.kill_owned(self.state.spec_for(record))
            self.state.history(record.name, "recover", f"{reason}; {e.message}", ok=False)
            await self.watching.fail_idle(record, f"{reason}; {e.message}", PowerState.NOSTATE)
            return
        if adopted is not None:
            self.watching.attach(record.name, adopted, advertise=True)
        if task is TaskState.DELETING:
            await self._stop_adopted(record.name, adopted)
            await self.actions.forget(record, reason)
            return
        if task is TaskState.POWERING_OFF:
            await self._stop_adopted(record.name, adopted)
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
        await self._stop_adopted(record.name, adopted)
        await self._resolve_error(record, reason)

    async def _stop_adopted(self, name: str, adopted: RunningVM | None) -> None:
        if adopted is not None:
            self.watching.detach(name)
            await adopted.force_stop()

    async def _resolve_error(self, record: InstanceRecord, reason: str) -> None:
        """A task that cannot be finished after a restart ends in error, saying so."""
        self.state.history(record.name, "recover", reason, ok=False)
        await self.watching.fail_idle(record, reason, PowerState.NOSTATE)

    async def _resolve(
        self, record: InstanceRecord, task: TaskState, vm_state: VMState, power: PowerState
    ) -> None:
        detail = f"daemon stopped during {task.value}; now {vm_state}"
        self.state.history(record.name, "recover", detail)
        finished = await self.state.store.instances.finish_task(record.name, task, vm_state, power)
        self.state.publish_state(finished)


def _syncable(record: InstanceRecord) -> bool:
    """Power sync visits idle instances, in error only if their monitor was lost."""
    if record.task_state is not None:
        return False
    return record.vm_state is not VMState.ERROR or MONITOR_LOST_KEY in record.config
