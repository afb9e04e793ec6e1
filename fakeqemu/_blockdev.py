"""``-blockdev`` nodes (``qcow2`` or ``raw`` over a ``file``) and ``virtio-blk-pci`` disks.

QEMU checks a ``-blockdev``'s syntax and schema in its option loop, opens the
image (and its backing chain) once the chardevs and fsdevs exist, and attaches
a disk when the devices are realized.  fakeqemu reads each image's header
itself (:mod:`fakeqemu._qcow2`) and follows the backing chain; it never reads
or writes guest data.  Every message here was measured on QEMU 7.2.
"""

from __future__ import annotations

import os
import stat

import attrs

from fakeqemu._qcow2 import HEADER_READ_SIZE, ImageError, parse_qcow2_header
from fakeqemu._qemuopts import CommandLineError, is_identifier, parse_bool, split_options

# BlockdevDriver values of QEMU 7.2 (Debian build) other than the modelled ones.
_OTHER_DRIVERS = frozenset(
    {
        "blkdebug",
        "blklogwrites",
        "blkreplay",
        "blkverify",
        "bochs",
        "cloop",
        "compress",
        "copy-before-write",
        "copy-on-read",
        "dmg",
        "ftp",
        "ftps",
        "gluster",
        "host_cdrom",
        "host_device",
        "http",
        "https",
        "io_uring",
        "iscsi",
        "luks",
        "nbd",
        "nfs",
        "null-aio",
        "null-co",
        "nvme",
        "parallels",
        "preallocate",
        "qcow",
        "qed",
        "quorum",
        "rbd",
        "replication",
        "snapshot-access",
        "ssh",
        "throttle",
        "vdi",
        "vhdx",
        "vmdk",
        "vpc",
        "vvfat",
    }
)
_FORMAT_DRIVERS = ("qcow2", "raw")
_MODELLED_KEYS = frozenset({"driver", "node-name", "read-only", "file.driver", "file.filename"})
# Members of BlockdevOptions (base, qcow2, raw, file) that fakeqemu does not model.
_UNMODELLED_KEYS = frozenset(
    {
        "discard",
        "cache.direct",
        "cache.no-flush",
        "auto-read-only",
        "force-share",
        "detect-zeroes",
        "backing",
        "lazy-refcounts",
        "pass-discard-request",
        "pass-discard-snapshot",
        "pass-discard-other",
        "overlap-check",
        "cache-size",
        "l2-cache-size",
        "l2-cache-entry-size",
        "refcount-cache-size",
        "cache-clean-interval",
        "encrypt",
        "data-file",
        "offset",
        "size",
        "file.pr-manager",
        "file.locking",
        "file.aio",
        "file.aio-max-batch",
        "file.drop-cache",
        "file.read-only",
        "file.node-name",
        "file.cache.direct",
        "file.cache.no-flush",
        "file.discard",
        "file.auto-read-only",
        "file.force-share",
        "file.detect-zeroes",
    }
)
_MAX_NODE_NAME = 31
_MAX_CHAIN = 64


@attrs.frozen
class BlockdevSpec:
    """An opened block node: its name, format, image and the backing files behind it."""

    node_name: str
    driver: str
    filename: str
    read_only: bool
    backing_chain: tuple[str, ...]


@attrs.frozen
class DiskSpec:
    """``-device virtio-blk-pci,drive=NODE``: a disk the guest sees."""

    drive: str
    device_path: str


def parse_blockdev_option(value: str) -> dict[str, str]:
    """The option loop's reading of ``-blockdev``: keyval syntax, then QEMU's schema checks."""
    if value.lstrip().startswith("{"):
        raise CommandLineError("fakeqemu reads -blockdev only in its key=value form")
    opts: dict[str, str] = {}
    for index, part in enumerate(split_options(value)):
        key, sep, item = part.partition("=")
        if not sep:
            if index:
                raise CommandLineError(f"Expected '=' after parameter '{part}'")
            key, item = "driver", part
        opts[key] = item
    driver = opts.get("driver")
    if driver is None:
        raise CommandLineError("Parameter 'driver' is missing")
    if driver not in _FORMAT_DRIVERS and driver != "file":
        if driver in _OTHER_DRIVERS:
            raise CommandLineError(f"fakeqemu does not emulate the '{driver}' block driver")
        raise CommandLineError(f"Parameter 'driver' does not accept value '{driver}'")
    if driver == "file":
        raise CommandLineError("fakeqemu attaches disks only through a qcow2 or raw node")
    if "file" in opts:
        raise CommandLineError(
            "fakeqemu reads the image from file.driver=file,file.filename=PATH only"
        )
    if "file.driver" not in opts:
        raise CommandLineError("Parameter 'file.driver' is missing")
    file_driver = opts["file.driver"]
    if file_driver != "file":
        if file_driver in _OTHER_DRIVERS or file_driver in _FORMAT_DRIVERS:
            raise CommandLineError(f"fakeqemu does not emulate the '{file_driver}' block driver")
        raise CommandLineError(f"Parameter 'file.driver' does not accept value '{file_driver}'")
    if "file.filename" not in opts:
        raise CommandLineError("Parameter 'file.filename' is missing")
    if "read-only" in opts:
        parse_bool("read-only", opts["read-only"])
    # The nested file node's leftovers are refused before the outer node's.
    for nested in (True, False):
        for key in opts:
            if key.startswith("file.") != nested or key in _MODELLED_KEYS:
                continue
            if key in _UNMODELLED_KEYS:
                raise CommandLineError(f"fakeqemu does not emulate the block option '{key}'")
            raise CommandLineError(f"Parameter '{key}' is unexpected")
    return opts


def open_blockdev(opts: dict[str, str], node_names: set[str], cwd: str) -> BlockdevSpec:
    """Open a ``-blockdev`` node as QEMU does after its option loop: file, name, format, chain."""
    node_name = opts.get("node-name")
    if node_name is None:
        raise CommandLineError("'node-name' must be specified for the root node")
    read_only = parse_bool("read-only", opts["read-only"]) if "read-only" in opts else False
    filename = opts["file.filename"]
    try:
        data = _open_image(filename, cwd, writable=not read_only)
    except ImageError as e:
        raise CommandLineError(str(e)) from None
    if not is_identifier(node_name):
        raise CommandLineError(f"Invalid node-name: '{node_name}'")
    if len(node_name) > _MAX_NODE_NAME:
        raise CommandLineError("Node name too long")
    if node_name in node_names:
        raise CommandLineError(f"Duplicate nodes with node-name='{node_name}'")
    driver = opts["driver"]
    chain: tuple[str, ...] = ()
    if driver == "qcow2":
        try:
            chain = _backing_chain(filename, data, cwd)
        except ImageError as e:
            raise CommandLineError(str(e)) from None
    node_names.add(node_name)
    return BlockdevSpec(node_name, driver, filename, read_only, chain)


def _open_image(filename: str, cwd: str, writable: bool) -> bytes:
    """Open an image as QEMU's ``file`` driver does and read its first cluster (at most)."""
    try:
        fd = os.open(os.path.join(cwd, filename), os.O_RDWR if writable else os.O_RDONLY)
    except OSError as e:
        raise ImageError(f"Could not open '{filename}': {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageError(f"'file' driver requires '{filename}' to be a regular file")
        # The header, and a backing file name up to the largest cluster size.
        return os.pread(fd, max(HEADER_READ_SIZE, 2 << 20), 0)
    finally:
        os.close(fd)


def _backing_chain(filename: str, data: bytes, cwd: str) -> tuple[str, ...]:
    """Check a qcow2 image and every backing file behind it, as QEMU opens them."""
    chain: list[str] = []
    prefix = ""
    header = parse_qcow2_header(data)
    while header.backing_file is not None:
        if len(chain) >= _MAX_CHAIN:
            raise ImageError(f"fakeqemu follows at most {_MAX_CHAIN} backing files")
        # A relative backing file name is relative to the image that names it.
        backing = os.path.join(os.path.dirname(filename), header.backing_file)
        chain.append(backing)
        prefix += "Could not open backing file: "
        try:
            data = _open_image(backing, cwd, writable=False)
            backing_format = header.backing_format or (
                "qcow2" if data.startswith(b"QFI\xfb") else "raw"
            )
            if backing_format == "raw":
                break
            if backing_format != "qcow2":
                raise ImageError(f"fakeqemu does not open '{backing_format}' backing files")
            header = parse_qcow2_header(data)
        except ImageError as e:
            raise ImageError(prefix + str(e)) from None
    return tuple(chain)


def realize_virtio_blk(
    opts: dict[str, str],
    device_path: str,
    blockdevs: dict[str, BlockdevSpec],
    attached: dict[str, DiskSpec],
) -> DiskSpec:
    """Realize ``virtio-blk-pci``: its drive must name a node no other disk writes to.

    ``device_path`` is the QOM path QEMU names the device by:
    ``/machine/peripheral/<id>/virtio-backend``, or
    ``/machine/peripheral-anon/device[N]/virtio-backend`` counting every ``-device``
    without an id.
    """
    drive = opts.get("drive")
    if drive is None:
        raise CommandLineError("drive property not set")
    if drive not in blockdevs:
        raise CommandLineError(f"Property 'virtio-blk-device.drive' can't find value '{drive}'")
    other = attached.get(drive)
    if other is not None and not blockdevs[drive].read_only:
        # Measured: the disk already attached is named first, the newcomer second.
        raise CommandLineError(
            f"Permission conflict on node '{drive}': permissions 'write' are both required by "
            f"block device '{other.device_path}' (uses node '{drive}' as 'root' child) and "
            f"unshared by block device '{device_path}' (uses node '{drive}' as 'root' child)."
        )
    disk = DiskSpec(drive, device_path)
    attached.setdefault(drive, disk)
    return disk
