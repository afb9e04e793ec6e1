"""Inputs that broke a wire parser (found by fuzzing or while writing its target), kept.

Each was a crash (an exception other than the parser's own error), unbounded
memory, or a message accepted that the protocol does not allow.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu.testing import InMemoryVM, raw_qmp_transport
from tests.fuzzing import wire_qmp, wire_ring, wire_text
from vmready.protocols.qmp import QMPClientProtocol, QMPProtocolError
from vmready.protocols.ringbuffer import parse_connect_line
from vmready.protocols.transcript import (
    FORMAT,
    PADDED_BODY_LIMIT,
    TranscriptError,
    body_from_fields,
)
from vmready.protocols.transcriptreader import read_transcript

_HEADER = {"format": FORMAT, "version": 1, "side": "agent", "instance": "web1"}


def _transcript(*records: Any) -> list[str]:
    return [json.dumps(_HEADER), *(r if isinstance(r, str) else json.dumps(r) for r in records)]


class TranscriptRegressionTests(SynchronousTestCase):
    """``read_transcript`` refuses every damaged file with TranscriptError."""

    def assertRefused(self, lines: list[str], line: int, says: str) -> None:
        error = self.assertRaises(TranscriptError, read_transcript, lines)
        self.assertEqual(error.line, line)
        self.assertIn(says, error.message)

    def test_sideOfAnotherType(self) -> None:
        """A list as the header's side was a TypeError (unhashable), found by fuzzing."""
        header = json.dumps({**_HEADER, "side": [{"then": 1}]})
        self.assertRefused([header], 1, "neither")

    def test_kindOfAnotherType(self) -> None:
        self.assertRefused(_transcript({"t": 1, "kind": ["serial-in"]}), 2, "unknown record kind")

    def test_timeTooLargeForAFloat(self) -> None:
        """A 400-digit ``t`` was an OverflowError."""
        self.assertRefused(
            _transcript('{"t": 1' + "0" * 400 + ', "kind": "serial-in", "text": ""}'), 2, '"t"'
        )

    def test_nestedDeeperThanPythonParses(self) -> None:
        """A line nested 100,000 deep was a RecursionError."""
        self.assertRefused(_transcript("[" * 100_000 + "]" * 100_000), 2, "nested too deeply")

    def test_textWithALoneSurrogate(self) -> None:
        """JSON lets ``\\ud800`` in; the replay's encode of it was a UnicodeEncodeError."""
        record = {"t": 1, "kind": "host-request", "id": 1, "method": "GET", "path": "/1.0"}
        self.assertRefused(_transcript({**record, "body": "\ud800"}), 2, '"body" is not UTF-8')
        self.assertRefused(
            _transcript({"t": 1, "kind": "serial-in", "text": "\ud800"}), 2, '"text" is not UTF-8'
        )

    def test_bodyThatIsNotBase64(self) -> None:
        """A bad ``body_b64`` passed the reader and failed the replay (binascii.Error)."""
        record = {"t": 1, "kind": "host-request", "id": 1, "method": "GET", "path": "/1.0"}
        self.assertRefused(_transcript({**record, "body_b64": "a"}), 2, '"body_b64" is not base64')

    def test_hugeBodyLengthIsNotAllocated(self) -> None:
        """``body_length`` 10**12 made a replay allocate a terabyte of padding."""
        body = body_from_fields({"body": "x", "body_length": 10**12, "truncated": True})
        self.assertEqual(len(body), PADDED_BODY_LIMIT)
        self.assertEqual(body_from_fields({"body": "x", "body_length": 3}), b"x  ")


class QMPClientRegressionTests(SynchronousTestCase):
    """vmready's QMP client closes the monitor on malformed input; it never raises."""

    def setUp(self) -> None:
        self.protocol = QMPClientProtocol()
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.protocol.dataReceived(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')

    def assertProtocolError(self) -> None:
        self.assertTrue(self.transport.disconnecting)
        lost = self.protocol._lost
        assert lost is not None
        self.assertTrue(lost.check(QMPProtocolError))

    def test_errorThatIsNotAnObject(self) -> None:
        """``"error": "x"`` was an AttributeError (``str.get``)."""
        self.protocol.dataReceived(b'{"error": "no", "id": 1}\r\n')
        self.assertProtocolError()

    def test_eventTimestampPastAFloat(self) -> None:
        """A 400-digit timestamp was an OverflowError."""
        stamp = b'{"seconds": 1' + b"0" * 400 + b', "microseconds": 0}'
        self.protocol.dataReceived(b'{"event": "STOP", "timestamp": ' + stamp + b"}\r\n")
        self.assertProtocolError()

    def test_lineNestedDeeperThanPythonParses(self) -> None:
        """A line nested 100,000 deep was a RecursionError."""
        self.protocol.dataReceived(b"[" * 100_000 + b"]" * 100_000 + b"\r\n")
        self.assertProtocolError()

    def test_trueIsNotIdOne(self) -> None:
        """``"id": true`` answered command 1 (True == 1 in Python)."""
        self.protocol.dataReceived(b'{"return": {}, "id": true}\r\n')
        self.assertFalse(self.protocol.negotiated)
        self.protocol.dataReceived(b'{"return": {}, "id": 1}\r\n')
        self.assertTrue(self.protocol.negotiated)

    def test_fuzzTargetChecksThem(self) -> None:
        """The target's own check takes each of these inputs (a protocol error is no crash)."""
        greeting = b'{"QMP": {}}\r\n'
        for line in (b'{"error": [], "id": 1}', b'{"return": 1, "id": true}', b"[" * 5000):
            wire_qmp.check_qmp_client([greeting + line + b"\r\n"])
        self.protocol.connectionLost(Failure(ConnectionError("done")))


class QMPSplitterRegressionTests(SynchronousTestCase):
    """fakeqemu reads what QEMU reads."""

    def test_integerWithMoreDigitsThanPythonConverts(self) -> None:
        """5,000 digits was a ValueError from int(); QEMU reads a huge integer as a double."""
        server, transport = raw_qmp_transport(InMemoryVM(wire_qmp._VM_ARGV))
        server.dataReceived(b'{"execute": "qmp_capabilities", "id": ' + b"1" * 5000 + b"}")
        reply = transport.value().split(b"\r\n")[1]
        self.assertEqual(reply, b'{"return": {}, "id": Infinity}')


class ConnectLineRegressionTests(SynchronousTestCase):
    """A CONNECT line is ASCII, as the host writes it."""

    def test_otherDigitsAreRefused(self) -> None:
        """``\\d`` matched Arabic-Indic digits: CONNECT U+0661:U+0662 was cid 1, port 2."""
        for line in ("CONNECT \u0661:\u0662", "CONNECT tcp:10.0.2.2:\u0661\u0662"):
            self.assertRaises(ValueError, parse_connect_line, line)
            wire_ring.check_connect_line(line)


class EndpointStringRegressionTests(SynchronousTestCase):
    """Endpoint descriptions the target has met."""

    def test_trailingBackslash(self) -> None:
        """Twisted's tokenizer raises RuntimeError on it, before vmready's parser is asked."""
        wire_text.check_endpoint_string("vsock:\\")
        wire_text.check_endpoint_string("vsock:port=1\\\\")
