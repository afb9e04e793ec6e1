"""Fuzz target for the guest API: what a guest's agent sends, as raw HTTP.

``PATCH /1.0`` bodies (the workload's Ready), ``GET /1.0/events`` type
filters, ``GET /1.0/config/<key>`` keys and query strings on every route.
What must hold (docs/guest-api.md): a documented status, never a 500; an
error in devlxd's envelope with a message; a refusal changes nothing (the
instance's ``volatile.last_state.ready`` above all); an accepted PATCH sets
Ready exactly when the body's ``state`` is ``"Ready"``.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.web_http import (
    RUNNING,
    WORLDS,
    assert_error_envelope,
    refused_as_not_text,
    request,
)
from tests.fuzzing.web_mutations import edited, json_edited
from tests.fuzzing.wire_mutations import deep_json, noise
from vmready.domain.states import READY_KEY

_STATES = st.sampled_from(
    ["Ready", "Started", "ready", "READY", "Ready ", "", "Stopped", "\ud800"]
)
_VALID = st.builds(lambda state: {"state": state}, _STATES)
_WEIRD = st.sampled_from(
    [
        b"",
        b"null",
        b"[]",
        b'"Ready"',
        b'{"state": NaN}',
        b'{"state": "Ready", "state": "Started"}',
        b'{"state": "\\ud800"}',
        b'{"state": "Re\\u0061dy"}',
        b'{"state": 1' + b"0" * 5000 + b"}",
        b'\xef\xbb\xbf{"state": "Ready"}',
        deep_json(100_000),
    ]
) | noise(256)
_GET_PATHS = [
    "/",
    "/1.0",
    "/1.0/config",
    "/1.0/meta-data",
    "/1.0/devices",
    "/1.0/events",
]
_CONFIG_KEYS = st.sampled_from(
    [
        "user.role",
        "user.missing",
        "cloud-init.user-data",
        "volatile.last_state.ready",
        "limits.cpu",
    ]
) | st.text(max_size=10)
_EVENT_TYPES = st.sampled_from(
    [
        "config",
        "device",
        "config,device",
        "lifecycle",
        "",
        ",",
        "config,",
        "Config",
        "%ff",
        "\u00e9",
    ]
) | st.text(max_size=6)
# Statuses docs/guest-api.md lists, by request kind.
_STATUSES = {
    "patch": frozenset({200, 400, 409, 413}),
    "get": frozenset({200}),
    "config": frozenset({200, 403, 404}),
    "events": frozenset({200, 400}),
}
_ROUTING = frozenset({404, 405})


@st.composite
def _guest_case(draw: st.DrawFn) -> tuple[str, bytes, bytes, bytes | None]:
    kind = draw(st.sampled_from(["patch", "patch", "patch", "get", "config", "events"]))
    if kind == "patch":
        choice = draw(st.integers(0, 9))
        if choice < 5:
            body = json.dumps(draw(json_edited(_VALID))).encode()
        elif choice < 8:
            body = draw(edited(_VALID.map(lambda v: json.dumps(v).encode())))
        else:
            body = draw(_WEIRD)
        return kind, b"PATCH", b"/1.0", body
    if kind == "config":
        key = quote(draw(_CONFIG_KEYS), safe="./", errors="surrogatepass")
        return kind, b"GET", b"/1.0/config/" + key.encode(), None
    query = b""
    if kind == "events":
        values = draw(st.lists(_EVENT_TYPES, max_size=3))
        query = b"&".join(
            b"type=" + quote(value, safe=",", errors="surrogatepass").encode() for value in values
        )
        path = b"/1.0/events"
    else:
        path = draw(st.sampled_from(_GET_PATHS[:-1])).encode()
        query = draw(st.sampled_from([b"", b"recursion=1", b"type=x", b"a=%ff&&="]))
    return kind, b"GET", path + (b"?" + query if query else b""), None


_GUEST_CASES = _guest_case()


def _requested(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value.get("state") if isinstance(value, dict) else None


def check_guest_request(case: tuple[str, bytes, bytes, bytes | None]) -> None:
    """One guest request: a documented answer; a refusal leaves Ready (and all else) alone."""
    kind, method, target, body = case
    world = WORLDS.current()
    before = world.state()
    ready_before = world.engine.instances.get_instance(RUNNING).config.get(READY_KEY)
    answer = request(world.guest, method, target, body)
    assert answer is not None, "no answer"
    assert answer.status != 500, answer
    if not refused_as_not_text(answer):
        assert answer.status in _STATUSES[kind] | _ROUTING, (answer.status, answer.body[:300])
    if answer.status >= 400:
        assert_error_envelope(answer, guest=True)
        assert world.engine.instances.get_instance(RUNNING).config.get(READY_KEY) == ready_before
        assert world.state() == before, (answer, before, world.state())
        return
    if kind == "events":
        assert answer.headers.get(b"content-type") == b"application/x-ndjson", answer
        assert world.state() == before
        return
    reply = answer.json()
    assert reply.get("type") == "sync" and reply.get("status_code") == 200, reply
    if kind == "patch":
        assert body is not None
        state = _requested(body)
        assert state in ("Ready", "Started"), (body, answer)
        ready = world.engine.instances.get_instance(RUNNING).config.get(READY_KEY)
        assert ready == ("true" if state == "Ready" else "false"), (body, ready)
        world.settle()
        if world.state() != before:
            WORLDS.changed()
        return
    assert world.state() == before, "a GET changed the world"


TARGETS = [
    FuzzTarget(
        name="guest-body",
        description="guest API bodies (PATCH /1.0), event types, config keys and query strings",
        inputs=_GUEST_CASES,
        check=check_guest_request,
    ),
]
