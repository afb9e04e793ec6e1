"""Replay a recorded session against a fresh daemon core and compare what the host does.

``replay(path)`` builds the real core (an in-memory ``Store``, an ``EventBus``,
a ``Lifecycle`` over fakeqemu in-process, the ``GuestAPI``) on one
``task.Clock``, feeds it the guest's side of the transcript at its recorded
times, stepping the clock from timer to timer, and compares what the host does
(ring writes, HTTP answers, lifecycle events) with the recording, channel by
channel in order.  ``ReplayResult.describe()`` says the earliest divergence in
one line.  docs/transcripts.md says what is fed and compared.

This module reads and checks the transcript and runs the replay; the parts are
``replaysetup`` (the header), ``replaycore`` (the core and its clock, on
``replaydriver``'s fakeqemu), ``replaysession`` (the walk, feeding the inputs
``replayinputs`` finds), ``replayoutputs`` (what the host did) and
``divergence`` (the comparison).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock

from vmready.protocols import FORMAT, TranscriptError
from vmready.protocols.transcriptreader import Entry, Transcript, read_transcript
from vmready.record.divergence import ReplayResult
from vmready.record.replaysession import ReplaySession

__all__ = ["open_session", "replay", "replay_realtime"]


def _headers(source: str | list[str]) -> list[tuple[int, dict[str, Any]]]:
    """Each header in the file (several where rotated files were joined), with its line."""
    if isinstance(source, str):
        try:
            with open(source, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError):
            return []
    else:
        lines = source
    found = []
    for number, line in enumerate(lines, start=1):
        if '"format"' not in line:
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("format") == FORMAT:
            found.append((number, value))
    return found


def _check_joined(transcript: Transcript, headers: list[tuple[int, dict[str, Any]]]) -> None:
    """Refuse a session whose start is not in the file, or files of two instances joined."""
    first = headers[0][1] if headers else transcript.header
    uuid = first.get("uuid")
    for number, header in headers[1:]:
        if uuid is not None and header.get("uuid") is not None and header["uuid"] != uuid:
            raise TranscriptError(
                transcript.source,
                number,
                f"a header of another instance named {transcript.header['instance']!r} "
                f"(uuid {header['uuid']}, the session's is {uuid}: deleted and created "
                "again?); join only the files of one session",
            )
    if not first.get("continues"):
        return
    if len(headers) > 1:
        raise TranscriptError(
            transcript.source,
            1,
            "the start of this session was rotated away (its oldest kept file continues "
            "an older one; see --record-keep): it cannot be replayed",
        )
    raise TranscriptError(
        transcript.source,
        1,
        "this file continues a rotated transcript mid-session; replay it joined to the "
        "files before it (cat NAME.jsonl.2 NAME.jsonl.1 NAME.jsonl > whole.jsonl); if "
        "none is left, the start of the session was rotated away (--record-keep) and it "
        "cannot be replayed",
    )


def open_session(
    source: str | Iterable[str] | Transcript, clock: Clock | None = None
) -> ReplaySession:
    """Read and check a transcript (a path, its lines, or a read ``Transcript``) for replay.

    Raises ``TranscriptError`` (naming the file and line) for a malformed or
    unsupported transcript, one whose start was rotated away, or a header the
    core cannot be built from.
    """
    if isinstance(source, Transcript):
        transcript, headers = source, []
    else:
        lines = source if isinstance(source, str) else list(source)
        transcript = read_transcript(lines)
        headers = _headers(lines)
    _check_joined(transcript, headers)
    return ReplaySession(transcript, clock)


def replay(
    source: str | Iterable[str] | Transcript,
    clock: Clock | None = None,
    on_step: Callable[[Entry], None] | None = None,
) -> ReplayResult:
    """Replay a transcript (a path, its lines, or a read ``Transcript``) as fast as possible.

    Raises ``TranscriptError`` for a malformed or unsupported transcript.
    """
    session = open_session(source, clock)
    try:
        for _entry in session.walk(on_step):
            continue  # walking replays; the result is read once it is done
        return session.result()
    finally:
        session.close()


async def replay_realtime(
    source: str | Iterable[str] | Transcript,
    reactor: IReactorTime,
    on_step: Callable[[Entry], None] | None = None,
) -> ReplayResult:
    """``replay`` at the recorded pace: each record waits for its time on ``reactor``.

    Each record is replayed once ``reactor`` reached its recorded time (counted
    from the call), then ``on_step`` is told of it.
    """
    from twisted.internet.task import deferLater

    session = open_session(source)
    try:
        started = reactor.seconds()
        for t in session.walk(on_step):
            delay = started + t - reactor.seconds()
            if delay > 0:
                await deferLater(reactor, delay, lambda: None)
        return session.result()
    finally:
        session.close()
