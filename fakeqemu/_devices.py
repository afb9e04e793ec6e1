"""``-device``: the device models fakeqemu emulates, realized in command-line order as QEMU does.

QEMU creates each ``-device`` once the board exists: it sets the properties in
the order given (a property's own value check fails there), then realizes the
device (the device's checks).  PCI devices take the next free slot, which is
part of what a migration stream names them by.  Every text here was measured
on QEMU 7.2 unless a comment says it is fakeqemu's own refusal.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs

from fakeqemu._blockdev import BlockdevSpec, DiskSpec, realize_virtio_blk
from fakeqemu._chardev import ChardevSpec, RingbufSpec, SocketChardevSpec
from fakeqemu._fsdev import FsdevSpec, ShareSpec, realize_9p_device
from fakeqemu._qemuopts import CommandLineError, uint32_property, uint64_property
from fakeqemu._usernet import NetdevSpec, NicSpec, realize_nic

VHOST_VSOCK_VARIABLE = "FAKEQEMU_VHOST_VSOCK_DEVICE"
_MAX_VIRTIO_SERIAL_PORTS = 511
_MAX_GUEST_CID = 0xFFFFFFFF
# QEMU devices a user may reasonably pass that fakeqemu does not model.
_UNMODELLED_DEVICES = frozenset(
    {
        "virtio-scsi-pci",
        "virtio-balloon-pci",
        "virtconsole",
        "e1000",
        "e1000e",
        "VGA",
        "qxl-vga",
        "usb-tablet",
        "qemu-xhci",
        "pcie-root-port",
        "isa-serial",
        "virtio-9p-device",
        "virtio-net-device",
        "virtio-blk-device",
    }
)
_ALIASES = {
    "virtio-serial": "virtio-serial-pci",
    "virtio-9p": "virtio-9p-pci",
    "virtio-net": "virtio-net-pci",
    "virtio-blk": "virtio-blk-pci",
    "virtio-rng": "virtio-rng-pci",
}
# Each device model's properties fakeqemu accepts.
_PROPERTIES = {
    "virtio-serial-pci": ("id", "max_ports", "bus", "addr"),
    "virtserialport": ("id", "chardev", "name", "bus", "nr"),
    "pvpanic": ("id", "ioport", "events"),
    "pvpanic-pci": ("id", "events"),
    "virtio-9p-pci": ("id", "fsdev", "mount_tag"),
    "virtio-net-pci": ("id", "netdev", "mac"),
    "vhost-vsock-pci": ("id", "guest-cid"),
    "virtio-blk-pci": ("id", "drive"),
    "virtio-rng-pci": ("id",),
}
# The migration section each PCI model saves, and the option ROM it maps (measured:
# a stream names them '0000:00:03.0/virtio-net' and '0000:00:03.0/virtio-net-pci.rom').
_SECTIONS = {
    "virtio-serial-pci": "virtio-console",
    "pvpanic-pci": "pvpanic-pci",
    "virtio-9p-pci": "virtio-9p",
    "virtio-net-pci": "virtio-net",
    "vhost-vsock-pci": "vhost-vsock",
    "virtio-blk-pci": "virtio-blk",
    "virtio-rng-pci": "virtio-rng",
}
_ROMS = {"virtio-net-pci": "virtio-net-pci.rom"}


@attrs.frozen
class SerialBusSpec:
    """``-device virtio-serial-pci``: one virtio-serial bus and its PCI address."""

    device_id: str | None
    bus_name: str
    max_ports: int
    pci_address: str


@attrs.frozen
class SerialPortSpec:
    """``-device virtserialport``: a port on a bus, optionally wired to a chardev."""

    bus_name: str
    nr: int
    name: str | None
    chardev: str | None
    device_id: str | None


@attrs.frozen
class PciDeviceSpec:
    """A PCI device as a migration stream names it: address, section and option ROM."""

    address: str
    section: str
    rom: str | None = None


@attrs.frozen
class Devices:
    """Every device the command line realized, by kind."""

    serial_buses: tuple[SerialBusSpec, ...] = ()
    serial_ports: tuple[SerialPortSpec, ...] = ()
    pvpanic_events: int | None = None
    shares: tuple[ShareSpec, ...] = ()
    nics: tuple[NicSpec, ...] = ()
    vsock_cid: int | None = None
    disks: tuple[DiskSpec, ...] = ()
    pci_devices: tuple[PciDeviceSpec, ...] = ()


def vhost_vsock_device() -> str:
    """The device vhost-vsock opens; ``$FAKEQEMU_VHOST_VSOCK_DEVICE`` overrides it for tests."""
    return os.environ.get(VHOST_VSOCK_VARIABLE, "/dev/vhost-vsock")


class DeviceRealizer:
    """Realizes ``-device`` options one after another, keeping what QEMU keeps between them."""

    def __init__(
        self,
        machine_type: str,
        nodefaults: bool,
        chardevs: dict[str, ChardevSpec],
        serial_chardev: str | None,
        fsdevs: dict[str, FsdevSpec],
        netdevs: dict[str, NetdevSpec],
        blockdevs: dict[str, BlockdevSpec],
        cwd: str,
    ) -> None:
        self._machine_type = machine_type
        self._chardevs = chardevs
        self._fsdevs = fsdevs
        self._netdevs = netdevs
        self._blockdevs = blockdevs
        self._cwd = cwd
        # QEMU's defaults (VGA, a NIC) take slots unless -nodefaults.
        base = 1 if machine_type == "pc-q35-7.2" else 2
        self._next_slot = base if nodefaults else base + 2
        self._anonymous = 0
        self._unnamed_buses = 0
        self._used_chardevs: set[str] = {serial_chardev} if serial_chardev else set()
        self._port_names: set[str] = set()
        self._used_netdevs: set[str] = set()
        self._attached_disks: dict[str, DiskSpec] = {}
        self._nic_count = 0
        self._buses: list[SerialBusSpec] = []
        self._ports: list[SerialPortSpec] = []
        self._pvpanic_events: int | None = None
        self._isa_pvpanic = False
        self._shares: list[ShareSpec] = []
        self._nics: list[NicSpec] = []
        self._vsock_cid: int | None = None
        self._disks: list[DiskSpec] = []
        self._pci: list[PciDeviceSpec] = []

    def realize(self, value: str, driver: str, opts: dict[str, str]) -> None:
        """Create one ``-device VALUE``; raises CommandLineError prefixed with the option."""
        try:
            self._realize(_ALIASES.get(driver, driver), opts)
        except CommandLineError as e:
            raise CommandLineError(f"-device {value}: {e}") from None

    def devices(self) -> Devices:
        """What was realized."""
        return Devices(
            tuple(self._buses),
            tuple(self._ports),
            self._pvpanic_events,
            tuple(self._shares),
            tuple(self._nics),
            self._vsock_cid,
            tuple(self._disks),
            tuple(self._pci),
        )

    def _realize(self, driver: str, opts: dict[str, str]) -> None:
        if driver not in _PROPERTIES:
            if driver in _UNMODELLED_DEVICES:
                # fakeqemu's own refusal: QEMU has this device.
                raise CommandLineError(f"fakeqemu does not emulate device model '{driver}'")
            raise CommandLineError(f"'{driver}' is not a valid device model name")
        device_id = opts.get("id")
        if device_id:
            device_path = f"/machine/peripheral/{device_id}"
        else:
            device_path = f"/machine/peripheral-anon/device[{self._anonymous}]"
            self._anonymous += 1
        if driver == "pvpanic":
            if self._machine_type == "none":
                raise CommandLineError("No 'ISA' bus found for device 'pvpanic'")
        elif driver != "virtserialport" and self._machine_type == "none":
            raise CommandLineError(f"No 'PCI' bus found for device '{driver}'")
        handler: Callable[[str, dict[str, str], str], None] = getattr(
            self, "_realize_" + driver.replace("-", "_")
        )
        handler(driver, opts, device_path)
        if driver in _SECTIONS:
            self._pci.append(
                PciDeviceSpec(self._pci_address(), _SECTIONS[driver], _ROMS.get(driver))
            )
            self._next_slot += 1

    def _pci_address(self) -> str:
        return f"0000:00:{self._next_slot:02x}.0"

    def _set_properties(
        self, driver: str, opts: dict[str, str], setters: dict[str, Callable[[str], None]]
    ) -> None:
        """Set properties in the order given, as QEMU does; a setter checks its value."""
        for key, value in opts.items():
            if key not in _PROPERTIES[driver]:
                raise CommandLineError(f"Property '{driver}.{key}' not found")
            setter = setters.get(key)
            if setter is not None:
                setter(value)

    # -- virtio-serial ----------------------------------------------------

    def _realize_virtio_serial_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        max_ports = [31]
        self._set_properties(
            driver,
            opts,
            {"max_ports": lambda v: max_ports.__setitem__(0, uint32_property("max_ports", v))},
        )
        device_id = opts.get("id")
        # QEMU numbers only the buses of devices without an id.
        if device_id:
            bus_name = f"{device_id}.0"
        else:
            bus_name = f"virtio-serial-bus.{self._unnamed_buses}"
            self._unnamed_buses += 1
        if max_ports[0] == 0:
            raise CommandLineError("Maximum number of serial ports not specified")
        if max_ports[0] > _MAX_VIRTIO_SERIAL_PORTS:
            raise CommandLineError(f"maximum ports supported: {_MAX_VIRTIO_SERIAL_PORTS}")
        self._buses.append(SerialBusSpec(device_id, bus_name, max_ports[0], self._pci_address()))

    def _realize_virtserialport(self, driver: str, opts: dict[str, str], _: str) -> None:
        nr_given: list[int] = []
        chardev: list[str] = []

        def set_chardev(value: str) -> None:
            if value not in self._chardevs:
                raise CommandLineError(
                    f"Property 'virtserialport.chardev' can't find value '{value}'"
                )
            if value in self._used_chardevs:
                raise CommandLineError(
                    f"Property 'virtserialport.chardev' can't take value '{value}': "
                    f"Device '{value}' is in use"
                )
            if not isinstance(self._chardevs[value], RingbufSpec | SocketChardevSpec):
                # fakeqemu's own refusal: QEMU would write the port's output to the file.
                raise CommandLineError(
                    "fakeqemu wires virtserialport only to ringbuf and socket chardevs"
                )
            chardev.append(value)

        self._set_properties(
            driver,
            opts,
            {"chardev": set_chardev, "nr": lambda v: nr_given.append(uint32_property("nr", v))},
        )
        if not self._buses:
            raise CommandLineError("No 'virtio-serial-bus' bus found for device 'virtserialport'")
        # Without bus=, QEMU picks the most recently created virtio-serial bus.
        bus_name = opts.get("bus", self._buses[-1].bus_name)
        matching = [b for b in self._buses if b.bus_name == bus_name]
        if not matching:
            raise CommandLineError(f"Bus '{bus_name}' not found")
        bus = matching[0]
        if chardev:
            self._used_chardevs.add(chardev[0])
        name = opts.get("name")
        if name is not None:
            if name in self._port_names:
                raise CommandLineError(f"virtio-serial-bus: A port already exists by name {name}")
            self._port_names.add(name)
        nr = self._port_number(bus, nr_given[-1] if nr_given else None)
        self._ports.append(
            SerialPortSpec(bus_name, nr, name, chardev[0] if chardev else None, opts.get("id"))
        )

    def _port_number(self, bus: SerialBusSpec, given: int | None) -> int:
        """A port's number on its bus: ``nr=`` if free, else the lowest free one from 1."""
        taken = {p.nr for p in self._ports if p.bus_name == bus.bus_name}
        if given is not None:
            nr = given
            if nr == 0:
                raise CommandLineError(
                    "Port number 0 on virtio-serial devices reserved for virtconsole devices "
                    "for backward compatibility."
                )
            if nr in taken:
                raise CommandLineError(f"virtio-serial-bus: A port already exists at id {nr}")
        else:
            nr = next(n for n in range(1, bus.max_ports + 1) if n not in taken)
        if nr >= bus.max_ports:
            raise CommandLineError(
                "virtio-serial-bus: Out-of-range port id specified, "
                f"max. allowed: {bus.max_ports - 1}"
            )
        return nr

    # -- pvpanic ----------------------------------------------------------

    def _realize_pvpanic(self, driver: str, opts: dict[str, str], _: str) -> None:
        events = [3]

        def set_ioport(value: str) -> None:
            uint32_property("ioport", value)

        self._set_properties(
            driver,
            opts,
            {
                "ioport": set_ioport,
                "events": lambda v: events.__setitem__(0, uint32_property("events", v)),
            },
        )
        if self._isa_pvpanic:
            # Measured: a second ISA pvpanic clashes on its firmware config file.
            raise CommandLineError("duplicate fw_cfg file name: etc/pvpanic-port")
        self._isa_pvpanic = True
        self._pvpanic_events = (self._pvpanic_events or 0) | events[0]

    def _realize_pvpanic_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        events = [3]
        self._set_properties(
            driver,
            opts,
            {"events": lambda v: events.__setitem__(0, uint32_property("events", v))},
        )
        self._pvpanic_events = (self._pvpanic_events or 0) | events[0]

    # -- 9p, network, vsock, disks -----------------------------------------

    def _realize_virtio_9p_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        self._set_properties(driver, opts, {})
        self._shares.append(realize_9p_device(opts, self._fsdevs, self._cwd))

    def _realize_virtio_net_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        self._set_properties(driver, opts, {})
        # A NIC's network client is named by its id, else by model and a count.
        name = opts.get("id") or f"{driver}.{self._nic_count}"
        self._nic_count += 1
        self._nics.append(realize_nic(list(opts.items()), name, self._netdevs, self._used_netdevs))

    def _realize_vhost_vsock_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        cid = [0]
        self._set_properties(
            driver,
            opts,
            {"guest-cid": lambda v: cid.__setitem__(0, uint64_property("guest-cid", v))},
        )
        if cid[0] <= 2:
            raise CommandLineError("guest-cid property must be greater than 2")
        if cid[0] > _MAX_GUEST_CID:
            raise CommandLineError("guest-cid property must be a 32-bit number")
        try:
            fd = os.open(vhost_vsock_device(), os.O_RDWR)
        except OSError as e:
            raise CommandLineError(
                f"vhost-vsock: failed to open vhost device: {e.strerror}"
            ) from None
        os.close(fd)
        self._vsock_cid = cid[0]

    def _realize_virtio_blk_pci(self, driver: str, opts: dict[str, str], path: str) -> None:
        def set_drive(value: str) -> None:
            if value not in self._blockdevs:
                raise CommandLineError(
                    f"Property 'virtio-blk-device.drive' can't find value '{value}'"
                )

        self._set_properties(driver, opts, {"drive": set_drive})
        self._disks.append(
            realize_virtio_blk(
                opts, f"{path}/virtio-backend", self._blockdevs, self._attached_disks
            )
        )

    def _realize_virtio_rng_pci(self, driver: str, opts: dict[str, str], _: str) -> None:
        # A guest's entropy source: nothing for fakeqemu's host-process guests to read, but
        # a PCI slot and a migration section of its own ('0000:00:NN.0/virtio-rng').
        self._set_properties(driver, opts, {})

    def peer_warnings(self) -> list[str]:
        """QEMU's warnings for a netdev no NIC uses and a NIC with no netdev (netdevs first)."""
        warnings = [
            f"warning: netdev {netdev} has no peer"
            for netdev in self._netdevs
            if netdev not in self._used_netdevs
        ]
        warnings += [
            f"warning: nic {nic.name} has no peer" for nic in self._nics if nic.netdev is None
        ]
        return warnings
