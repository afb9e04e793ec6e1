"""Fuzz targets for the ring-buffer line protocol and CONNECT lines, on both sides.

The guest writes status lines to its ring buffer, the daemon drains it in
chunks (``AgentLink.ring_read``); the daemon writes CONNECT lines to the
guest's ``vmready.connect`` port, the agent reads them in whatever pieces the
port delivers (``AgentCore``).  Either peer can write anything.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st
from twisted.internet.testing import StringTransport

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.wire_mutations import mutated, noise, stream, with_chunks
from vmready.agent.connectport import ConnectPortReader
from vmready.agent.core import AbandonDial, AgentCore, Dial, Phase, TcpAddress, VsockAddress
from vmready.agent.ports import FoundPort, SerialPortMissing
from vmready.agentlink import connectport as daemon_connectport
from vmready.agentlink.link import AgentLink, StatusChanged, WriteConnect
from vmready.protocols.ringbuffer import (
    MAX_LINE_BYTES,
    AgentStatus,
    HostEcho,
    RingBufferReader,
    StatusLine,
    TcpHostEcho,
    format_connect,
    format_tcp_connect,
    parse_connect,
    parse_connect_line,
    parse_tcp_connect,
)

_STATUS_LINES = [b"STARTED\n", b"CONNECTED\n", b"STOPPED\n", b"STARTED\r\n"]
_STATUS_WORDS = (b"STARTED", b"CONNECTED", b"STOPPED")


def _connect_lines() -> st.SearchStrategy[bytes]:
    vsock = st.builds(
        format_connect,
        st.sampled_from([0, 2, 3, 2**32 - 1]) | st.integers(0, 2**32 - 1),
        st.sampled_from([0, 1024, 2**32 - 1]) | st.integers(0, 2**32 - 1),
    )
    tcp = st.builds(
        format_tcp_connect,
        st.sampled_from(["10.0.2.2", "127.0.0.1", "255.255.255.255", "0.0.0.0"]),
        st.integers(1, 65535),
    )
    return vsock | tcp


_VALID_LINE = st.sampled_from(_STATUS_LINES) | _connect_lines() | st.just(b"hello\n")
_LINE = mutated(_VALID_LINE)
RING_STREAM = stream(_LINE, 10) | noise()


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a stdlib logger for one input: garbage is logged, one line per line."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _complete_lines(data: bytes) -> list[bytes]:
    """The newline-terminated lines of ``data`` (without their newline)."""
    return data.split(b"\n")[:-1]


# -- the reader both sides share ----------------------------------------------


def _reader_inputs() -> st.SearchStrategy[tuple[bytes, list[bytes]]]:
    return with_chunks(RING_STREAM)


def check_reader(example: tuple[bytes, list[bytes]]) -> None:
    """Any split of a stream gives the records of the whole; no line buffered past the cap."""
    data, chunks = example
    whole = RingBufferReader()
    expected = whole.feed(data)
    pieces = RingBufferReader()
    got = []
    for chunk in chunks:
        got += pieces.feed(chunk)
        assert len(pieces.pending) <= MAX_LINE_BYTES, len(pieces.pending)
    assert got == expected, (got, expected)
    statuses = [r.status for r in expected if isinstance(r, StatusLine)]
    assert pieces.status is (statuses[-1] if statuses else AgentStatus.UNKNOWN)


# -- host side: what the daemon decodes from the ring -------------------------

_RING_SIZE = 64


def _ring_reads() -> st.SearchStrategy[list[bytes]]:
    # Some reads fill the ring exactly: the daemon then discards their head as overflowed.
    full = RING_STREAM.map(
        lambda data: (data * (1 + _RING_SIZE // max(1, len(data))))[:_RING_SIZE]
    )
    return st.lists(RING_STREAM | full, min_size=1, max_size=6)


def check_ring_host(reads: list[bytes]) -> None:
    """``AgentLink.ring_read``: status changes only on status lines; a CONNECT only for STARTED."""
    link = AgentLink("fuzz", ring_size=_RING_SIZE, port=1024)
    link.vm_started(advertise=False)
    now = 0.0
    for chunk in reads:
        before, buffered = link.status, link.reader.pending
        link.read_started()
        commands = link.ring_read(chunk, now)
        now += 1.0
        assert len(link.reader.pending) <= MAX_LINE_BYTES
        changes = [c for c in commands if isinstance(c, StatusChanged)]
        connects = [c for c in commands if isinstance(c, WriteConnect)]
        assert len(changes) + len(connects) == len(commands), commands
        assert len(connects) <= 1, commands  # one answer per read
        if connects:
            assert b"STARTED" in buffered + chunk, (chunk, commands)
        if link.status is not before:
            assert changes == [StatusChanged(before, link.status)], (before, link.status, changes)
            assert link.status.name.encode() in buffered + chunk, (chunk, link.status)
        else:
            assert not changes, changes


# -- guest side: what the agent parses ----------------------------------------


def _valid_connects(data: bytes) -> list[object]:
    """A reference reading: complete lines within the cap, UTF-8, valid CONNECTs."""
    addresses: list[object] = []
    for raw in _complete_lines(data):
        if len(raw) > MAX_LINE_BYTES:
            continue
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            continue
        if not text.startswith("CONNECT "):
            continue
        try:
            record = parse_connect_line(text)
        except ValueError:
            continue
        address: object = (
            VsockAddress(record.cid, record.port)
            if isinstance(record, HostEcho)
            else TcpAddress(record.host, record.port)
        )
        addresses.append(address)
    return addresses


def _expected_dials(*streams: bytes) -> list[object]:
    """What an agent that never gets a dial result dials: a repeated address only once."""
    dials: list[object] = []
    for data in streams:
        for address in _valid_connects(data):
            if not dials or dials[-1] != address:
                dials.append(address)
    return dials


def _missing() -> FoundPort:
    raise SerialPortMissing("fuzzing")


GuestInput = tuple[bytes, list[bytes], bytes, list[bytes]]


def _guest_inputs() -> st.SearchStrategy[GuestInput]:
    """A stream on the status port and one on the connect port, each in chunks."""
    return st.tuples(with_chunks(RING_STREAM), with_chunks(RING_STREAM)).map(
        lambda pair: (*pair[0], *pair[1])
    )


def check_ring_guest(example: GuestInput) -> None:
    """``AgentCore`` dials exactly the valid CONNECTs it reads, on either port, nothing else."""
    serial_data, serial_chunks, connect_data, connect_chunks = example
    core = AgentCore()
    commands: list[Any] = []
    reader = ConnectPortReader(
        _missing, lambda data: commands.extend(core.connect_port_data(data))
    )
    with _quiet("vmready.agent.core"):
        for chunk in serial_chunks:
            commands.extend(core.data_received(chunk))
        for chunk in connect_chunks:
            reader.received(chunk)
    assert len(core._reader.pending) <= MAX_LINE_BYTES
    assert len(core._connect_reader.pending) <= MAX_LINE_BYTES
    # Each new address abandons the dial before it: Dial and AbandonDial only.
    assert all(isinstance(command, Dial | AbandonDial) for command in commands), commands
    dials = [c.address for c in commands if isinstance(c, Dial)]
    assert dials == _expected_dials(serial_data, connect_data), dials
    assert core.status is AgentStatus.STARTED  # no dial ever succeeded
    if not dials:
        assert core.phase is Phase.WAITING and core.address is None, core.phase


# -- CONNECT lines --------------------------------------------------------------

_CONNECT_TEXT = mutated(_connect_lines()).map(lambda b: b.decode("utf-8", "surrogateescape")) | (
    st.text(max_size=40).map(lambda t: "CONNECT " + t)
)


def check_connect_line(text: str) -> None:
    """A CONNECT line parses to an address in range, written back the same, or ValueError."""
    try:
        record = parse_connect_line(text)
    except ValueError as e:
        assert str(e), text
        for parse in (parse_connect, parse_tcp_connect):
            accepted = True
            try:
                parse(text)
            except ValueError:
                accepted = False
            assert not accepted, f"{parse.__name__} accepts {text!r}; parse_connect_line does not"
        return
    assert text.strip().isascii(), f"accepted a non-ASCII CONNECT line {text!r}"
    if isinstance(record, HostEcho):
        assert 0 <= record.cid < 2**32 and 0 <= record.port < 2**32, record
        assert parse_connect(text) == (record.cid, record.port)
        line = format_connect(record.cid, record.port)
    else:
        assert isinstance(record, TcpHostEcho)
        assert 0 < record.port < 65536, record
        assert parse_tcp_connect(text) == (record.host, record.port)
        line = format_tcp_connect(record.host, record.port)
    assert parse_connect_line(line.decode("ascii")) == record


# -- the daemon's end of the connect port ------------------------------------


# Around the cap on what is counted.
_BIG = st.sampled_from([65535, 65536, 65537, 70_000]).map(lambda n: b"x" * n)


def check_connect_port_daemon(chunks: list[bytes]) -> None:
    """The agent never writes on the connect port: what it sends is counted, capped, dropped."""
    writer = daemon_connectport._Writer()
    transport = StringTransport()
    writer.makeConnection(transport)
    total = 0
    for chunk in chunks:
        writer.dataReceived(chunk)
        total += len(chunk)
        assert writer.ignored == min(total, daemon_connectport._IGNORED_LIMIT), writer.ignored
    assert transport.value() == b"", transport.value()


TARGETS = [
    FuzzTarget(
        name="ring-reader",
        description="RingBufferReader.feed: the line framing the daemon and the agent share",
        inputs=_reader_inputs(),
        check=check_reader,
    ),
    FuzzTarget(
        name="ring-host",
        description="AgentLink.ring_read: ring-buffer reads the daemon drains from a guest",
        inputs=_ring_reads(),
        check=check_ring_host,
    ),
    FuzzTarget(
        name="ring-guest",
        description="AgentCore: bytes the agent reads on its status and vmready.connect ports",
        inputs=_guest_inputs(),
        check=check_ring_guest,
    ),
    FuzzTarget(
        name="connect-line",
        description="parse_connect_line and friends: one CONNECT line as text",
        inputs=_CONNECT_TEXT,
        check=check_connect_line,
    ),
    FuzzTarget(
        name="connect-port-daemon",
        description="the daemon's vmready.connect socket: bytes a guest writes back on it",
        inputs=st.lists(noise() | _BIG, max_size=4),
        check=check_connect_port_daemon,
    ),
]
