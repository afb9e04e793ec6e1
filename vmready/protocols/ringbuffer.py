"""The agent's ring-buffer line protocol, without I/O.

The in-guest agent writes status lines (``STARTED``, ``CONNECTED``,
``STOPPED``) to a virtio serial port wired to a QEMU ring buffer; the host
drains the buffer with ``ringbuf-read`` and writes ``CONNECT <cid>:<port>``
(vsock) or ``CONNECT tcp:<ipv4>:<port>`` (the fallback transport) back with
``ringbuf-write``.  Because QEMU appends the host's writes to the
same buffer, the host reads its own ``CONNECT`` lines back, and because QEMU
overwrites the oldest bytes when the buffer is full, the first line of a full
read may be the tail of a longer line.

``RingBufferReader.feed`` takes each drained chunk (raw bytes: read with
``format: base64`` so no byte is lost to UTF-8 replacement) and returns what it
found, in order.  The agent status is the last complete status line.

The agent bundles this module (``vmready.hypervisor.agentbundle``): standard library only,
and Python 3.9 syntax.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Union

MAX_LINE_BYTES = 256
_CONNECT = re.compile(r"CONNECT (\d{1,10}):(\d{1,10})", re.ASCII)
_TCP_CONNECT = re.compile(r"CONNECT tcp:([0-9.]{1,15}):(\d{1,10})", re.ASCII)
_U32 = 2**32


class AgentStatus(enum.Enum):
    """What the agent last said about itself."""

    UNKNOWN = "unknown"
    STARTED = "started"
    CONNECTED = "connected"
    STOPPED = "stopped"


_STATUS_WORDS = {
    "STARTED": AgentStatus.STARTED,
    "CONNECTED": AgentStatus.CONNECTED,
    "STOPPED": AgentStatus.STOPPED,
}


@dataclass(frozen=True)
class StatusLine:
    """A complete status line from the agent."""

    status: AgentStatus


@dataclass(frozen=True)
class HostEcho:
    """The host's own ``CONNECT <cid>:<port>`` line, read back from the shared buffer."""

    cid: int
    port: int


@dataclass(frozen=True)
class TcpHostEcho:
    """The host's own ``CONNECT tcp:<ipv4>:<port>`` line, read back from the shared buffer."""

    host: str
    port: int


@dataclass(frozen=True)
class Noise:
    """A complete line that is neither a status nor the host's echo."""

    text: str


@dataclass(frozen=True)
class DiscardedFragment:
    """The head of a read that overflowed: the tail of a line whose start was lost."""

    data: bytes


@dataclass(frozen=True)
class OverlongLine:
    """A line longer than MAX_LINE_BYTES, dropped; ``length`` counts the bytes seen."""

    length: int


@dataclass(frozen=True)
class UndecodableLine:
    """A complete line that is not UTF-8."""

    data: bytes


Record = Union[
    StatusLine, HostEcho, TcpHostEcho, Noise, DiscardedFragment, OverlongLine, UndecodableLine
]


def format_connect(cid: int, port: int) -> bytes:
    """The line the host writes to tell the agent where to dial (vsock)."""
    if not (0 <= cid < _U32 and 0 <= port < _U32):
        raise ValueError(f"vsock address out of range: {cid}:{port}")
    return f"CONNECT {cid}:{port}\n".encode("ascii")


def format_tcp_connect(host: str, port: int) -> bytes:
    """The line that tells an agent on the fallback transport to dial TCP ``host:port``."""
    _check_ipv4(host)
    if not 0 < port < 65536:
        raise ValueError(f"TCP port out of range: {port}")
    return f"CONNECT tcp:{host}:{port}\n".encode("ascii")


def parse_connect(line: str) -> tuple[int, int]:
    """``CONNECT <cid>:<port>`` → (cid, port); ValueError for anything else."""
    match = _CONNECT.fullmatch(line.strip())
    if match is None:
        raise ValueError(f"not a CONNECT line: {line[:80]!r}")
    cid, port = int(match.group(1)), int(match.group(2))
    if cid >= _U32 or port >= _U32:
        raise ValueError(f"vsock address out of range: {line[:80]!r}")
    return cid, port


def parse_tcp_connect(line: str) -> tuple[str, int]:
    """``CONNECT tcp:<ipv4>:<port>`` → (host, port); ValueError saying what is wrong."""
    text = line.strip()
    match = _TCP_CONNECT.fullmatch(text)
    if match is None:
        raise ValueError(f"not a 'CONNECT tcp:<ipv4>:<port>' line: {text[:80]!r}")
    host, port = match.group(1), int(match.group(2))
    _check_ipv4(host)
    if not 0 < port < 65536:
        raise ValueError(f"TCP port {port} is out of range (1-65535)")
    return host, port


def _check_ipv4(host: str) -> None:
    """ValueError unless ``host`` is a dotted-quad IPv4 address in its canonical form."""
    try:
        canonical = str(ipaddress.IPv4Address(host))
    except ValueError:
        canonical = ""
    if canonical != host:  # also refuses leading zeros, which old Pythons read as octal
        raise ValueError(f"{host[:40]!r} is not an IPv4 address")


def parse_connect_line(line: str) -> HostEcho | TcpHostEcho:
    """Either form of ``CONNECT``, as a record; ValueError saying precisely what is wrong."""
    text = line.strip()
    if text.startswith("CONNECT tcp:"):
        host, port = parse_tcp_connect(text)
        return TcpHostEcho(host, port)
    match = _CONNECT.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text[:80]!r} is neither 'CONNECT <cid>:<port>' nor 'CONNECT tcp:<ipv4>:<port>'"
        )
    cid, port = int(match.group(1)), int(match.group(2))
    if cid >= _U32:
        raise ValueError(f"vsock cid {cid} is out of range (0-{_U32 - 1})")
    if port >= _U32:
        raise ValueError(f"vsock port {port} is out of range (0-{_U32 - 1})")
    return HostEcho(cid, port)


def connect_line_problem(line: str) -> str:
    """Why a line that starts with ``CONNECT`` is not a valid one ("" if it is valid)."""
    try:
        parse_connect_line(line)
    except ValueError as e:
        return str(e)
    return ""


class RingBufferReader:
    """Turns drained ring-buffer chunks into records; remembers the agent status."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self.status = AgentStatus.UNKNOWN
        self._partial = bytearray()
        self._discarding = 0  # bytes of an over-long line seen so far, while > 0

    def feed(self, chunk: bytes, *, buffer_size: int | None = None) -> list[Record]:
        """Consume one drained chunk.

        Pass ``buffer_size`` (the ring's capacity): a chunk that fills the ring
        may have overflowed, so the bytes before its first newline cannot be
        trusted to continue what came before, and are discarded.
        """
        records: list[Record] = []
        if buffer_size is not None and buffer_size > 0 and len(chunk) >= buffer_size:
            newline = chunk.find(b"\n")
            head = chunk if newline < 0 else chunk[: newline + 1]
            chunk = b"" if newline < 0 else chunk[newline + 1 :]
            records.append(DiscardedFragment(bytes(self._partial) + head))
            self._partial.clear()
            self._discarding = 0
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            piece = chunk[start:] if newline < 0 else chunk[start:newline]
            start = len(chunk) if newline < 0 else newline + 1
            if self._discarding:
                self._discarding += len(piece)
                if newline >= 0:
                    records.append(OverlongLine(self._discarding))
                    self._discarding = 0
                continue
            if len(self._partial) + len(piece) > self.max_line:
                self._discarding = len(self._partial) + len(piece)
                self._partial.clear()
                if newline >= 0:
                    records.append(OverlongLine(self._discarding))
                    self._discarding = 0
                continue
            self._partial += piece
            if newline >= 0:
                line, self._partial = bytes(self._partial), bytearray()
                records.append(self._classify(line))
        return records

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete line awaiting its newline."""
        return bytes(self._partial)

    def _classify(self, raw: bytes) -> Record:
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            return UndecodableLine(raw)
        status = _STATUS_WORDS.get(text)
        if status is not None:
            self.status = status
            return StatusLine(status)
        if text.startswith("CONNECT "):
            try:
                return parse_connect_line(text)
            except ValueError:
                return Noise(text)
        return Noise(text)
