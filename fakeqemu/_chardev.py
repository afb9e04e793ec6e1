"""``-chardev`` backends fakeqemu models (``ringbuf``, ``file``, unix ``socket``) and ``-serial``.

QEMU creates every chardev after its option loop, in command-line order, and
a ``file`` chardev opens (creating, and without ``append=on`` truncating) its
file right then, before any device exists.  ``-serial`` is resolved later,
once the accelerator is up.  Every text here was measured on QEMU 7.2.
"""

from __future__ import annotations

import os

import attrs

from fakeqemu._qemuopts import (
    SIZE_ERROR,
    CommandLineError,
    parse_bool,
    parse_size,
    program_name,
)
from fakeqemu._ringbuf import DEFAULT_RINGBUF_SIZE

# Backends QEMU 7.2 has that fakeqemu does not model.
_UNMODELLED_BACKENDS = frozenset(
    {"null", "pty", "stdio", "pipe", "memory", "udp", "serial", "tty", "parallel"}
)
# ``-serial`` shorthands QEMU understands (qemu_chr_parse_compat) that fakeqemu does not model.
_UNMODELLED_SERIAL_NAMES = frozenset(
    {"null", "vc", "stdio", "pty", "msmouse", "braille", "console", "serial", "mon:stdio"}
)
_UNMODELLED_SERIAL_PREFIXES = (
    "file:",
    "pipe:",
    "udp:",
    "tcp:",
    "telnet:",
    "tn3270:",
    "websocket:",
    "unix:",
    "mon:",
    "vc:",
    "/dev/",
)


@attrs.frozen
class RingbufSpec:
    """``-chardev ringbuf,id=ID,size=N``."""

    id: str
    size: int


@attrs.frozen
class FileChardevSpec:
    """``-chardev file,id=ID,path=P[,append=on]``: output appended to a host file."""

    id: str
    path: str
    append: bool


@attrs.frozen
class SocketChardevSpec:
    """``-chardev socket,id=ID,path=P,server=on,wait=off``: a unix socket QEMU serves.

    One client at a time: a second one's connection is accepted by the kernel
    and waits, unserved, until the first leaves (measured on QEMU 7.2).
    """

    id: str
    path: str


ChardevSpec = RingbufSpec | FileChardevSpec | SocketChardevSpec


def check_chardev_option(opts: dict[str, str]) -> None:
    """What QEMU's option loop checks in a ``-chardev`` besides keys and IDs: typed values."""
    if "size" in opts:
        try:
            parse_size(opts["size"], 1)
        except ValueError:
            raise CommandLineError(SIZE_ERROR) from None
    for key in ("append", "logappend", "mux", "server", "wait", "telnet", "nodelay"):
        if key in opts:
            parse_bool(key, opts[key])


def create_chardev(opts: dict[str, str], cwd: str) -> ChardevSpec:
    """Create a ``-chardev`` backend as QEMU does after its option loop.

    A ``file`` backend opens its file now, as QEMU does: created with mode 0666
    less the umask, truncated unless ``append=on``.  ``cwd`` is the directory a
    relative path is relative to (the launching process's).
    """
    backend = opts.get("backend", "")
    if backend not in ("ringbuf", "file", "socket"):
        if backend in _UNMODELLED_BACKENDS:
            raise CommandLineError(f"fakeqemu does not emulate the '{backend}' char driver")
        raise CommandLineError(f"'{backend}' is not a valid char driver name")
    chardev_id = opts.get("id")
    if chardev_id is None:
        raise CommandLineError("chardev: no id specified")
    if backend == "file":
        return _create_file(chardev_id, opts, cwd)
    if backend == "socket":
        return _socket(chardev_id, opts)
    size = parse_size(opts["size"], 1) if "size" in opts else DEFAULT_RINGBUF_SIZE
    if size & (size - 1):
        raise CommandLineError("size of ringbuf chardev must be power of two")
    return RingbufSpec(chardev_id, size)


def _create_file(chardev_id: str, opts: dict[str, str], cwd: str) -> FileChardevSpec:
    path = opts.get("path")
    if path is None:
        raise CommandLineError("chardev: file: no filename given")
    append = parse_bool("append", opts["append"]) if "append" in opts else False
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(os.path.join(cwd, path), flags, 0o666)
    except OSError as e:
        raise CommandLineError(f"Could not open '{path}': {e.strerror}") from None
    os.close(fd)
    return FileChardevSpec(chardev_id, path, append)


def _socket(chardev_id: str, opts: dict[str, str]) -> SocketChardevSpec:
    """A unix server socket that does not wait for its client; other forms are not emulated."""
    path = opts.get("path")
    unmodelled = sorted(set(opts) & {"host", "port", "fd", "telnet", "tn3270", "websocket"})
    if path is None or unmodelled:
        raise CommandLineError(
            "fakeqemu emulates socket chardevs only as unix servers: "
            "socket,id=ID,path=P,server=on,wait=off"
        )
    server = parse_bool("server", opts["server"]) if "server" in opts else False
    wait = parse_bool("wait", opts["wait"]) if "wait" in opts else True
    if not server or wait:
        raise CommandLineError(
            "fakeqemu emulates socket chardevs only as unix servers that do not wait "
            "for their client: server=on,wait=off"
        )
    return SocketChardevSpec(chardev_id, path)


def serial_chardev(value: str, chardevs: dict[str, ChardevSpec]) -> str | None:
    """The chardev a ``-serial VALUE`` connects the first UART to (None: ``-serial none``)."""
    if value == "none":
        return None
    failed = f"could not connect serial device to character backend '{value}'"
    if value.startswith("chardev:"):
        chardev_id = value[len("chardev:") :]
        if chardev_id not in chardevs:
            raise CommandLineError(f"-serial {value}: {failed}")
        return chardev_id
    if value in _UNMODELLED_SERIAL_NAMES or value.startswith(_UNMODELLED_SERIAL_PREFIXES):
        raise CommandLineError(
            f"-serial {value}: fakeqemu connects serial ports only to 'chardev:ID'"
        )
    # QEMU's two lines: the chardev parser's, then the serial port's.
    raise CommandLineError(
        f"-serial {value}: '{value}' is not a valid char driver\n"
        f"{program_name()}: -serial {value}: {failed}"
    )


class FileChardevWriter:
    """The file of a ``file`` chardev, held open for the VM's life as QEMU holds it.

    Writes go where the open file is: a log renamed away (rotated) keeps
    receiving them, as it does from QEMU.
    """

    def __init__(self, path: str) -> None:
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, data: bytes) -> None:
        """Append ``data``."""
        view = memoryview(data)
        while view and self._fd is not None:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        """Close the file (the machine is gone)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_chardev_files(
    specs: tuple[FileChardevSpec, ...], cwd: str
) -> dict[str, FileChardevWriter]:
    """Open every ``file`` chardev's file for a machine about to run."""
    return {spec.id: FileChardevWriter(os.path.join(cwd, spec.path)) for spec in specs}
