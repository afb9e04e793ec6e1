"""The guest's kernel and initramfs: modules in load order, a newc cpio archive, the ELF kernel."""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence

import attrs

from vmready.hypervisor.bootfiles import has_pvh_entry
from vmready.hypervisor.guestimage.commands import GuestImageError
from vmready.hypervisor.guestimage.content import BUSYBOX_APPLETS, INIT_SCRIPT


def module_name(filename: str) -> str:
    """The kernel's name for a module file: ``pvpanic-mmio.ko`` -> ``pvpanic_mmio``."""
    base = os.path.basename(filename)
    for suffix in (".ko.xz", ".ko"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def modinfo(module: bytes, what: str = "module") -> dict[str, list[str]]:
    """The ``key=value`` strings of a module's ``.modinfo`` ELF section, by key."""
    if module[:4] != b"\x7fELF" or module[4:6] != b"\x02\x01":
        raise GuestImageError(f"reading {what} failed: not a 64-bit little-endian ELF module")
    try:
        (section_offset,) = struct.unpack_from("<Q", module, 0x28)
        entry_size, count, names_index = struct.unpack_from("<HHH", module, 0x3A)
        headers = [
            struct.unpack_from("<IIQQQQ", module, section_offset + i * entry_size)
            for i in range(count)
        ]
        names_offset, names_size = headers[names_index][4], headers[names_index][5]
        names = module[names_offset : names_offset + names_size]
        for name_offset, _type, _flags, _addr, offset, size in headers:
            name = names[name_offset : names.index(b"\0", name_offset)]
            if name == b".modinfo":
                info: dict[str, list[str]] = {}
                for entry in module[offset : offset + size].split(b"\0"):
                    key, sep, value = entry.decode("utf-8", "replace").partition("=")
                    if sep:
                        info.setdefault(key, []).append(value)
                return info
    except (struct.error, IndexError, ValueError) as e:
        raise GuestImageError(f"reading {what} failed: a malformed ELF file ({e})") from e
    raise GuestImageError(f"reading {what} failed: it has no .modinfo section")


def module_dependencies(module: bytes, what: str = "module") -> list[str]:
    """The modules a module's ``depends=`` names, by their module names."""
    depends = ",".join(modinfo(module, what).get("depends", []))
    return [module_name(name) for name in depends.split(",") if name]


def load_order(
    wanted: Sequence[str],
    dependencies: Callable[[str], Sequence[str]],
    available: Iterable[str],
    builtin: Iterable[str] = (),
) -> list[str]:
    """The modules to insmod, each after its dependencies, else in ``wanted``'s order.

    ``available`` are the kernel's loadable modules, ``builtin`` those compiled in
    (never loaded); ``dependencies(name)`` reads one module's ``depends=``.
    """
    loadable = set(available)
    compiled_in = set(builtin)
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str, needed_by: str | None) -> None:
        if name in order or name in compiled_in:
            return
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name) :], name])
            raise GuestImageError(
                f"ordering the kernel modules failed: a dependency cycle {cycle}"
            )
        if name not in loadable:
            by = f" (needed by {needed_by})" if needed_by else ""
            raise GuestImageError(
                f"ordering the kernel modules failed: the kernel has no module {name}{by}, "
                "neither loadable nor built in"
            )
        visiting.append(name)
        for dependency in dependencies(name):
            visit(dependency, name)
        visiting.pop()
        order.append(name)

    for name in wanted:
        visit(module_name(name), None)
    return order


def read_module(path: str) -> bytes:
    """A module file's ELF bytes (``.ko``, or ``.ko.xz`` decompressed)."""
    with open(path, "rb") as f:
        data = f.read()
    return lzma.decompress(data) if path.endswith(".xz") else data


def kernel_modules(modules_dir: str) -> tuple[dict[str, str], set[str]]:
    """A kernel's loadable modules (name -> file) and built-in ones, from ``lib/modules/<rel>``."""
    files: dict[str, str] = {}
    for directory, _dirs, names in os.walk(os.path.join(modules_dir, "kernel")):
        for name in names:
            if name.endswith((".ko", ".ko.xz")):
                files[module_name(name)] = os.path.join(directory, name)
    builtin: set[str] = set()
    listed = os.path.join(modules_dir, "modules.builtin")
    with contextlib.suppress(FileNotFoundError), open(listed, encoding="utf-8") as f:
        builtin = {module_name(line.strip()) for line in f if line.strip()}
    return files, builtin


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


def initramfs_entries(
    busybox: bytes, modules: Sequence[tuple[str, bytes]], init: str = INIT_SCRIPT
) -> list[ArchiveEntry]:
    """The initramfs: busybox and its applets, ``/init``, and ``modules`` in load order."""
    directory, regular, link = stat.S_IFDIR | 0o755, stat.S_IFREG, stat.S_IFLNK | 0o777
    entries = [
        ArchiveEntry(name, directory)
        for name in ("bin", "dev", "lib", "lib/modules", "newroot", "proc", "sys")
    ]
    entries.append(ArchiveEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(ArchiveEntry("bin/busybox", regular | 0o755, busybox))
    entries.extend(ArchiveEntry(f"bin/{applet}", link, b"busybox") for applet in BUSYBOX_APPLETS)
    entries.append(ArchiveEntry("init", regular | 0o755, init.encode()))
    order = "".join(f"{name}\n" for name, _ in modules).encode()
    entries.append(ArchiveEntry("lib/modules/load-order", regular | 0o644, order))
    entries.extend(
        ArchiveEntry(f"lib/modules/{name}.ko", regular | 0o644, data) for name, data in modules
    )
    return entries


def is_bzimage(kernel: bytes) -> bool:
    """Whether ``kernel`` starts like an x86 Linux bzImage (the ``HdrS`` boot header)."""
    return kernel[0x202:0x206] == b"HdrS"


def uncompressed_kernel(bzimage: bytes, what: str = "the kernel") -> bytes:
    """The ELF kernel a bzImage carries (its XZ or gzip payload), which must have a PVH entry."""
    step = f"uncompressing {what}"
    if not is_bzimage(bzimage) or struct.unpack_from("<H", bzimage, 0x206)[0] < 0x208:
        raise GuestImageError(f"{step} failed: not a bzImage of boot protocol 2.08 or newer")
    setup_sectors = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sectors + 1) * 512 + offset
    payload = bzimage[start : start + length]
    try:
        if payload.startswith(b"\xfd7zXZ\x00"):
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        elif payload.startswith(b"\x1f\x8b"):
            elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
        else:
            raise GuestImageError(
                f"{step} failed: its payload is compressed with a method other than XZ or gzip "
                f"(starts {payload[:4].hex()})"
            )
    except (lzma.LZMAError, zlib.error) as e:
        raise GuestImageError(f"{step} failed: its payload does not decompress ({e})") from e
    if not has_pvh_entry(io.BytesIO(elf)):
        raise GuestImageError(f"{step} failed: the kernel has no PVH entry point (CONFIG_PVH)")
    return elf
