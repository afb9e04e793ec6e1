"""Parse the part of the ``qemu-system-x86_64`` command line fakeqemu emulates.

Errors carry QEMU's own wording (measured on QEMU 7.2) so a caller that handles
real QEMU's refusals handles fakeqemu's the same way.  Options QEMU knows but
fakeqemu does not emulate are refused, never ignored.

QEMU checks its command line in two passes, and where an error goes depends on
which pass finds it: errors in the option loop itself (an unknown option, a
malformed ``-m`` or ``-name``, a bad identifier, a duplicate ID) always go to
stderr; everything checked after the loop (the machine type, chardev backends,
accelerators, devices, the ``-incoming`` URI) is found only once the ``-D``
log file is open, and with ``-daemonize`` that file has replaced stderr.
:func:`parse_arguments` is the first pass, :meth:`ParsedArguments.configure`
the second, each finding what QEMU's does, in QEMU's order.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator, Sequence

import attrs

from fakeqemu._blockdev import BlockdevSpec, DiskSpec, open_blockdev, parse_blockdev_option
from fakeqemu._chardev import (
    ChardevSpec,
    FileChardevSpec,
    RingbufSpec,
    SocketChardevSpec,
    check_chardev_option,
    create_chardev,
    serial_chardev,
)
from fakeqemu._cpu import check_cpu_model
from fakeqemu._devices import (
    DeviceRealizer,
    Devices,
    PciDeviceSpec,
    SerialBusSpec,
    SerialPortSpec,
)
from fakeqemu._fsdev import FsdevSpec, ShareSpec, check_fsdev_option, create_fsdev
from fakeqemu._help import HELP_VALUES, HelpRequested
from fakeqemu._kernel import KernelSpec, check_kernel_options, load_linux
from fakeqemu._qemuopts import (
    IDENTIFIER_ERROR,
    SIZE_ERROR,
    CommandLineError,
    check_identifier,
    format_messages,
    parse_option_list,
    parse_options,
    parse_size,
    program_name,
    split_options,
)
from fakeqemu._usernet import GuestForwardSpec, NetdevSpec, NicSpec, create_user_netdev

__all__ = [
    "IDENTIFIER_ERROR",
    "QEMU_PACKAGE",
    "QEMU_VERSION",
    "SIZE_ERROR",
    "BlockdevSpec",
    "CommandLineError",
    "DiskSpec",
    "FileChardevSpec",
    "FsdevSpec",
    "GuestForwardSpec",
    "KernelSpec",
    "MachineConfig",
    "NetdevSpec",
    "NicSpec",
    "ParsedArguments",
    "PciDeviceSpec",
    "RingbufSpec",
    "SerialBusSpec",
    "SerialPortSpec",
    "ShareSpec",
    "SocketChardevSpec",
    "format_messages",
    "kvm_available",
    "parse_arguments",
    "parse_command_line",
    "parse_options",
    "parse_size",
    "program_name",
    "split_options",
]

QEMU_VERSION = (7, 2, 22)
QEMU_PACKAGE = "fakeqemu"

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
_ACCELERATORS = ("kvm", "tcg", "qtest")
_DEFAULT_MEMORY = 128 * 1024 * 1024
_MAX_UNIX_PATH = 107
# QEMU 7.2's DisplayType names on Linux; fakeqemu has none of them but ``none``.
_DISPLAY_TYPES = frozenset(
    {"default", "none", "gtk", "sdl", "egl-headless", "curses", "spice-app", "dbus"}
)
# Every key QEMU 7.2's -chardev accepts for some backend; ringbuf reads only ``size``.
_CHARDEV_KEYS = frozenset(
    {
        "backend",
        "id",
        "path",
        "host",
        "port",
        "fd",
        "local",
        "localaddr",
        "localport",
        "to",
        "ipv4",
        "ipv6",
        "wait",
        "server",
        "delay",
        "nodelay",
        "reconnect",
        "telnet",
        "tn3270",
        "websocket",
        "width",
        "height",
        "cols",
        "rows",
        "mux",
        "signal",
        "name",
        "debug",
        "size",
        "chardev",
        "append",
        "logfile",
        "logappend",
        "mouse",
        "clipboard",
        "tls-creds",
        "tls-authz",
        "abstract",
        "tight",
    }
)
_FLAG_OPTIONS = frozenset({"nodefaults", "S", "daemonize", "version", "h", "help"})
# Help requests QEMU answers after its option loop, in the order it checks them.
_HELP_ORDER = ("machine", "accel", "cpu", "device")
_VALUE_OPTIONS = frozenset(
    {
        "D",
        "name",
        "machine",
        "M",
        "accel",
        "cpu",
        "m",
        "smp",
        "display",
        "qmp",
        "chardev",
        "serial",
        "fsdev",
        "netdev",
        "blockdev",
        "device",
        "kernel",
        "initrd",
        "append",
        "incoming",
        "pidfile",
    }
)


@attrs.frozen
class MachineConfig:
    """Everything the command line said, validated."""

    name: str | None = None
    machine_type: str = "pc-i440fx-7.2"
    accelerator: str = "tcg"
    cpu_model: str | None = None
    memory_bytes: int = _DEFAULT_MEMORY
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


def _iterate_arguments(argv: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word == "-":
            raise CommandLineError(f"{word}: fakeqemu does not emulate disk images")
        option = word.lstrip("-")
        if option in _FLAG_OPTIONS:
            yield option, None
            i += 1
        elif option in _VALUE_OPTIONS:
            if i + 1 >= len(argv):
                raise CommandLineError(f"{word}: requires an argument")
            yield option, argv[i + 1]
            i += 2
        else:
            raise CommandLineError(f"{word}: invalid option")


def kvm_available() -> bool:
    """Whether the KVM device opens, as QEMU's kvm accelerator needs."""
    device = os.environ.get("FAKEQEMU_KVM_DEVICE", "/dev/kvm")
    try:
        fd = os.open(device, os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


class _Builder:
    """QEMU's two passes: ``option`` is the option loop, ``build`` what follows it."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.machine_opts: dict[str, str] = {}
        self.smp_opts: dict[str, str] = {}
        self.display: str = "none"
        # (option value, accelerator name, its properties), in command-line order.
        self.accelerators: list[tuple[str, str, dict[str, str]]] = []
        self.cpu: str | None = None
        # -chardev and -qmp create their chardevs in one pass, in command-line order.
        self.backends: list[tuple[str, str, dict[str, str]]] = []
        self.chardev_ids: set[str] = set()
        self.serials: list[str] = []
        self.fsdevs: list[tuple[str, dict[str, str]]] = []
        self.fsdev_ids: set[str] = set()
        self.netdevs: list[tuple[str, list[tuple[str, str]]]] = []
        self.netdev_ids: set[str] = set()
        self.blockdevs: list[tuple[str, dict[str, str]]] = []
        # (option value, driver, properties).
        self.devices: list[tuple[str, str, dict[str, str]]] = []
        self.device_ids: set[str] = set()
        self.kernel: str | None = None
        self.initrd: str | None = None
        self.append: str | None = None
        self.incoming: str | None = None
        self.warnings: list[str] = []
        # Options whose value asked for help (``-machine help``…), answered after the loop.
        self.help_requests: set[str] = set()

    # -- the option loop: errors here go to stderr, whatever -D says ------

    def option(self, option: str, value: str | None) -> None:
        where = f"-{option}" if value is None else f"-{option} {value}"
        handler = getattr(self, "_opt_" + {"M": "machine"}.get(option, option))
        try:
            handler(value)
        except CommandLineError as e:
            raise CommandLineError(f"{where}: {e}") from None

    def after_loop(self) -> None:
        """What QEMU checks right after its option loop, before it opens ``-D``."""
        check_kernel_options(self.kernel, self.initrd, self.append)

    def _opt_nodefaults(self, _: None) -> None:
        self.values["nodefaults"] = True

    def _opt_S(self, _: None) -> None:  # QEMU's option is -S
        self.values["start_paused"] = True

    def _opt_daemonize(self, _: None) -> None:
        self.values["daemonize"] = True

    def _opt_version(self, _: None) -> None:
        self.values["show_version"] = True

    def _opt_h(self, _: None) -> None:
        # As QEMU: the help is printed at once, whatever follows on the command line.
        raise HelpRequested("usage")

    _opt_help = _opt_h

    def _opt_pidfile(self, value: str) -> None:
        self.values["pidfile"] = value

    def _opt_D(self, value: str) -> None:  # QEMU's option is -D
        self.values["logfile"] = value

    def _opt_name(self, value: str) -> None:
        opts = parse_options(value, "guest")
        for key in opts:
            if key not in ("guest", "process", "debug-threads"):
                raise CommandLineError(f"Invalid parameter '{key}'")
        self.values["name"] = opts.get("guest")

    def _opt_machine(self, value: str) -> None:
        opts = parse_options(value, "type")
        if opts.get("type") in HELP_VALUES:
            self.help_requests.add("machine")
        self.machine_opts.update(opts)

    def _opt_accel(self, value: str) -> None:
        opts = parse_options(value, "accel")
        if opts.get("accel") in HELP_VALUES:
            self.help_requests.add("accel")
        self.accelerators.append((value, opts.pop("accel", ""), opts))

    def _opt_cpu(self, value: str) -> None:
        if value in HELP_VALUES:
            self.help_requests.add("cpu")
        self.cpu = value

    def _opt_m(self, value: str) -> None:
        opts = parse_options(value, "size")
        for key in opts:
            if key != "size":
                raise CommandLineError(f"Invalid parameter '{key}'")
        try:
            self.values["memory_bytes"] = parse_size(opts["size"], 1 << 20)
        except ValueError:
            raise CommandLineError(SIZE_ERROR) from None

    def _opt_smp(self, value: str) -> None:
        # Checked with the machine's other properties, after the option loop.
        self.smp_opts.update(parse_options(value, "cpus"))

    def _opt_display(self, value: str) -> None:
        opts = parse_options(value, "type")
        kind = opts.pop("type", "")
        if kind not in _DISPLAY_TYPES:
            raise CommandLineError(f"Parameter 'type' does not accept value '{kind}'")
        for key in opts:
            raise CommandLineError(f"Parameter '{key}' is unexpected")
        self.display = kind

    def _opt_qmp(self, value: str) -> None:
        parts = split_options(value)
        params = parse_options(",".join(parts[1:]), None) if parts[1:] else {}
        for key in params:
            if key not in ("server", "wait"):
                raise CommandLineError(
                    f"Invalid parameter '{key}'\n"
                    f"{program_name()}: -qmp {value}: parse error: {value}"
                )
        self.backends.append(("qmp", value, params))

    def _opt_chardev(self, value: str) -> None:
        opts = parse_options(value, "backend")
        self._new_id(opts, self.chardev_ids, "chardev")
        for key in opts:
            if key not in _CHARDEV_KEYS:
                raise CommandLineError(f"Invalid parameter '{key}'")
        check_chardev_option(opts)
        self.backends.append(("chardev", value, opts))

    def _opt_serial(self, value: str) -> None:
        self.serials.append(value)

    def _opt_fsdev(self, value: str) -> None:
        opts = parse_options(value, "fsdriver")
        self._new_id(opts, self.fsdev_ids, "fsdev")
        check_fsdev_option(opts)
        self.fsdevs.append((value, opts))

    def _opt_netdev(self, value: str) -> None:
        options = parse_option_list(value, "type")
        self._new_id(dict(options), self.netdev_ids, "netdev")
        self.netdevs.append((value, options))

    def _opt_blockdev(self, value: str) -> None:
        self.blockdevs.append((value, parse_blockdev_option(value)))

    def _opt_device(self, value: str) -> None:
        opts = parse_options(value, "driver")
        if opts.get("driver") in HELP_VALUES:
            self.help_requests.add("device")
            return
        self._new_id(opts, self.device_ids, "device")
        driver = opts.pop("driver", "")
        self.devices.append((value, driver, opts))

    def _opt_kernel(self, value: str) -> None:
        self.kernel = value

    def _opt_initrd(self, value: str) -> None:
        self.initrd = value

    def _opt_append(self, value: str) -> None:
        self.append = value

    def _opt_incoming(self, value: str) -> None:
        self.incoming = value

    @staticmethod
    def _new_id(opts: dict[str, str], taken: set[str], kind: str) -> None:
        """An ``id=`` must be an identifier, unique among its kind (QemuOpts's checks)."""
        check_identifier(opts)
        new_id = opts.get("id")
        if new_id is not None:
            if new_id in taken:
                raise CommandLineError(f"Duplicate ID '{new_id}' for {kind}")
            taken.add(new_id)

    # -- after the option loop: where -D and -daemonize send errors -------

    def build(self, cwd: str) -> MachineConfig:
        """The checks QEMU makes after its option loop, in its order (-incoming last)."""
        self.warnings = []  # every warning comes from these checks
        try:
            return self._build(cwd)
        except CommandLineError as e:
            raise CommandLineError(str(e), self.warnings) from None

    def _build(self, cwd: str) -> MachineConfig:
        machine_type = self._machine_type()
        self._check_display()
        chardevs, qmp_sockets = self._backends(cwd)
        fsdevs = self._fsdevs()
        blockdevs = self._blockdevs(cwd)
        cpus = self._smp()
        self._machine_properties(machine_type)
        accelerator = self._accelerator()
        netdevs = self._netdevs()
        serial = self._serial(chardevs)
        cpu_model = check_cpu_model(self.cpu, accelerator) if self.cpu is not None else None
        kernel = self._kernel(machine_type, cwd)
        realizer = DeviceRealizer(
            machine_type,
            bool(self.values.get("nodefaults")),
            chardevs,
            serial,
            fsdevs,
            netdevs,
            blockdevs,
            cwd,
        )
        for value, driver, opts in self.devices:
            realizer.realize(value, driver, opts)
        self.warnings.extend(realizer.peer_warnings())
        incoming_path = self._incoming_path()
        return self._config(
            machine_type=machine_type,
            accelerator=accelerator,
            cpu_model=cpu_model,
            cpus=cpus,
            qmp_sockets=tuple(qmp_sockets),
            chardevs=chardevs,
            serial_chardev=serial,
            netdevs=netdevs,
            blockdevs=blockdevs,
            devices=realizer.devices(),
            kernel=kernel,
            incoming_path=incoming_path,
            cwd=cwd,
        )

    def _config(
        self,
        *,
        chardevs: dict[str, ChardevSpec],
        netdevs: dict[str, NetdevSpec],
        blockdevs: dict[str, BlockdevSpec],
        devices: Devices,
        **fields: object,
    ) -> MachineConfig:
        return MachineConfig(
            ringbufs=tuple(c for c in chardevs.values() if isinstance(c, RingbufSpec)),
            file_chardevs=tuple(c for c in chardevs.values() if isinstance(c, FileChardevSpec)),
            socket_chardevs=tuple(
                c for c in chardevs.values() if isinstance(c, SocketChardevSpec)
            ),
            netdevs=tuple(netdevs.values()),
            blockdevs=tuple(blockdevs.values()),
            serial_buses=devices.serial_buses,
            serial_ports=devices.serial_ports,
            pvpanic_events=devices.pvpanic_events,
            shares=devices.shares,
            nics=devices.nics,
            vsock_cid=devices.vsock_cid,
            disks=devices.disks,
            pci_devices=devices.pci_devices,
            warnings=tuple(self.warnings),
            **fields,  # type: ignore[arg-type]  # each option's value as its parser typed it
            **self.values,  # type: ignore[arg-type]  # each option's value as its parser typed it
        )

    def _machine_type(self) -> str:
        machine_type = MACHINE_ALIASES.get(self.machine_opts.get("type", "pc"))
        if machine_type is None:
            raise CommandLineError(
                "unsupported machine type\nUse -machine help to list supported machines"
            )
        return machine_type

    def _check_display(self) -> None:
        if self.display != "none":
            raise CommandLineError(f"Display '{self.display}' is not available.")

    def _backends(self, cwd: str) -> tuple[dict[str, ChardevSpec], list[str]]:
        chardevs: dict[str, ChardevSpec] = {}
        qmp_sockets: list[str] = []
        for option, value, opts in self.backends:
            try:
                if option == "qmp":
                    qmp_sockets.append(_qmp_socket(value, opts))
                else:
                    spec = create_chardev(opts, cwd)
                    chardevs[spec.id] = spec
            except CommandLineError as e:
                raise CommandLineError(f"-{option} {value}: {e}") from None
        return chardevs, qmp_sockets

    def _fsdevs(self) -> dict[str, FsdevSpec]:
        fsdevs: dict[str, FsdevSpec] = {}
        for value, opts in self.fsdevs:
            try:
                spec = create_fsdev(opts)
            except CommandLineError as e:
                raise CommandLineError(f"-fsdev {value}: {e}") from None
            fsdevs[spec.id] = spec
        return fsdevs

    def _blockdevs(self, cwd: str) -> dict[str, BlockdevSpec]:
        blockdevs: dict[str, BlockdevSpec] = {}
        node_names: set[str] = set()
        for value, opts in self.blockdevs:
            try:
                spec = open_blockdev(opts, node_names, cwd)
            except CommandLineError as e:
                raise CommandLineError(f"-blockdev {value}: {e}") from None
            blockdevs[spec.node_name] = spec
        return blockdevs

    def _smp(self) -> int:
        for key in self.smp_opts:
            if key not in ("cpus", "maxcpus", "sockets", "cores", "threads"):
                raise CommandLineError(f"Parameter 'smp.{key}' is unexpected")
        try:
            cpus = int(self.smp_opts.get("cpus", "1"))
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
        for key in self.machine_opts:
            if key != "type":
                prefix = _MACHINE_PROPERTY_PREFIX[machine_type]
                raise CommandLineError(f"Property '{prefix}.{key}' not found")

    def _accelerator(self) -> str:
        if not self.accelerators:
            return "tcg"
        # QEMU tries each in turn, reporting each failure, until one initializes.
        failures: list[str] = []
        for value, accel, properties in self.accelerators:
            if accel not in _ACCELERATORS:
                failures.append(f"-accel {value}: invalid accelerator {accel}")
                continue
            for key in properties:
                # Setting a property that does not exist is fatal, not a reason to fall back.
                self.warnings.extend(failures)
                raise CommandLineError(f"-accel {value}: Property '{accel}-accel.{key}' not found")
            if accel == "kvm" and not kvm_available():
                # QEMU's kvm_init prints its first line without the program name.
                failures.append(
                    "Could not access KVM kernel module: No such file or directory\n"
                    f"{program_name()}: -accel {value}: failed to initialize kvm: "
                    "No such file or directory"
                )
                continue
            if failures:
                self.warnings.extend([*failures, f"falling back to {accel}"])
            return accel
        self.warnings.extend(failures[:-1])
        raise CommandLineError(failures[-1])

    def _netdevs(self) -> dict[str, NetdevSpec]:
        netdevs: dict[str, NetdevSpec] = {}
        for value, options in self.netdevs:
            try:
                spec = create_user_netdev(value, options)
            except CommandLineError as e:
                raise CommandLineError(f"-netdev {value}: {e}") from None
            netdevs[spec.id] = spec
        return netdevs

    def _serial(self, chardevs: dict[str, ChardevSpec]) -> str | None:
        connected: str | None = None
        for index, value in enumerate(self.serials):
            chardev = serial_chardev(value, chardevs)
            if index and chardev is not None:
                # fakeqemu's own refusal: QEMU would add another UART.
                raise CommandLineError(f"-serial {value}: fakeqemu emulates one serial port")
            if index == 0:
                connected = chardev
        return connected

    def _kernel(self, machine_type: str, cwd: str) -> KernelSpec | None:
        if self.kernel is None:
            return None
        spec = KernelSpec(self.kernel, self.initrd, self.append or "")
        memory = self.values.get("memory_bytes", _DEFAULT_MEMORY)
        assert isinstance(memory, int)
        load_linux(spec, machine_type, memory, cwd)
        return spec

    def _incoming_path(self) -> str | None:
        value = self.incoming
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


class ParsedArguments:
    """A command line through QEMU's option loop, not yet checked as a whole."""

    def __init__(self, builder: _Builder) -> None:
        self._builder = builder

    def _value(self, key: str) -> object:
        return self._builder.values.get(key)

    @property
    def show_version(self) -> bool:
        """``-version``: print it and exit, before anything else."""
        return bool(self._value("show_version"))

    @property
    def daemonize(self) -> bool:
        """``-daemonize``: with ``logfile``, the log file takes stderr's place."""
        return bool(self._value("daemonize"))

    @property
    def logfile(self) -> str | None:
        """``-D FILE`` (the last one given), which QEMU opens before ``configure``'s checks."""
        value = self._value("logfile")
        return value if isinstance(value, str) else None

    def configure(self, cwd: str | None = None) -> MachineConfig:
        """QEMU's checks after the option loop; raises CommandLineError with its warnings.

        Files the command line names (chardev files, exports, images, kernels) are
        opened relative to ``cwd``, the launching process's directory (default: ours).
        """
        if self.show_version:
            return MachineConfig(show_version=True)
        return self._builder.build(os.getcwd() if cwd is None else cwd)


def parse_arguments(argv: Sequence[str]) -> ParsedArguments:
    """QEMU's option loop: raises CommandLineError for what QEMU reports while parsing.

    HelpRequested when the command line asks for help (``-h``, ``-machine help``…).
    """
    builder = _Builder()
    # QEMU's first pass: every option known and given its argument, before any is acted on.
    for option, value in list(_iterate_arguments(argv)):
        builder.option(option, value)
    for kind in _HELP_ORDER:
        if kind in builder.help_requests and not builder.values.get("show_version"):
            raise HelpRequested(kind)
    if not builder.values.get("show_version"):
        builder.after_loop()
    return ParsedArguments(builder)


def parse_command_line(argv: Sequence[str], cwd: str | None = None) -> MachineConfig:
    """Turn QEMU arguments (without the program name) into a validated MachineConfig."""
    return parse_arguments(argv).configure(cwd)
