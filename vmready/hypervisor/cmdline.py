"""The QEMU command line vmready gives a VM, built from a ``VMSpec`` without any I/O.

The same command line runs on real ``qemu-system-x86_64`` and on fakeqemu: a
q35 machine with no default devices and exactly one accelerator, the QMP
monitor on a unix socket in the VM's run directory, one virtio-serial bus with
the agent's ring buffer wired to the ``com.canonical.lxd`` port (every port
with an ``id=``, so QEMU reports the guest opening and closing it), the
guest's serial console appended to a log file, a pvpanic device, and — as the
spec asks — the config drive over virtio-9p, a root disk (and with it the
read-only NoCloud seed), a virtio-rng device, a kernel to boot directly, and the
guest API's transport: ``vhost-vsock-pci`` with the instance's CID, or a user-mode
network restricted to one forward (``GuestForward``) where the host has no
``/dev/vhost-vsock``.

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

from vmready.hypervisor.nocloud import seed_path

AGENT_RING = "vmready"
AGENT_PORT = "com.canonical.lxd"
LEGACY_PORT = "org.linuxcontainers.lxd"
SERIAL_BUS = "vs0"
DEFAULT_RING_SIZE = 65536

QMP_SOCKET_NAME = "qmp.sock"
QEMU_LOG_NAME = "qemu.log"
CONSOLE_LOG_NAME = "console.log"
PIDFILE_NAME = "vm.pid"
GUEST_DIR_SUFFIX = ".guest"
CONFIG_DRIVE_TAG = "config"
ACCELERATORS = ("kvm", "tcg")
# The guest's end of the fallback transport: what it dials, and the one forward there is.
FORWARD_GUEST_ADDRESS = "10.0.2.100"
FORWARD_GUEST_PORT = 8443
FORWARD_NETWORK = "10.0.2.0/24"
FORWARD_NETDEV = "vmready-net"
CONSOLE_CHARDEV = "console"
# Host → guest: QEMU's ringbuf-write never reaches the guest, so CONNECT lines go to a
# port of their own, backed by a unix socket the daemon connects to.
CONNECT_PORT = "vmready.connect"
CONNECT_CHARDEV = "vmready-connect"
CONNECT_SOCKET_NAME = "connect.sock"
ROOT_NODE = "root"
SEED_NODE = "nocloud-seed"


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


def _absolute_or_none(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


@attrs.frozen
class GuestForward:
    """The fallback transport: user-mode networking that reaches one host socket, nothing else.

    QEMU's restricted slirp network gives the guest no route anywhere; its
    one ``guestfwd`` rule runs ``program`` for each connection the guest opens
    to ``FORWARD_GUEST_ADDRESS:FORWARD_GUEST_PORT``, joining it to the
    daemon's guest API socket ``socket``.
    """

    socket: str = attrs.field(converter=_absolute)
    mac: str
    program: str = "socat"

    def guestfwd(self) -> str:
        """The ``guestfwd=`` value (QEMU splits its command shell-style; no shell runs it)."""
        command = shlex.join([self.program, "-", f"UNIX-CONNECT:{self.socket}"])
        return f"tcp:{FORWARD_GUEST_ADDRESS}:{FORWARD_GUEST_PORT}-cmd:{command}"


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
    accel: str = attrs.field(default="tcg", validator=attrs.validators.in_(ACCELERATORS))
    # The directory exported read-only to the guest as 9p tag "config" (None: no drive).
    config_drive: str | None = attrs.field(default=None, converter=_absolute_or_none)
    # The root disk: the instance's qcow2 overlay (None: no disk).
    disk: str | None = attrs.field(default=None, converter=_absolute_or_none)
    kernel: str | None = None
    initrd: str | None = None
    append: str | None = None
    # The guest API's transport: a vsock CID, or the restricted forward (or neither: hvsock).
    vsock_cid: int | None = None
    forward: GuestForward | None = None
    # A virtio-rng-pci device: the guest's kernel has random numbers at once instead of
    # gathering them for seconds (under TCG, 10 s into a boot); its Pythons waited for them.
    rng: bool = True

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

    @property
    def connect_socket(self) -> str:
        """The unix socket behind the ``vmready.connect`` port (QEMU serves it)."""
        return os.path.join(self.run_dir, CONNECT_SOCKET_NAME)

    @property
    def console_log(self) -> str:
        """Where the guest's serial console (ttyS0) is appended."""
        return os.path.join(self.run_dir, CONSOLE_LOG_NAME)

    def device_set(self) -> dict[str, object]:
        """What a saved VM state depends on: machine, CPU, memory, vCPUs and devices.

        QEMU loads a state only into the same devices (an added port fails).  The
        port names are part of it too: a renamed port would load in QEMU, but
        the agent inside the saved guest holds the port by its old name.  The
        accelerator stands for the CPU model (KVM runs ``-cpu host``).
        """
        return {
            "machine": "q35",
            "accel": self.accel,
            "memory_mib": self.memory_mib,
            "cpus": self.cpus,
            "serial_ports": [
                {"name": port.name, "chardev": port.chardev} for port in self.serial_ports
            ],
            "connect_port": True,
            "console": True,
            "pvpanic": True,
            "config_drive": self.config_drive is not None,
            # The NoCloud seed comes with the root disk (and goes unrecorded: a VM that
            # boots a disk image takes no stateful snapshot).
            "disk": self.disk is not None,
            "transport": (
                "vsock" if self.vsock_cid is not None else "forward" if self.forward else "none"
            ),
            "rng": self.rng,
        }

    @property
    def seed(self) -> str | None:
        """The NoCloud seed's file: a VM with a config drive and a root disk has one."""
        if self.config_drive is None or self.disk is None:
            return None
        return seed_path(self.config_drive)

    @property
    def guest_dir(self) -> str:
        """fakeqemu's guest-side sockets (``virtio-ports/<name>``, ``control``)."""
        return self.qmp_socket + GUEST_DIR_SUFFIX


def fakeqemu_guest_paths(spec: VMSpec) -> dict[str, str]:
    """Where a fakeqemu guest's agent finds its ports, serves its socket, keeps its tmpfs.

    A fakeqemu guest is a host process: its devices are sockets in the run
    directory, and its "tmpfs" (``state_dir``) a directory a new boot empties.
    """
    guest_root = os.path.join(spec.run_dir, "guest")
    return {
        "virtio_ports": os.path.join(spec.guest_dir, "virtio-ports"),
        "tcp_sockets": os.path.join(spec.guest_dir, "tcp"),
        "devlxd_socket": os.path.join(guest_root, "lxd.sock"),
        "state_dir": os.path.join(guest_root, "run"),
    }


def device_problem(device: str) -> str | None:
    """Why QEMU could not open ``device`` (``/dev/kvm``, ``/dev/vhost-vsock``), or None."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"{device} cannot be opened: {e.strerror}"
    os.close(fd)
    return None


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
        name = escape_option(port.name)
        # The id makes QEMU emit VSERPORT_CHANGE when the guest opens or closes the port.
        args += [
            "-device",
            f"virtserialport,{wiring}name={name},bus={SERIAL_BUS}.0,id={name}",
        ]
    return args


def disk_arguments(spec: VMSpec) -> list[str]:
    """The root disk, then the NoCloud seed: the guest sees them as /dev/vda and /dev/vdb."""
    args = []
    if spec.disk is not None:
        args += [
            "-blockdev",
            f"driver=qcow2,node-name={ROOT_NODE},file.driver=file,"
            f"file.filename={escape_option(spec.disk)}",
            "-device",
            f"virtio-blk-pci,drive={ROOT_NODE}",
        ]
    if spec.seed is not None:
        args += [
            "-blockdev",
            f"driver=raw,node-name={SEED_NODE},read-only=on,file.driver=file,"
            f"file.filename={escape_option(spec.seed)}",
            "-device",
            f"virtio-blk-pci,drive={SEED_NODE}",
        ]
    return args


def device_arguments(spec: VMSpec) -> list[str]:
    """Console log, pvpanic, config drive, transport, disks, rng: devices past the serial bus."""
    args = []
    if spec.serial_ports:
        args += [
            "-chardev",
            f"socket,id={CONNECT_CHARDEV},path={escape_option(spec.connect_socket)},"
            "server=on,wait=off",
            "-device",
            f"virtserialport,chardev={CONNECT_CHARDEV},name={CONNECT_PORT},"
            f"bus={SERIAL_BUS}.0,id={CONNECT_PORT}",
        ]
    args += [
        "-chardev",
        f"file,id={CONSOLE_CHARDEV},path={escape_option(spec.console_log)},append=on",
        "-serial",
        f"chardev:{CONSOLE_CHARDEV}",
        "-device",
        "pvpanic",
    ]
    if spec.config_drive is not None:
        args += [
            "-fsdev",
            f"local,id={CONFIG_DRIVE_TAG},path={escape_option(spec.config_drive)},"
            "security_model=none,readonly=on",
            "-device",
            f"virtio-9p-pci,fsdev={CONFIG_DRIVE_TAG},mount_tag={CONFIG_DRIVE_TAG}",
        ]
    if spec.forward is not None:
        args += [
            "-netdev",
            f"user,id={FORWARD_NETDEV},restrict=on,net={FORWARD_NETWORK},ipv6=off,"
            f"guestfwd={escape_option(spec.forward.guestfwd())}",
            "-device",
            f"virtio-net-pci,netdev={FORWARD_NETDEV},mac={spec.forward.mac}",
        ]
    if spec.vsock_cid is not None:
        args += ["-device", f"vhost-vsock-pci,guest-cid={spec.vsock_cid}"]
    args += disk_arguments(spec)
    if spec.rng:
        # Last of the PCI devices: every other one keeps the slot it had before it came.
        args += ["-device", "virtio-rng-pci"]
    if spec.kernel is not None:
        args += ["-kernel", spec.kernel]
        if spec.initrd is not None:
            args += ["-initrd", spec.initrd]
        if spec.append is not None:
            args += ["-append", spec.append]
    return args


def build_command_line(
    spec: VMSpec,
    program: Sequence[str],
    paused: bool = False,
    incoming: str | None = None,
) -> list[str]:
    """The full argv that starts ``spec``'s VM daemonized (``-S``: paused; restoring ``incoming``).

    One ``-accel``, the spec's: vmready chooses it (and falls back from KVM to
    TCG itself, saying so) rather than letting QEMU try a list in silence.
    KVM runs the host's CPU model.  No ``-uuid``: fakeqemu does not accept
    it, and the spec's uuid identifies the instance to vmready, not to the guest.
    """
    if not program:
        raise ValueError("the hypervisor program is empty")
    args = [
        *program,
        "-name",
        f"guest={escape_option(spec.name)}",
        "-machine",
        "q35",
        "-accel",
        spec.accel,
    ]
    if spec.accel == "kvm":
        args += ["-cpu", "host"]
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
        *device_arguments(spec),
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
