"""fakeqemu's migration stream: a JSON state file, checked on load as QEMU checks its own.

Real QEMU refuses an incoming stream whose machine type, RAM size or devices
differ from the destination's, and prints the lines naming what failed, in
the stream's order: the machine type, then RAM (its size, then every RAM
block, such as a NIC's option ROM ``0000:00:03.0/virtio-net-pci.rom``), then
each device's section by PCI address (``0000:00:04.0/virtio-blk``), then a
virtio-serial bus's port numbers.  A destination device the stream does not
mention keeps its reset state.  Port *names*, ring-buffer sizes, the ISA
pvpanic and the kernel are not in QEMU's stream, so a renamed port restores
fine there and here.  Ring buffer contents are chardev state, which QEMU does
not migrate: they are recorded in the file for inspection and not restored.
All of it was measured on QEMU 7.2.

:class:`Migration` is a machine's side of it: the capabilities, ``migrate`` to
``exec:cat > PATH`` (setup, active, completed), and ``-incoming`` finished.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fakeqemu._config import MachineConfig
from fakeqemu._runstate import MachineError, RunState

if TYPE_CHECKING:
    from fakeqemu._machine import Machine

STATE_MAGIC = "FAKEQEMU-VMSTATE"
STATE_VERSION = 1
MIGRATION_CAPABILITIES = (
    "xbzrle",
    "rdma-pin-all",
    "auto-converge",
    "zero-blocks",
    "compress",
    "events",
    "postcopy-ram",
    "x-colo",
    "release-ram",
    "block",
    "return-path",
    "pause-before-switchover",
    "multifd",
    "dirty-bitmaps",
    "postcopy-blocktime",
    "late-block-activate",
    "x-ignore-shared",
    "validate-uuid",
    "background-snapshot",
    "zero-copy-send",
    "postcopy-preempt",
)


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
        "pci_devices": [
            {"address": d.address, "section": d.section, "rom": d.rom} for d in config.pci_devices
        ],
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
    _check_ram_blocks(config, document, failed)
    _check_devices(config, document, failed)
    return document


def _check_devices(config: MachineConfig, document: dict[str, Any], failed: str) -> None:
    """Every device section of the stream must exist at the destination, serial ports alike.

    QEMU names each device section by its PCI address and loads the sections in
    stream order.  A section the destination lacks is fatal.
    """
    local = {(d.address, d.section) for d in config.pci_devices}
    local_buses = {bus.pci_address: bus for bus in config.serial_buses}
    source_buses = {b["pci_address"]: b for b in document.get("serial_buses", [])}
    for device in _source_devices(document):
        address, section = device["address"], device["section"]
        if (address, section) not in local:
            raise IncomingMigrationError(
                [
                    f"Unknown savevm section or instance '{address}/{section}' 0. "
                    "Make sure that your current VM setup matches your saved VM setup, "
                    "including any hotplugged devices",
                    failed,
                ]
            )
        if section != "virtio-console":
            continue
        bus = local_buses[address]
        local_ports = sorted(p.nr for p in config.serial_ports if p.bus_name == bus.bus_name)
        source_ports = source_buses.get(address, {}).get("ports", [])
        if sorted(p["nr"] for p in source_ports) != local_ports:
            raise IncomingMigrationError(
                [
                    "Failed to load virtio-console:virtio",
                    "error while loading state for instance 0x0 of device "
                    f"'{address}/virtio-console'",
                    failed,
                ]
            )


def _source_devices(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's PCI devices; a file from an older fakeqemu lists only serial buses."""
    if "pci_devices" in document:
        return list(document["pci_devices"])
    return [
        {"address": bus["pci_address"], "section": "virtio-console", "rom": None}
        for bus in document.get("serial_buses", [])
    ]


def _check_ram_blocks(config: MachineConfig, document: dict[str, Any], failed: str) -> None:
    """Every RAM block of the stream (after pc.ram) must exist at the destination."""
    local = {f"{d.address}/{d.rom}" for d in config.pci_devices if d.rom}
    for device in _source_devices(document):
        if device.get("rom"):
            block = f"{device['address']}/{device['rom']}"
            if block not in local:
                raise IncomingMigrationError(
                    [
                        f'Unknown ramblock "{block}", cannot accept migration',
                        "error while loading state for instance 0x0 of device 'ram'",
                        failed,
                    ]
                )


def _hex(value: object) -> str:
    return f"{value:#x}" if isinstance(value, int) else repr(value)


class Migration:
    """QEMU's migration commands on one machine: capabilities, ``migrate`` and ``-incoming``."""

    def __init__(self, machine: Machine) -> None:
        self._machine = machine
        self._capabilities = dict.fromkeys(MIGRATION_CAPABILITIES, False)
        # What ``query-migrate`` reports of the last migration.
        self.info: dict[str, Any] = {}
        # Whether the vCPUs start once an incoming migration completes (QEMU's autostart).
        self.autostart = not machine.config.start_paused

    def query_capabilities(self) -> list[dict[str, Any]]:
        """``query-migrate-capabilities``."""
        return [{"state": v, "capability": k} for k, v in self._capabilities.items()]

    def set_capability(self, capability: str, state: bool) -> None:
        """One entry of ``migrate-set-capabilities``."""
        if capability not in self._capabilities:
            raise MachineError(f"Parameter 'capability' does not accept value '{capability}'")
        self._capabilities[capability] = state

    def _event(self, status: str) -> None:
        self.info = {"status": status}
        if self._capabilities["events"]:
            self._machine.emit("MIGRATION", {"status": status})

    def migrate(self, uri: str, write_file: Callable[[str, bytes], None]) -> None:
        """``migrate`` to ``exec:cat > PATH``: save the state, leaving the VM in postmigrate."""
        machine = self._machine
        if machine.run_state is RunState.POSTMIGRATE:
            raise MachineError("Can't migrate the vm that was paused due to previous migration")
        if machine.run_state is RunState.INMIGRATE:
            raise MachineError("Guest is waiting for an incoming migration")
        self._event("setup")
        path = _exec_cat_target(uri)
        if path is None:
            # QEMU enters setup before it looks at the URI, then fails the migration.
            self._event("failed")
            raise MachineError("Parameter 'uri' expects a valid migration protocol")
        machine.clock.callLater(0, self._finish, path, write_file)

    def _finish(self, path: str, write_file: Callable[[str, bytes], None]) -> None:
        machine = self._machine
        if machine.exited is not None:
            return
        started = machine.clock.seconds()
        if self._capabilities["events"]:
            machine.emit("MIGRATION_PASS", {"pass": 1})
        self._event("active")
        was_running = machine.running
        rings = machine.wiring.ringbufs
        state = serialize_state(machine.config, {k: v.peek() for k, v in rings.items()})
        try:
            write_file(path, state)
        except OSError:
            self._event("failed")
            self.info["error-desc"] = "Unable to write to command: Broken pipe"
            return
        if was_running:
            machine.run_state = RunState.PAUSED
            machine.emit("STOP")
        machine.run_state = RunState.POSTMIGRATE
        if self._capabilities["events"]:
            machine.emit("MIGRATION_PASS", {"pass": 2})
        self._event("completed")
        total_ms = int((machine.clock.seconds() - started) * 1000)
        self.info.update(
            {
                "setup-time": 0,
                "downtime": 0,
                "total-time": total_ms,
                "ram": {"total": machine.config.memory_bytes, "transferred": len(state)},
            }
        )

    def load_incoming(self, data: bytes) -> None:
        """Finish ``-incoming``: resume from the state, or exit 1 with QEMU's lines."""
        machine = self._machine
        try:
            check_incoming(machine.config, machine.config.incoming_path or "", data)
        except IncomingMigrationError as e:
            machine.exit(1, e.lines)
            return
        self.info = {"status": "completed"}
        if not self.autostart:
            machine.run_state = RunState.PAUSED
        else:
            machine.run_state = RunState.RUNNING
            machine.emit("RESUME")


def _exec_cat_target(uri: str) -> str | None:
    prefix = "exec:cat >"
    if not uri.startswith(prefix):
        return None
    path = uri[len(prefix) :].strip()
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    return path or None
