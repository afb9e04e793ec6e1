"""The transcript format: writing with rotation and redaction, reading with validation."""

from __future__ import annotations

import json
import os

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.recording import AgentRecorder
from vmready.protocols.transcript import (
    REDACTED,
    REDACTED_PEM,
    PemRedactor,
    TranscriptError,
    TranscriptWriter,
    body_fields,
    body_from_fields,
    data_fields,
    data_from_fields,
    redact_json,
)
from vmready.protocols.transcriptreader import read_transcript
from vmready.trust.certs import generate

HEADER = {"side": "host", "instance": "vm1", "uuid": "u-1", "host_port": 1}


class Ticker:
    """A monotonic clock a test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def records(path: str) -> list[dict[str, object]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


class WriterTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = os.path.join(self.mktemp() + "-d", "vm1.jsonl")
        os.makedirs(os.path.dirname(self.path))
        self.clock = Ticker()

    def writer(self, max_bytes: int = 1 << 20, keep: int = 3) -> TranscriptWriter:
        return TranscriptWriter(self.path, dict(HEADER), self.clock, max_bytes, keep)

    def test_theFirstLineIsAVersionedHeader(self) -> None:
        self.writer().close()
        [header] = records(self.path)
        self.assertEqual(
            {k: header[k] for k in ("format", "version", "side", "instance")},
            {"format": "vmready-transcript", "version": 1, "side": "host", "instance": "vm1"},
        )
        self.assertRegex(str(header["started"]), r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")

    def test_recordsCarryMonotonicSecondsSinceTheStart(self) -> None:
        writer = self.writer()
        self.clock.now += 1.5
        writer.write("ring-write", text="CONNECT 2:1\n")
        writer.close()
        self.assertEqual(
            records(self.path)[1], {"t": 1.5, "kind": "ring-write", "text": "CONNECT 2:1\n"}
        )

    def test_aRestartedWriterContinuesTheSameSession(self) -> None:
        writer = self.writer()
        self.clock.now += 5
        writer.write("ring-read", text="STARTED\n")
        writer.close()
        self.clock.now = 3.0  # another process: another monotonic origin
        again = self.writer()
        again.write("daemon-start", port=2)
        again.close()
        self.assertTrue(again.appended)
        lines = records(self.path)
        self.assertEqual([line.get("kind") for line in lines], [None, "ring-read", "daemon-start"])
        self.assertGreaterEqual(float(str(lines[2]["t"])), 5.0)

    def test_aContinuedWriterKnowsTheHighestRequestId(self) -> None:
        writer = self.writer()
        writer.write("guest-request", id=7, method="GET", path="/1.0")
        writer.write("guest-response", id=7, status=200)
        writer.close()
        self.assertEqual(self.writer().last_id, 7)

    def test_aSecondAgentRecordingToTheSameFileNumbersOn(self) -> None:
        first = AgentRecorder(self.path, "vm1", self.clock)
        self.assertEqual(first.host_request("GET", "/1.0", b""), 1)
        first.close()
        again = AgentRecorder(self.path, "vm1", self.clock)
        self.assertEqual(again.host_request("GET", "/1.0", b""), 2)
        again.close()

    def test_aTornLastLineIsCutOffBeforeContinuing(self) -> None:
        writer = self.writer()
        writer.write("ring-read", text="STARTED\n")
        writer.close()
        with open(self.path, "a") as f:
            f.write('{"t": 3, "kind": "ring-re')  # killed mid-write
        again = self.writer()
        again.write("daemon-start", port=2)
        again.close()
        transcript = read_transcript(self.path)
        self.assertEqual([e.kind for e in transcript.entries], ["ring-read", "daemon-start"])

    def test_invalidUTF8NamesItsLine(self) -> None:
        writer = self.writer()
        writer.write("ring-read", text="STARTED\n")
        writer.close()
        with open(self.path, "ab") as f:
            f.write(b'{"t": 1, "kind": "ring-read", "text": "\xff"}\n')
        error = self.assertRaises(TranscriptError, read_transcript, self.path)
        self.assertEqual(error.line, 3)
        self.assertIn("not UTF-8", error.message)

    def test_nonFiniteTimeNamesItsLine(self) -> None:
        writer = self.writer()
        writer.write("ring-read", text="STARTED\n")
        writer.close()
        with open(self.path, "a") as f:
            f.write('{"t": NaN, "kind": "ring-read", "text": "x"}\n')
        error = self.assertRaises(TranscriptError, read_transcript, self.path)
        self.assertEqual(error.line, 3)
        self.assertIn('"t" must be seconds', error.message)

    def test_anotherInstancesTranscriptIsRotatedAway(self) -> None:
        with open(self.path, "w") as f:
            f.write(
                '{"format": "vmready-transcript", "version": 1, "side": "host", '
                '"instance": "other"}\n'
            )
        self.writer().close()
        self.assertEqual(records(self.path + ".1")[0]["instance"], "other")
        self.assertEqual(records(self.path)[0]["instance"], "vm1")

    def test_pastTheBoundTheFileRotatesWithItsOwnHeader(self) -> None:
        writer = self.writer(max_bytes=600, keep=2)
        for n in range(40):
            self.clock.now += 1
            writer.write("ring-read", text=f"line {n}\n")
        writer.close()
        self.assertTrue(os.path.exists(self.path + ".1"))
        self.assertTrue(os.path.exists(self.path + ".2"))
        self.assertFalse(os.path.exists(self.path + ".3"))
        for path in (self.path, self.path + ".1"):
            self.assertLessEqual(os.path.getsize(path), 600 + 200)
        current = records(self.path)
        self.assertTrue(current[0]["continues"])
        # t continues across the rotation.
        self.assertEqual(current[-1]["t"], 40.0)

    def test_joinedRotatedFilesReadAsOneSession(self) -> None:
        writer = self.writer(max_bytes=300, keep=5)
        for n in range(10):
            writer.write("ring-read", text=f"line {n}\n")
        writer.close()
        parts = sorted(
            (p for p in os.listdir(os.path.dirname(self.path)) if p != "vm1.jsonl"),
            reverse=True,
        )
        lines: list[str] = []
        for name in [*parts, "vm1.jsonl"]:
            with open(os.path.join(os.path.dirname(self.path), name)) as f:
                lines += f.read().splitlines()
        transcript = read_transcript(lines)
        self.assertEqual([e.fields["text"] for e in transcript.entries][-1], "line 9\n")
        self.assertEqual(len(transcript.entries), 10)


class RedactionTests(SynchronousTestCase):
    def test_pemBlocksAreNeverWritten(self) -> None:
        pair = generate("vm1")
        fields = body_fields(json.dumps({"metadata": pair.cert_pem.decode()}).encode())
        self.assertNotIn("BEGIN CERTIFICATE", json.dumps(fields))
        self.assertIn(REDACTED_PEM, fields["body"])
        raw = data_fields(b"noise " + pair.key_pem + b"\n")
        self.assertNotIn("PRIVATE KEY", json.dumps(raw))

    def test_aPemBlockSplitAcrossChunksIsRedactedWhole(self) -> None:
        pem = generate("vm1").key_pem
        redactor = PemRedactor()
        chunks = [b"before " + pem[:40], pem[40:100], pem[100:] + b"after\n", b"next\n"]
        out = [data_fields(chunk, redactor)["text"] for chunk in chunks]
        self.assertEqual(out[0], "before " + REDACTED_PEM)
        self.assertEqual(out[1:], [REDACTED_PEM, REDACTED_PEM + "\nafter\n", "next\n"])

    def test_aMarkerSplitAcrossChunksIsFound(self) -> None:
        redactor = PemRedactor()
        parts = [b"x -----BEG", b"IN CERTIFICATE-----\nSECRET\n-----EN", b"D CERTIFICATE-----ok"]
        out = b"".join(redactor.feed(part) for part in parts)
        self.assertNotIn(b"SECRET", out)
        self.assertTrue(out.endswith(b"ok"), out)

    def test_aBlockWithNoEndIsRedactedUpToTheLimit(self) -> None:
        redactor = PemRedactor(limit=100)
        self.assertEqual(redactor.feed(b"-----BEGIN X-----\n" + b"s" * 60), REDACTED_PEM.encode())
        self.assertEqual(redactor.feed(b"s" * 60), REDACTED_PEM.encode())  # crosses the limit
        self.assertEqual(redactor.feed(b"plain\n"), b"plain\n")

    def test_secretNamedFieldsAreRedactedAtAnyDepth(self) -> None:
        value = {"a": {"api_token": "t", "Password": "p", "x": [{"client-cert": "c"}]}, "ok": 1}
        self.assertEqual(
            redact_json(value),
            {
                "a": {
                    "api_token": REDACTED,
                    "Password": REDACTED,
                    "x": [{"client-cert": REDACTED}],
                },
                "ok": 1,
            },
        )

    def test_aSecretConfigValueIsRedactedInTheAnswer(self) -> None:
        body = b'{"type": "sync", "metadata": "s3cret"}\n'
        self.assertNotIn("s3cret", json.dumps(body_fields(body, secret=True)))

    def test_aBodyThatNeedsNoRedactionIsKeptByteForByte(self) -> None:
        body = b'{"state":   "Ready"}'
        self.assertEqual(body_from_fields(body_fields(body)), body)

    def test_bytesThatAreNotUTF8RoundTrip(self) -> None:
        self.assertEqual(data_from_fields(data_fields(b"\xff\xfe\n")), b"\xff\xfe\n")

    def test_aHugeBodyKeepsItsLength(self) -> None:
        body = b"x" * 200_000
        fields = body_fields(body)
        self.assertTrue(fields["truncated"])
        self.assertEqual(len(body_from_fields(fields)), 200_000)
