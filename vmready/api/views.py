"""The operator API's JSON views: instances, their state, boot, snapshots, as LXD shapes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vmready.agentlink.transport import TRANSPORT_KEY
from vmready.domain import ACCEL_KEY, InstanceRecord, OperatorStatus, StatusCode
from vmready.hypervisor import ACCEL_REASON_KEY, CURRENT_ACCEL_KEY, SERIAL_LAYOUTS, BootSource
from vmready.lifecycle import LAYOUT_KEY, Fault, LinkChange, Operation, rfc3339
from vmready.protocols import AgentStatus

# The one architecture vmready's VMs have (QEMU's x86_64 system emulator).
ARCHITECTURE = "x86_64"
# LXD's profiles: vmready has the one empty ``default`` profile every instance is in.
PROFILES = ["default"]
# Go's zero time, as LXD writes a time that is not set (a snapshot that never expires).
ZERO_TIME = "0001-01-01T00:00:00Z"


def instance_url(name: str) -> str:
    """The API path of an instance."""
    return f"/1.0/instances/{name}"


def operation_url(operation: Operation) -> str:
    """The API path of an operation."""
    return f"/1.0/operations/{operation.id}"


def state_json(record: InstanceRecord, agent: AgentStatus = AgentStatus.UNKNOWN) -> dict[str, Any]:
    """``/1.0/instances/<name>/state``: the derived status beside the three stored fields."""
    return {
        **_shown_status(record, unreachable=False),
        "vm_state": record.vm_state.value,
        "task_state": record.task_state.value if record.task_state is not None else None,
        "power_state": record.power_state.value,
        "ready": record.ready,
        "agent": {"status": agent.value},
        # LXD's resource fields: vmready measures none of them in the guest.
        "memory": {
            "total": record.memory_mib * 1024 * 1024,
            "total_mib": record.memory_mib,
            "usage": 0,
            "usage_peak": 0,
            "swap_usage": 0,
            "swap_usage_peak": 0,
        },
        "cpu": {"count": record.cpus, "usage": 0},
        "disk": {},
        "network": {},
        "pid": 0,
        "processes": -1,
    }


def snapshot_url(name: str, snapshot: str) -> str:
    """The API path of an instance's snapshot."""
    return f"{instance_url(name)}/snapshots/{snapshot}"


def snapshot_json(snapshot: dict[str, Any]) -> dict[str, Any]:
    """One snapshot as the API shows it: LXD's snapshot object and vmready's fields."""
    metadata = snapshot["metadata"]
    config = metadata.get("config", {})
    created = rfc3339(snapshot["created_at"])
    return {
        "name": snapshot["name"],
        "stateful": snapshot["stateful"],
        "created_at": created,
        "last_used_at": created,
        "expires_at": ZERO_TIME,
        "architecture": ARCHITECTURE,
        "config": config,
        "devices": {},
        "expanded_config": config,
        "expanded_devices": {},
        "ephemeral": False,
        "profiles": PROFILES,
        "description": "",
        "size": -1,
        "serial_layout": metadata.get("layout"),
        "device_set": metadata.get("device_set"),
    }


def instance_json(
    record: InstanceRecord,
    agent: AgentStatus = AgentStatus.UNKNOWN,
    faults: Sequence[Fault] = (),
    agent_history: Sequence[LinkChange] = (),
    console_log: str | None = None,
    location: str = "none",
    unreachable: Fault | None = None,
) -> dict[str, Any]:
    """``/1.0/instances/<name>``: LXD's instance object plus vmready's state fields.

    ``faults``: what is wrong right now (its VM's monitor lost, its agent gone
    silent, the store refusing writes…) and since when, as the events said;
    ``agent_history``: the agent link's recent changes, oldest first;
    ``console_log``: where its serial console is logged; ``location``: the
    cluster member that runs it (LXD's key; ``none`` on a single host).
    ``unreachable``: its member's lease ran out (``unreachable_fault``): its
    status is then unknown — ``Unknown``/``UNKNOWN`` with LXD's Error code, as
    LXD reports an instance of an offline member — the stored fields stay as
    last known, and the fault says why and since when.
    """
    if unreachable is not None:
        faults = (unreachable, *faults)
    return {
        **_lxd_instance(record, location),
        **_shown_status(record, unreachable is not None),
        "vm_state": record.vm_state.value,
        "task_state": record.task_state.value if record.task_state is not None else None,
        "power_state": record.power_state.value,
        "error": record.error or "",
        "agent": {
            "status": agent.value,
            "history": [_link_change_json(change) for change in agent_history],
        },
        "faults": [
            {"kind": fault.kind, "message": fault.message, "since": rfc3339(fault.since)}
            for fault in faults
        ],
        "serial_layout": _layout_json(record),
        "boot": boot_json(record),
        "console": {"log": console_log},
        "limits": {"memory_mib": record.memory_mib, "cpus": record.cpus},
        "updated_at": rfc3339(record.updated_at),
    }


def _lxd_instance(record: InstanceRecord, location: str) -> dict[str, Any]:
    """The fields of LXD's instance object, as vmready has them."""
    config = dict(record.config)
    devices = {name: dict(device) for name, device in record.devices.items()}
    return {
        "name": record.name,
        "uuid": record.uuid,
        "type": "virtual-machine",
        "architecture": ARCHITECTURE,
        "location": location,
        "project": "default",
        "description": "",
        "ephemeral": False,
        "stateful": False,
        "profiles": PROFILES,
        "config": config,
        "devices": devices,
        # No profiles add anything: the expanded view is the instance's own.
        "expanded_config": dict(config),
        "expanded_devices": {name: dict(device) for name, device in devices.items()},
        "created_at": rfc3339(record.created_at),
        "last_used_at": rfc3339(record.updated_at),
    }


def _shown_status(record: InstanceRecord, unreachable: bool) -> dict[str, Any]:
    """The statuses shown: derived from the stored fields, or unknown (host unreachable)."""
    if unreachable:
        return {
            "operator_status": OperatorStatus.UNKNOWN.value,
            "status": "Unknown",
            "status_code": int(StatusCode.ERROR),
            "display_status": "UNKNOWN",
        }
    status = record.status
    return {
        "operator_status": record.operator_status.value,
        "status": status.name,
        "status_code": int(status.code),
        "display_status": record.display_status,
    }


def unreachable_fault(reason: str, since: float) -> Fault:
    """The fault of an instance whose host is unreachable: ``host``, why, since when."""
    return Fault("host", reason, since)


def boot_json(record: InstanceRecord) -> dict[str, Any]:
    """What the instance boots, under which accelerator, and how its agent reaches the host."""
    source = BootSource.from_config(record.config)
    return {
        "source": source.describe(),
        "image": source.image,
        "kernel": source.kernel,
        "initrd": source.initrd,
        "append": source.append,
        "accel": {
            "requested": record.config.get(ACCEL_KEY, "auto"),
            "current": record.config.get(CURRENT_ACCEL_KEY),
            "reason": record.config.get(ACCEL_REASON_KEY),
        },
        "transport": record.config.get(TRANSPORT_KEY),
    }


def _link_change_json(change: LinkChange) -> dict[str, Any]:
    """One agent-link change: its status, when (RFC 3339) and, if known, why."""
    shown: dict[str, Any] = {"status": change.status, "at": rfc3339(change.at)}
    if change.reason is not None:
        shown["reason"] = change.reason
    return shown


def _layout_json(record: InstanceRecord) -> dict[str, str] | None:
    """The serial layout the instance's VM was last started with (None: never started)."""
    name = record.config.get(LAYOUT_KEY)
    if name is None:
        return None
    layout = SERIAL_LAYOUTS.get(name)
    return {"name": name, "description": layout.description if layout else "unknown"}
