"""The files a boot source names, checked by their first bytes: kernels, initrds, raw disk images.

Nothing here runs a program: a kernel is a bzImage (or an ELF ``vmlinux``
with a PVH entry), an initrd a cpio archive (compressed or not), and a raw
image holds a partition table or a filesystem QEMU's guest can use.
``check_files`` is everything that can be checked of a ``BootSource``
without ``qemu-img``.
"""

from __future__ import annotations

import os
import stat
import struct
from typing import BinaryIO

from vmready.domain import KERNEL_KEY, BadRequest
from vmready.hypervisor.bootsource import BootSource

_XEN_ELFNOTE_PHYS32_ENTRY = 18

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


def read_head(path: str, what: str, size: int) -> bytes:
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
    head = read_head(path, "kernel", 0x206)
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
    head = read_head(path, "initrd", 8)
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
    read_head(boot.image, "image", 1)
    if forbidden_dir is not None:
        inside = os.path.join(os.path.realpath(forbidden_dir), "")
        if os.path.realpath(boot.image).startswith(inside):
            raise BadRequest(
                f"image {boot.image} is an instance's disk overlay; boot its image instead"
            )
