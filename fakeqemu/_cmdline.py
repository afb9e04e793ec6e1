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
import re
import shlex
from collections.abc import Iterator, Sequence

import attrs

from fakeqemu._ringbuf import DEFAULT_RINGBUF_SIZE

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
_MAX_VIRTIO_SERIAL_PORTS = 511
# QEMU devices a user may reasonably pass that fakeqemu does not model.
_UNMODELLED_DEVICES = frozenset(
    {
        "virtio-net-pci",
        "virtio-blk-pci",
        "virtio-scsi-pci",
        "virtio-rng-pci",
        "virtio-balloon-pci",
        "vhost-vsock-pci",
        "virtconsole",
        "e1000",
        "e1000e",
        "VGA",
        "qxl-vga",
        "usb-tablet",
        "qemu-xhci",
        "pcie-root-port",
    }
)
_SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_ERROR = (
    "Parameter 'size' expects a non-negative number below 2^64\n"
    "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"
    "and exabytes, respectively."
)
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_IDENTIFIER_ERROR = (
    "Parameter 'id' expects an identifier\n"
    "Identifiers consist of letters, digits, '-', '.', '_', starting with a letter."
)
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
_FLAG_OPTIONS = frozenset({"nodefaults", "S", "daemonize", "version"})
_VALUE_OPTIONS = frozenset(
    {
        "D",
        "name",
        "machine",
        "M",
        "accel",
        "m",
        "smp",
        "display",
        "qmp",
        "chardev",
        "device",
        "incoming",
        "pidfile",
    }
)


class CommandLineError(Exception):
    """The command line is refused; ``str(e)`` is QEMU's text without the program prefix.

    ``warnings`` are the messages QEMU printed before it gave up (an accelerator
    that failed to initialize, a deprecated topology), in order.
    """

    def __init__(self, message: str, warnings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.warnings = tuple(warnings)

    @property
    def messages(self) -> list[str]:
        """Everything QEMU prints for this refusal: the warnings, then the error."""
        return [*self.warnings, str(self)]


@attrs.frozen
class RingbufSpec:
    """``-chardev ringbuf,id=ID,size=N``."""

    id: str
    size: int


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
class MachineConfig:
    """Everything the command line said, validated."""

    name: str | None = None
    machine_type: str = "pc-i440fx-7.2"
    accelerator: str = "tcg"
    memory_bytes: int = _DEFAULT_MEMORY
    cpus: int = 1
    nodefaults: bool = False
    start_paused: bool = False
    daemonize: bool = False
    pidfile: str | None = None
    qmp_sockets: tuple[str, ...] = ()
    ringbufs: tuple[RingbufSpec, ...] = ()
    serial_buses: tuple[SerialBusSpec, ...] = ()
    serial_ports: tuple[SerialPortSpec, ...] = ()
    incoming_path: str | None = None
    logfile: str | None = None
    warnings: tuple[str, ...] = ()
    show_version: bool = False


def split_options(text: str) -> list[str]:
    """Split a QemuOpts string on commas, with ``,,`` standing for a literal comma."""
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == ",":
            if text[i + 1 : i + 2] == ",":
                current.append(",")
                i += 2
                continue
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    return parts


def parse_options(text: str, implied_key: str | None) -> dict[str, str]:
    """Parse ``a,b=c`` into a dict; a bare first item is ``implied_key``'s value."""
    result: dict[str, str] = {}
    for index, part in enumerate(split_options(text)):
        if "=" in part:
            key, value = part.split("=", 1)
        elif index == 0 and implied_key is not None:
            key, value = implied_key, part
        elif part.startswith("no") and len(part) > 2:
            key, value = part[2:], "off"
        else:
            key, value = part, "on"
        result[key] = value
    return result


def parse_size(value: str, default_unit: int) -> int:
    """Parse a QEMU size (``64``, ``64M``, ``1G``); a bare number is in ``default_unit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bBkKmMgGtT]?)", value.strip())
    if match is None:
        raise ValueError(value)
    number, suffix = match.groups()
    unit = _SIZE_SUFFIX[suffix.upper()] if suffix else default_unit
    return int(float(number) * unit)


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
        # -chardev and -qmp create their chardevs in one pass, in command-line order.
        self.backends: list[tuple[str, str, dict[str, str]]] = []
        self.chardev_ids: set[str] = set()
        # (option value, driver, properties).
        self.devices: list[tuple[str, str, dict[str, str]]] = []
        self.device_ids: set[str] = set()
        self.incoming: str | None = None
        self.warnings: list[str] = []

    # -- the option loop: errors here go to stderr, whatever -D says ------

    def option(self, option: str, value: str | None) -> None:
        where = f"-{option}" if value is None else f"-{option} {value}"
        handler = getattr(self, "_opt_" + {"M": "machine"}.get(option, option))
        try:
            handler(value)
        except CommandLineError as e:
            raise CommandLineError(f"{where}: {e}") from None

    def _opt_nodefaults(self, _: None) -> None:
        self.values["nodefaults"] = True

    def _opt_S(self, _: None) -> None:  # QEMU's option is -S
        self.values["start_paused"] = True

    def _opt_daemonize(self, _: None) -> None:
        self.values["daemonize"] = True

    def _opt_version(self, _: None) -> None:
        self.values["show_version"] = True

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
        self.machine_opts.update(parse_options(value, "type"))

    def _opt_accel(self, value: str) -> None:
        opts = parse_options(value, "accel")
        self.accelerators.append((value, opts.pop("accel", ""), opts))

    def _opt_m(self, value: str) -> None:
        opts = parse_options(value, "size")
        for key in opts:
            if key != "size":
                raise CommandLineError(f"Invalid parameter '{key}'")
        try:
            self.values["memory_bytes"] = parse_size(opts["size"], 1 << 20)
        except ValueError:
            raise CommandLineError(_SIZE_ERROR) from None

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
        _check_identifier(opts)
        chardev_id = opts.get("id")
        if chardev_id is not None:
            if chardev_id in self.chardev_ids:
                raise CommandLineError(f"Duplicate ID '{chardev_id}' for chardev")
            self.chardev_ids.add(chardev_id)
        for key in opts:
            if key not in _CHARDEV_KEYS:
                raise CommandLineError(f"Invalid parameter '{key}'")
        if "size" in opts:
            try:
                parse_size(opts["size"], 1)
            except ValueError:
                raise CommandLineError(_SIZE_ERROR) from None
        self.backends.append(("chardev", value, opts))

    def _opt_device(self, value: str) -> None:
        opts = parse_options(value, "driver")
        _check_identifier(opts)
        device_id = opts.get("id")
        if device_id is not None:
            if device_id in self.device_ids:
                raise CommandLineError(f"Duplicate ID '{device_id}' for device")
            self.device_ids.add(device_id)
        driver = opts.pop("driver", "")
        self.devices.append(
            (value, {"virtio-serial": "virtio-serial-pci"}.get(driver, driver), opts)
        )

    def _opt_incoming(self, value: str) -> None:
        self.incoming = value

    # -- after the option loop: where -D and -daemonize send errors -------

    def build(self) -> MachineConfig:
        """The checks QEMU makes after its option loop, in its order (-incoming last)."""
        self.warnings = []  # every warning comes from these checks
        try:
            machine_type = self._machine_type()
            self._check_display()
            ringbufs, qmp_sockets = self._backends()
            cpus = self._smp()
            self._machine_properties(machine_type)
            accelerator = self._accelerator()
            buses, ports = self._serial_devices(machine_type, ringbufs)
            incoming_path = self._incoming_path()
        except CommandLineError as e:
            raise CommandLineError(str(e), self.warnings) from None
        return MachineConfig(
            machine_type=machine_type,
            accelerator=accelerator,
            cpus=cpus,
            qmp_sockets=tuple(qmp_sockets),
            ringbufs=tuple(ringbufs.values()),
            serial_buses=tuple(buses),
            serial_ports=tuple(ports),
            incoming_path=incoming_path,
            warnings=tuple(self.warnings),
            **self.values,  # type: ignore[arg-type]
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

    def _backends(self) -> tuple[dict[str, RingbufSpec], list[str]]:
        ringbufs: dict[str, RingbufSpec] = {}
        qmp_sockets: list[str] = []
        for option, value, opts in self.backends:
            try:
                if option == "qmp":
                    qmp_sockets.append(_qmp_socket(value, opts))
                else:
                    spec = _ringbuf(opts)
                    ringbufs[spec.id] = spec
            except CommandLineError as e:
                raise CommandLineError(f"-{option} {value}: {e}") from None
        return ringbufs, qmp_sockets

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

    def _serial_devices(
        self, machine_type: str, ringbufs: dict[str, RingbufSpec]
    ) -> tuple[list[SerialBusSpec], list[SerialPortSpec]]:
        buses: list[SerialBusSpec] = []
        ports: list[SerialPortSpec] = []
        used_chardevs: set[str] = set()
        port_names: set[str] = set()
        next_slot = self._first_pci_slot(machine_type)
        unnamed_buses = 0
        allowed = {
            "virtio-serial-pci": {"id", "max_ports", "bus", "addr"},
            "virtserialport": {"id", "chardev", "name", "bus", "nr"},
        }
        for value, driver, opts in self.devices:
            try:
                if driver not in allowed:
                    if driver in _UNMODELLED_DEVICES:
                        raise CommandLineError(
                            f"fakeqemu does not emulate device model '{driver}'"
                        )
                    raise CommandLineError(f"'{driver}' is not a valid device model name")
                for key in opts:
                    if key not in allowed[driver]:
                        raise CommandLineError(f"Property '{driver}.{key}' not found")
                device_id = opts.get("id")
                if driver == "virtio-serial-pci":
                    if machine_type == "none":
                        raise CommandLineError("No 'PCI' bus found for device 'virtio-serial-pci'")
                    # QEMU numbers only the buses of devices without an id.
                    if device_id:
                        bus_name = f"{device_id}.0"
                    else:
                        bus_name = f"virtio-serial-bus.{unnamed_buses}"
                        unnamed_buses += 1
                    max_ports = _uint32_property("max_ports", opts.get("max_ports", "31"))
                    if max_ports == 0:
                        raise CommandLineError("Maximum number of serial ports not specified")
                    if max_ports > _MAX_VIRTIO_SERIAL_PORTS:
                        raise CommandLineError(
                            f"maximum ports supported: {_MAX_VIRTIO_SERIAL_PORTS}"
                        )
                    buses.append(
                        SerialBusSpec(device_id, bus_name, max_ports, f"0000:00:{next_slot:02x}.0")
                    )
                    next_slot += 1
                else:
                    ports.append(
                        self._serial_port(opts, ringbufs, buses, ports, used_chardevs, port_names)
                    )
            except CommandLineError as e:
                raise CommandLineError(f"-device {value}: {e}") from None
        return buses, ports

    def _first_pci_slot(self, machine_type: str) -> int:
        # QEMU's defaults (VGA, a NIC) take slots unless -nodefaults.
        base = 1 if machine_type == "pc-q35-7.2" else 2
        return base if self.values.get("nodefaults") else base + 2

    def _serial_port(
        self,
        opts: dict[str, str],
        ringbufs: dict[str, RingbufSpec],
        buses: list[SerialBusSpec],
        ports: list[SerialPortSpec],
        used_chardevs: set[str],
        port_names: set[str],
    ) -> SerialPortSpec:
        if not buses:
            raise CommandLineError("No 'virtio-serial-bus' bus found for device 'virtserialport'")
        # Without bus=, QEMU picks the most recently created virtio-serial bus.
        bus_name = opts.get("bus", buses[-1].bus_name)
        matching = [b for b in buses if b.bus_name == bus_name]
        if not matching:
            raise CommandLineError(f"Bus '{bus_name}' not found")
        bus = matching[0]
        chardev = opts.get("chardev")
        if chardev is not None:
            if chardev not in ringbufs:
                raise CommandLineError(
                    f"Property 'virtserialport.chardev' can't find value '{chardev}'"
                )
            if chardev in used_chardevs:
                raise CommandLineError(
                    f"Property 'virtserialport.chardev' can't take value '{chardev}': "
                    f"Device '{chardev}' is in use"
                )
            used_chardevs.add(chardev)
        name = opts.get("name")
        if name is not None:
            if name in port_names:
                raise CommandLineError(f"virtio-serial-bus: A port already exists by name {name}")
            port_names.add(name)
        taken = {p.nr for p in ports if p.bus_name == bus_name}
        if "nr" in opts:
            nr = _uint32_property("nr", opts["nr"])
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
        return SerialPortSpec(bus_name, nr, name, chardev, opts.get("id"))

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


def _ringbuf(opts: dict[str, str]) -> RingbufSpec:
    """Create a ``-chardev`` backend as QEMU does once its options parsed."""
    backend = opts.get("backend", "")
    if backend != "ringbuf":
        if backend in ("socket", "file", "null", "pty", "stdio", "pipe", "memory", "udp"):
            raise CommandLineError(f"fakeqemu does not emulate the '{backend}' char driver")
        raise CommandLineError(f"'{backend}' is not a valid char driver name")
    chardev_id = opts.get("id")
    if chardev_id is None:
        raise CommandLineError("chardev: no id specified")
    size = parse_size(opts["size"], 1) if "size" in opts else DEFAULT_RINGBUF_SIZE
    if size & (size - 1):
        raise CommandLineError("size of ringbuf chardev must be power of two")
    return RingbufSpec(chardev_id, size)


def _uint32_property(key: str, value: str) -> int:
    try:
        number = int(value, 0)
    except ValueError:
        raise CommandLineError(f"Parameter '{key}' expects integer") from None
    if not 0 <= number < 1 << 32:
        raise CommandLineError(f"Parameter '{key}' expects uint32_t")
    return number


def _check_identifier(opts: dict[str, str]) -> None:
    if "id" in opts and not _IDENTIFIER.fullmatch(opts["id"]):
        raise CommandLineError(_IDENTIFIER_ERROR)


def format_messages(prog: str, messages: Sequence[str]) -> str:
    """QEMU's stderr form: each message prefixed with the program, continuation lines bare."""
    text = ""
    for message in messages:
        first, *rest = message.split("\n")
        text += f"{prog}: {first}\n" + "".join(line + "\n" for line in rest)
    return text


def program_name() -> str:
    """The name QEMU-style messages start with: the basename of argv[0], as QEMU does."""
    import sys

    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not base or base in ("__main__.py", "-c", "trial", "python", "python3"):
        return "fakeqemu"
    return base


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

    def configure(self) -> MachineConfig:
        """QEMU's checks after the option loop; raises CommandLineError with its warnings."""
        if self.show_version:
            return MachineConfig(show_version=True)
        return self._builder.build()


def parse_arguments(argv: Sequence[str]) -> ParsedArguments:
    """QEMU's option loop: raises CommandLineError for what QEMU reports while parsing."""
    builder = _Builder()
    for option, value in _iterate_arguments(argv):
        builder.option(option, value)
    return ParsedArguments(builder)


def parse_command_line(argv: Sequence[str]) -> MachineConfig:
    """Turn QEMU arguments (without the program name) into a validated MachineConfig."""
    return parse_arguments(argv).configure()
