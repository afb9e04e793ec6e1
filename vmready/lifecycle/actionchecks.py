"""An action's checks before anything is claimed: its parameters, what a snapshot can know."""

from __future__ import annotations

import os
from typing import Any

import attrs

from vmready.domain import (
    BadRequest,
    Conflict,
    InstanceRecord,
    NotFound,
    VMState,
    parse_cpus,
    parse_memory,
    restored_config,
)
from vmready.hypervisor import (
    STATE_FILE,
    describe_layout,
    saved_rng,
    state_mismatch,
    validate_snapshot_name,
)
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import InstanceSpecs
from vmready.store import AsyncStore

DEFAULT_STOP_TIMEOUT = 30.0
MAX_STOP_TIMEOUT = 3600.0


@attrs.define(kw_only=True, eq=False)
class ActionChecks:
    """An action's checks before anything is claimed: a 400, 404 or 409 before its operation."""

    store: AsyncStore
    specs: InstanceSpecs
    running: RunningVMs
    booting: Booting
    stop_timeout: float

    def prepare(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Validate an action's parameters before anything is claimed."""
        if action in ("stop", "restart"):
            return self._stop_params(params)
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
            return _snapshot_params(action, params)
        unexpected = sorted(params)
        if unexpected:
            raise BadRequest(f"Unexpected parameters for {action}: {', '.join(unexpected)}")
        return {}

    def _stop_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """A stop's or restart's ``timeout`` (``--stop-timeout`` by default) and ``force``."""
        timeout = params.get("timeout", self.stop_timeout)
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

    async def preflight(self, action: str, record: InstanceRecord, params: dict[str, Any]) -> None:
        """What can be known before a snapshot or restore touches anything: refuse it now."""
        name = params["snapshot"]
        if self.specs.disk_path(record) is not None:
            # A snapshot keeps config (and memory); without the disk's contents its restore
            # would pair a guest with a disk it never wrote: refuse rather than corrupt.
            raise BadRequest(
                f"Cannot {action} instance {record.name}: snapshots of instances that boot a "
                "disk image do not capture the disk yet"
            )
        if action == "snapshot":
            if await self.store.snapshots.find_snapshot(record.name, name) is not None:
                raise Conflict(f"Snapshot {name} of instance {record.name} already exists")
            if params["stateful"] and (
                record.vm_state is not VMState.ACTIVE or not self.running.has_vm(record.name)
            ):
                raise Conflict(
                    f"Cannot take a stateful snapshot of instance {record.name}: it is not "
                    "running (a stateful snapshot saves the running VM's memory)"
                )
            return
        snapshot = await self.store.snapshots.find_snapshot(record.name, name)
        if snapshot is None:
            raise NotFound(f"Snapshot {name} of instance {record.name} not found")
        if params["stateful"]:
            self._check_state(record, name, snapshot, params["force"])

    def _check_state(
        self, record: InstanceRecord, name: str, snapshot: dict[str, Any], force: bool
    ) -> None:
        """A stateful restore: its state is there and fits the VM as it would start now."""
        if not snapshot["stateful"]:
            raise BadRequest(
                f"Snapshot {name} of instance {record.name} is stateless: it has no VM state "
                "to restore; restore it without --stateful"
            )
        metadata = snapshot["metadata"]
        state_file = os.path.join(self.specs.snapshot_dir(record, name), STATE_FILE)
        if not os.path.isfile(state_file):
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: "
                f"its state file {state_file} is missing"
            )
        target = attrs.evolve(record, config=restored_config(record.config, metadata))
        saved = metadata.get("device_set", {})
        accel = saved.get("accel") if saved.get("accel") in ("kvm", "tcg") else None
        mismatch = state_mismatch(saved, self.booting.launch_spec(target, accel, saved_rng(saved)))
        if mismatch is not None and not force:
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: it "
                f"was saved with serial layout {describe_layout(metadata.get('layout'))} and "
                "the VM would now start with layout "
                f"{describe_layout(self.booting.serial_layout.name)}"
                f" ({mismatch}); QEMU cannot load a state into a different device set. "
                f"Restore without --stateful to get the snapshot's config back and boot "
                f"afresh, or add --force to let QEMU try anyway."
            )


def _snapshot_params(action: str, params: dict[str, Any]) -> dict[str, Any]:
    """A snapshot's or restore's ``snapshot`` name and its ``stateful`` (and ``force``) flags."""
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
