"""The qcow2 image header, read as QEMU 7.2's qcow2_do_open reads it (bytes in, no I/O).

Only the header fields QEMU checks before it touches the image's tables are
read: magic, version, cluster size, header length, backing file name and the
backing-format extension.  Every message was measured on QEMU 7.2 with images
made by ``qemu-img create`` and patched (version, cluster bits, header length,
backing offset and name size, encryption method) or truncated.
"""

from __future__ import annotations

import struct

import attrs

QCOW2_MAGIC = b"QFI\xfb"
# QEMU reads sizeof(QCowHeader) bytes; past the end of a short file they read as zeros.
HEADER_READ_SIZE = 112
_MIN_CLUSTER_BITS = 9
_MAX_CLUSTER_BITS = 21
_V3_MIN_HEADER_LENGTH = 104
_V2_HEADER_LENGTH = 72
_MAX_BACKING_NAME = 1023
_EXT_END = 0
_EXT_BACKING_FORMAT = 0xE2792ACA
_CRYPT_LUKS = 2


class ImageError(Exception):
    """QEMU refuses the image; ``str(e)`` is its message."""


@attrs.frozen
class Qcow2Header:
    """What fakeqemu needs from a qcow2 header: version and backing file."""

    version: int
    cluster_bits: int
    virtual_size: int
    backing_file: str | None
    backing_format: str | None


def _read(data: bytes, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``, zero-filled past the end as QEMU's block layer reads."""
    chunk = data[offset : offset + size]
    return chunk + b"\0" * (size - len(chunk))


def parse_qcow2_header(data: bytes) -> Qcow2Header:
    """Check a qcow2 image's first cluster as QEMU does; ``data`` may be the whole image.

    Give at least the first cluster (up to 2 MiB) for an image with a backing file.
    """
    head = _read(data, 0, HEADER_READ_SIZE)
    (
        magic,
        version,
        backing_offset,
        backing_size,
        cluster_bits,
        virtual_size,
        crypt_method,
    ) = struct.unpack_from(">4sIQIIQI", head)
    if magic != QCOW2_MAGIC:
        raise ImageError("Image is not in qcow2 format")
    if version < 2 or version > 3:
        raise ImageError(f"Unsupported qcow2 version {version}")
    if not _MIN_CLUSTER_BITS <= cluster_bits <= _MAX_CLUSTER_BITS:
        raise ImageError(f"Unsupported cluster size: 2^{_signed(cluster_bits)}")
    cluster_size = 1 << cluster_bits
    if version == 2:
        header_length = _V2_HEADER_LENGTH
    else:
        (header_length,) = struct.unpack_from(">I", head, 100)
        if header_length < _V3_MIN_HEADER_LENGTH:
            raise ImageError("qcow2 header too short")
    if header_length > cluster_size:
        raise ImageError("qcow2 header exceeds cluster size")
    if backing_offset > cluster_size:
        raise ImageError("Invalid backing file offset")
    extensions_end = backing_offset if backing_offset else cluster_size
    backing_format = _backing_format(data, header_length, extensions_end)
    if crypt_method > _CRYPT_LUKS:
        raise ImageError(f"Unsupported encryption method {crypt_method}")
    if crypt_method:
        raise ImageError("fakeqemu does not open encrypted qcow2 images")
    backing_file: str | None = None
    if backing_offset:
        if backing_size > min(_MAX_BACKING_NAME, cluster_size - backing_offset):
            raise ImageError("Backing file name too long")
        raw = _read(data, backing_offset, backing_size)
        backing_file = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    return Qcow2Header(version, cluster_bits, virtual_size, backing_file, backing_format)


def _signed(value: int) -> int:
    """QEMU prints cluster_bits with PRIi32."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _backing_format(data: bytes, start: int, end: int) -> str | None:
    """The backing-format header extension's value, if the image has one."""
    offset = start
    while offset + 8 <= end:
        ext_type, length = struct.unpack_from(">II", _read(data, offset, 8))
        offset += 8
        if ext_type == _EXT_END or offset + length > end:
            return None
        if ext_type == _EXT_BACKING_FORMAT:
            return _read(data, offset, length).split(b"\0", 1)[0].decode("ascii", "replace")
        offset += (length + 7) & ~7
    return None
