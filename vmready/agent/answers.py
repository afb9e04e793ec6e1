"""What a guest program receives from ``/dev/lxd/sock``, in devlxd's unix-socket format.

LXD's devlxd answers a guest program without its API envelope: a success is
its metadata, a string raw (``application/octet-stream``: a config value, the
meta-data), anything else as JSON with a trailing newline (``application/json``,
as Go's encoder writes it); an error is one line of plain text with its HTTP
status.  The proxy unwraps the host's envelopes into these
(``devlxd_answer``); ``vmready.agent.bootdata`` answers in them directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON = "application/json"
RAW = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Answer:
    """What the guest program receives."""

    code: int
    content_type: str
    body: bytes


def plain(code: int, message: str) -> Answer:
    """An error as LXD's devlxd writes it: plain text, one line."""
    return Answer(code, TEXT, message.encode("utf-8") + b"\n")


def metadata_answer(code: int, metadata: object) -> Answer:
    """A successful answer's metadata as devlxd sends it: a string raw, anything else as JSON."""
    if isinstance(metadata, str):
        return Answer(code, RAW, metadata.encode("utf-8"))
    return Answer(code, JSON, json.dumps(metadata).encode("utf-8") + b"\n")


def devlxd_answer(code: int, raw: bytes) -> Answer:
    """The host's enveloped answer, unwrapped into devlxd's unix-socket format."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        envelope = None
    if not isinstance(envelope, dict) or envelope.get("type") not in ("sync", "error"):
        return plain(502, f"host sent an invalid answer (HTTP {code}, not an LXD envelope)")
    if envelope["type"] == "error" or code >= 400:
        error = envelope.get("error") or f"HTTP {code}"
        return plain(code if code >= 400 else 500, str(error))
    return metadata_answer(code, envelope.get("metadata"))
