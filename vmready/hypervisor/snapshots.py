"""Snapshots on disk, and whether a saved VM state can be loaded into today's device set.

A snapshot is a directory ``<data>/snapshots/<instance id>/<name>/`` holding
``snapshot.json`` (the instance's config, the serial layout it ran with and
its device set) and, for a stateful snapshot, ``state``: the QEMU migration
stream ``migrate`` wrote.  The store keeps one row per snapshot with the same
metadata, so either can be checked against the other.

QEMU loads a state only into the devices it was saved from (DESIGN.md quotes
what it prints when a port was added).  ``state_mismatch`` makes that check
before anything is stopped, so a restore that cannot work is refused with
both layouts named, instead of leaving a dead VM behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from vmready.domain import BadRequest
from vmready.hypervisor.cmdline import SERIAL_LAYOUTS, SerialLayout

METADATA_FILE = "snapshot.json"
STATE_FILE = "state"
_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}")


def validate_snapshot_name(name: object) -> str:
    """Snapshot names: letters, digits, ``.``, ``_`` and ``-``; 63 at most; no path tricks."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise BadRequest(
            f"Invalid snapshot name {name!r}: use 1-63 letters, digits, dots, underscores "
            "and hyphens, starting with a letter or digit"
        )
    return name


def snapshot_directory(root: str, instance_id: str, name: str) -> str:
    """Where snapshot ``name`` of the instance with run id ``instance_id`` lives."""
    return os.path.join(root, instance_id, validate_snapshot_name(name))


def remove_instance_snapshots(root: str, instance_id: str) -> None:
    """The instance is deleted: its snapshots go with it."""
    shutil.rmtree(os.path.join(root, instance_id), ignore_errors=True)


def write_metadata(directory: str, metadata: dict[str, Any]) -> None:
    """Write ``snapshot.json`` atomically (a crash leaves the old file or the new one)."""
    path = os.path.join(directory, METADATA_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(metadata, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def describe_layout(name: str | None) -> str:
    """A layout by name, as operators read it: ``legacy (org.linuxcontainers.lxd on …)``."""
    layout: SerialLayout | None = SERIAL_LAYOUTS.get(name or "")
    if layout is None:
        return f"{name or 'unrecorded'} (unknown to this vmready)"
    return f"{layout.name} ({layout.description})"


def _ports(device_set: dict[str, Any]) -> str:
    ports = device_set.get("serial_ports") or []
    described = [
        f"{port.get('name')}" + (f" on {port['chardev']}" if port.get("chardev") else " unwired")
        for port in ports
    ]
    return ", ".join(described) or "no serial ports"


def state_mismatch(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why a state saved with device set ``recorded`` cannot load into ``now`` (None: it can)."""
    differences = []
    for key, label in (("machine", "machine"), ("memory_mib", "memory"), ("cpus", "vCPUs")):
        if recorded.get(key) != now.get(key):
            differences.append(f"{label} {recorded.get(key)} then, {now.get(key)} now")
    if recorded.get("serial_ports") != now.get("serial_ports"):
        differences.append(f"serial ports [{_ports(recorded)}] then, [{_ports(now)}] now")
    for key, label in _DEVICES:
        then, current = recorded.get(key, _UNRECORDED.get(key)), now.get(key)
        if then != current:
            differences.append(f"{label} {_device_state(then)} then, {_device_state(current)} now")
    return "; ".join(differences) or None


# Devices past the serial bus, as VMSpec.device_set names them.  A state saved by a
# vmready that did not record one has None for it, and loads into nothing newer.
_DEVICES = (
    ("accel", "accelerator"),
    ("connect_port", "vmready.connect port"),
    ("console", "serial console"),
    ("pvpanic", "pvpanic device"),
    ("config_drive", "config drive"),
    ("disk", "root disk"),
    ("transport", "guest API transport"),
    ("rng", "virtio-rng device"),
)
# What a device set recorded before a device was ever given means for it: no vmready
# before the rng device gave VMs one.
_UNRECORDED = {"rng": False}


def saved_rng(recorded: dict[str, Any]) -> bool:
    """Whether a state saved with device set ``recorded`` had a virtio-rng device to load into."""
    return recorded.get("rng") is True


def _device_state(value: Any) -> str:
    if value is None:
        return "not recorded"
    if value is True:
        return "present"
    if value is False:
        return "absent"
    return str(value)
