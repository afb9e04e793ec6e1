"""Comparing a replay with its recording: the first divergence, and the result in one line.

What the recorded host did is read from the transcript, channel by channel;
what the replayed host did is in ``replayoutputs.Outputs``.  They are compared
in order, not by timestamp; the first divergence is the one with the earliest
recorded time.
"""

from __future__ import annotations

from typing import Any

import attrs

from vmready.protocols import data_from_fields
from vmready.protocols.transcriptreader import Entry, Transcript
from vmready.record.replayinputs import connect_ports, guest_power_action
from vmready.record.replayoutputs import (
    CHANNELS,
    TEXT_LIMIT,
    Output,
    Outputs,
    answer_text,
    body_key,
    normalised,
    operator_text,
    quoted,
    short,
    state_text,
)

# Past TEXT_LIMIT, a divergence shows a window around the first differing
# character, this many characters either side.
_WINDOW = 40


@attrs.frozen
class Divergence:
    """Where the replayed host first did something else than the recorded one."""

    t: float
    line: int | None
    expected: str
    got: str

    def describe(self) -> str:
        """One line: ``first divergence at t=3.214s (line 42): expected …, got …``."""
        where = f" (line {self.line})" if self.line is not None else ""
        return (
            f"first divergence at t={self.t:.3f}s{where}: expected {self.expected}, got {self.got}"
        )


@attrs.frozen
class ReplayResult:
    """The outcome of one replay."""

    source: str
    side: str
    instance: str
    records: int
    compared: dict[str, int]
    divergence: Divergence | None

    @property
    def matched(self) -> bool:
        """Whether the host did everything it did in the recording, and nothing else."""
        return self.divergence is None

    def describe(self) -> str:
        """What ``vmready replay`` prints."""
        if self.divergence is not None:
            return f"transcript {self.source} diverged: {self.divergence.describe()}"
        counts = ", ".join(f"{count} {channel}" for channel, count in self.compared.items())
        return (
            f"transcript {self.source} matched: {self.records} records ({self.side} side, "
            f"instance {self.instance}); compared {counts}"
        )


@attrs.frozen
class _Expected:
    """One thing the recorded host did."""

    entry: Entry
    key: Any
    text: str


def _contrast(expected: str, got: str) -> tuple[str, str]:
    """Both texts, short enough for one line, with their first difference visible.

    Texts that differ early are cut at ``TEXT_LIMIT``; otherwise each becomes
    ``…<_WINDOW characters before>⟨first differing character⟩<_WINDOW after>…``.
    """
    if len(expected) <= TEXT_LIMIT and len(got) <= TEXT_LIMIT:
        return expected, got
    index = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    if index < TEXT_LIMIT - _WINDOW:
        return short(expected), short(got)

    def window(text: str) -> str:
        start = index - _WINDOW
        after = text[index + 1 : index + 1 + _WINDOW]
        tail = "…" if index + 1 + _WINDOW < len(text) else ""
        return f"…{text[start:index]}⟨{text[index : index + 1]}⟩{after}{tail}"

    return window(expected), window(got)


def _requests(transcript: Transcript) -> dict[Any, Entry]:
    return {
        entry.fields["id"]: entry
        for entry in transcript.entries
        if entry.kind in ("guest-request", "host-request")
    }


def _expected(transcript: Transcript) -> dict[str, list[_Expected]]:
    """What the recorded host did, channel by channel."""
    expected: dict[str, list[_Expected]] = {channel: [] for channel in CHANNELS}
    requests = _requests(transcript)
    for entry in transcript.entries:
        fields = entry.fields
        if entry.kind in ("ring-write", "serial-in"):
            for line in data_from_fields(fields).splitlines(keepends=True):
                if entry.kind == "serial-in" and not connect_ports(line):
                    continue
                expected["ring-write"].append(_Expected(entry, line, f"ring-write {quoted(line)}"))
        elif entry.kind in ("guest-response", "host-response"):
            status = int(fields["status"])
            if status == 0 or fields["id"] not in requests:
                continue
            body = None if fields.get("stream") else body_key(fields)
            text = answer_text(status, None if fields.get("stream") else fields)
            expected["http"].append(_Expected(entry, (fields["id"], (status, body)), text))
        elif entry.kind == "operator-action":
            action = str(fields["action"])
            expected["action"].append(
                _Expected(entry, ("operator", action), operator_text(action, fields["params"]))
            )
        elif entry.kind == "qmp-event" and guest_power_action(entry) is not None:
            action = str(guest_power_action(entry))
            expected["action"].append(_Expected(entry, ("guest", action), f"guest {action}"))
        elif entry.kind == "state":
            context = normalised(fields["context"])
            action = str(fields["action"])
            expected["state"].append(
                _Expected(entry, (action, context), state_text(action, context))
            )
    return expected


def compare(transcript: Transcript, outputs: Outputs) -> ReplayResult:
    """Compare what the replayed host did (``outputs``) with the recording."""
    expected = _expected(transcript)
    requests = _requests(transcript)
    answers = outputs.answers
    got: dict[str, list[Output]] = dict(outputs.channels)
    got["http"] = [
        attrs.evolve(answers[key.key[0]], key=(key.key[0], answers[key.key[0]].key))
        if key.key[0] in answers
        else Output(key.entry.t, (key.key[0], None), "no answer")
        for key in expected["http"]
    ]
    divergences = []
    for channel, wanted in expected.items():
        have_all = got[channel]
        for index in range(max(len(wanted), len(have_all))):
            want = wanted[index] if index < len(wanted) else None
            have = have_all[index] if index < len(have_all) else None
            if want is not None and have is not None and want.key == have.key:
                continue
            if want is None:
                assert have is not None
                divergences.append(Divergence(have.t, None, "nothing more", short(have.text)))
                break
            want_text, got_text = _contrast(
                want.text, have.text if have is not None else f"no {channel}"
            )
            if channel == "http":
                request = requests[want.key[0]]
                want_text += f" to {request.fields['method']} {request.fields['path']}"
            divergences.append(Divergence(want.entry.t, want.entry.line, want_text, got_text))
            break
    divergence = min(divergences, key=lambda d: d.t, default=None)
    return ReplayResult(
        transcript.source,
        outputs.side,
        outputs.name,
        len(transcript.entries),
        {channel: len(items) for channel, items in expected.items() if items},
        divergence,
    )
