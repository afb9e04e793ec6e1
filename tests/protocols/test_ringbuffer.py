"""Tests for vmready.protocols.ringbuffer, the agent's ring-buffer line protocol."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from vmready.protocols.ringbuffer import (
    MAX_LINE_BYTES,
    AgentStatus,
    DiscardedFragment,
    HostEcho,
    Noise,
    OverlongLine,
    Record,
    RingBufferReader,
    StatusLine,
    TcpHostEcho,
    UndecodableLine,
    connect_line_problem,
    format_connect,
    format_tcp_connect,
    parse_connect,
    parse_connect_line,
    parse_tcp_connect,
)

STARTED = StatusLine(AgentStatus.STARTED)
CONNECTED = StatusLine(AgentStatus.CONNECTED)
STOPPED = StatusLine(AgentStatus.STOPPED)


class StatusLineTests(SynchronousTestCase):
    """Complete status lines set the agent status; the last one wins."""

    def test_unknownUntilAStatusLineArrives(self) -> None:
        reader = RingBufferReader()
        self.assertEqual(reader.status, AgentStatus.UNKNOWN)
        self.assertEqual(reader.feed(b"STAR"), [])
        self.assertEqual(reader.status, AgentStatus.UNKNOWN)

    def test_lineSplitAcrossReadsIsJoined(self) -> None:
        reader = RingBufferReader()
        reader.feed(b"STAR")
        self.assertEqual(reader.feed(b"TED\n"), [STARTED])
        self.assertEqual(reader.status, AgentStatus.STARTED)

    def test_lastCompleteStatusLineIsTheStatus(self) -> None:
        reader = RingBufferReader()
        records = reader.feed(b"STARTED\nCONNECTED\nSTOPPED\nSTARTED\n")
        self.assertEqual(records, [STARTED, CONNECTED, STOPPED, STARTED])
        self.assertEqual(reader.status, AgentStatus.STARTED)

    def test_incompleteTrailingLineDoesNotChangeStatus(self) -> None:
        reader = RingBufferReader()
        reader.feed(b"CONNECTED\nSTOPP")
        self.assertEqual(reader.status, AgentStatus.CONNECTED)
        self.assertEqual(reader.pending, b"STOPP")

    def test_carriageReturnIsTolerated(self) -> None:
        self.assertEqual(RingBufferReader().feed(b"CONNECTED\r\n"), [CONNECTED])

    def test_statusWordsAreExactAndCaseSensitive(self) -> None:
        reader = RingBufferReader()
        self.assertEqual(
            reader.feed(b"started\n STARTED\nSTARTEDX\n"),
            [Noise("started"), Noise(" STARTED"), Noise("STARTEDX")],
        )
        self.assertEqual(reader.status, AgentStatus.UNKNOWN)


class EchoAndNoiseTests(SynchronousTestCase):
    """The host's own CONNECT lines are recognised; anything else is noise."""

    def test_hostConnectEchoIsRecognisedAndSkipped(self) -> None:
        reader = RingBufferReader()
        self.assertEqual(reader.feed(b"STARTED\nCONNECT 2:49152\n"), [STARTED, HostEcho(2, 49152)])
        self.assertEqual(reader.status, AgentStatus.STARTED)

    def test_malformedConnectIsNoise(self) -> None:
        records = RingBufferReader().feed(b"CONNECT 2:\nCONNECT x:1\nCONNECT 2:99999999999\n")
        self.assertEqual(
            records, [Noise("CONNECT 2:"), Noise("CONNECT x:1"), Noise("CONNECT 2:99999999999")]
        )

    def test_nonUtf8LineIsReportedNotRaised(self) -> None:
        reader = RingBufferReader()
        self.assertEqual(reader.feed(b"\xff\xfeSTARTED\n"), [UndecodableLine(b"\xff\xfeSTARTED")])
        self.assertEqual(reader.status, AgentStatus.UNKNOWN)

    def test_emptyLineIsNoise(self) -> None:
        self.assertEqual(RingBufferReader().feed(b"\n"), [Noise("")])


class OverflowTests(SynchronousTestCase):
    """A read that fills the ring may start mid-line; that head is discarded."""

    def test_fullReadDiscardsHeadFragment(self) -> None:
        reader = RingBufferReader()
        records = reader.feed(b"NNECT 2:1234567\n", buffer_size=16)
        self.assertEqual(records, [DiscardedFragment(b"NNECT 2:1234567\n")])

    def test_fullReadKeepsCompleteLinesAfterTheFragment(self) -> None:
        reader = RingBufferReader()
        records = reader.feed(b"TED\nCONNECTED\n", buffer_size=14)
        self.assertEqual(records, [DiscardedFragment(b"TED\n"), CONNECTED])
        self.assertEqual(reader.status, AgentStatus.CONNECTED)

    def test_fullReadDropsPendingPartialLineToo(self) -> None:
        reader = RingBufferReader()
        reader.feed(b"STAR")
        records = reader.feed(b"xxTED\nSTOPPED\n", buffer_size=14)
        self.assertEqual(records, [DiscardedFragment(b"STARxxTED\n"), STOPPED])

    def test_fullReadWithoutNewlineIsAllFragment(self) -> None:
        reader = RingBufferReader()
        self.assertEqual(reader.feed(b"abcd", buffer_size=4), [DiscardedFragment(b"abcd")])
        self.assertEqual(reader.feed(b"STARTED\n"), [STARTED])

    def test_shortReadIsNotTreatedAsOverflow(self) -> None:
        reader = RingBufferReader()
        reader.feed(b"STAR")
        self.assertEqual(reader.feed(b"TED\n", buffer_size=16), [STARTED])


class OverlongLineTests(SynchronousTestCase):
    """Lines past the limit are dropped without holding them in memory."""

    def test_overlongLineIsDroppedAndReaderRecovers(self) -> None:
        reader = RingBufferReader(max_line=16)
        records = reader.feed(b"A" * 40 + b"\nSTARTED\n")
        self.assertEqual(records, [OverlongLine(40), STARTED])

    def test_overlongLineAcrossManyReadsKeepsMemoryBounded(self) -> None:
        reader = RingBufferReader(max_line=16)
        for _ in range(1000):
            self.assertEqual(reader.feed(b"B" * 64), [])
            self.assertLessEqual(len(reader.pending), 16)
        self.assertEqual(reader.feed(b"\nCONNECTED\n"), [OverlongLine(64_000), CONNECTED])

    def test_lineExactlyAtTheLimitIsKept(self) -> None:
        line = b"x" * MAX_LINE_BYTES
        self.assertEqual(RingBufferReader().feed(line + b"\n"), [Noise(line.decode())])


class ConnectLineTests(SynchronousTestCase):
    """The CONNECT line both sides share."""

    def test_formatConnect(self) -> None:
        self.assertEqual(format_connect(2, 49152), b"CONNECT 2:49152\n")

    def test_parseConnectRoundTrips(self) -> None:
        self.assertEqual(parse_connect(format_connect(3, 1024).decode()), (3, 1024))

    def test_parseConnectRefusesOtherText(self) -> None:
        for text in ("CONNECT", "CONNECT 2", "CONNECT -1:5", "connect 2:5", "CONNECT 2:5:6"):
            with self.assertRaises(ValueError):
                parse_connect(text)

    def test_formatConnectRefusesOutOfRange(self) -> None:
        with self.assertRaises(ValueError):
            format_connect(2, 2**32)


class TcpConnectLineTests(SynchronousTestCase):
    """``CONNECT tcp:<ipv4>:<port>``, the fallback transport's form."""

    def test_formatTcpConnect(self) -> None:
        self.assertEqual(format_tcp_connect("10.0.2.100", 8443), b"CONNECT tcp:10.0.2.100:8443\n")

    def test_parseTcpConnectRoundTrips(self) -> None:
        line = format_tcp_connect("10.0.2.100", 8443).decode()
        self.assertEqual(parse_tcp_connect(line), ("10.0.2.100", 8443))

    def test_formatTcpConnectRefusesAHostName(self) -> None:
        error = self.assertRaises(ValueError, format_tcp_connect, "host", 8443)
        self.assertEqual(str(error), "'host' is not an IPv4 address")

    def test_formatTcpConnectRefusesAPortOutOfRange(self) -> None:
        for port in (0, 65536):
            self.assertRaises(ValueError, format_tcp_connect, "10.0.2.100", port)

    def test_readerRecognisesTheHostsOwnTcpConnect(self) -> None:
        records = RingBufferReader().feed(b"STARTED\nCONNECT tcp:10.0.2.100:8443\n")
        self.assertEqual(records, [STARTED, TcpHostEcho("10.0.2.100", 8443)])

    def test_malformedTcpConnectIsNoise(self) -> None:
        lines = [
            b"CONNECT tcp:10.0.2.256:8443",
            b"CONNECT tcp:10.0.2.100:99999",
            b"CONNECT tcp:10.0.2.100",
            b"CONNECT tcp::8443",
        ]
        records = RingBufferReader().feed(b"\n".join(lines) + b"\n")
        self.assertEqual(records, [Noise(line.decode()) for line in lines])

    def test_parseConnectLineTakesEitherForm(self) -> None:
        self.assertEqual(parse_connect_line("CONNECT 2:5"), HostEcho(2, 5))
        self.assertEqual(parse_connect_line("CONNECT tcp:1.2.3.4:5"), TcpHostEcho("1.2.3.4", 5))

    def test_parseConnectStaysVsockOnly(self) -> None:
        self.assertRaises(ValueError, parse_connect, "CONNECT tcp:1.2.3.4:5")

    def test_problemOfAValidLineIsEmpty(self) -> None:
        self.assertEqual(connect_line_problem("CONNECT tcp:1.2.3.4:5"), "")

    def test_problemSaysWhatIsWrong(self) -> None:
        self.assertEqual(
            connect_line_problem("CONNECT 4294967296:1"),
            "vsock cid 4294967296 is out of range (0-4294967295)",
        )


_TOKENS = st.sampled_from(
    [
        b"STARTED\n",
        b"CONNECTED\n",
        b"STOPPED\n",
        b"CONNECT 2:5000\n",
        b"CONNECT tcp:10.0.2.100:8443\n",
        b"noise\n",
        b"\xff\n",
        b"x",
    ]
)


def _feed_in_chunks(stream: bytes, cuts: list[int]) -> tuple[list[Record], AgentStatus]:
    reader = RingBufferReader()
    records: list[Record] = []
    points = sorted({c % (len(stream) + 1) for c in cuts})
    start = 0
    for point in [*points, len(stream)]:
        records += reader.feed(stream[start:point])
        start = point
    return records, reader.status


class ChunkingPropertyTests(SynchronousTestCase):
    """However the same stream is cut into reads, the same lines come out."""

    @given(
        tokens=st.lists(_TOKENS, max_size=40),
        cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
    )
    def test_chunkingDoesNotChangeRecords(self, tokens: list[bytes], cuts: list[int]) -> None:
        stream = b"".join(tokens)
        whole = _feed_in_chunks(stream, [])
        self.assertEqual(_feed_in_chunks(stream, cuts), whole)

    @given(stream=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=30))
    def test_arbitraryBytesNeverRaiseAndChunkingDoesNotMatter(
        self, stream: bytes, cuts: list[int]
    ) -> None:
        self.assertEqual(_feed_in_chunks(stream, cuts), _feed_in_chunks(stream, []))
