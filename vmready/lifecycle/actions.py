"""An operator's actions on an instance, each a task.

Start, stop, restart, freeze, unfreeze, rebuild, resize (confirm, revert) and
delete: their checks before anything is claimed, and their steps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Awaitable
from typing import Any

from twisted.logger import Logger

from vmready.domain.model import (
    BadRequest,
    Conflict,
    HypervisorError,
    InstanceRecord,
    NotFound,
    VMReadyError,
)
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.snapshots import (
    STATE_FILE,
    describe_layout,
    remove_instance_snapshots,
    snapshot_directory,
    state_mismatch,
    validate_snapshot_name,
)
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.snapshotting import Snapshotting
from vmready.lifecycle.state import (
    _PREVIOUS_CPU,
    _PREVIOUS_MEMORY,
    MAX_STOP_TIMEOUT,
    ActionContext,
    LifecycleState,
    parse_cpus,
    parse_memory,
    run_dir_name,
)
from vmready.lifecycle.watching import Watching


class Actions:
    """An operator's actions on an instance, each a task.

    Start, stop, restart, freeze, unfreeze, rebuild, resize (confirm, revert) and
    delete: their checks before anything is claimed, and their steps.
    """

    log = Logger()

    def __init__(
        self,
        state: LifecycleState,
        booting: Booting,
        snapshotting: Snapshotting,
        watching: Watching,
    ) -> None:
        self.state = state
        self.booting = booting
        self.snapshotting = snapshotting
        self.watching = watching

    def prepare(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Validate an action's parameters before anything is claimed."""
        if action in ("stop", "restart"):
            timeout = params.get("timeout", self.state.stop_timeout)
            if (
                not isinstance(timeout, int | float)
                or isinstance(timeout, bool)
                # also refuses nan, inf and integers too large for a float
                or not 0 <= timeout <= MAX_STOP_TIMEOUT
            ):
                raise BadRequest(
                    f"Invalid timeout {timeout!r}: expected seconds from 0 to {MAX_STOP_TIMEOUT:g}"
                )
            force = params.get("force", False)
            if not isinstance(force, bool):
                raise BadRequest(f"Invalid force {force!r}: expected true or false")
            return {"timeout": float(timeout), "force": force}
        if action == "resize":
            memory = params.get("memory")
            cpus = params.get("cpus")
            if memory is None and cpus is None:
                raise BadRequest("resize needs memory and/or cpus")
            return {
                "memory": parse_memory(memory) if memory is not None else None,
                "cpus": parse_cpus(cpus) if cpus is not None else None,
            }
        if action in ("snapshot", "restore"):
            allowed = {"snapshot", "stateful"} | ({"force"} if action == "restore" else set())
            unexpected = sorted(set(params) - allowed)
            if unexpected:
                raise BadRequest(f"Unexpected parameters for {action}: {', '.join(unexpected)}")
            prepared: dict[str, Any] = {"snapshot": validate_snapshot_name(params.get("snapshot"))}
            for flag in sorted(allowed - {"snapshot"}):
                value = params.get(flag, False)
                if not isinstance(value, bool):
                    raise BadRequest(f"Invalid {flag} {value!r}: expected true or false")
                prepared[flag] = value
            if prepared.get("force") and not prepared["stateful"]:
                raise BadRequest("force applies to a stateful restore only: add stateful")
            return prepared
        unexpected = sorted(params)
        if unexpected:
            raise BadRequest(f"Unexpected parameters for {action}: {', '.join(unexpected)}")
        return {}

    async def preflight(self, action: str, record: InstanceRecord, params: dict[str, Any]) -> None:
        """What can be known before a snapshot or restore touches anything: refuse it now."""
        name = params["snapshot"]
        if self.state.disk_path(record) is not None:
            # A snapshot keeps config (and memory); without the disk's contents its restore
            # would pair a guest with a disk it never wrote: refuse rather than corrupt.
            raise BadRequest(
                f"Cannot {action} instance {record.name}: snapshots of instances that boot a "
                "disk image do not capture the disk yet"
            )
        if action == "snapshot":
            if await self.state.store.snapshots.find_snapshot(record.name, name) is not None:
                raise Conflict(f"Snapshot {name} of instance {record.name} already exists")
            if params["stateful"] and (
                record.vm_state is not VMState.ACTIVE or not self.state.has_vm(record.name)
            ):
                raise Conflict(
                    f"Cannot take a stateful snapshot of instance {record.name}: it is not "
                    "running (a stateful snapshot saves the running VM's memory)"
                )
            return
        snapshot = await self.state.store.snapshots.find_snapshot(record.name, name)
        if snapshot is None:
            raise NotFound(f"Snapshot {name} of instance {record.name} not found")
        if not params["stateful"]:
            return
        if not snapshot["stateful"]:
            raise BadRequest(
                f"Snapshot {name} of instance {record.name} is stateless: it has no VM state "
                "to restore; restore it without --stateful"
            )
        metadata = snapshot["metadata"]
        directory = snapshot_directory(self.state.snapshot_root, run_dir_name(record.uuid), name)
        if not os.path.isfile(os.path.join(directory, STATE_FILE)):
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: "
                f"its state file {os.path.join(directory, STATE_FILE)} is missing"
            )
        target = self.snapshotting.restored_record(record, metadata)
        saved = metadata.get("device_set", {})
        accel = saved.get("accel") if saved.get("accel") in ("kvm", "tcg") else None
        mismatch = state_mismatch(saved, self.booting.launch_spec(target, accel))
        if mismatch is not None and not params["force"]:
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: it "
                f"was saved with serial layout {describe_layout(metadata.get('layout'))} and "
                "the VM would now start with layout "
                f"{describe_layout(self.state.serial_layout.name)}"
                f" ({mismatch}); QEMU cannot load a state into a different device set. "
                f"Restore without --stateful to get the snapshot's config back and boot "
                f"afresh, or add --force to let QEMU try anyway."
            )

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
        if leaving_error and self.state.has_vm(record.name):
            # In error, but its VM still runs and is followed: keep it, do not replace it.
            context.note("kept the VM that was still running")
            power = await self.state.vm(record.name).query_power_state()
            await context.finish(power)
            self.state.events.lifecycle("instance-started", record.name)
            return
        if (
            leaving_error
            and not self.state.has_vm(record.name)
            and await self._take_over_running_vm(context, record)
        ):
            power = await self.state.vm(record.name).query_power_state()
            await context.finish(power)
        else:
            # A stray VM of a stopped instance may run an old configuration: replace it.
            if await self.state.driver.kill_owned(self.state.spec_for(record)):
                context.note("killed a stray VM before starting")
            await self.booting.launch(record)
            await context.finish(PowerState.RUNNING)
        self.state.events.lifecycle("instance-started", record.name)

    async def _take_over_running_vm(self, context: ActionContext, record: InstanceRecord) -> bool:
        """Before starting: a VM that still runs (an instance left in error) is adopted."""
        spec = self.state.spec_for(record)
        try:
            adopted = await self.state.driver.adopt(spec)
        except HypervisorError as e:
            await self.state.driver.kill_owned(spec)
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
        self.state.events.lifecycle("instance-stopped", record.name)

    async def do_restart(
        self, context: ActionContext, record: InstanceRecord, timeout: float, force: bool
    ) -> None:
        await self.booting.power_off(context, record.name, timeout, force)
        await self.state.store.instances.update_config(record.name, {READY_KEY: "false"})
        await self.booting.launch(self.state.store.view.get_instance(record.name))
        await context.finish(PowerState.RUNNING)
        self.state.events.lifecycle("instance-restarted", record.name)

    async def do_freeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.state.vm(record.name).pause()
        await context.finish(PowerState.PAUSED)
        self.state.events.lifecycle("instance-paused", record.name)

    async def do_unfreeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.state.vm(record.name).resume()
        await context.finish(PowerState.RUNNING)
        self.state.events.lifecycle("instance-resumed", record.name)

    async def do_rebuild(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.booting.power_off(context, record.name, 0, force=True)
        record = await self.state.store.instances.update_config(record.name, {READY_KEY: "false"})
        boot = BootSource.from_config(record.config)
        if boot.image is not None:
            # The image may have changed or gone since launch: check it again.
            await self.booting.make_disk(context, record, await self.state.check_boot_source(boot))
        await self.booting.launch(record)
        await context.finish(PowerState.RUNNING)
        self.state.events.lifecycle("instance-rebuilt", record.name)

    async def do_resize(
        self,
        context: ActionContext,
        record: InstanceRecord,
        memory: int | None,
        cpus: int | None,
    ) -> None:
        await context.advance(TaskState.RESIZE_PREP)
        updates: dict[str, str | None] = {
            _PREVIOUS_MEMORY: str(record.memory_mib),
            _PREVIOUS_CPU: str(record.cpus),
            "limits.memory": str(memory if memory is not None else record.memory_mib),
            "limits.cpu": str(cpus if cpus is not None else record.cpus),
        }
        was_running = self.state.has_vm(record.name)
        await context.advance(TaskState.RESIZE_MIGRATING)
        resized = await self.booting.relaunch_with(context, record.name, updates, was_running)
        await context.advance(TaskState.RESIZE_FINISH)
        power = PowerState.RUNNING if was_running else PowerState.SHUTDOWN
        await context.finish(power)
        self.state.events.lifecycle(
            "instance-resized",
            record.name,
            {"memory_mib": resized.memory_mib, "cpus": resized.cpus},
        )

    async def do_confirm_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        running = self.state.has_vm(record.name)
        await context.finish(
            PowerState.RUNNING if running else PowerState.SHUTDOWN,
            {_PREVIOUS_MEMORY: None, _PREVIOUS_CPU: None},
            store_power=False,
        )
        self.state.events.lifecycle("instance-resize-confirmed", record.name)

    async def do_revert_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        updates: dict[str, str | None] = {
            "limits.memory": record.config.get(_PREVIOUS_MEMORY, str(record.memory_mib)),
            "limits.cpu": record.config.get(_PREVIOUS_CPU, str(record.cpus)),
            _PREVIOUS_MEMORY: None,
            _PREVIOUS_CPU: None,
        }
        was_running = self.state.has_vm(record.name)
        await self.booting.relaunch_with(context, record.name, updates, was_running)
        if was_running:
            await context.finish(PowerState.RUNNING)
        else:
            await context.finish(PowerState.SHUTDOWN)
        self.state.events.lifecycle("instance-resize-reverted", record.name)

    async def do_delete(self, context: ActionContext, record: InstanceRecord) -> None:
        await self.booting.power_off(context, record.name, 0, force=True)
        await context.complete()
        await self.forget(record)

    async def forget(self, record: InstanceRecord, reason: str | None = None) -> None:
        """The instance is gone: its row (revoking its certificate), run dir, DELETED event."""
        await self.state.store.instances.delete_instance(record.name)
        self.state.last_agent_status.pop(record.name, None)
        self.state.agent_history.forget(record.name)
        remove_instance_snapshots(self.state.snapshot_root, run_dir_name(record.uuid))
        shutil.rmtree(self.state.spec_for(record).run_dir, ignore_errors=True)
        disk = self.state.disk_path(record)
        if disk is not None:
            for path in (disk, disk + ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.state.events.lifecycle(
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
        self.state.events.lifecycle(
            "instance-deleted", record.name, {"reason": reason} if reason else {}
        )
