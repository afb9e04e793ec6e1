"""What a ``qemu-system-x86_64`` command line says, once both of QEMU's passes accepted it."""

from __future__ import annotations

import os

import attrs

from fakeqemu._blockdev import BlockdevSpec, DiskSpec
from fakeqemu._chardev import FileChardevSpec, RingbufSpec, SocketChardevSpec
from fakeqemu._devices import PciDeviceSpec, SerialBusSpec, SerialPortSpec
from fakeqemu._fsdev import ShareSpec
from fakeqemu._kernel import KernelSpec
from fakeqemu._usernet import GuestForwardSpec, NetdevSpec, NicSpec

DEFAULT_MEMORY = 128 * 1024 * 1024


@attrs.frozen
class MachineConfig:
    """Everything the command line said, validated."""

    name: str | None = None
    machine_type: str = "pc-i440fx-7.2"
    accelerator: str = "tcg"
    cpu_model: str | None = None
    memory_bytes: int = DEFAULT_MEMORY
    cpus: int = 1
    nodefaults: bool = False
    start_paused: bool = False
    daemonize: bool = False
    pidfile: str | None = None
    qmp_sockets: tuple[str, ...] = ()
    ringbufs: tuple[RingbufSpec, ...] = ()
    file_chardevs: tuple[FileChardevSpec, ...] = ()
    socket_chardevs: tuple[SocketChardevSpec, ...] = ()
    # -serial chardev:ID: the chardev behind the first UART (the guest's ttyS0).
    serial_chardev: str | None = None
    serial_buses: tuple[SerialBusSpec, ...] = ()
    serial_ports: tuple[SerialPortSpec, ...] = ()
    # The pvpanic device's ``events`` bits (1: panicked, 2: crash loaded); None: no device.
    pvpanic_events: int | None = None
    shares: tuple[ShareSpec, ...] = ()
    netdevs: tuple[NetdevSpec, ...] = ()
    nics: tuple[NicSpec, ...] = ()
    vsock_cid: int | None = None
    blockdevs: tuple[BlockdevSpec, ...] = ()
    disks: tuple[DiskSpec, ...] = ()
    kernel: KernelSpec | None = None
    pci_devices: tuple[PciDeviceSpec, ...] = ()
    incoming_path: str | None = None
    logfile: str | None = None
    warnings: tuple[str, ...] = ()
    show_version: bool = False
    # The directory relative paths of the command line are relative to (the launcher's).
    cwd: str = "."

    @property
    def guest_forwards(self) -> tuple[GuestForwardSpec, ...]:
        """The ``guestfwd`` rules a guest can reach: those of netdevs a NIC is attached to."""
        attached = {nic.netdev for nic in self.nics}
        return tuple(
            forward
            for netdev in self.netdevs
            if netdev.id in attached
            for forward in netdev.forwards
        )

    def host_path(self, path: str) -> str:
        """``path`` from the command line, as the process that gave it would open it."""
        return os.path.join(self.cwd, path)
