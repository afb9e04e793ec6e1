"""What the replayed host does, collected channel by channel, each with its one-line text.

Four channels: its ring-buffer writes (``ring-write``), its HTTP answers
(``http``, by request), its lifecycle events (``state``, host side) and the
actions performed on it (``action``).  Each output has a key, compared with
the recorded one's, and a text, shown when they differ.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from vmready.lifecycle import Event
from vmready.protocols import redact_json

CHANNELS = ("ring-write", "http", "state", "action")
_BODY_FIELDS = ("body", "body_b64", "body_length", "truncated")
# A text is shown whole up to this length.
TEXT_LIMIT = 160


@attrs.frozen
class Output:
    """One thing the replayed host did."""

    t: float
    key: Any
    text: str


class Outputs:
    """Everything the replayed host did, in order, on the replay's clock."""

    def __init__(self, seconds: Callable[[], float], side: str, name: str) -> None:
        self._seconds = seconds
        self.side = side
        self.name = name
        self.channels: dict[str, list[Output]] = {channel: [] for channel in CHANNELS}
        # The answer to each request sent, by the request's recorded id.
        self.answers: dict[int, Output] = {}

    def host_wrote(self, data: bytes) -> None:
        """The host wrote to the agent's ring buffer (for an agent transcript: its port)."""
        for line in data.splitlines(keepends=True):
            self.channels["ring-write"].append(
                Output(self._seconds(), line, f"ring-write {quoted(line)}")
            )

    def event(self, event: Event) -> None:
        """A lifecycle event: host side, one of the instance's is a ``state`` output."""
        if self.side != "host":
            return
        if event.metadata.get("source") != f"/1.0/instances/{self.name}":
            return
        action = str(event.metadata.get("action", ""))
        context = normalised(dict(event.metadata.get("context") or {}))
        self.channels["state"].append(
            Output(self._seconds(), (action, context), state_text(action, context))
        )

    def answered(
        self,
        request_id: int,
        status: int,
        fields: dict[str, Any] | None,
        error: BaseException | None = None,
    ) -> None:
        """The host answered request ``request_id`` (``fields``: None for an event stream)."""
        if error is not None:
            output = Output(self._seconds(), ("failed",), f"no answer ({error})")
        else:
            key = (status, None if fields is None else body_key(fields))
            output = Output(self._seconds(), key, answer_text(status, fields))
        self.answers[request_id] = output

    def acted(self, key: Any, text: str) -> None:
        """An action was performed on the host (by the operator or the guest)."""
        self.channels["action"].append(Output(self._seconds(), key, text))


def quoted(data: bytes) -> str:
    return json.dumps(data.decode("utf-8", "replace"))


def short(text: str, limit: int = TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def normalised(value: Any) -> Any:
    return json.loads(json.dumps(redact_json(value)))


def body_key(fields: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((name, fields[name]) for name in _BODY_FIELDS if name in fields)


def answer_text(status: int, fields: dict[str, Any] | None) -> str:
    if fields is None:
        return f"HTTP {status} (event stream)"
    body = fields.get("body")
    if isinstance(body, str):
        shown = json.dumps(body)
    else:
        shown = f"<binary body, base64 {fields.get('body_b64', '')}>"
    if fields.get("truncated"):
        shown += f" (cut, {fields.get('body_length')} bytes)"
    return f"HTTP {status} {shown}"


def operator_text(action: str, params: Any) -> str:
    return f"operator {action} {json.dumps(params, sort_keys=True)}"


def state_text(action: str, context: dict[str, Any]) -> str:
    return f"state {action} {json.dumps(context, sort_keys=True)}"
