"""QEMU's answers to help requests: ``-h``, ``-machine help``, ``-device help``, ``-accel help``.

Each lists only what fakeqemu models, in the format QEMU 7.2 prints (each
line of ``-machine help`` and ``-device help`` is one QEMU prints too; the
conformance suite checks that against real ``qemu-system-x86_64``).  All go
to stdout and exit 0, as QEMU's do.
"""

from __future__ import annotations

from fakeqemu._cpu import CPU_MODELS

__all__ = [
    "HELP_VALUES",
    "HelpRequested",
    "accel_help",
    "cpu_help",
    "device_help",
    "machine_help",
    "usage",
]

# What QEMU takes as a request for help in an option's value.
HELP_VALUES = frozenset({"help", "?"})

# (name, description) as ``-machine help`` lists them; QEMU's default machine is pc.
_MACHINES = (
    ("pc", "Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-7.2)"),
    ("pc-i440fx-7.2", "Standard PC (i440FX + PIIX, 1996) (default)"),
    ("q35", "Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)"),
    ("pc-q35-7.2", "Standard PC (Q35 + ICH9, 2009)"),
    ("none", "empty machine"),
)

# ``-device help``: QEMU's categories, in its order, with the models fakeqemu runs.
_DEVICE_CATEGORIES = (
    (
        "Storage devices",
        (
            'name "virtio-9p-pci", bus PCI, alias "virtio-9p"',
            'name "virtio-blk-pci", bus PCI, alias "virtio-blk"',
        ),
    ),
    ("Network devices", ('name "virtio-net-pci", bus PCI, alias "virtio-net"',)),
    (
        "Input devices",
        (
            'name "virtio-serial-pci", bus PCI, alias "virtio-serial"',
            'name "virtserialport", bus virtio-serial-bus',
        ),
    ),
    (
        "Misc devices",
        (
            'name "pvpanic", bus ISA',
            'name "pvpanic-pci", bus PCI',
            'name "vhost-vsock-pci", bus PCI',
            'name "virtio-rng-pci", bus PCI, alias "virtio-rng"',
        ),
    ),
)

# The options fakeqemu understands, with what each does here, in QEMU's help layout.
_OPTIONS = (
    (
        "Standard options",
        (
            ("-h or -help", "display this help and exit"),
            ("-version", "display version information and exit"),
            (
                "-machine [type=]name[,prop[=value][,...]]",
                "selects emulated machine ('-machine help' for list)",
            ),
            ("-cpu cpu", "select CPU ('-cpu help' for list)"),
            (
                "-accel [accel=]accelerator[,prop[=value][,...]]",
                "select accelerator (kvm or tcg; use 'help' for a list)",
            ),
            (
                "-smp [cpus=]n[,maxcpus=maxcpus][,sockets=s][,cores=c][,threads=t]",
                "set the number of initial CPUs to 'n'",
            ),
            ("-m [size=]megs", "configure guest RAM (suffixes k, M, G, T; default 128M)"),
            (
                "-name string1[,process=string2][,debug-threads=on|off]",
                "set the name of the guest",
            ),
            (
                "-fsdev local,id=id,path=path,security_model=passthrough|mapped-xattr|none",
                "a host directory a virtio-9p-pci device exports",
            ),
            (
                "-device driver[,prop[=value][,...]]",
                "add device driver ('-device help' for a list of drivers)",
            ),
            ("-nodefaults", "don't create default devices"),
        ),
    ),
    (
        "Block device options",
        (
            (
                "-blockdev [driver=]driver[,node-name=N][,read-only=on|off]",
                "configure a block backend (file, qcow2, raw)",
            ),
        ),
    ),
    ("Display options", (("-display none", "select display backend type (only none)"),)),
    (
        "Linux/Multiboot boot specific",
        (
            ("-kernel bzImage", "use 'bzImage' as kernel image"),
            ("-append cmdline", "use 'cmdline' as kernel command line"),
            ("-initrd file", "use 'file' as initial ram disk"),
        ),
    ),
    (
        "Network options",
        (
            (
                "-netdev user,id=str[,guestfwd=...][,restrict=on|off]",
                "configure a user mode network backend",
            ),
        ),
    ),
    (
        "Character device options",
        (("-chardev ringbuf|socket|file|null,id=id[,...]", "configure a character device"),),
    ),
    (
        "Debug/Expert options",
        (
            ("-serial dev", "redirect the serial port to char device 'dev'"),
            ("-qmp dev", "like -monitor but opens in 'control' mode"),
            ("-S", "freeze CPU at startup (use 'c' to start execution)"),
            ("-D logfile", "output log to logfile (default stderr)"),
            ("-pidfile file", "write PID to 'file'"),
            ("-daemonize", "daemonize QEMU after initializing"),
            ("-incoming uri", "prepare for incoming migration, listen on uri"),
        ),
    ),
)


class HelpRequested(Exception):
    """The command line asked for help of one ``kind``: print it to stdout and exit 0."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        # "usage" (-h), "machine", "accel", "cpu" or "device".
        self.kind = kind

    def text(self, prog: str, version_line: str) -> str:
        """What QEMU prints for this request."""
        if self.kind == "usage":
            return usage(prog, version_line)
        return {
            "machine": machine_help,
            "accel": accel_help,
            "cpu": cpu_help,
            "device": device_help,
        }[self.kind]()


def usage(prog: str, version_line: str) -> str:
    """``-h``: the version line, the usage line, then each option QEMU-style."""
    lines = [
        version_line,
        f"usage: {prog} [options] [disk_image]",
        "",
        "'disk_image' is a raw hard disk image for IDE hard disk 0 "
        "(fakeqemu boots no disk image this way)",
    ]
    for section, options in _OPTIONS:
        lines += ["", f"{section}:"]
        for option, text in options:
            if len(option) < 16:
                lines.append(f"{option:<16}{text}")
            else:
                lines += [option, f"{'':16}{text}"]
    lines += [
        "",
        "During emulation, fakeqemu answers QMP on the -qmp sockets; it runs no guest code.",
    ]
    return "\n".join(lines) + "\n"


def machine_help() -> str:
    """``-machine help``."""
    return "Supported machines are:\n" + "".join(
        f"{name:<20} {description}\n" for name, description in _MACHINES
    )


def device_help() -> str:
    """``-device help``: each category followed by a blank line, as QEMU prints them."""
    return "".join(
        f"{category}:\n" + "".join(f"{line}\n" for line in lines) + "\n"
        for category, lines in _DEVICE_CATEGORIES
    )


def accel_help() -> str:
    """``-accel help``."""
    return "Accelerators supported in QEMU binary:\ntcg\nkvm\n"


def cpu_help() -> str:
    """``-cpu help``: the models fakeqemu accepts (QEMU adds each one's notes and flags)."""
    return "Available CPUs:\n" + "".join(f"x86 {model}\n" for model in sorted(CPU_MODELS))
