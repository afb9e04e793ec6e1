"""Snapshots and restores.

Config, and for a stateful one the VM's memory through QMP migrate.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from vmready.domain import (
    READY_KEY,
    Conflict,
    HypervisorError,
    InstanceRecord,
    NotFound,
    PowerState,
    VMReadyError,
    VMState,
    config_updates,
    restored_config,
    snapshot_config,
)
from vmready.hypervisor import (
    STATE_FILE,
    read_log_lines,
    saved_rng,
    validate_snapshot_name,
    write_metadata,
)
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.hooks import Hypervisor
from vmready.lifecycle.journal import ActionContext, Journal
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import InstanceSpecs
from vmready.store import AsyncStore

# How long a stateful restore may take to load its state, and how often it is looked at.
RESTORE_TIMEOUT = 600.0
_RESTORE_POLL_SECONDS = 0.05


@attrs.define(kw_only=True, eq=False)
class Snapshotting:
    """Snapshots and restores.

    Config, and for a stateful one the VM's memory through QMP migrate.
    """

    log = Logger()

    clock: IReactorTime
    store: AsyncStore
    events: EventBus
    journal: Journal
    driver: Hypervisor
    specs: InstanceSpecs
    running: RunningVMs
    booting: Booting
    # Restores under way, by (instance, snapshot): how many use that snapshot now.
    _restoring: dict[tuple[str, str], int] = attrs.field(init=False, factory=dict)

    def reserve_for_restore(self, instance: str, snapshot: str) -> Callable[[], None]:
        """Mark the snapshot in use by a restore until the returned function is called.

        Called when a restore is asked for, before anything awaits, so a delete
        either comes first (and the restore finds no snapshot) or is refused.
        """
        key = (instance, snapshot)
        self._restoring[key] = self._restoring.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._restoring.pop(key) - 1
                if left:
                    self._restoring[key] = left

        return release

    async def delete_snapshot(self, instance: str, snapshot: str) -> dict[str, Any]:
        """Forget a snapshot and remove its files; refused while a restore from it runs.

        The row goes first: once it is committed the snapshot is gone for
        everyone.  A crash before its directory is removed leaves files no row
        names; the next snapshot of that name replaces them, the instance's
        delete removes them.
        """
        validate_snapshot_name(snapshot)
        if (instance, snapshot) in self._restoring:
            raise Conflict(
                f"Cannot delete snapshot {snapshot} of instance {instance}: the instance is "
                "being restored from it"
            )
        record = self.store.view.get_instance(instance)
        deleted = await self.store.snapshots.delete_snapshot(instance, snapshot)
        directory = self.specs.snapshot_dir(record, snapshot)
        shutil.rmtree(directory, ignore_errors=True)
        self.journal.history(instance, "snapshot-delete", f"deleted snapshot {snapshot}")
        self.events.lifecycle("instance-snapshot-deleted", instance, {"snapshot": snapshot})
        return deleted

    async def do_snapshot(
        self, context: ActionContext, record: InstanceRecord, snapshot: str, stateful: bool
    ) -> None:
        name = snapshot
        directory = self.specs.snapshot_dir(record, name)
        running = self.running.has_vm(record.name)
        spec = self.specs.spec_for(record)
        metadata: dict[str, Any] = {
            "config": snapshot_config(record.config),
            "layout": self.specs.layout_of(record).name,
            "device_set": spec.device_set(),
            "state": STATE_FILE if stateful else None,
        }
        shutil.rmtree(directory, ignore_errors=True)  # a leftover of a snapshot that failed
        try:
            await self._save(record, directory, name, stateful, metadata)
        except VMReadyError as e:
            shutil.rmtree(directory, ignore_errors=True)
            vm_alive = self.running.has_vm(record.name)
            if vm_alive == running:
                # The VM runs on as before (or was never running): nothing to put in error.
                await context.abandon(
                    VMState.ACTIVE if running else VMState.STOPPED,
                    PowerState.RUNNING if running else None,
                    e.message,
                )
                self.events.lifecycle(
                    "instance-snapshot-failed", record.name, {"snapshot": name, "error": e.message}
                )
            raise
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if running:
            await context.finish(PowerState.RUNNING)
        else:
            await context.finish(PowerState.SHUTDOWN, store_power=False)
        self.events.lifecycle(
            "instance-snapshot-created", record.name, {"snapshot": name, "stateful": stateful}
        )

    async def _save(
        self,
        record: InstanceRecord,
        directory: str,
        name: str,
        stateful: bool,
        metadata: dict[str, Any],
    ) -> None:
        """The snapshot's files, then its row (written last: a snapshot exists once recorded).

        A disk that refuses the files (full, read-only) fails the snapshot with
        the disk's own words, like any other failure that leaves the VM running.
        """
        try:
            os.makedirs(directory, mode=0o700)
            if stateful:
                vm = self.running.vm(record.name)
                try:
                    await vm.migrate_to_file(os.path.join(directory, STATE_FILE))
                finally:
                    if not vm.gone:
                        await vm.resume()
            write_metadata(directory, metadata)
        except OSError as e:
            raise HypervisorError(
                f"Cannot save snapshot {name} of instance {record.name}: "
                f"{e.filename or directory}: {e.strerror}"
            ) from e
        await self.store.snapshots.create_snapshot(record.name, name, stateful, metadata)

    async def do_restore(
        self,
        context: ActionContext,
        record: InstanceRecord,
        snapshot: str,
        stateful: bool,
        force: bool,
    ) -> None:
        name = snapshot
        found = await self.store.snapshots.find_snapshot(record.name, name)
        if found is None:
            raise NotFound(f"Snapshot {name} of instance {record.name} not found")
        metadata = found["metadata"]
        was_running = self.running.has_vm(record.name)
        if was_running or record.vm_state is VMState.ERROR:
            await self.booting.power_off(context, record.name, 0, force=True)
        updates = config_updates(record.config, restored_config(record.config, metadata))
        restored = await self.store.instances.update_config(
            record.name, {**updates, READY_KEY: "false"}
        )
        if stateful:
            directory = self.specs.snapshot_dir(record, name)
            saved = metadata.get("device_set", {})
            accel = saved.get("accel") if saved.get("accel") in ("kvm", "tcg") else None
            state = os.path.join(directory, STATE_FILE)
            await self._load_state(context, restored, state, accel, saved_rng(saved))
            await context.finish(PowerState.RUNNING)
        elif was_running:
            await self.booting.launch(restored)
            await context.finish(PowerState.RUNNING)
        else:
            await context.finish(PowerState.SHUTDOWN)
        self.events.lifecycle(
            "instance-restored", record.name, {"snapshot": name, "stateful": stateful}
        )

    async def _load_state(
        self,
        context: ActionContext,
        record: InstanceRecord,
        path: str,
        accel: str | None,
        rng: bool,
    ) -> None:
        """Start the VM from a saved state; QEMU's own lines if it cannot load it."""
        if not os.path.isfile(path):
            # QEMU would wait for the stream forever (measured): say what is missing instead.
            raise HypervisorError(f"Failed restoring state from {path}: the file is missing")
        try:
            vm = await self.booting.launch(record, incoming=path, accel=accel, rng=rng)
        except HypervisorError as e:
            raise HypervisorError(f"Failed restoring state from {path}: {e.message}") from e
        deadline = self.clock.seconds() + RESTORE_TIMEOUT
        while not vm.gone:
            power = await vm.query_power_state()
            if power is PowerState.RUNNING:
                context.note(f"loaded the state from {path}")
                return
            if self.clock.seconds() >= deadline:
                raise HypervisorError(
                    f"Failed restoring state from {path}: QEMU did not finish loading it "
                    f"within {RESTORE_TIMEOUT:g}s"
                )
            await deferLater(self.clock, _RESTORE_POLL_SECONDS, lambda: None)
        gone = await vm.when_gone()
        await self.driver.wait_released(vm.spec)
        # A daemonized QEMU reports a failed load only in its -D log.
        lines = read_log_lines(vm.spec)
        said = "\n".join(lines) if lines else gone.detail
        raise HypervisorError(f"Failed restoring state from {path}: {said}")
