"""The demo guest's initramfs: busybox and ``/init`` in a newc cpio archive."""

from __future__ import annotations

import stat
from collections.abc import Iterable

import attrs

from vmready.hypervisor.guestimage.content import BUSYBOX_APPLETS, INIT_SCRIPT


@attrs.frozen
class ArchiveEntry:
    """One member of a newc cpio archive."""

    path: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def newc_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A ``newc`` (SVR4, no CRC) cpio archive, as the kernel unpacks an initramfs."""
    out = bytearray()

    def member(inode: int, entry: ArchiveEntry) -> None:
        name = entry.path.encode() + b"\0"
        nlink = 2 if stat.S_ISDIR(entry.mode) else 1
        fields = (inode, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev)
        out.extend(b"070701" + b"".join(b"%08X" % v for v in fields))
        out.extend(b"%08X%08X" % (len(name), 0))
        out.extend(name)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(entry.data)
        out.extend(b"\0" * (-len(out) % 4))

    inode = 0
    for inode, entry in enumerate(entries, start=1):
        member(inode, entry)
    member(inode + 1, ArchiveEntry("TRAILER!!!", 0))
    out.extend(b"\0" * (-len(out) % 512))
    return bytes(out)


def initramfs_entries(busybox: bytes, init: str = INIT_SCRIPT) -> list[ArchiveEntry]:
    """The initramfs: busybox and its applets, and ``/init``."""
    directory, regular, link = stat.S_IFDIR | 0o755, stat.S_IFREG, stat.S_IFLNK | 0o777
    entries = [ArchiveEntry(name, directory) for name in ("bin", "dev", "newroot", "proc", "sys")]
    entries.append(ArchiveEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(ArchiveEntry("bin/busybox", regular | 0o755, busybox))
    entries.extend(ArchiveEntry(f"bin/{applet}", link, b"busybox") for applet in BUSYBOX_APPLETS)
    entries.append(ArchiveEntry("init", regular | 0o755, init.encode()))
    return entries
