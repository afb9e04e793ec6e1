"""QEMU's ``ringbuf`` chardev: a fixed-size byte ring that drains on read."""

from __future__ import annotations

import re

DEFAULT_RINGBUF_SIZE = 65536

# qbase64_decode's accepted characters; GLib then skips the newlines.
_BASE64_ALPHABET = re.compile(rb"[A-Za-z0-9+/=\n]*")
_BASE64_RANK = {
    char: rank
    for rank, char in enumerate(
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    )
}
_PAD = ord("=")
_BASE64_RANK[_PAD] = 0
_REPLACEMENT = "\ufffd"
# The smallest code point each sequence length may encode (shorter is overlong).
_MIN_CODEPOINT = {2: 0x80, 3: 0x800, 4: 0x10000, 5: 0x200000, 6: 0x4000000}


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
    """Decode base64 as QEMU 7.2 does (``qbase64_decode``, then GLib's decoder).

    Only the base64 alphabet, ``=`` and newlines are accepted; newlines are
    skipped, ``=`` counts as a zero digit wherever it stands and suppresses the
    output byte it pads, and a trailing partial group is dropped.
    """
    raw = text.encode("ascii", "replace")
    if not _BASE64_ALPHABET.fullmatch(raw):
        raise Base64Error("Base64 data contains invalid characters")
    out = bytearray()
    value = digits = 0
    last = previous = 0
    for char in raw:
        rank = _BASE64_RANK.get(char)
        if rank is None:  # a newline
            continue
        previous, last = last, char
        value = ((value << 6) | rank) & 0xFFFFFF
        digits += 1
        if digits == 4:
            out.append(value >> 16)
            if previous != _PAD:
                out.append((value >> 8) & 0xFF)
            if last != _PAD:
                out.append(value & 0xFF)
            digits = 0
    return bytes(out)


def _is_valid_codepoint(codepoint: int) -> bool:
    if codepoint > 0x10FFFF or 0xD800 <= codepoint <= 0xDFFF:
        return False
    return not (0xFDD0 <= codepoint <= 0xFDEF or codepoint & 0xFFFE == 0xFFFE)


def decode_modified_utf8(data: bytes) -> str:
    """Read bytes as QEMU reads a C string into JSON: stop at NUL, U+FFFD per bad sequence.

    This is QEMU's ``mod_utf8_codepoint``: ``\\xC0\\x80`` stands for U+0000, and an
    overlong, surrogate, noncharacter or out-of-range sequence becomes one U+FFFD.
    """
    nul = data.find(b"\0")
    if nul >= 0:
        data = data[:nul]
    chars: list[str] = []
    i = 0
    while i < len(data):
        byte = data[i]
        i += 1
        if byte < 0x80:
            chars.append(chr(byte))
            continue
        if byte >= 0xFE or not byte & 0x40:
            chars.append(_REPLACEMENT)
            continue
        length = 0
        mask = 0x80
        while byte & mask:
            length += 1
            mask >>= 1
        codepoint = byte & (mask - 1)
        for _ in range(1, length):
            following = data[i] if i < len(data) else 0
            if following & 0xC0 != 0x80:
                codepoint = -1
                break
            i += 1
            codepoint = (codepoint << 6) | (following & 0x3F)
        # Overlong forms are refused, except \xC0\x80 for U+0000 (modified UTF-8).
        overlong = codepoint < _MIN_CODEPOINT[length] and (codepoint, length) != (0, 2)
        if codepoint >= 0 and (overlong or not _is_valid_codepoint(codepoint)):
            codepoint = -1
        chars.append(_REPLACEMENT if codepoint < 0 else chr(codepoint))
    return "".join(chars)


def encode_qmp_utf8(data: bytes) -> str:
    """Render drained bytes as QEMU's ``utf8`` read does: a C string, bad sequences replaced."""
    return decode_modified_utf8(data)
