"""QEMU's first pass over its command line: the option loop.

Each option is checked on its own as QEMU's loop checks it, and what it says
is kept for the second pass (:mod:`fakeqemu._configure`).  Errors found here
always go to stderr, whatever ``-D`` says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from fakeqemu._blockdev import parse_blockdev_option
from fakeqemu._chardev import check_chardev_option
from fakeqemu._config import DEFAULT_MEMORY
from fakeqemu._fsdev import check_fsdev_option
from fakeqemu._help import HELP_VALUES, HelpRequested
from fakeqemu._kernel import check_kernel_options
from fakeqemu._qemuopts import (
    SIZE_ERROR,
    CommandLineError,
    check_identifier,
    parse_option_list,
    parse_options,
    parse_size,
    program_name,
    split_options,
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
_FLAG_OPTIONS = frozenset({"nodefaults", "S", "daemonize", "version", "h", "help"})
# Help requests QEMU answers after its option loop, in the order it checks them.
_HELP_ORDER = ("machine", "accel", "cpu", "device")
# Options the loop only stores, and the field each sets (the others have an ``_opt_`` method).
_STORED = {
    "nodefaults": "nodefaults",
    "S": "start_paused",
    "daemonize": "daemonize",
    "version": "show_version",
    "pidfile": "pidfile",
    "D": "logfile",
    "kernel": "kernel",
    "initrd": "initrd",
    "append": "append",
    "incoming": "incoming",
}
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


def iterate_arguments(argv: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """Each option and its value (None for a flag), refusing an unknown or incomplete one."""
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


class OptionLoop:
    """QEMU's option loop: ``option`` takes each option in turn; the rest is what they said."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.nodefaults = False
        self.start_paused = False
        self.daemonize = False
        self.show_version = False
        self.pidfile: str | None = None
        self.logfile: str | None = None
        self.memory_bytes = DEFAULT_MEMORY
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
        # Options whose value asked for help (``-machine help``…), answered after the loop.
        self.help_requests: set[str] = set()

    def option(self, option: str, value: str | None) -> None:
        """Take one option: stored as it is, or checked by its ``_opt_`` method."""
        if option in _STORED:
            # The last one given wins, as in QEMU; a flag is stored as True.
            setattr(self, _STORED[option], True if value is None else value)
            return
        where = f"-{option}" if value is None else f"-{option} {value}"
        handler = getattr(self, "_opt_" + {"M": "machine"}.get(option, option))
        try:
            handler(value)
        except CommandLineError as e:
            raise CommandLineError(f"{where}: {e}") from None

    def after_loop(self) -> None:
        """What QEMU checks right after its option loop, before it opens ``-D`` (not with
        ``-version``): a request for help, then the kernel's options."""
        if self.show_version:
            return
        for kind in _HELP_ORDER:
            if kind in self.help_requests:
                raise HelpRequested(kind)
        check_kernel_options(self.kernel, self.initrd, self.append)

    def _opt_h(self, _: None) -> None:
        # As QEMU: the help is printed at once, whatever follows on the command line.
        raise HelpRequested("usage")

    _opt_help = _opt_h

    def _opt_name(self, value: str) -> None:
        opts = parse_options(value, "guest")
        for key in opts:
            if key not in ("guest", "process", "debug-threads"):
                raise CommandLineError(f"Invalid parameter '{key}'")
        self.name = opts.get("guest")

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
            self.memory_bytes = parse_size(opts["size"], 1 << 20)
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

    @staticmethod
    def _new_id(opts: dict[str, str], taken: set[str], kind: str) -> None:
        """An ``id=`` must be an identifier, unique among its kind (QemuOpts's checks)."""
        check_identifier(opts)
        new_id = opts.get("id")
        if new_id is not None:
            if new_id in taken:
                raise CommandLineError(f"Duplicate ID '{new_id}' for {kind}")
            taken.add(new_id)
