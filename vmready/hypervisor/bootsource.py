"""What an instance boots: a disk image (through its own qcow2 overlay) and/or a Linux kernel.

The source is four config keys, set at launch and kept with the instance:
``boot.image`` (a qcow2 or raw disk image), ``boot.kernel`` (a bzImage),
``boot.initrd`` and ``boot.append`` (need a kernel).  Paths are absolute: the
daemon does not share the CLI's working directory.

The image is never written.  Each instance boots its own qcow2 overlay backed
by it, made with ``qemu-img create`` in the daemon's data dir, checked with
``qemu-img info`` and removed when the instance is deleted; a rebuild makes a
fresh one.  Everything that can be known about the files is checked before an
instance exists, so a launch from a missing, unreadable or non-image file, a
backing chain that cannot be followed, or a kernel that is not a kernel fails
with one clear message and leaves nothing behind.

``qemu-img`` runs as a child process through the reactor (``ImageTool``),
never blocking it; the header checks of kernels and initrds read a few bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import stat
import struct
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import attrs
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure

from vmready.domain.model import BadRequest, HypervisorError

__all__ = [
    "APPEND_KEY",
    "BOOT_KEYS",
    "IMAGE_FORMATS",
    "IMAGE_KEY",
    "INITRD_KEY",
    "KERNEL_KEY",
    "MAX_APPEND_BYTES",
    "BootSource",
    "ImageInfo",
    "ImageTool",
    "check_files",
    "check_initrd",
    "check_kernel",
    "check_raw_image",
    "has_pvh_entry",
    "parse_image_info",
]

IMAGE_KEY = "boot.image"
KERNEL_KEY = "boot.kernel"
INITRD_KEY = "boot.initrd"
APPEND_KEY = "boot.append"
BOOT_KEYS = (IMAGE_KEY, KERNEL_KEY, INITRD_KEY, APPEND_KEY)
IMAGE_FORMATS = ("qcow2", "raw")
# x86's COMMAND_LINE_SIZE is 2048 bytes, the terminating NUL included.
MAX_APPEND_BYTES = 2047
QEMU_IMG = "qemu-img"
_XEN_ELFNOTE_PHYS32_ENTRY = 18
# Longer backing chains than this are refused (each layer is one qemu-img run).
MAX_CHAIN = 16
# A backing name with a protocol prefix (nbd:, http:, json:{…}) rather than a path.
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_OUTPUT_TAIL = 2000

# What a raw disk image starts with where it holds something a guest can boot or mount:
# (offset, magic, what it is).  GPT comes before MBR: a GPT disk also carries the
# protective MBR's 0x55AA.
_RAW_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (512, b"EFI PART", "a GPT partition table"),
    (510, b"\x55\xaa", "an MBR partition table"),
    (1080, b"\x53\xef", "an ext2/3/4 filesystem"),
    (0, b"XFSB", "an XFS filesystem"),
    (0x10040, b"_BHRfS_M", "a btrfs filesystem"),
    (0x8001, b"CD001", "an ISO 9660 filesystem"),
    (0, b"hsqs", "a squashfs filesystem"),
)
# Compressed or plain cpio archives, as the kernel unpacks initramfs images.
_INITRD_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"\x04\x22\x4d\x18", "lz4"),
    (b"BZh", "bzip2"),
    (b"\x5d\x00\x00", "lzma"),
    (b"\x89LZO", "lzo"),
    (b"070701", "cpio"),
    (b"070702", "cpio"),
    (b"070707", "cpio"),
)


@attrs.frozen
class BootSource:
    """An instance's boot source as its config keys hold it (every part optional)."""

    image: str | None = None
    kernel: str | None = None
    initrd: str | None = None
    append: str | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, str]) -> BootSource:
        """The boot source recorded in an instance's config."""
        return cls(
            image=config.get(IMAGE_KEY) or None,
            kernel=config.get(KERNEL_KEY) or None,
            initrd=config.get(INITRD_KEY) or None,
            append=config.get(APPEND_KEY) or None,
        )

    @property
    def empty(self) -> bool:
        """Nothing to boot: the VM runs its firmware and finds no disk."""
        return self.image is None and self.kernel is None

    def config(self) -> dict[str, str]:
        """The config keys that record this source."""
        values = {
            IMAGE_KEY: self.image,
            KERNEL_KEY: self.kernel,
            INITRD_KEY: self.initrd,
            APPEND_KEY: self.append,
        }
        return {key: value for key, value in values.items() if value is not None}

    def describe(self) -> str:
        """One line for people: ``image /x.qcow2, kernel /vmlinuz`` or ``nothing``."""
        parts = []
        if self.image is not None:
            parts.append(f"image {self.image}")
        if self.kernel is not None:
            parts.append(f"kernel {self.kernel}")
        if self.initrd is not None:
            parts.append(f"initrd {self.initrd}")
        if self.append is not None:
            parts.append(f"append {self.append!r}")
        return ", ".join(parts) if parts else "nothing (no image, no kernel)"

    def check_shape(self) -> None:
        """What can be said without opening a file: absolute paths, an initrd needs a kernel."""
        for key, value in (
            (IMAGE_KEY, self.image),
            (KERNEL_KEY, self.kernel),
            (INITRD_KEY, self.initrd),
        ):
            if value is None:
                continue
            if "\0" in value or not os.path.isabs(value):
                raise BadRequest(f"Invalid {key} {value!r}: expected an absolute path")
        if self.kernel is None:
            for key, value in ((INITRD_KEY, self.initrd), (APPEND_KEY, self.append)):
                if value is not None:
                    raise BadRequest(f"Invalid {key}: it needs {KERNEL_KEY} (a kernel to boot)")
        if self.append is not None:
            if "\0" in self.append or "\n" in self.append:
                raise BadRequest(f"Invalid {APPEND_KEY}: a kernel command line is one line")
            size = len(self.append.encode("utf-8"))
            if size > MAX_APPEND_BYTES:
                raise BadRequest(
                    f"Invalid {APPEND_KEY}: {size} bytes; a kernel command line holds at "
                    f"most {MAX_APPEND_BYTES}"
                )


def _read_head(path: str, what: str, size: int) -> bytes:
    """The first ``size`` bytes of a regular file, or a BadRequest saying what is wrong."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise BadRequest(f"{what} {path} does not exist") from None
    except OSError as e:
        raise BadRequest(f"{what} {path} cannot be examined: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise BadRequest(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise BadRequest(f"{what} {path} is not a regular file")
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise BadRequest(f"{what} {path} cannot be read: {e.strerror}") from None


def _is_kernel(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a bzImage (boot sector 0xAA55, ``HdrS``)."""
    return head[0x1FE:0x200] == b"\x55\xaa" and head[0x202:0x206] == b"HdrS"


def check_kernel(path: str) -> None:
    """``path`` is a Linux kernel QEMU boots: a bzImage, or an ELF ``vmlinux`` with a PVH entry.

    An uncompressed PVH kernel skips the decompression a bzImage does first,
    which is seconds under TCG.
    """
    head = _read_head(path, "kernel", 0x206)
    if _is_kernel(head):
        return
    if head[:4] == b"\x7fELF":
        with open(path, "rb") as f:
            if has_pvh_entry(f):
                return
        raise BadRequest(
            f"kernel {path} is an ELF file without a PVH entry note: QEMU boots an "
            "uncompressed kernel only through PVH (use the bzImage, /boot/vmlinuz-*)"
        )
    raise BadRequest(
        f"kernel {path} is not a Linux kernel: no bzImage header "
        "(expected a vmlinuz such as /boot/vmlinuz-*)"
    )


def has_pvh_entry(elf: BinaryIO) -> bool:
    """Whether the 64-bit little-endian ELF file ``elf`` carries Xen's PVH entry note.

    Reads the program headers, then only the PT_NOTE segments (a vmlinux is
    tens of MiB).
    """
    elf.seek(0)
    header = elf.read(64)
    if header[:4] != b"\x7fELF" or header[4:6] != b"\x02\x01" or len(header) < 64:
        return False
    (table,) = struct.unpack_from("<Q", header, 0x20)
    entry_size, count = struct.unpack_from("<HH", header, 0x36)
    if entry_size < 56 or count > 256:
        return False
    elf.seek(table)
    headers = elf.read(entry_size * count)
    for i in range(count):
        try:
            kind, _flags, offset, _v, _p, size = struct.unpack_from(
                "<IIQQQQ", headers, i * entry_size
            )
        except struct.error:
            return False
        if kind != 4 or size > 1 << 20:  # PT_NOTE, and a sane size
            continue
        elf.seek(offset)
        notes = elf.read(size)
        at = 0
        while at + 12 <= len(notes):
            name_size, desc_size, note_type = struct.unpack_from("<III", notes, at)
            name = notes[at + 12 : at + 12 + name_size]
            if name == b"Xen\0" and note_type == _XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            at += 12 + (name_size + 3) // 4 * 4 + (desc_size + 3) // 4 * 4
    return False


def check_initrd(path: str) -> None:
    """``path`` is an initramfs: a cpio archive, plain or compressed as the kernel accepts."""
    head = _read_head(path, "initrd", 8)
    if not head:
        raise BadRequest(f"initrd {path} is empty")
    if not any(head.startswith(magic) for magic, _ in _INITRD_MAGICS):
        raise BadRequest(
            f"initrd {path} is not an initramfs: neither a cpio archive nor one compressed "
            "with gzip, zstd, xz, lz4, bzip2, lzma or lzo"
        )


def _le(data: bytes, start: int, length: int) -> int:
    return int.from_bytes(data[start : start + length], "little")


def _ext_bytes(head: bytes) -> int:
    """The size an ext2/3/4 superblock gives its filesystem (0: it does not say)."""
    superblock = head[1024:2048]
    log_block_size = _le(superblock, 24, 4)
    if log_block_size > 6:  # blocks are 1 KiB to 64 KiB
        return 0
    blocks = _le(superblock, 4, 4)
    if _le(superblock, 0x60, 4) & 0x80:  # INCOMPAT_64BIT: the count's high half
        blocks |= _le(superblock, 0x150, 4) << 32
    return blocks * (1024 << log_block_size)


def _mbr_bytes(head: bytes) -> int:
    """Where the last partition of an MBR ends (0: none, or not a partition table)."""
    entries = [head[446 + 16 * i : 462 + 16 * i] for i in range(4)]
    if any(entry[0] not in (0x00, 0x80) for entry in entries):
        return 0  # boot code that happens to end in 0x55AA, not a partition table
    ends = [
        (_le(entry, 8, 4) + _le(entry, 12, 4)) * 512
        for entry in entries
        if entry[4] not in (0x00, 0xEE)  # unused, GPT's protective entry
    ]
    return max(ends, default=0)


def _gpt_bytes(head: bytes) -> int:
    """Where a GPT disk ends: after its backup header (0: the header does not say)."""
    backup_lba = _le(head, 512 + 32, 8)
    return (backup_lba + 1) * 512 if backup_lba else 0


# How many bytes a raw image must have for what it holds, where that can be read from its head.
_RAW_EXTENTS = {
    "a GPT partition table": _gpt_bytes,
    "an MBR partition table": _mbr_bytes,
    "an ext2/3/4 filesystem": _ext_bytes,
}


def check_raw_image(path: str) -> str:
    """What a raw image holds (a partition table or a filesystem), or BadRequest.

    ``qemu-img`` calls any file a raw image; a file holding none of these is
    not a disk a guest could boot, and is refused as the wrong file.  So is a
    kernel (it has a boot sector's 0x55AA too), and an image shorter than
    its partition table or filesystem says it is (a copy or download that
    stopped early).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(0x10048)
    except OSError as e:
        raise BadRequest(f"image {path} cannot be read: {e.strerror}") from None
    if _is_kernel(head):
        raise BadRequest(
            f"image {path} is a Linux kernel, not a disk image (boot it as {KERNEL_KEY})"
        )
    for offset, magic, what in _RAW_SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            if size % 512:
                raise BadRequest(
                    f"image {path} holds {what} but its size ({size} bytes) is not a "
                    "multiple of 512: a truncated disk image"
                )
            extent = _RAW_EXTENTS.get(what)
            needed = extent(head) if extent is not None else 0
            if needed > size:
                raise BadRequest(
                    f"image {path} holds {what} of {needed} bytes but the file has only "
                    f"{size}: a truncated disk image"
                )
            return what
    raise BadRequest(
        f"image {path} is not a disk image: qemu-img reads it as raw, but it holds no "
        "partition table or filesystem (expected a qcow2 image, or a raw disk or filesystem "
        "image)"
    )


@attrs.frozen
class ImageInfo:
    """A disk image as ``qemu-img info --backing-chain`` describes it."""

    path: str
    format: str
    virtual_size: int
    # The backing chain below the image, nearest first (empty: a standalone image).
    backing: tuple[str, ...] = ()
    # The format of each backing file, in the same order.
    backing_formats: tuple[str, ...] = ()
    # For a raw image (or a raw bottom of its chain): what it holds.
    content: str = ""

    def describe(self) -> str:
        """One line for people."""
        size = f"{self.virtual_size / (1 << 30):.1f} GiB"
        chain = f", backed by {' <- '.join(self.backing)}" if self.backing else ""
        content = f", {self.content}" if self.content else ""
        return f"{self.format} image {self.path} ({size}{content}{chain})"


def parse_image_info(path: str, output: bytes) -> ImageInfo:
    """``qemu-img info --output=json --backing-chain`` output → ImageInfo, or BadRequest."""
    try:
        chain = json.loads(output)
    except ValueError:
        raise HypervisorError(
            f"qemu-img info {path} answered something that is not JSON: {output[:200]!r}"
        ) from None
    if isinstance(chain, dict):
        chain = [chain]
    if not isinstance(chain, list) or not chain or not all(isinstance(i, dict) for i in chain):
        raise HypervisorError(f"qemu-img info {path} answered an unexpected shape: {chain!r}")
    top = chain[0]
    image_format = str(top.get("format", ""))
    if image_format not in IMAGE_FORMATS:
        raise BadRequest(
            f"image {path} is {_a_format(image_format)}; vmready boots qcow2 and "
            "raw images (convert it: qemu-img convert -O qcow2 …)"
        )
    backing: list[str] = []
    formats: list[str] = []
    for layer, below in itertools.pairwise(chain):
        # The file qemu-img opened: a backing name recorded relative to its image is
        # resolved against the image's directory, not the daemon's working directory.
        name = str(
            below.get("filename")
            or layer.get("full-backing-filename")
            or layer.get("backing-filename")
            or "?"
        )
        below_format = str(below.get("format", ""))
        if below_format not in IMAGE_FORMATS:
            raise BadRequest(
                f"image {path} is backed by {name}, {_a_format(below_format)}; "
                "only qcow2 and raw backing files are followed"
            )
        backing.append(name)
        formats.append(below_format)
    if chain[-1].get("backing-filename"):
        missing = chain[-1].get("full-backing-filename") or chain[-1]["backing-filename"]
        raise BadRequest(f"image {path}: its backing chain points to {missing}, which is missing")
    size = top.get("virtual-size")
    if not isinstance(size, int) or size <= 0:
        raise BadRequest(f"image {path} has no usable size ({size!r})")
    return ImageInfo(path, image_format, size, tuple(backing), tuple(formats))


def _a_format(image_format: str) -> str:
    """``a vmdk image``, or ``an image of unknown format`` when qemu-img named none."""
    return f"a {image_format} image" if image_format else "an image of unknown format"


def check_files(boot: BootSource, forbidden_dir: str | None = None) -> None:
    """What a boot source needs checked without ``qemu-img``: shape, kernel, initrd, image file.

    ``forbidden_dir`` holds the daemon's own overlays: booting another
    instance's disk as an image would share it behind its back.
    """
    boot.check_shape()
    if boot.kernel is not None:
        check_kernel(boot.kernel)
    if boot.initrd is not None:
        check_initrd(boot.initrd)
    if boot.image is None:
        return
    _read_head(boot.image, "image", 1)
    if forbidden_dir is not None:
        inside = os.path.join(os.path.realpath(forbidden_dir), "")
        if os.path.realpath(boot.image).startswith(inside):
            raise BadRequest(
                f"image {boot.image} is an instance's disk overlay; boot its image instead"
            )


def _local_backing(image: str, layer: dict[str, Any]) -> str | None:
    """The local file ``layer`` (the image file ``image``) is backed by, or None.

    Only plain local files are followed: a backing name with a protocol
    (``nbd:``, ``http:``, ``json:``…) is refused before anything opens it.
    """
    name = layer.get("backing-filename")
    if not name:
        return None
    name = str(name)
    if _PROTOCOL.match(name) and not name.startswith("/"):
        raise BadRequest(
            f"image {image} is backed by {name!r}, which is not a local file; "
            "vmready follows only local backing files"
        )
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(image)), name))


def _with_content(info: ImageInfo) -> ImageInfo:
    """``info`` with what its raw layers hold; BadRequest for a raw layer that holds nothing.

    Every backing layer must be a regular file, as the image itself must: a
    chain may not lead the guest to a host block device, a device node or a
    network export.
    """
    for backing in info.backing:
        try:
            mode = os.stat(backing).st_mode
        except OSError as e:
            raise BadRequest(
                f"image {info.path} is backed by {backing}, which cannot be examined: {e.strerror}"
            ) from None
        if not stat.S_ISREG(mode):
            raise BadRequest(
                f"image {info.path} is backed by {backing}, which is not a regular file"
            )
    layers = [(info.path, info.format), *zip(info.backing, info.backing_formats, strict=True)]
    contents = [check_raw_image(layer) for layer, kind in layers if kind == "raw"]
    return attrs.evolve(info, content=contents[0]) if contents else info


def _check_backing(image: str, backing: str) -> None:
    """``image``'s backing file is a regular file this daemon can read, or BadRequest."""
    try:
        mode = os.stat(backing).st_mode
    except FileNotFoundError:
        raise BadRequest(f"image {image} is backed by {backing}, which does not exist") from None
    except OSError as e:
        raise BadRequest(
            f"image {image} is backed by {backing}, which cannot be examined: {e.strerror}"
        ) from None
    if not stat.S_ISREG(mode):
        raise BadRequest(f"image {image} is backed by {backing}, which is not a regular file")
    if not os.access(backing, os.R_OK):
        raise BadRequest(f"image {image} is backed by {backing}, which cannot be read")


def _json_object(path: str, output: bytes) -> dict[str, Any]:
    """qemu-img's JSON answer about one file."""
    try:
        value = json.loads(output)
    except ValueError:
        raise HypervisorError(
            f"qemu-img info {path} answered something that is not JSON: {output[:200]!r}"
        ) from None
    if not isinstance(value, dict):
        raise HypervisorError(f"qemu-img info {path} answered an unexpected shape: {value!r}")
    return value


def _failure_text(err: bytes, out: bytes) -> str:
    """qemu-img's complaint as one message (its ``qemu-img: `` prefix dropped)."""
    text = (err or out).decode("utf-8", "replace").strip()[-_OUTPUT_TAIL:]
    lines = [line.removeprefix("qemu-img: ") for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or "no reason given"


class ImageTool:
    """Runs ``qemu-img`` for the daemon, through the reactor (it never blocks)."""

    def __init__(self, reactor: Any, program: str = QEMU_IMG) -> None:
        self.reactor = reactor
        self.program = program

    async def _run(self, args: Sequence[str]) -> tuple[bytes, bytes, int]:
        executable = _which(self.program)
        if executable is None:
            raise HypervisorError(
                f"{self.program} is not installed; it makes and checks disk overlays "
                "(Debian: apt-get install qemu-utils)"
            )

        def killed(failure: Failure) -> Failure:
            # Killed by a signal, the child's (out, err, signal) arrives as a failure's
            # value: not an exception, so it cannot be raised into a coroutine as it is.
            if isinstance(failure.value, tuple):
                out, err, number = failure.value
                raise HypervisorError(
                    f"{self.program} {args[0]} did not finish: killed by "
                    f"{_signal_name(number)}: {_failure_text(err, out)}"
                )
            return failure

        try:
            result: tuple[bytes, bytes, int] = await getProcessOutputAndValue(
                executable, list(args), env=dict(os.environ), reactor=self.reactor
            ).addErrback(killed)
        except HypervisorError:
            raise
        except Exception as e:
            raise HypervisorError(f"{self.program} {args[0]} could not run: {e}") from None
        return result

    async def info(self, path: str) -> ImageInfo:
        """Check that ``path`` is a bootable qcow2 or raw image whose chain can be followed.

        The chain is walked one file at a time (``qemu-img info`` without
        ``--backing-chain`` does not open a backing file), so each backing
        name is checked — a local regular file, no loop — before anything
        opens it.
        """
        layers: list[dict[str, Any]] = []
        current, seen = path, set()
        while True:
            if layers:
                _check_backing(str(layers[-1]["filename"]), current)
            else:
                _read_head(current, "image", 1)
            if os.path.realpath(current) in seen:
                raise BadRequest(f"image {path}: its backing chain loops back to {current}")
            seen.add(os.path.realpath(current))
            args = ["info", "-U", "--output=json"]
            expected = layers[-1].get("backing-filename-format") if layers else None
            if expected:
                args += ["-f", str(expected)]
            out, err, code = await self._run([*args, current])
            if code != 0:
                raise BadRequest(f"image {current} cannot be opened: {_failure_text(err, out)}")
            layer = _json_object(current, out)
            layer["filename"] = current
            data = (layer.get("format-specific") or {}).get("data") or {}
            if isinstance(data, dict) and data.get("data-file"):
                raise BadRequest(
                    f"image {current} keeps its data in an external file "
                    f"({data['data-file']}); vmready boots self-contained images"
                )
            layers.append(layer)
            below = _local_backing(current, layer)
            if below is None:
                break
            if len(layers) > MAX_CHAIN:
                raise BadRequest(f"image {path}: its backing chain is longer than {MAX_CHAIN}")
            current = below
        return _with_content(parse_image_info(path, json.dumps(layers).encode()))

    async def create_overlay(self, image: ImageInfo, overlay: str) -> None:
        """Make ``overlay``, a qcow2 backed by ``image`` (replacing one that exists), and check it.

        Written as ``<overlay>.tmp`` and renamed, so a crash never leaves a
        half-made overlay under the real name.
        """
        os.makedirs(os.path.dirname(overlay), mode=0o700, exist_ok=True)
        partial = overlay + ".tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        out, err, code = await self._run(
            ["create", "-q", "-f", "qcow2", "-F", image.format, "-b", image.path, partial]
        )
        try:
            if code != 0:
                raise HypervisorError(
                    f"qemu-img could not create the overlay {overlay} on {image.path}: "
                    f"{_failure_text(err, out)}"
                )
            out, err, code = await self._run(["info", "-U", "--output=json", partial])
            if code != 0:
                raise HypervisorError(
                    f"the new overlay {overlay} cannot be opened: {_failure_text(err, out)}"
                )
            made = json.loads(out)
            if made.get("format") != "qcow2" or made.get("backing-filename") != image.path:
                raise HypervisorError(
                    f"the new overlay {overlay} is not a qcow2 backed by {image.path}: {made!r}"
                )
            os.chmod(partial, 0o600)
            os.replace(partial, overlay)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _which(program: str) -> str | None:
    if os.sep in program:
        return program if os.access(program, os.X_OK) else None
    import shutil

    return shutil.which(program)
