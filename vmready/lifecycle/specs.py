"""An instance's files and its VM as the hypervisor sees it, derived from its record.

Everything an instance keeps on disk is named after its uuid: its run
directory (config drive, console log, sockets), its root-disk overlay and its
snapshots.
"""

from __future__ import annotations

import os

from vmready.agentlink.transport import CID_KEY, TRANSPORT_KEY, forward_mac
from vmready.domain import InstanceRecord
from vmready.hypervisor import (
    AGENT_PORT,
    CONSOLE_LOG_NAME,
    CURRENT_ACCEL_KEY,
    LEGACY_PORT,
    SERIAL_LAYOUTS,
    UNRECORDED_LAYOUT,
    BootSource,
    GuestForward,
    SerialLayout,
    SerialPort,
    VMSpec,
    read_console,
    snapshot_directory,
)
from vmready.lifecycle.guestlink import GuestReach

CONFIG_DRIVE = "config-drive"
# The serial layout an instance's VM was last started with (``SERIAL_LAYOUTS``).
LAYOUT_KEY = "volatile.serial.layout"
# Whether its VM was last started with a virtio-rng device ("true"; absent: by a vmready
# that gave none).
RNG_KEY = "volatile.rng"


def run_dir_name(instance_uuid: str) -> str:
    """An instance's run directory: 64 bits of its uuid, short enough for socket paths."""
    return instance_uuid.replace("-", "")[:16]


class InstanceSpecs:
    """Where an instance's files are, and its ``VMSpec`` as its VM runs (or would start) now.

    ``snapshot_root`` and ``disk_root`` default to ``snapshots`` and ``disks``
    beside ``run_root``.
    """

    def __init__(
        self,
        run_root: str,
        reach: GuestReach,
        snapshot_root: str | None = None,
        disk_root: str | None = None,
    ) -> None:
        self.run_root = run_root
        self.reach = reach
        beside = os.path.dirname(os.path.abspath(run_root))
        self.snapshot_root = snapshot_root or os.path.join(beside, "snapshots")
        # Each instance's root-disk overlay lives here, named like its run directory.
        self.disk_root = disk_root or os.path.join(beside, "disks")

    def run_dir(self, record: InstanceRecord) -> str:
        """The instance's run directory (its sockets, pidfile, logs, config drive)."""
        return os.path.join(self.run_root, run_dir_name(record.uuid))

    def console_log_path(self, record: InstanceRecord) -> str:
        """Where QEMU appends the instance's serial console (absent before its first boot)."""
        run_dir = os.path.join(os.path.abspath(self.run_root), run_dir_name(record.uuid))
        return os.path.join(run_dir, CONSOLE_LOG_NAME)

    def console_log(self, record: InstanceRecord, limit: int) -> bytes:
        """The tail of the instance's console log (empty before its first boot)."""
        return read_console(self.console_log_path(record), limit)

    def config_drive(self, record: InstanceRecord) -> str:
        """The directory handed to the guest as its config drive (certificates, agent.json)."""
        return os.path.join(self.run_dir(record), CONFIG_DRIVE)

    def disk_path(self, record: InstanceRecord) -> str | None:
        """The instance's root-disk overlay (None: it boots no image)."""
        if BootSource.from_config(record.config).image is None:
            return None
        return os.path.join(self.disk_root, run_dir_name(record.uuid) + ".qcow2")

    def snapshot_dir(self, record: InstanceRecord, snapshot: str) -> str:
        """Where the files of the instance's snapshot ``snapshot`` are."""
        return snapshot_directory(self.snapshot_root, run_dir_name(record.uuid), snapshot)

    def layout_of(self, record: InstanceRecord) -> SerialLayout:
        """The serial layout the instance's VM was last started with.

        Never started by a vmready that records layouts: ``unrecorded``, the
        wiring every earlier vmready gave its VMs.
        """
        recorded = SERIAL_LAYOUTS.get(record.config.get(LAYOUT_KEY, ""))
        return recorded if recorded is not None else UNRECORDED_LAYOUT

    def spec_for(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        accel: str | None = None,
        transport: str | None = None,
        rng: bool | None = None,
    ) -> VMSpec:
        """The hypervisor's view of an instance, as its VM runs (or would start) now.

        The serial layout, accelerator, transport and rng device default to
        those the VM was last started with; a launch passes the ones it starts
        it with.
        """
        boot = BootSource.from_config(record.config)
        drive = self.config_drive(record)
        transport = transport or record.config.get(TRANSPORT_KEY, "hvsock")
        cid = record.config.get(CID_KEY)
        guest = self.reach.link
        forward = None
        if transport == "forward" and guest is not None and guest.forward_socket is not None:
            forward = GuestForward(guest.forward_socket, forward_mac(record.uuid))
        return VMSpec(
            name=record.name,
            uuid=record.uuid,
            memory_mib=record.memory_mib,
            cpus=record.cpus,
            run_dir=self.run_dir(record),
            serial_ports=(layout or self.layout_of(record)).ports,
            accel=accel or record.config.get(CURRENT_ACCEL_KEY, "tcg"),
            config_drive=drive if os.path.isdir(drive) else None,
            disk=self.disk_path(record),
            kernel=boot.kernel,
            initrd=boot.initrd,
            append=boot.append,
            vsock_cid=int(cid) if transport == "vsock" and cid is not None else None,
            forward=forward,
            rng=rng if rng is not None else record.config.get(RNG_KEY) == "true",
        )


def agent_chardev(spec: VMSpec) -> str | None:
    """The ring buffer the VM's agent writes to: the one wired to its agent port, new or old."""
    port = _agent_port(spec)
    return port.chardev if port is not None else None


def agent_port_name(spec: VMSpec) -> str | None:
    """The name of the port wired to the agent's ring buffer (the agent tries it first)."""
    port = _agent_port(spec)
    return port.name if port is not None else None


def _agent_port(spec: VMSpec) -> SerialPort | None:
    """The agent's port with a ring buffer behind it: the current name first, then the legacy."""
    for wanted in (AGENT_PORT, LEGACY_PORT):
        for port in spec.serial_ports:
            if port.name == wanted and port.chardev is not None:
                return port
    return None
