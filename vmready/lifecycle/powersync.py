"""Power sync: each round, the store made to agree with the VMs that really run.

QMP events carry every power change; the sync is the safety net (a hung
monitor, a VM started or stopped by hand, an agent's certificate files made
readable again).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import attrs
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults
from twisted.logger import Logger

from vmready.domain import (
    READY_KEY,
    RUNNING_VM_STATES,
    HypervisorError,
    InstanceRecord,
    PowerState,
    VMReadyError,
    VMState,
)
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.hooks import Hypervisor
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import InstanceSpecs
from vmready.lifecycle.watching import MONITOR_LOST_KEY, Watching
from vmready.store import AsyncStore


@attrs.define(kw_only=True, eq=False)
class PowerSync:
    """Power sync: the store made to agree with the VMs that really run, round by round."""

    log = Logger()

    store: AsyncStore
    events: EventBus
    journal: Journal
    driver: Hypervisor
    specs: InstanceSpecs
    running: RunningVMs
    watching: Watching
    guestside: GuestSide
    # At most this many instances reconciled at once.
    concurrency: int

    async def sync_power_states(self) -> None:
        """One reconciliation round, ``concurrency`` instances at a time; tasks left alone.

        Errors are left too, but for one whose VM's monitor was lost: its VM is
        adopted again once the monitor answers.  Instances whose certificate
        files could not be read are looked at again.
        """
        idle = [record for record in self.store.view.owned_instances() if _syncable(record)]
        await bounded(self.concurrency, self._sync_guarded, idle)

    async def _sync_guarded(self, listed: InstanceRecord) -> None:
        # Listed when the round began; the limit may have kept it waiting since, while an
        # action started or stopped it: act on what the store says now, as the round would.
        record = self.store.view.find_instance(listed.name)
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
        vm = self.running.vms.get(record.name)
        should_run = record.vm_state in RUNNING_VM_STATES and (
            record.power_state is not PowerState.SHUTDOWN
        )
        # QEMU announced SHUTDOWN (a guest power-off) and has not exited yet.
        shutting_down = (
            record.vm_state in RUNNING_VM_STATES and record.power_state is PowerState.SHUTDOWN
        )
        if vm is None or vm.gone:
            if should_run or shutting_down:
                await self.adopt_or_settle(record, "VM not running: no QEMU process answers")
            elif await self.driver.kill_owned(self.specs.spec_for(record)):
                self.journal.history(
                    record.name,
                    "power-sync",
                    "a VM was running while the instance is stopped; stopped it",
                )
            return
        if shutting_down:
            return  # its exit settles the instance (stopped, with the guest's reason)
        if not should_run:
            await self.watching.force_stop(record.name, vm)
            self.journal.history(
                record.name,
                "power-sync",
                "a VM was running while the instance is stopped; stopped it",
            )
            return
        try:
            power = await vm.query_power_state()
        except HypervisorError as e:
            # A monitor that stops answering is not a running VM anyone can manage.
            current = self.store.view.find_instance(record.name)
            if current is not None and current.task_state is None:
                self.watching.detach(record.name)
                self.journal.history(record.name, "power-sync", e.message, ok=False)
                await self._monitor_lost(current, e.message)
                await vm.detach()  # hang up on the monitor; the VM itself is left as it is
            return
        current = self.store.view.find_instance(record.name)
        if current is not None and current.task_state is None and power is not current.power_state:
            self.journal.publish_state(
                await self.store.instances.set_power_state(record.name, power)
            )

    async def adopt_or_settle(self, record: InstanceRecord, why: str) -> None:
        """Re-attach the instance's VM; if none runs, it is stopped; if it won't answer, error."""
        try:
            adopted = await self.driver.adopt(self.specs.spec_for(record))
        except HypervisorError as e:
            current = self.store.view.find_instance(record.name)
            if current is not None and current.task_state is None:
                self.journal.history(record.name, "power-sync", e.message, ok=False)
                await self._monitor_lost(current, e.message)
            return
        if adopted is not None:
            self.watching.attach(record.name, adopted, advertise=True)
            return
        updated = await self.store.instances.settle(
            record.name,
            RUNNING_VM_STATES,
            VMState.STOPPED,
            PowerState.SHUTDOWN,
            {READY_KEY: "false"},
        )
        if updated is not None:
            self.journal.history(record.name, "power-sync", why)
            self.journal.publish_state(updated)
            self.events.lifecycle("instance-stopped", record.name, {"reason": why})

    async def _readopt(self, record: InstanceRecord) -> None:
        """An instance in error because its monitor was lost: adopt its VM once it answers."""
        if self.running.has_vm(record.name):
            return  # followed already (a start adopted it)
        try:
            adopted = await self.driver.adopt(self.specs.spec_for(record))
        except HypervisorError:
            return  # still unreachable: the error stays, tried again next round
        if adopted is None:
            # The VM ended meanwhile: the error stays, with nothing left to adopt.
            self.journal.history(record.name, "power-sync", "the VM is gone", ok=False)
            await self.store.instances.update_config(record.name, {MONITOR_LOST_KEY: None})
            self.journal.publish_state(
                await self.store.instances.set_power_state(record.name, PowerState.CRASHED)
            )
            return
        try:
            power = await adopted.query_power_state()
        except HypervisorError:
            await adopted.detach()
            return
        vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
        updated = await self.store.instances.settle(
            record.name, frozenset({VMState.ERROR}), vm_state, power, {MONITOR_LOST_KEY: None}
        )
        if updated is None:
            await adopted.detach()  # an action took the instance meanwhile: it decides
            return
        self.watching.attach(record.name, adopted, advertise=True)
        detail = "its QMP monitor answers again; adopted the VM"
        self.journal.history(record.name, "power-sync", detail)
        self.journal.publish_state(updated)
        self.events.lifecycle("instance-monitor-restored", record.name, {"reason": detail})

    async def _monitor_lost(self, record: InstanceRecord, reason: str) -> None:
        """The VM runs but its QMP monitor cannot be reached: error, marked for re-adoption.

        Each round tries to adopt the VM again (``MONITOR_LOST_KEY``); once its
        monitor answers, the instance runs again without an action.
        """
        await self.store.instances.update_config(record.name, {MONITOR_LOST_KEY: "true"})
        if await self.watching.fail(record, reason, PowerState.NOSTATE, idle=True):
            self.events.lifecycle("instance-monitor-lost", record.name, {"reason": reason})


async def bounded(
    concurrency: int,
    work: Callable[[InstanceRecord], Coroutine[Any, Any, None]],
    records: list[InstanceRecord],
) -> None:
    """``work`` on every record, never more than ``concurrency`` at once."""
    limit = DeferredSemaphore(concurrency)

    def one(record: InstanceRecord) -> Deferred[None]:
        return limit.run(lambda: Deferred.fromCoroutine(work(record)))

    await gatherResults([one(record) for record in records], consumeErrors=True)


def _syncable(record: InstanceRecord) -> bool:
    """Power sync visits idle instances, in error only if their monitor was lost."""
    if record.task_state is not None:
        return False
    return record.vm_state is not VMState.ERROR or MONITOR_LOST_KEY in record.config
