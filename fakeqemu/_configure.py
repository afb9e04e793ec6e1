"""QEMU's second pass over its command line: the checks after the option loop, in its order.

What this pass finds, QEMU finds only once the ``-D`` log file is open, and
with ``-daemonize`` that file has replaced stderr: the machine type, chardev
backends, accelerators, devices, the ``-incoming`` URI (last).
"""

from __future__ import annotations

import os
import shlex
from typing import TypeVar

from fakeqemu._accel import choose_accelerator
from fakeqemu._blockdev import BlockdevSpec, open_blockdev
from fakeqemu._chardev import (
    ChardevSpec,
    FileChardevSpec,
    RingbufSpec,
    SocketChardevSpec,
    create_chardev,
    serial_chardev,
)
from fakeqemu._config import MachineConfig
from fakeqemu._cpu import check_cpu_model
from fakeqemu._devices import DeviceRealizer, Devices
from fakeqemu._fsdev import FsdevSpec, create_fsdev
from fakeqemu._kernel import KernelSpec, load_linux
from fakeqemu._optionloop import OptionLoop
from fakeqemu._qemuopts import CommandLineError, split_options
from fakeqemu._usernet import NetdevSpec, create_user_netdev

MACHINE_ALIASES = {
    "none": "none",
    "q35": "pc-q35-7.2",
    "pc-q35-7.2": "pc-q35-7.2",
    "pc": "pc-i440fx-7.2",
    "pc-i440fx-7.2": "pc-i440fx-7.2",
}
_MACHINE_PROPERTY_PREFIX = {
    "none": "none-machine",
    "pc-q35-7.2": "pc-q35-7.2-machine",
    "pc-i440fx-7.2": "pc-i440fx-7.2-machine",
}
_MAX_UNIX_PATH = 107
_Spec = TypeVar("_Spec", bound=ChardevSpec)


def configure(loop: OptionLoop, cwd: str) -> MachineConfig:
    """The machine the option loop described; raises CommandLineError with its warnings.

    Files the command line names are opened relative to ``cwd``.
    """
    second = _SecondPass(loop, cwd)
    try:
        return second.config()
    except CommandLineError as e:
        raise CommandLineError(str(e), second.warnings) from None


def _of_kind(chardevs: dict[str, ChardevSpec], kind: type[_Spec]) -> tuple[_Spec, ...]:
    return tuple(spec for spec in chardevs.values() if isinstance(spec, kind))


class _SecondPass:
    """One run of the checks after the option loop; ``warnings`` are what it printed."""

    def __init__(self, loop: OptionLoop, cwd: str) -> None:
        self.loop = loop
        self.cwd = cwd
        self.warnings: list[str] = []

    def config(self) -> MachineConfig:
        loop = self.loop
        machine_type = self._machine_type()
        self._check_display()
        chardevs, qmp_sockets = self._backends()
        fsdevs = self._fsdevs()
        blockdevs = self._blockdevs()
        cpus = self._smp()
        self._machine_properties(machine_type)
        accelerator = choose_accelerator(loop.accelerators, self.warnings)
        netdevs = self._netdevs()
        serial = self._serial(chardevs)
        cpu_model = check_cpu_model(loop.cpu, accelerator) if loop.cpu is not None else None
        kernel = self._kernel(machine_type)
        devices = self._devices(
            DeviceRealizer(
                machine_type,
                loop.nodefaults,
                chardevs,
                serial,
                fsdevs,
                netdevs,
                blockdevs,
                self.cwd,
            )
        )
        incoming_path = self._incoming_path()
        return MachineConfig(
            name=loop.name,
            machine_type=machine_type,
            accelerator=accelerator,
            cpu_model=cpu_model,
            memory_bytes=loop.memory_bytes,
            cpus=cpus,
            nodefaults=loop.nodefaults,
            start_paused=loop.start_paused,
            daemonize=loop.daemonize,
            pidfile=loop.pidfile,
            qmp_sockets=tuple(qmp_sockets),
            ringbufs=_of_kind(chardevs, RingbufSpec),
            file_chardevs=_of_kind(chardevs, FileChardevSpec),
            socket_chardevs=_of_kind(chardevs, SocketChardevSpec),
            serial_chardev=serial,
            serial_buses=devices.serial_buses,
            serial_ports=devices.serial_ports,
            pvpanic_events=devices.pvpanic_events,
            shares=devices.shares,
            netdevs=tuple(netdevs.values()),
            nics=devices.nics,
            vsock_cid=devices.vsock_cid,
            blockdevs=tuple(blockdevs.values()),
            disks=devices.disks,
            kernel=kernel,
            pci_devices=devices.pci_devices,
            incoming_path=incoming_path,
            logfile=loop.logfile,
            warnings=tuple(self.warnings),
            cwd=self.cwd,
        )

    def _machine_type(self) -> str:
        machine_type = MACHINE_ALIASES.get(self.loop.machine_opts.get("type", "pc"))
        if machine_type is None:
            raise CommandLineError(
                "unsupported machine type\nUse -machine help to list supported machines"
            )
        return machine_type

    def _check_display(self) -> None:
        if self.loop.display != "none":
            raise CommandLineError(f"Display '{self.loop.display}' is not available.")

    def _backends(self) -> tuple[dict[str, ChardevSpec], list[str]]:
        chardevs: dict[str, ChardevSpec] = {}
        qmp_sockets: list[str] = []
        for option, value, opts in self.loop.backends:
            try:
                if option == "qmp":
                    qmp_sockets.append(_qmp_socket(value, opts))
                else:
                    spec = create_chardev(opts, self.cwd)
                    chardevs[spec.id] = spec
            except CommandLineError as e:
                raise CommandLineError(f"-{option} {value}: {e}") from None
        return chardevs, qmp_sockets

    def _fsdevs(self) -> dict[str, FsdevSpec]:
        fsdevs: dict[str, FsdevSpec] = {}
        for value, opts in self.loop.fsdevs:
            try:
                spec = create_fsdev(opts)
            except CommandLineError as e:
                raise CommandLineError(f"-fsdev {value}: {e}") from None
            fsdevs[spec.id] = spec
        return fsdevs

    def _blockdevs(self) -> dict[str, BlockdevSpec]:
        blockdevs: dict[str, BlockdevSpec] = {}
        node_names: set[str] = set()
        for value, opts in self.loop.blockdevs:
            try:
                spec = open_blockdev(opts, node_names, self.cwd)
            except CommandLineError as e:
                raise CommandLineError(f"-blockdev {value}: {e}") from None
            blockdevs[spec.node_name] = spec
        return blockdevs

    def _smp(self) -> int:
        for key in self.loop.smp_opts:
            if key not in ("cpus", "maxcpus", "sockets", "cores", "threads"):
                raise CommandLineError(f"Parameter 'smp.{key}' is unexpected")
        try:
            cpus = int(self.loop.smp_opts.get("cpus", "1"))
        except ValueError:
            raise CommandLineError("Parameter 'smp.cpus' expects integer") from None
        if cpus == 0:
            self.warnings.append(
                "warning: Deprecated CPU topology (considered invalid): "
                "CPU topology parameters must be greater than zero"
            )
            cpus = 1
        return cpus

    def _machine_properties(self, machine_type: str) -> None:
        for key in self.loop.machine_opts:
            if key != "type":
                prefix = _MACHINE_PROPERTY_PREFIX[machine_type]
                raise CommandLineError(f"Property '{prefix}.{key}' not found")

    def _netdevs(self) -> dict[str, NetdevSpec]:
        netdevs: dict[str, NetdevSpec] = {}
        for value, options in self.loop.netdevs:
            try:
                spec = create_user_netdev(value, options)
            except CommandLineError as e:
                raise CommandLineError(f"-netdev {value}: {e}") from None
            netdevs[spec.id] = spec
        return netdevs

    def _serial(self, chardevs: dict[str, ChardevSpec]) -> str | None:
        connected: str | None = None
        for index, value in enumerate(self.loop.serials):
            chardev = serial_chardev(value, chardevs)
            if index and chardev is not None:
                # fakeqemu's own refusal: QEMU would add another UART.
                raise CommandLineError(f"-serial {value}: fakeqemu emulates one serial port")
            if index == 0:
                connected = chardev
        return connected

    def _kernel(self, machine_type: str) -> KernelSpec | None:
        loop = self.loop
        if loop.kernel is None:
            return None
        spec = KernelSpec(loop.kernel, loop.initrd, loop.append or "")
        load_linux(spec, machine_type, loop.memory_bytes, self.cwd)
        return spec

    def _devices(self, realizer: DeviceRealizer) -> Devices:
        """Every ``-device``, in command-line order, then the NICs' and netdevs' warnings."""
        for value, driver, opts in self.loop.devices:
            realizer.realize(value, driver, opts)
        self.warnings.extend(realizer.peer_warnings())
        return realizer.devices()

    def _incoming_path(self) -> str | None:
        value = self.loop.incoming
        if value is None:
            return None
        if value.startswith("exec:"):
            words = shlex.split(value[len("exec:") :])
            if len(words) == 2 and words[0] == "cat":
                return words[1]
            message = "fakeqemu accepts only 'exec:cat PATH' as an exec: migration"
        elif value.startswith(("tcp:", "unix:", "fd:", "rdma:", "defer")):
            message = "fakeqemu restores only from 'exec:cat PATH'"
        else:
            message = f"unknown migration protocol: {value}"
        raise CommandLineError(f"-incoming {value}: {message}")


def _qmp_socket(value: str, params: dict[str, str]) -> str:
    """The path a ``-qmp`` monitor listens on, or fakeqemu's refusal of it."""
    address = split_options(value)[0]
    if not address.startswith("unix:"):
        raise CommandLineError("fakeqemu serves QMP only on unix: sockets")
    path = address[len("unix:") :]
    if params.get("server", "off") != "on":
        raise CommandLineError(f"Failed to connect to '{path}': fakeqemu only listens (server=on)")
    if params.get("wait", "on") != "off":
        raise CommandLineError("fakeqemu does not wait for a QMP client: add wait=off")
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise CommandLineError(
            f"UNIX socket path '{path}' is too long\nPath must be less than 108 bytes"
        )
    return path
