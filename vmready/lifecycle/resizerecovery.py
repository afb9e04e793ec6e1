"""Recovery of a resize, confirm-resize or revert-resize a daemon crash cut short."""

from __future__ import annotations

import attrs

from vmready.domain import READY_KEY, InstanceRecord, PowerState, TaskState, VMState
from vmready.hypervisor import RunningVM
from vmready.lifecycle.actions import PREVIOUS_CPU_KEY, PREVIOUS_MEMORY_KEY
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.watching import Watching
from vmready.store import AsyncStore

# The tasks of resize, confirm-resize and revert-resize: never left half-applied.
RESIZE_TASKS = frozenset(
    {
        TaskState.RESIZE_QUEUED,
        TaskState.RESIZE_PREP,
        TaskState.RESIZE_MIGRATING,
        TaskState.RESIZE_FINISH,
        TaskState.RESIZE_CONFIRMING,
        TaskState.RESIZE_REVERTING,
    }
)
# The resize steps after which its new size may be in the store (written with the old one
# kept beside it, once the old VM is down, before the new one starts).
_RESIZE_MAY_HAVE_WRITTEN = frozenset({TaskState.RESIZE_MIGRATING, TaskState.RESIZE_FINISH})


@attrs.define(kw_only=True, eq=False)
class ResizeRecovery:
    """A resize, confirm or revert cut short: completed or rolled back, never half-applied.

    A resize stops the old VM, then writes the new size with the old one kept
    beside it (``volatile.resize.previous.*``) in one store write, then starts
    the VM at the new size. Which of those happened decides:

    - the new size is in the store and the VM is as the resize leaves it
      (running, which can only be the VM started at the new size, if it ran
      before; none if it was stopped): the resize is *completed*, resized,
      awaiting confirm or revert as after any resize;
    - otherwise it is *rolled back* as a revert would: the old size back in
      the store, a VM of the new size stopped, and the VM started again at
      the old size if it ran before the resize (active), else stopped. Only
      the old size is known to fit: nothing the operator has not confirmed
      is kept half-way;
    - a revert is completed the same way (its end is the rollback's);
    - a confirm changes only the store: it is completed.
    """

    store: AsyncStore
    events: EventBus
    journal: Journal
    booting: Booting
    watching: Watching

    async def recover(
        self, record: InstanceRecord, task: TaskState, adopted: RunningVM | None
    ) -> None:
        """Complete or roll back ``record``'s interrupted ``task`` (one of the resize tasks)."""
        previous = PREVIOUS_MEMORY_KEY in record.config or PREVIOUS_CPU_KEY in record.config
        ran_before = record.power_state in (PowerState.RUNNING, PowerState.PAUSED)
        if task is TaskState.RESIZE_CONFIRMING:
            await self._finish(
                record,
                task,
                adopted,
                "the resize is confirmed",
                "instance-resize-confirmed",
                {PREVIOUS_MEMORY_KEY: None, PREVIOUS_CPU_KEY: None},
            )
            return
        written = previous and task in _RESIZE_MAY_HAVE_WRITTEN
        if written and (adopted is not None) == ran_before:
            await self._finish(
                record, task, adopted, "the new size was applied", "instance-resized", resized=True
            )
            return
        if written or (previous and task is TaskState.RESIZE_REVERTING):
            await self.watching.force_stop(record.name, adopted)
            adopted = None
            record = await self.store.instances.update_config(
                record.name,
                {
                    "limits.memory": record.config.get(
                        PREVIOUS_MEMORY_KEY, str(record.memory_mib)
                    ),
                    "limits.cpu": record.config.get(PREVIOUS_CPU_KEY, str(record.cpus)),
                    PREVIOUS_MEMORY_KEY: None,
                    PREVIOUS_CPU_KEY: None,
                    READY_KEY: "false",
                },
            )
        if adopted is None and ran_before:
            adopted = await self.booting.launch(record)
        await self._finish(
            record, task, adopted, "rolled back to the old size", "instance-resize-reverted"
        )

    async def _finish(
        self,
        record: InstanceRecord,
        task: TaskState,
        vm: RunningVM | None,
        outcome: str,
        event: str,
        config: dict[str, str | None] | None = None,
        *,
        resized: bool = False,
    ) -> None:
        power = await vm.query_power_state() if vm is not None else PowerState.SHUTDOWN
        if resized:
            vm_state = VMState.RESIZED
        elif power is PowerState.PAUSED:
            vm_state = VMState.PAUSED
        elif vm is not None:
            vm_state = VMState.ACTIVE
        else:
            vm_state = VMState.STOPPED
        detail = f"daemon stopped during {task.value}; {outcome}: now {vm_state}"
        self.journal.history(record.name, "recover", detail)
        finished = await self.store.instances.finish_task(
            record.name, task, vm_state, power, config
        )
        self.journal.publish_state(finished)
        self.events.lifecycle(
            event,
            record.name,
            {"reason": detail, "memory_mib": finished.memory_mib, "cpus": finished.cpus},
        )
