"""fakeqemu's migration stream: a JSON state file, checked on load as QEMU checks its own.

Real QEMU refuses an incoming stream whose machine type, RAM size or
virtio-serial port numbers differ from the destination's, and prints three
lines naming the section that failed.  Port *names* and ring-buffer sizes are
not in QEMU's stream, so a renamed port restores fine there and here.  Ring
buffer contents are chardev state, which QEMU does not migrate: they are
recorded in the file for inspection and not restored.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from fakeqemu._cmdline import MachineConfig

STATE_MAGIC = "FAKEQEMU-VMSTATE"
STATE_VERSION = 1


class IncomingMigrationError(Exception):
    """The stream was refused; ``lines`` are what QEMU prints, without the program prefix."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def serialize_state(config: MachineConfig, ringbuf_contents: dict[str, bytes]) -> bytes:
    """The state file for a machine: its device set, memory and ring-buffer contents."""
    document: dict[str, Any] = {
        "magic": STATE_MAGIC,
        "version": STATE_VERSION,
        "machine": config.machine_type,
        "memory_bytes": config.memory_bytes,
        "cpus": config.cpus,
        "serial_buses": [
            {
                "bus": bus.bus_name,
                "pci_address": bus.pci_address,
                "ports": [
                    {"nr": p.nr, "name": p.name, "chardev": p.chardev}
                    for p in config.serial_ports
                    if p.bus_name == bus.bus_name
                ],
            }
            for bus in config.serial_buses
        ],
        "ringbufs": {
            spec.id: {
                "size": spec.size,
                "contents": base64.b64encode(ringbuf_contents.get(spec.id, b"")).decode(),
            }
            for spec in config.ringbufs
        },
    }
    return json.dumps(document, indent=1).encode() + b"\n"


def check_incoming(config: MachineConfig, path: str, data: bytes) -> dict[str, Any]:
    """Check a state file against the destination; raise IncomingMigrationError as QEMU would."""
    failed = "load of migration failed: Invalid argument"
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        document = None
    if not isinstance(document, dict) or document.get("magic") != STATE_MAGIC:
        raise IncomingMigrationError(["Not a migration stream", failed])
    if document.get("version") != STATE_VERSION:
        raise IncomingMigrationError(
            [f"Unsupported migration stream version {document.get('version')!r}", failed]
        )
    source_machine = document.get("machine")
    if source_machine != config.machine_type:
        raise IncomingMigrationError(
            [
                f"Machine type received is '{source_machine}' and local is "
                f"'{config.machine_type}'",
                failed,
            ]
        )
    source_ram = document.get("memory_bytes")
    if source_ram != config.memory_bytes:
        raise IncomingMigrationError(
            [
                f"Size mismatch: pc.ram: {_hex(source_ram)} != {config.memory_bytes:#x}: "
                "Invalid argument",
                "error while loading state for instance 0x0 of device 'ram'",
                failed,
            ]
        )
    # QEMU names each virtio-serial section by its PCI address and loads the
    # sections in stream order.  A section the destination lacks is fatal; a
    # destination device the stream does not mention keeps its reset state.
    local_buses = {bus.pci_address: bus for bus in config.serial_buses}
    for source_bus in document.get("serial_buses", []):
        address = source_bus["pci_address"]
        bus = local_buses.get(address)
        if bus is None:
            raise IncomingMigrationError(
                [
                    f"Unknown savevm section or instance '{address}/virtio-console' 0. "
                    "Make sure that your current VM setup matches your saved VM setup, "
                    "including any hotplugged devices",
                    failed,
                ]
            )
        local_ports = sorted(p.nr for p in config.serial_ports if p.bus_name == bus.bus_name)
        if sorted(p["nr"] for p in source_bus["ports"]) != local_ports:
            raise IncomingMigrationError(
                [
                    "Failed to load virtio-console:virtio",
                    "error while loading state for instance 0x0 of device "
                    f"'{address}/virtio-console'",
                    failed,
                ]
            )
    return document


def _hex(value: object) -> str:
    return f"{value:#x}" if isinstance(value, int) else repr(value)
