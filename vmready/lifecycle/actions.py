"""An operator's actions on an instance, each a task.

Start, stop, restart, freeze, unfreeze, rebuild, resize (confirm, revert) and
delete: their steps (``actionchecks`` checks them before anything is claimed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Awaitable

import attrs
from twisted.logger import Logger

from vmready.domain import (
    READY_KEY,
    HypervisorError,
    InstanceRecord,
    PowerState,
    TaskState,
    VMReadyError,
    VMState,
)
from vmready.hypervisor import BootSource, remove_instance_snapshots
from vmready.lifecycle.agenthistory import AgentHistory
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.hooks import Hypervisor
from vmready.lifecycle.journal import ActionContext
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import InstanceSpecs, run_dir_name
from vmready.lifecycle.watching import Watching
from vmready.store import AsyncStore

# A resize keeps the size it replaced here until it is confirmed or reverted.
PREVIOUS_MEMORY_KEY = "volatile.resize.previous.memory"
PREVIOUS_CPU_KEY = "volatile.resize.previous.cpu"


@attrs.define(kw_only=True, eq=False)
class Actions:
    """An operator's actions on an instance, each a task.

    Start, stop, restart, freeze, unfreeze, rebuild, resize (confirm, revert) and
    delete: their steps.
    """

    log = Logger()

    store: AsyncStore
    events: EventBus
    driver: Hypervisor
    specs: InstanceSpecs
    running: RunningVMs
    agent_history: AgentHistory
    booting: Booting
    watching: Watching
    stop_timeout: float

    async def guarded(self, context: ActionContext, work: Awaitable[None]) -> None:
        """Run an action's body; any failure ends the task in error with its reason."""
        try:
            await work
        except VMReadyError as e:
            if not context.ended:
                await context.fail(e.message)
            raise
        except Exception as e:
            self.log.failure(
                "action {action} on {name} failed", action=context.action, name=context.name
            )
            if not context.ended:
                await context.fail(f"internal error: {e}")
            raise

    async def do_start(self, context: ActionContext, record: InstanceRecord) -> None:
        leaving_error = record.vm_state is VMState.ERROR
        if leaving_error and self.running.has_vm(record.name):
            # In error, but its VM still runs and is followed: keep it, do not replace it.
            context.note("kept the VM that was still running")
            power = await self.running.vm(record.name).query_power_state()
            await context.finish(power)
            self.events.lifecycle("instance-started", record.name)
            return
        if (
            leaving_error
            and not self.running.has_vm(record.name)
            and await self._take_over_running_vm(context, record)
        ):
            power = await self.running.vm(record.name).query_power_state()
            await context.finish(power)
        else:
            # A stray VM of a stopped instance may run an old configuration: replace it.
            if await self.driver.kill_owned(self.specs.spec_for(record)):
                context.note("killed a stray VM before starting")
            await self.booting.launch(record)
            await context.finish(PowerState.RUNNING)
        self.events.lifecycle("instance-started", record.name)

    async def _take_over_running_vm(self, context: ActionContext, record: InstanceRecord) -> bool:
        """Before starting: a VM that still runs (an instance left in error) is adopted."""
        spec = self.specs.spec_for(record)
        try:
            adopted = await self.driver.adopt(spec)
        except HypervisorError as e:
            await self.driver.kill_owned(spec)
            context.note(f"killed a VM whose monitor did not answer: {e.message}")
            return False
        if adopted is None:
            return False
        self.watching.attach(record.name, adopted, advertise=True)
        context.note("adopted the VM that was still running")
        return True

    async def do_stop(
        self, context: ActionContext, record: InstanceRecord, timeout: float, force: bool
    ) -> None:
        await self.booting.power_off(context, record.name, timeout, force)
        await context.finish(PowerState.SHUTDOWN, {READY_KEY: "false"})
        self.events.lifecycle("instance-stopped", record.name)

    async def do_restart(
        self, context: ActionContext, record: InstanceRecord, timeout: float, force: bool
    ) -> None:
        await self.booting.power_off(context, record.name, timeout, force)
        await self.store.instances.update_config(record.name, {READY_KEY: "false"})
        await self.booting.launch(self.store.view.get_instance(record.name))
        await context.finish(PowerState.RUNNING)
        self.events.lifecycle("instance-restarted", record.name)

    async def do_freeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.running.vm(record.name).pause()
        await context.finish(PowerState.PAUSED)
        self.events.lifecycle("instance-paused", record.name)

    async def do_unfreeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.running.vm(record.name).resume()
        await context.finish(PowerState.RUNNING)
        self.events.lifecycle("instance-resumed", record.name)

    async def do_rebuild(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.booting.power_off(context, record.name, 0, force=True)
        record = await self.store.instances.update_config(record.name, {READY_KEY: "false"})
        boot = BootSource.from_config(record.config)
        if boot.image is not None:
            # The image may have changed or gone since launch: check it again.
            await self.booting.make_disk(
                context, record, await self.booting.check_boot_source(boot)
            )
        await self.booting.launch(record)
        await context.finish(PowerState.RUNNING)
        self.events.lifecycle("instance-rebuilt", record.name)

    async def do_resize(
        self,
        context: ActionContext,
        record: InstanceRecord,
        memory: int | None,
        cpus: int | None,
    ) -> None:
        await context.advance(TaskState.RESIZE_PREP)
        updates: dict[str, str | None] = {
            PREVIOUS_MEMORY_KEY: str(record.memory_mib),
            PREVIOUS_CPU_KEY: str(record.cpus),
            "limits.memory": str(memory if memory is not None else record.memory_mib),
            "limits.cpu": str(cpus if cpus is not None else record.cpus),
        }
        was_running = self.running.has_vm(record.name)
        await context.advance(TaskState.RESIZE_MIGRATING)
        resized = await self._relaunch_with(context, record.name, updates, was_running)
        await context.advance(TaskState.RESIZE_FINISH)
        power = PowerState.RUNNING if was_running else PowerState.SHUTDOWN
        await context.finish(power)
        self.events.lifecycle(
            "instance-resized",
            record.name,
            {"memory_mib": resized.memory_mib, "cpus": resized.cpus},
        )

    async def do_confirm_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        running = self.running.has_vm(record.name)
        await context.finish(
            PowerState.RUNNING if running else PowerState.SHUTDOWN,
            {PREVIOUS_MEMORY_KEY: None, PREVIOUS_CPU_KEY: None},
            store_power=False,
        )
        self.events.lifecycle("instance-resize-confirmed", record.name)

    async def do_revert_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        updates: dict[str, str | None] = {
            "limits.memory": record.config.get(PREVIOUS_MEMORY_KEY, str(record.memory_mib)),
            "limits.cpu": record.config.get(PREVIOUS_CPU_KEY, str(record.cpus)),
            PREVIOUS_MEMORY_KEY: None,
            PREVIOUS_CPU_KEY: None,
        }
        was_running = self.running.has_vm(record.name)
        await self._relaunch_with(context, record.name, updates, was_running)
        if was_running:
            await context.finish(PowerState.RUNNING)
        else:
            await context.finish(PowerState.SHUTDOWN)
        self.events.lifecycle("instance-resize-reverted", record.name)

    async def _relaunch_with(
        self,
        context: ActionContext,
        name: str,
        updates: dict[str, str | None],
        was_running: bool,
    ) -> InstanceRecord:
        """Apply ``updates`` with the VM down: stopped (cleanly) first, started again after."""
        if was_running:
            await self.booting.power_off(context, name, self.stop_timeout, force=False)
        record = await self.store.instances.update_config(name, {**updates, READY_KEY: "false"})
        if was_running:
            await self.booting.launch(record)
        return record

    async def do_delete(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.booting.power_off(context, record.name, 0, force=True)
        await context.complete()
        await self.forget(record)

    async def forget(self, record: InstanceRecord, reason: str | None = None) -> None:
        """The instance is gone: its row (revoking its certificate), run dir, DELETED event."""
        await self.store.instances.delete_instance(record.name)
        self.running.forget(record.name)
        self.agent_history.forget(record.name)
        remove_instance_snapshots(self.specs.snapshot_root, run_dir_name(record.uuid))
        shutil.rmtree(self.specs.spec_for(record).run_dir, ignore_errors=True)
        disk = self.specs.disk_path(record)
        if disk is not None:
            for path in (disk, disk + ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.events.lifecycle(
            "instance-state",
            record.name,
            {
                "status": "Deleted",
                "display_status": "DELETED",
                "vm_state": VMState.DELETED.value,
                "task_state": None,
                "power_state": PowerState.NOSTATE.value,
                "error": "",
            },
        )
        self.events.lifecycle(
            "instance-deleted", record.name, {"reason": reason} if reason else {}
        )
