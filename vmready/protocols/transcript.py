"""Session transcripts: the format, and a writer with rotation and redaction.

A transcript is JSON lines: one header object, then one record per line, each
``{"t": <seconds since the session started, monotonic>, "kind": …, …}``.  The
daemon writes one per instance (``side`` "host"), the agent one for its guest
(``side`` "agent"); ``vmready replay`` reads either, checked by
:mod:`vmready.protocols.transcriptreader`.  ``docs/transcripts.md`` specifies
every record kind and field; the two modules are that specification in code.

Nothing secret is ever written: PEM blocks anywhere become ``[REDACTED PEM]``
(in a stream of chunks, ``PemRedactor`` redacts a block split across them),
and in JSON bodies and config the value of any field whose name looks like a
secret (key, token, password, secret, authorization, cert, user-data,
vendor-data…) becomes ``[REDACTED]``, as does the value of such a config key
read over the guest API.

The agent bundles this module (``vmready.hypervisor.agentbundle``) for ``--record``:
standard library only, and Python 3.9 syntax.  It does not carry the reader.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import time
from collections.abc import Callable
from typing import IO, Any

import vmready

FORMAT = "vmready-transcript"
VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 3
# Bodies longer than this are kept as their first BODY_LIMIT bytes and their length.
BODY_LIMIT = 64 * 1024
REDACTED = "[REDACTED]"
REDACTED_PEM = "[REDACTED PEM]"
# A replay pads a truncated body to its recorded length, up to this: past every body cap.
PADDED_BODY_LIMIT = 1024 * 1024 + 1
# A PEM block spread over several chunks is redacted up to its END line, or this many bytes.
PEM_BLOCK_LIMIT = 64 * 1024
# Record kinds whose "id" pairs a request with its answer (unique within a file).
_ID_KINDS = frozenset({"guest-request", "guest-response", "host-request", "host-response"})

HOST_KINDS = frozenset(
    {
        "ring-read",
        "ring-write",
        "qmp-event",
        "guest-request",
        "guest-response",
        "state",
        "daemon-start",
        "operator-action",
    }
)
AGENT_KINDS = frozenset({"serial-in", "serial-out", "host-request", "host-response"})

_SECRET_NAME = re.compile(
    r"key|token|passw|secret|authori[sz]ation|cert|credential|private|user-?data|vendor-?data",
    re.IGNORECASE,
)
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL)
_PEM_BYTES = re.compile(
    rb"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL
)
_PEM_BEGIN = re.compile(rb"-----BEGIN [A-Z0-9 ]{1,100}-----")
_PEM_END = re.compile(rb"-----END [A-Z0-9 ]{1,100}-----")
# How much of a stream's earlier bytes a marker split across chunks may start in.
_MARKER_TAIL = 120


class TranscriptError(Exception):
    """A transcript that cannot be read: malformed, or of a version this vmready does not know."""

    def __init__(self, source: str, line: int, message: str) -> None:
        super().__init__(f"transcript {source} line {line}: {message}")
        self.source = source
        self.line = line
        self.message = message


# -- redaction ----------------------------------------------------------------


def looks_secret(name: str) -> bool:
    """Whether a field, header or config key of this name may hold a secret."""
    return _SECRET_NAME.search(name) is not None


def redact_text(text: str) -> str:
    """``text`` with every PEM block (keys, certificates) replaced."""
    if "-----BEGIN " not in text:
        return text
    return _PEM.sub(REDACTED_PEM, text)


def redact_json(value: Any) -> Any:
    """A JSON value with secret-named fields and PEM blocks replaced, at any depth."""
    if isinstance(value, dict):
        return {
            key: REDACTED if looks_secret(str(key)) else redact_json(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_json(item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redact_bytes(data: bytes) -> bytes:
    if b"-----BEGIN " not in data:
        return data
    return _PEM_BYTES.sub(REDACTED_PEM.encode(), data)


class PemRedactor:
    """Redacts PEM blocks in one stream of chunks (a ring buffer's reads, a serial port's writes).

    Redaction chunk by chunk would leak the part of a block that arrives in a
    later chunk: once a ``-----BEGIN …-----`` line has been seen, everything up
    to the matching ``-----END …-----`` is redacted, in whichever chunk it is
    (each chunk holding some of it says ``[REDACTED PEM]``).  A block with no
    END is redacted for ``PEM_BLOCK_LIMIT`` bytes (the chunk crossing the limit
    whole), then the stream is written again.  Markers split across chunks are
    found too; nothing is held back, so every chunk is written when it happens.
    """

    def __init__(self, limit: int = PEM_BLOCK_LIMIT) -> None:
        self.limit = limit
        self.inside = False
        self._redacted = 0
        self._tail = b""

    def feed(self, data: bytes) -> bytes:
        """``data`` redacted, given what came before it in this stream."""
        window = self._tail + data
        if not self.inside and b"-----" not in window:
            self._tail = window[-_MARKER_TAIL:]
            return data
        cursor = len(self._tail)
        out = bytearray()
        marked = False
        while cursor < len(window):
            if not self.inside:
                begin = _first_ending_after(_PEM_BEGIN, window, cursor)
                if begin is None:
                    out += window[cursor:]
                    break
                out += window[cursor : max(cursor, begin.start())]
                self.inside, self._redacted, cursor = True, 0, begin.end()
                continue
            if not marked:
                out += REDACTED_PEM.encode()
                marked = True
            end = _first_ending_after(_PEM_END, window, cursor)
            if end is None:
                self._redacted += len(window) - cursor
                if self._redacted > self.limit:
                    self.inside = False  # no END in sight: the rest of the stream is its own
                break
            self._redacted += end.end() - cursor
            self.inside, cursor, marked = False, end.end(), False
        if self.inside and not marked:
            out += REDACTED_PEM.encode()
        self._tail = window[-_MARKER_TAIL:]
        return bytes(out)


def _first_ending_after(pattern: re.Pattern[bytes], window: bytes, cursor: int) -> Any:
    start = max(0, cursor - _MARKER_TAIL)
    for match in pattern.finditer(window, start):
        if match.end() > cursor:
            return match
    return None


def data_fields(data: bytes, redactor: PemRedactor | None = None) -> dict[str, Any]:
    """Raw bytes as a record stores them: ``text`` when UTF-8, else ``data`` (base64).

    ``redactor``: the stream's, so that a PEM block split across chunks is redacted whole.
    """
    data = redactor.feed(data) if redactor is not None else _redact_bytes(data)
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"data": base64.b64encode(data).decode("ascii")}


def data_from_fields(fields: dict[str, Any]) -> bytes:
    """The bytes of a record written by ``data_fields``."""
    if "text" in fields:
        return str(fields["text"]).encode("utf-8")
    return base64.b64decode(str(fields.get("data", "")))


def body_fields(body: bytes, secret: bool = False) -> dict[str, Any]:
    """An HTTP body as a record stores it, redacted; ``secret``: the whole value is one.

    A JSON body that needed redaction is stored re-serialised; any other body as
    it was (``body`` text, or ``body_b64``).  A body over ``BODY_LIMIT`` keeps
    its first ``BODY_LIMIT`` bytes with ``body_length`` and ``truncated``.
    """
    fields: dict[str, Any] = {}
    if len(body) > BODY_LIMIT:
        fields.update(body_length=len(body), truncated=True)
        body = body[:BODY_LIMIT]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        fields["body_b64"] = base64.b64encode(_redact_bytes(body)).decode("ascii")
        return fields
    fields["body"] = _redact_body_text(text, secret)
    return fields


def _redact_body_text(text: str, secret: bool) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        return redact_text(text)
    if secret and isinstance(value, dict) and "metadata" in value:
        value = {**value, "metadata": REDACTED}
        return json.dumps(value) + ("\n" if text.endswith("\n") else "")
    redacted = redact_json(value)
    if redacted == value:
        return text
    return json.dumps(redacted) + ("\n" if text.endswith("\n") else "")


def body_from_fields(fields: dict[str, Any]) -> bytes:
    """The body a record describes (a truncated one padded with spaces to its length).

    The padding stops at ``PADDED_BODY_LIMIT``: a longer body is refused for its
    size alike, and a damaged ``body_length`` must not make a replay allocate gigabytes.
    """
    if "body_b64" in fields:
        body = base64.b64decode(str(fields["body_b64"]))
    else:
        body = str(fields.get("body", "")).encode("utf-8")
    length = fields.get("body_length")
    if isinstance(length, int) and length > len(body):
        body += b" " * (min(length, PADDED_BODY_LIMIT) - len(body))
    return body


# -- writing ------------------------------------------------------------------


def _rfc3339(epoch: float) -> str:
    stamp = datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_rfc3339(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class TranscriptWriter:
    """Appends records to one transcript file, rotating it past ``max_bytes``.

    ``header`` holds the side-specific fields (``side``, ``instance`` …); the
    writer adds ``format``, ``version``, ``vmready`` and ``started``.  An
    existing transcript of the same side and instance is continued (``appended``
    is then true, and ``t`` goes on from where it ended plus the wall time
    since); anything else at ``path`` is rotated away first.  Past
    ``max_bytes`` the file becomes ``path.1`` (``path.1`` becomes ``path.2`` …,
    ``keep`` old files at most) and a new file starts with a header marked
    ``"continues": true``, ``t`` continuing.  ``last_id`` is the highest
    request ``id`` in the continued file (0 for a new one), so that a recorder
    continuing it numbers its requests on from there: ids are unique per file.
    """

    def __init__(
        self,
        path: str,
        header: dict[str, Any],
        monotonic: Callable[[], float] = time.monotonic,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0 or keep < 0:
            raise ValueError("max_bytes must be positive and keep at least 0")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._monotonic = monotonic
        self._wall = wall
        self._header = {
            "format": FORMAT,
            "version": VERSION,
            **header,
            "vmready": vmready.__version__,
            "started": _rfc3339(wall()),
        }
        self._offset = 0.0
        # The highest request id in the file continued: the recorder's ids go on from it.
        self.last_id = 0
        self.appended = self._continue_existing()
        self._base = monotonic()
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if not self.appended:
            self._write_line(self._header)

    def _continue_existing(self) -> bool:
        """Continue a transcript of the same side and instance; rotate anything else away.

        A last line cut short (the writer was killed, or the disk filled, mid-line)
        is cut off first, so that the records appended after it stay readable.
        """
        if not os.path.exists(self.path):
            return False
        header: Any = None
        last_t = 0.0
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
            torn = lines.pop()  # b"" when the file ends with its newline
            header = json.loads(lines[0].decode("utf-8")) if lines else None
            for line in lines[1:]:
                try:
                    value = json.loads(line.decode("utf-8"))
                    last_t = float(value.get("t", last_t))
                except (ValueError, AttributeError, TypeError):
                    continue
                if value.get("kind") in _ID_KINDS and isinstance(value.get("id"), int):
                    self.last_id = max(self.last_id, value["id"])
        except (OSError, ValueError, UnicodeDecodeError):
            header = None
        same = (
            isinstance(header, dict)
            and header.get("format") == FORMAT
            and header.get("version") == VERSION
            and all(
                header.get(key) == self._header.get(key) for key in ("side", "instance", "uuid")
            )
        )
        if not same:
            self.last_id = 0
            self._rotate_files()
            return False
        assert isinstance(header, dict)
        if torn:
            with open(self.path, "r+b") as f:
                f.truncate(os.path.getsize(self.path) - len(torn))
        self._header["started"] = header.get("started", self._header["started"])
        started = _parse_rfc3339(str(header.get("started", "")))
        since = self._wall() - started if started is not None else 0.0
        self._offset = max(last_t, since)
        return True

    @property
    def t(self) -> float:
        """Seconds since the session started (monotonic within one process)."""
        return round(self._offset + self._monotonic() - self._base, 6)

    def write(self, kind: str, **fields: Any) -> None:
        """One record, stamped now."""
        if self._file is None:
            return
        self._write_line({"t": self.t, "kind": kind, **fields})
        if self._file.tell() > self.max_bytes:
            self._rotate()

    def _write_line(self, value: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(value, separators=(",", ":")) + "\n")
        self._file.flush()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        offset = self.t
        self._rotate_files()
        self._offset, self._base = offset, self._monotonic()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._write_line({**self._header, "continues": True, "t": offset})

    def _rotate_files(self) -> None:
        if self.keep == 0:
            os.unlink(self.path)
            return
        for n in range(self.keep - 1, 0, -1):
            older = f"{self.path}.{n}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{n + 1}")
        os.replace(self.path, f"{self.path}.1")

    def close(self) -> None:
        """Stop writing (later records are dropped)."""
        if self._file is not None:
            self._file.close()
            self._file = None
