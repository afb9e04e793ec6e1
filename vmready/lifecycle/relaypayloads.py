"""The relay's NOTIFY payloads: an event (with its instance's view), views, a request for them.

Plain functions, no I/O (``lifecycle.relay`` sends and receives them).  Every
payload is one JSON object with the format's version ``v``, the ``member``
that sent it and that member's ``seq``; beside those it holds one of:

- an event (``type``, ``timestamp``, ``metadata``), and, if it is about one
  of the member's instances, that member's view of it (``live``,
  ``lifecycle.liveviews``): ``encode_event``, ``decode_event``;
- views of the member's instances, by name (``views``): ``encode_views``;
- a request that every member send its views (``resend``): ``encode_resend``.

The instances channel's payloads (written by a trigger, not by vmready) are
read by ``decode_instance_change``.  Every payload stays within
``MAX_PAYLOAD_BYTES``: what does not fit is cut (``encode_event``) or not sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from vmready.lifecycle.events import EVENT_TYPES, LIFECYCLE, Event
from vmready.lifecycle.liveviews import LiveView, view_json
from vmready.store import MAX_PAYLOAD_BYTES

# The payload's format, should it ever change while members of two versions share a store.
PAYLOAD_VERSION = 1
# What a string in a trimmed context keeps.
TRIMMED_STRING_CHARS = 200


def encode_event(
    event: Event, member: str, seq: int = 0, live: dict[str, Any] | None = None
) -> tuple[str, bool] | None:
    """The NOTIFY payload relaying ``event`` from ``member``, within ``MAX_PAYLOAD_BYTES``,
    and whether it had to be trimmed.

    ``seq`` numbers the member's payloads: PostgreSQL folds identical payloads
    sent in one transaction into one, and two events alike to the microsecond
    must still both arrive.  ``live``: the member's view of the instance the
    event is about (``lifecycle.liveviews``), the first thing left out if the
    payload does not fit.

    None when even the trimmed event does not fit (no vmready event is that
    big without its context).
    """
    document: dict[str, Any] = {
        "v": PAYLOAD_VERSION,
        "member": member,
        "seq": seq,
        "type": event.type,
        "timestamp": event.timestamp,
        "metadata": event.metadata,
    }
    if live is not None:
        payload = _dumped({**document, "live": live})
        if _fits(payload):
            return payload, False
    payload = _dumped(document)
    if _fits(payload):
        return payload, False
    for trim in (_shorten_strings, _drop):
        document = {**document, "metadata": _trimmed(event, trim), "trimmed": True}
        payload = _dumped(document)
        if _fits(payload):
            return payload, True
    return None


def _dumped(document: dict[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def _fits(payload: str) -> bool:
    return len(payload.encode("utf-8")) <= MAX_PAYLOAD_BYTES


def _trimmed(event: Event, trim: Callable[[Any], Any]) -> dict[str, Any]:
    """The event's metadata with its free-form part (a lifecycle context, an operation's
    task metadata and error) trimmed by ``trim`` and marked trimmed."""
    metadata = dict(event.metadata)
    if event.type == LIFECYCLE:
        context = trim(metadata.get("context") or {})
        metadata["context"] = {**(context if isinstance(context, dict) else {}), "trimmed": True}
    else:
        inner = trim(metadata.get("metadata") or {})
        metadata["metadata"] = {**(inner if isinstance(inner, dict) else {}), "trimmed": True}
        metadata["err"] = trim(metadata.get("err", ""))
        metadata["description"] = _shorten_strings(metadata.get("description", ""))
    return metadata


def _shorten_strings(value: Any) -> Any:
    """``value`` with every string in it cut to ``TRIMMED_STRING_CHARS`` (marked with …)."""
    if isinstance(value, str):
        if len(value) <= TRIMMED_STRING_CHARS:
            return value
        return value[: TRIMMED_STRING_CHARS - 1] + "…"
    if isinstance(value, dict):
        return {_shorten_strings(key): _shorten_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_shorten_strings(item) for item in value]
    return value


def _drop(value: Any) -> Any:
    """Nothing of ``value`` is kept (an error string becomes empty)."""
    return "" if isinstance(value, str) else {}


def encode_views(member: str, views: Mapping[str, LiveView], seq: int = 0) -> list[str]:
    """NOTIFY payloads telling ``member``'s views of its instances, each within the limit.

    As many views to a payload as fit; a view too big for a payload of its own
    is not told (whoever needs it asks the member).  Each payload has its own
    ``seq``, from ``seq`` on.
    """
    payloads: list[str] = []
    batch: dict[str, Any] = {}

    def dumped(views_json: dict[str, Any]) -> str:
        sequence = seq + len(payloads)
        return _dumped(
            {"v": PAYLOAD_VERSION, "member": member, "seq": sequence, "views": views_json}
        )

    for name, view in views.items():
        candidate = {**batch, name: view_json(view)}
        if _fits(dumped(candidate)):
            batch = candidate
            continue
        if batch:
            payloads.append(dumped(batch))
        batch = {name: view_json(view)}
        if not _fits(dumped(batch)):
            batch = {}
    if batch:
        payloads.append(dumped(batch))
    return payloads


def encode_resend(member: str, seq: int = 0) -> str:
    """The payload by which ``member`` asks every other member for its views."""
    return _dumped({"v": PAYLOAD_VERSION, "member": member, "seq": seq, "resend": True})


def relay_document(payload: str) -> dict[str, Any] | None:
    """A relay payload's JSON, if it is one of this version's with a member; else None."""
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("v") != PAYLOAD_VERSION:
        return None
    member = document.get("member")
    return document if isinstance(member, str) and member else None


def decode_event(payload: str) -> tuple[str, Event] | None:
    """The member and the event a relayed payload carries; None if it is not one.

    The event keeps its original timestamp and has its member as location.
    """
    document = relay_document(payload)
    return None if document is None else event_of(document)


def event_of(document: dict[str, Any]) -> tuple[str, Event] | None:
    """The member and the event of a payload's ``relay_document``; None if it is not one."""
    member, type_, timestamp, metadata = (
        document.get(key) for key in ("member", "type", "timestamp", "metadata")
    )
    if not (isinstance(member, str) and member and type_ in EVENT_TYPES):
        return None
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        return None
    if not math.isfinite(timestamp) or not isinstance(metadata, dict):
        return None
    return member, Event(str(type_), float(timestamp), metadata, location=member)


@attrs.frozen
class InstanceChange:
    """One committed write of an instance row, as the instances channel tells it."""

    op: str
    name: str
    # The name before an UPDATE that renamed it (None: not a rename).
    old_name: str | None
    # The member whose instance it is ("": a single host's instance).
    member: str

    def names(self) -> list[str]:
        """The rows to read again: the name, and the name it had before a rename."""
        if self.old_name and self.old_name != self.name:
            return [self.old_name, self.name]
        return [self.name]


def decode_instance_change(payload: str) -> InstanceChange | None:
    """What an instances-channel payload says; None if it is not one."""
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    op, name, old_name, member = (
        document.get(key) for key in ("op", "name", "old_name", "member")
    )
    if op not in ("INSERT", "UPDATE", "DELETE") or not isinstance(name, str) or not name:
        return None
    if old_name is not None and not isinstance(old_name, str):
        return None
    if not isinstance(member, str):
        return None
    return InstanceChange(op, name, old_name, member)
