"""Direct kernel boot (``-kernel``, ``-initrd``, ``-append``) as QEMU 7.2's x86 loader checks it.

QEMU refuses ``-append``/``-initrd`` without ``-kernel`` right after its option
loop, and loads the kernel (and initrd) while it builds the board, after the
CPUs.  The loader reports with plain ``fprintf``: its lines start with
``qemu:`` instead of the program name.  fakeqemu runs no guest code; it reads
the kernel's setup header to refuse what QEMU refuses.  Every message here was
measured on QEMU 7.2 (Debian's ``vmlinuz-6.1.0-56-amd64``, a text file, an
empty file, a directory, and crafted headers).
"""

from __future__ import annotations

import os
import re
import stat
import struct

import attrs

from fakeqemu._qemuopts import CommandLineError, unprefixed

_HEADER_SIZE = 8192
_HDRS = b"HdrS"
_MULTIBOOT_MAGIC = 0x1BADB002
_ELF_MAGIC = b"\x7fELF"
_XLF_CAN_BE_LOADED_ABOVE_4G = 1 << 1
# pcmc->acpi_data_size of the 7.2 machine types: room kept for the ACPI tables.
_ACPI_DATA_SIZE = 0x20000 + 0x8000


@attrs.frozen
class KernelSpec:
    """``-kernel P [-initrd P] [-append T]``."""

    kernel: str
    initrd: str | None
    cmdline: str

    def panic_timeout(self) -> int:
        """The kernel's ``panic=N`` (0, the default, hangs; N > 0 reboots after N seconds)."""
        found = re.findall(r"(?:^|\s)panic=(-?\d+)(?=\s|$)", self.cmdline)
        return int(found[-1]) if found else 0


def check_kernel_options(kernel: str | None, initrd: str | None, append: str | None) -> None:
    """QEMU's check right after its option loop (measured: to stderr, before ``-D`` opens)."""
    if kernel is None:
        if append is not None:
            raise CommandLineError("-append only allowed with -kernel option")
        if initrd is not None:
            raise CommandLineError("-initrd only allowed with -kernel option")


def load_linux(spec: KernelSpec, machine_type: str, memory_bytes: int, cwd: str) -> None:
    """Check the kernel and initrd as x86_load_linux does; raise with QEMU's ``qemu:`` line."""
    path = os.path.join(cwd, spec.kernel)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CommandLineError(
            unprefixed(f"qemu: could not open kernel file '{spec.kernel}': {e.strerror}")
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise CommandLineError(
                unprefixed(f"qemu: could not load kernel '{spec.kernel}': Is a directory")
            )
        header = os.pread(fd, _HEADER_SIZE, 0)
        kernel_size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if not kernel_size:
        # QEMU prints whatever errno was left over; measured: ENOENT.
        raise CommandLineError(
            unprefixed(f"qemu: could not load kernel '{spec.kernel}': No such file or directory")
        )
    padded = header + b"\0" * (_HEADER_SIZE - len(header))
    if padded[0x202:0x206] == _HDRS:
        (protocol,) = struct.unpack_from("<H", padded, 0x206)
    else:
        if _is_multiboot(padded):
            raise CommandLineError("fakeqemu does not emulate multiboot kernels")
        if padded.startswith(_ELF_MAGIC):
            raise CommandLineError("fakeqemu does not emulate ELF (PVH) kernels")
        protocol = 0
    if spec.initrd is not None:
        _check_initrd(spec.initrd, padded, protocol, machine_type, memory_bytes, cwd)
    setup_sects = padded[0x1F1] or 4
    if (setup_sects + 1) * 512 > kernel_size:
        raise CommandLineError(unprefixed("qemu: invalid kernel header"))


def _is_multiboot(header: bytes) -> bool:
    """A multiboot header (magic, flags, checksum summing to 0) in the first 8 KiB."""
    for offset in range(0, _HEADER_SIZE - 11, 4):
        magic, flags, checksum = struct.unpack_from("<III", header, offset)
        if magic == _MULTIBOOT_MAGIC and (magic + flags + checksum) & 0xFFFFFFFF == 0:
            return True
    return False


def _check_initrd(
    initrd: str, header: bytes, protocol: int, machine_type: str, memory_bytes: int, cwd: str
) -> None:
    if protocol < 0x200:
        raise CommandLineError(unprefixed("qemu: linux kernel too old to load a ram disk"))
    path = os.path.join(cwd, initrd)
    # QEMU maps the initrd with GLib's g_mapped_file_new; these are GLib's words.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CommandLineError(
            unprefixed(
                f"qemu: error reading initrd {initrd}: "
                f"Failed to open file \u201c{initrd}\u201d: open() failed: {e.strerror}"
            )
        ) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CommandLineError(
            unprefixed(
                f"qemu: error reading initrd {initrd}: "
                f"Failed to map {initrd}' {initrd}': mmap() failed: No such device"
            )
        )
    initrd_max = _initrd_max(header, protocol, machine_type, memory_bytes)
    if st.st_size >= initrd_max:
        raise CommandLineError(
            unprefixed(
                f"qemu: initrd is too large, cannot support.(max: {initrd_max}, need {st.st_size})"
            )
        )


def _initrd_max(header: bytes, protocol: int, machine_type: str, memory_bytes: int) -> int:
    """The highest address an initrd may reach, as x86_load_linux computes it."""
    (xloadflags,) = struct.unpack_from("<H", header, 0x236)
    if protocol >= 0x20C and xloadflags & _XLF_CAN_BE_LOADED_ABOVE_4G:
        initrd_max = 0xFFFFFFFF
    elif protocol >= 0x203:
        (initrd_max,) = struct.unpack_from("<I", header, 0x22C)
    else:
        initrd_max = 0x37FFFFFF
    below_4g = min(memory_bytes, _lowmem(machine_type, memory_bytes))
    if initrd_max >= below_4g - _ACPI_DATA_SIZE:
        initrd_max = below_4g - _ACPI_DATA_SIZE - 1
    return initrd_max


def _lowmem(machine_type: str, memory_bytes: int) -> int:
    """Where the 7.2 PC machines end RAM below 4 GiB."""
    if machine_type == "pc-q35-7.2":
        return 0x80000000 if memory_bytes >= 0xB0000000 else 0xB0000000
    return 0xC0000000 if memory_bytes >= 0xE0000000 else 0xE0000000
