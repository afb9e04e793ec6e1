"""Reading a session transcript back, every line checked: what ``vmready replay`` reads.

A transcript that is malformed, or of a version or side this vmready does not
know, is refused with a ``TranscriptError`` naming its line.  The format and
its writer are :mod:`vmready.protocols.transcript`; the agent, which only
writes transcripts, does not carry this module.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vmready.protocols.transcript import AGENT_KINDS, FORMAT, HOST_KINDS, VERSION, TranscriptError

__all__ = ["Entry", "Transcript", "read_transcript"]

_SIDES = {"host": HOST_KINDS, "agent": AGENT_KINDS}


@dataclass(frozen=True)
class Entry:
    """One record: where it was in the file, when, what."""

    line: int
    t: float
    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Transcript:
    """A validated transcript: its header and its records in file order."""

    source: str
    header: dict[str, Any]
    entries: list[Entry]

    @property
    def side(self) -> str:
        """ "host" or "agent"."""
        return str(self.header["side"])


_STRING = (str,)
_NUMBER = (int, float)
# Required fields of each kind and their types.
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "ring-read": {},
    "ring-write": {},
    "serial-in": {},
    "serial-out": {},
    "qmp-event": {"event": _STRING},
    "guest-request": {"id": (int,), "method": _STRING, "path": _STRING},
    "guest-response": {"id": (int,), "status": (int,)},
    "host-request": {"id": (int,), "method": _STRING, "path": _STRING},
    "host-response": {"id": (int,), "status": (int,)},
    "state": {"action": _STRING, "context": (dict,)},
    "daemon-start": {"port": (int,)},
    "operator-action": {"action": _STRING, "params": (dict,)},
}
_DATA_KINDS = frozenset({"ring-read", "ring-write", "serial-in", "serial-out"})


def _lines(source: str | Iterable[str | bytes]) -> tuple[str, Iterator[str | bytes]]:
    if isinstance(source, str):
        name = os.path.basename(source)
        try:
            with open(source, "rb") as f:
                return name, iter(f.read().split(b"\n"))
        except OSError as e:
            raise TranscriptError(name, 0, f"cannot read it: {e.strerror or e}") from None
    return "<lines>", iter(source)


def _check_header(source: str, number: int, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TranscriptError(
            source, number, f'not a vmready transcript header (no "format": "{FORMAT}")'
        )
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TranscriptError(source, number, f"format version {version!r} is not a number")
    if version > VERSION:
        raise TranscriptError(
            source,
            number,
            f"format version {version} is newer than this vmready understands ({VERSION}); "
            "replay it with the vmready that recorded it, or a newer one",
        )
    if version < VERSION:
        raise TranscriptError(
            source,
            number,
            f"format version {version} is older than this vmready replays ({VERSION}): "
            "version 0 transcripts (vmready before 0.1) are not supported; record the "
            "session again",
        )
    side = header.get("side")
    if not isinstance(side, str) or side not in _SIDES:
        raise TranscriptError(source, number, f'side {side!r} is neither "host" nor "agent"')
    if not isinstance(header.get("instance"), str) or not header["instance"]:
        raise TranscriptError(source, number, 'the header names no "instance"')
    return header


def _check_entry(source: str, number: int, side: str, value: Any) -> Entry:
    if not isinstance(value, dict):
        raise TranscriptError(source, number, "a record must be a JSON object")
    t = value.get("t")
    seconds = _seconds(t)
    if seconds is None:
        raise TranscriptError(source, number, f'"t" must be seconds (0 or more), got {t!r:.80}')
    kind = value.get("kind")
    if not isinstance(kind, str) or kind not in _SIDES[side]:
        raise TranscriptError(
            source,
            number,
            f"unknown record kind {kind!r} in a {side}-side transcript (a kind added by a "
            "newer vmready? replay it with the vmready that recorded it, or a newer one)",
        )
    for field, types in _REQUIRED[kind].items():
        if not isinstance(value.get(field), types) or isinstance(value.get(field), bool):
            raise TranscriptError(
                source, number, f'a {kind} record needs "{field}" ({types[0].__name__})'
            )
    if kind in _DATA_KINDS:
        if not isinstance(value.get("text", value.get("data")), str):
            raise TranscriptError(source, number, f'a {kind} record needs "text" or "data"')
        if "text" in value:
            _check_text(source, number, "text", value["text"])
        else:
            _check_base64(source, number, "data", value["data"])
    if "body" in value:
        _check_text(source, number, "body", value["body"])
    if "body_b64" in value:
        _check_base64(source, number, "body_b64", value["body_b64"])
    fields = {k: v for k, v in value.items() if k not in ("t", "kind")}
    return Entry(number, seconds, kind, fields)


def _seconds(t: Any) -> float | None:
    """``t`` as seconds, if it is a finite number of them, 0 or more."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    try:
        seconds = float(t)
    except OverflowError:  # an integer too large for a float
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _check_text(source: str, number: int, field: str, text: Any) -> None:
    """A ``text`` or ``body`` field: a string that is UTF-8 (JSON lets a lone surrogate in)."""
    if not isinstance(text, str):
        raise TranscriptError(source, number, f'"{field}" must be a string')
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TranscriptError(source, number, f'"{field}" is not UTF-8 text ({e})') from None


def _check_base64(source: str, number: int, field: str, data: Any) -> None:
    if not isinstance(data, str):
        raise TranscriptError(source, number, f'"{field}" must be a base64 string')
    try:
        base64.b64decode(data)
    except ValueError as e:
        raise TranscriptError(source, number, f'"{field}" is not base64 ({e})') from None


def read_transcript(source: str | Iterable[str | bytes]) -> Transcript:
    """Read and validate a transcript (a path, or its lines); TranscriptError says where not."""
    name, lines = _lines(source)
    header: dict[str, Any] | None = None
    entries: list[Entry] = []
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as e:
            raise TranscriptError(name, number, f"not UTF-8 text ({e})") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise TranscriptError(name, number, f"not JSON ({e})") from None
        except RecursionError:
            raise TranscriptError(name, number, "not JSON (nested too deeply)") from None
        if header is None:
            header = _check_header(name, number, value)
            continue
        if isinstance(value, dict) and value.get("format") == FORMAT:
            # A rotated file's own header, where files were joined: the same session.
            again = _check_header(name, number, value)
            if (again["side"], again["instance"]) != (header["side"], header["instance"]):
                raise TranscriptError(name, number, "a header of another session")
            continue
        entries.append(_check_entry(name, number, str(header["side"]), value))
    if header is None:
        raise TranscriptError(name, 1, "empty: no header")
    return Transcript(name, header, entries)
