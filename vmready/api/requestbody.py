"""Reading an operator request: its JSON body (size-capped, an object), its fields, its query.

Request bodies are JSON objects of at most ``MAX_BODY_BYTES`` (1 MiB); larger
ones get 413, malformed ones or fields of the wrong kind 400 naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from twisted.web.iweb import IRequest

from vmready.domain import BadRequest, PayloadTooLarge
from vmready.lifecycle import EVENT_TYPES

# The documented cap on request bodies (413 above it).
MAX_BODY_BYTES = 1024 * 1024
# LXD's "timeout": -1 means "the daemon's default".
DEFAULT_TIMEOUT = -1


def read_body(request: IRequest, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw request body, at most ``limit`` bytes (413 beyond it; both APIs)."""
    too_large = PayloadTooLarge(f"Request body too large (limit {limit} bytes)")
    declared = request.getHeader(b"Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large
    if getattr(request, "body_overflowed", False):  # dropped while it arrived (api.web)
        raise too_large
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    raw: bytes = content.read(limit + 1)
    if len(raw) > limit:
        raise too_large
    return raw


def read_json_body(request: IRequest, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, read at most ``limit`` bytes (413 beyond it)."""
    raw = read_body(request, limit)
    if not raw.strip():
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"Invalid request body: expected a JSON object, got {_kind(body)}")
    return body


def parse_json(raw: bytes) -> Any:
    """A request body as strict JSON (400 ``Invalid request body: …`` otherwise)."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"Invalid request body: {e}") from None
    except RecursionError:
        raise BadRequest("Invalid request body: nested too deeply") from None


def _not_json(constant: str) -> Any:
    """Python's json accepts NaN and Infinity; JSON (and Go) do not."""
    raise ValueError(f"{constant} is not valid JSON")


def _kind(value: Any) -> str:
    """How a JSON value is called in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``body[name]`` if present and of ``kind``; a 400 naming the field otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise BadRequest(f"Invalid field {name!r}: expected {what}, got {_kind(value)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def query_param(request: IRequest, name: str) -> str | None:
    """One query parameter as text, or None."""
    values = request.args.get(name.encode("ascii"))
    if not values:
        return None
    value: bytes = values[-1]
    return value.decode("utf-8", errors="replace")


def recursion_level(request: IRequest) -> int:
    """``?recursion=N`` (0 when absent)."""
    raw = query_param(request, "recursion")
    if raw is None or raw == "":
        return 0
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"Invalid recursion {raw!r}: expected 0, 1 or 2") from None


def seconds_param(raw: str | None, name: str) -> float | None:
    """A query parameter in seconds; None when absent or -1 (LXD's "no limit")."""
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds") from None
    if not math.isfinite(seconds):
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds")
    if seconds == DEFAULT_TIMEOUT:
        return None
    if seconds < 0:
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds (0 or more, or -1)")
    return seconds


def event_types(raw: str | None) -> frozenset[str] | None:
    """``?type=lifecycle,operation``: the set asked for, or None for every type."""
    if raw is None or not raw.strip():
        return None
    wanted = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = sorted(wanted - EVENT_TYPES)
    if unknown:
        raise BadRequest(
            f"Invalid event type {unknown[0]!r}: expected {', '.join(sorted(EVENT_TYPES))}"
        )
    return wanted
