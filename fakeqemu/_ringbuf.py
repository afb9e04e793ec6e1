"""QEMU's ``ringbuf`` chardev: a fixed-size byte ring that drains on read."""

from __future__ import annotations

import base64
import binascii
import re

DEFAULT_RINGBUF_SIZE = 65536

_BASE64_ALPHABET = re.compile(rb"[A-Za-z0-9+/=]*")


class Base64Error(ValueError):
    """Raised for base64 text QEMU's decoder refuses."""


class RingBuffer:
    """A byte ring with QEMU's semantics: oldest bytes overwritten on overflow."""

    def __init__(self, size: int = DEFAULT_RINGBUF_SIZE) -> None:
        if size < 0 or size & (size - 1):
            raise ValueError("size of ringbuf chardev must be power of two")
        self.size = size
        self._data = bytearray()

    def write(self, data: bytes) -> None:
        """Append ``data``; past capacity the oldest bytes are lost, as in QEMU."""
        if self.size == 0:
            return
        self._data += data
        overflow = len(self._data) - self.size
        if overflow > 0:
            del self._data[:overflow]

    def read(self, size: int) -> bytes:
        """Remove and return up to ``size`` of the oldest bytes."""
        chunk = bytes(self._data[:size])
        del self._data[:size]
        return chunk

    def peek(self) -> bytes:
        """Everything buffered, without draining it (for state files and tests)."""
        return bytes(self._data)

    def __len__(self) -> int:
        return len(self._data)


def decode_qmp_base64(text: str) -> bytes:
    """Decode base64 as QEMU 7.2 does: strict alphabet, newlines skipped, partial groups dropped."""
    raw = text.encode("ascii", "replace").replace(b"\n", b"")
    if not _BASE64_ALPHABET.fullmatch(raw):
        raise Base64Error("Base64 data contains invalid characters")
    complete = raw[: len(raw) - len(raw) % 4]
    try:
        return base64.b64decode(complete)
    except binascii.Error as e:
        raise Base64Error("Base64 data contains invalid characters") from e


def encode_qmp_utf8(data: bytes) -> str:
    """Render drained bytes the way QEMU's ``utf8`` read does: a C string, invalid bytes replaced."""
    nul = data.find(b"\0")
    if nul >= 0:
        data = data[:nul]
    return data.decode("utf-8", "replace")
