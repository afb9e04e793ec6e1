"""The QEMU command line vmready gives a VM, built from a ``VMSpec`` without any I/O.

The same command line runs on real ``qemu-system-x86_64`` and on fakeqemu: a
q35 machine with no default devices, the QMP monitor on a unix socket in the
VM's run directory, one virtio-serial bus, and the agent's ring buffer wired to
the ``com.canonical.lxd`` port (DESIGN.md, "Ring buffer and agent states").

The serial wiring is data (``VMSpec.serial_ports``), not code: a layout is a
tuple of ``SerialPort`` values, so a VM can be started with another layout (the
legacy ``org.linuxcontainers.lxd`` wiring an older daemon used) by passing a
different tuple, and the builder stays the one place that turns it into
``-chardev``/``-device`` options.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

import attrs

__all__ = [
    "AGENT_PORT",
    "AGENT_RING",
    "AGENT_SERIAL_PORTS",
    "CURRENT_LAYOUT",
    "DEFAULT_RING_SIZE",
    "LEGACY_LAYOUT",
    "LEGACY_PORT",
    "SERIAL_BUS",
    "SERIAL_LAYOUTS",
    "STARTABLE_LAYOUTS",
    "UNRECORDED_LAYOUT",
    "SerialLayout",
    "SerialPort",
    "VMSpec",
    "build_command_line",
    "escape_option",
    "qmp_address",
    "serial_arguments",
]

AGENT_RING = "vmready"
AGENT_PORT = "com.canonical.lxd"
LEGACY_PORT = "org.linuxcontainers.lxd"
SERIAL_BUS = "vs0"
DEFAULT_RING_SIZE = 65536

QMP_SOCKET_NAME = "qmp.sock"
QEMU_LOG_NAME = "qemu.log"
PIDFILE_NAME = "vm.pid"
GUEST_DIR_SUFFIX = ".guest"


@attrs.frozen
class SerialPort:
    """One virtserialport: its name in the guest and the ring buffer wired to it (None: none)."""

    name: str
    chardev: str | None = None


@attrs.frozen
class SerialLayout:
    """A named serial wiring a VM can be started with (recorded, and shown to operators)."""

    name: str
    ports: tuple[SerialPort, ...]
    description: str


# Since the rename: the agent's ring buffer on com.canonical.lxd, plus an unwired port
# by the old name so that older guest images still find one.
CURRENT_LAYOUT = SerialLayout(
    "current",
    (SerialPort(AGENT_PORT, AGENT_RING), SerialPort(LEGACY_PORT)),
    f"{AGENT_PORT} on the agent ring buffer, {LEGACY_PORT} unwired",
)
# Before the rename: the ring buffer on org.linuxcontainers.lxd, and nothing else.
LEGACY_LAYOUT = SerialLayout(
    "legacy",
    (SerialPort(LEGACY_PORT, AGENT_RING),),
    f"{LEGACY_PORT} on the agent ring buffer (before the rename)",
)
# What vmready started VMs with before it recorded layouts: the new port alone. A VM
# found running without a recorded layout has this one (it can only come from then).
UNRECORDED_LAYOUT = SerialLayout(
    "unrecorded",
    (SerialPort(AGENT_PORT, AGENT_RING),),
    f"{AGENT_PORT} on the agent ring buffer, alone (started before layouts were recorded)",
)
SERIAL_LAYOUTS: dict[str, SerialLayout] = {
    layout.name: layout for layout in (CURRENT_LAYOUT, LEGACY_LAYOUT, UNRECORDED_LAYOUT)
}
# The layouts a daemon can be told to start VMs with.
STARTABLE_LAYOUTS = (CURRENT_LAYOUT.name, LEGACY_LAYOUT.name)
AGENT_SERIAL_PORTS: tuple[SerialPort, ...] = CURRENT_LAYOUT.ports


def _absolute(path: str) -> str:
    return os.path.abspath(path)


@attrs.frozen
class VMSpec:
    """What the hypervisor needs to run one instance's VM.

    ``run_dir`` is made absolute on construction: QEMU changes to ``/`` when it
    daemonizes, so a relative socket or pidfile path would point elsewhere.
    """

    name: str
    uuid: str
    memory_mib: int = attrs.field(validator=attrs.validators.ge(1))
    cpus: int = attrs.field(validator=attrs.validators.ge(1))
    run_dir: str = attrs.field(converter=_absolute)
    ring_size: int = DEFAULT_RING_SIZE
    serial_ports: tuple[SerialPort, ...] = AGENT_SERIAL_PORTS

    @property
    def qmp_socket(self) -> str:
        """The QMP monitor's unix socket."""
        return os.path.join(self.run_dir, QMP_SOCKET_NAME)

    @property
    def pidfile(self) -> str:
        """Where QEMU writes its process id."""
        return os.path.join(self.run_dir, PIDFILE_NAME)

    @property
    def log_file(self) -> str:
        """QEMU's ``-D`` log: once daemonized, QEMU reports its errors only there."""
        return os.path.join(self.run_dir, QEMU_LOG_NAME)

    def device_set(self) -> dict[str, object]:
        """What a saved VM state depends on: machine, memory, vCPUs and serial ports.

        QEMU loads a state only into the same devices (an added port fails).  The
        port names are part of it too: a renamed port would load in QEMU, but
        the agent inside the saved guest holds the port by its old name.
        """
        return {
            "machine": "q35",
            "memory_mib": self.memory_mib,
            "cpus": self.cpus,
            "serial_ports": [
                {"name": port.name, "chardev": port.chardev} for port in self.serial_ports
            ],
        }

    @property
    def guest_dir(self) -> str:
        """fakeqemu's guest-side sockets (``virtio-ports/<name>``, ``control``)."""
        return self.qmp_socket + GUEST_DIR_SUFFIX


def escape_option(value: str) -> str:
    """A value for a QemuOpts string (``a=b,c=d``): a literal comma is written ``,,``."""
    return value.replace(",", ",,")


def qmp_address(socket_path: str) -> str:
    """The ``-qmp`` address for a unix socket, as it appears on the command line."""
    return f"unix:{escape_option(socket_path)}"


def serial_arguments(ports: Sequence[SerialPort], ring_size: int) -> list[str]:
    """The virtio-serial bus, one ``ringbuf`` chardev per wired ring, and the ports in order."""
    if not ports:
        return []
    args = ["-device", f"virtio-serial-pci,id={SERIAL_BUS}"]
    rings = list(dict.fromkeys(port.chardev for port in ports if port.chardev is not None))
    for ring in rings:
        args += ["-chardev", f"ringbuf,id={ring},size={ring_size}"]
    for port in ports:
        wiring = f"chardev={port.chardev}," if port.chardev is not None else ""
        args += [
            "-device",
            f"virtserialport,{wiring}name={escape_option(port.name)},bus={SERIAL_BUS}.0",
        ]
    return args


def build_command_line(
    spec: VMSpec,
    program: Sequence[str],
    accelerators: Sequence[str],
    paused: bool = False,
    incoming: str | None = None,
) -> list[str]:
    """The full argv that starts ``spec``'s VM daemonized (``-S``: paused; restoring ``incoming``).

    Each accelerator gets its own ``-accel``; QEMU tries them in order.  No
    ``-uuid``: fakeqemu does not accept it, and the spec's uuid identifies the
    instance to vmready, not to the guest.
    """
    if not program:
        raise ValueError("the hypervisor program is empty")
    args = [
        *program,
        "-name",
        f"guest={escape_option(spec.name)}",
        "-machine",
        "q35",
    ]
    for accelerator in accelerators:
        args += ["-accel", accelerator]
    args += [
        "-nodefaults",
        "-display",
        "none",
        "-m",
        f"{spec.memory_mib}M",
        "-smp",
        str(spec.cpus),
        "-qmp",
        f"{qmp_address(spec.qmp_socket)},server=on,wait=off",
        *serial_arguments(spec.serial_ports, spec.ring_size),
        "-daemonize",
        "-pidfile",
        spec.pidfile,
        "-D",
        spec.log_file,
    ]
    if paused:
        args.append("-S")
    if incoming is not None:
        args += ["-incoming", f"exec:cat {shlex.quote(incoming)}"]
    return args
