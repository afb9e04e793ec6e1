"""Fuzz targets for the operator API: request bodies and query strings, sent as raw HTTP.

Every route that takes a body gets near-valid bodies (a valid one with fields
of the wrong type, unknown fields, huge numbers, NaN, deep nesting, bad config
keys and limits…, then bytes flipped, cut or repeated) and noise; the routes
that read a query string get query strings built the same way.  What must
hold (docs/api.md): the status is one the route documents, never a 500; an
error carries LXD's error envelope with a message; a refused request changes
nothing (no instance row, snapshot, action, operation or event).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.web_config import CONFIG_VALUES
from tests.fuzzing.web_http import (
    RUNNING,
    SNAPSHOT,
    STOPPED,
    WORLDS,
    Answer,
    refused_as_not_text,
    request,
)
from tests.fuzzing.web_mutations import edited, json_edited
from tests.fuzzing.wire_mutations import deep_json, noise

# Instance names in a path: the world's two, one that does not exist, and odd ones.
_NAMES = [
    RUNNING,
    RUNNING,
    STOPPED,
    "missing",
    "Web1",
    "web1%2F..",
    "%C3%A9",
    "a" * 70,
    "%00",
    "%ff",
]
# Route (method, path with {name}) → the valid bodies, and the statuses docs/api.md lists.
_ROUTES: dict[tuple[str, str], tuple[list[dict[str, Any]], frozenset[int]]] = {
    ("POST", "/1.0/instances"): (
        [
            {"name": "new1"},
            {"name": "new1", "config": {"user.a": "1", "limits.memory": "512MiB"}},
            {"name": "new1", "type": "virtual-machine", "config": {"limits.cpu": 2}},
        ],
        frozenset({202, 400, 409, 413}),
    ),
    ("PATCH", "/1.0/instances/{name}"): (
        [{"config": {"user.a": "2"}}, {"config": {"limits.cpu": "2", "user.role": None}}],
        frozenset({200, 400, 404, 409, 413}),
    ),
    ("PUT", "/1.0/instances/{name}"): (
        [{"restore": SNAPSHOT}, {"restore": SNAPSHOT, "stateful": False, "force": True}],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("PUT", "/1.0/instances/{name}/state"): (
        [
            {"action": "stop", "force": True, "timeout": 30},
            {"action": "start"},
            {"action": "restart", "timeout": -1},
            {"action": "freeze"},
            {"action": "unfreeze", "force": False},
        ],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("POST", "/1.0/instances/{name}/actions/resize"): (
        [{"memory": "512MiB", "cpus": 2}, {"memory": 1024}, {"cpus": "4"}],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("POST", "/1.0/instances/{name}/actions/rebuild"): (
        [{}],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("POST", "/1.0/instances/{name}/actions/confirm-resize"): (
        [{}],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("POST", "/1.0/instances/{name}/actions/revert-resize"): (
        [{}],
        frozenset({202, 400, 404, 409, 413}),
    ),
    ("POST", "/1.0/instances/{name}/snapshots"): (
        [{"name": "snap1"}, {"name": "snap1", "stateful": True}],
        frozenset({202, 400, 404, 409, 413}),
    ),
}
# Routing answers any path may get: an unknown path, a method the path does not take.
_ROUTING = frozenset({404, 405})

_WEIRD_BODIES = [
    b"",
    b"null",
    b"[]",
    b'"text"',
    b"1",
    b"NaN",
    b'{"name": NaN}',
    b'{"name": Infinity, "config": -Infinity}',
    b'{"name": 1' + b"0" * 5000 + b"}",
    b'{"name": "new1", "config": {"limits.memory": "' + b"9" * 5000 + b'"}}',
    b'{"name": "new1", "config": {"limits.memory": ' + b"9" * 4000 + b"}}",
    b'{"memory": "' + b"9" * 5000 + b'"}',
    b'{"cpus": ' + b"9" * 4000 + b"}",
    b'{"name": "\xff\xfe"}',
    b'{"name": "\\ud800"}',
    b'{"config": {"\\ud800": "x"}}',
    b'{"name": "new1", "name": 2}',
    b"\xef\xbb\xbf{}",
    b"{" * 50,
    deep_json(100_000),
    b'{"a": ' + deep_json(100_000) + b"}",
]


_WEIRD = st.sampled_from(_WEIRD_BODIES) | noise(256)


@st.composite
def _body_case(draw: st.DrawFn) -> tuple[str, str, str, bytes]:
    method, template = draw(st.sampled_from(sorted(_ROUTES)))
    valid, _statuses = _ROUTES[(method, template)]
    name = draw(st.sampled_from(_NAMES))
    kind = draw(st.integers(0, 9))
    if kind < 5:
        body = json.dumps(draw(json_edited(st.sampled_from(valid)))).encode()
    elif kind < 7:
        # The config object, or a resize's limits, replaced by fuzzed config.
        config = draw(CONFIG_VALUES)
        base = dict(draw(st.sampled_from(valid)))
        if "config" in base or template.endswith("instances") or method == "PATCH":
            base["config"] = config
        else:
            base.update({key: value for key, value in config.items() if key in ("memory", "cpus")})
            base["memory"] = config.get("limits.memory", base.get("memory"))
        body = json.dumps(base, default=str).encode()
    elif kind < 9:
        body = draw(edited(st.sampled_from(valid).map(lambda v: json.dumps(v).encode())))
    else:
        body = draw(_WEIRD)
    return method, template, name, body


_BODY_CASES = _body_case()


def _path(template: str, name: str) -> bytes:
    return template.replace("{name}", name).encode("utf-8", "surrogatepass")


def check_answer(answer: Answer | None, statuses: frozenset[int], before: Any, world: Any) -> None:
    """The answer is documented; a refusal has its envelope and changed nothing."""
    assert answer is not None, "no answer"
    assert answer.status != 500, answer
    if not refused_as_not_text(answer):
        assert answer.status in statuses | _ROUTING, (answer.status, answer.body[:300])
    body = answer.json()
    assert isinstance(body, dict), body
    if answer.status >= 400:
        assert body.get("type") == "error", body
        assert body.get("error_code") == answer.status, body
        message = body.get("error")
        assert isinstance(message, str) and message.strip(), body
        after = world.state()
        assert after == before, (answer.status, message, before, after)
        return
    if answer.status == 202:
        assert body.get("type") == "async" and body.get("status_code") == 100, body
        location = answer.headers.get(b"location", b"").decode()
        assert location == body.get("operation") and location.startswith("/1.0/operations/"), body
        world.lifecycle.operations.get(location.rsplit("/", 1)[1])
    else:
        assert body.get("type") == "sync" and body.get("status_code") == 200, body


def _after(world: Any, before: Any) -> None:
    """An accepted request may have changed the world: the next input gets a fresh one."""
    world.settle()
    if world.state() != before:
        WORLDS.changed()


def check_operator_body(case: tuple[str, str, str, bytes]) -> None:
    """One request with this body: a documented answer; a refusal changes nothing."""
    method, template, name, body = case
    world = WORLDS.current()
    before = world.state()
    answer = request(world.operator, method.encode(), _path(template, name), body)
    check_answer(answer, _ROUTES[(method, template)][1], before, world)
    _after(world, before)


# -- query strings ----------------------------------------------------------------

_QUERY_VALUES = [
    "0",
    "1",
    "2",
    "-1",
    "",
    "1e3",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "0x1",
    " 1",
    "1_0",
    "\u0661",
    "9" * 5000,
    "%ff",
    "%00",
    "%",
    "%2",
    "lifecycle",
    "operation",
    "lifecycle,operation",
    "lifecycle,,operation",
    " lifecycle",
    "logging",
    "config",
    ",",
    "0.000001",
]
# Path → parameters it reads, statuses docs/api.md lists.
_QUERY_ROUTES: dict[str, tuple[list[str], frozenset[int]]] = {
    "/1.0/instances": (["recursion"], frozenset({200, 400})),
    "/1.0/operations": (["recursion"], frozenset({200, 400})),
    "/1.0/operations/{operation}/wait": (["timeout"], frozenset({200, 400, 404})),
    "/1.0/operations/missing/wait": (["timeout"], frozenset({200, 400, 404})),
    "/1.0/events": (["type"], frozenset({200, 400})),
    "/1.0/instances/{name}": (["recursion"], frozenset({200, 400, 404})),
}


@st.composite
def _query_case(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(_QUERY_ROUTES)))
    names, _statuses = _QUERY_ROUTES[path]
    pairs = []
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*names, *names, "recursion", "x", "", "type[]"]))
        value = draw(st.sampled_from(_QUERY_VALUES) | st.text(max_size=6))
        encoded = value if draw(st.booleans()) else quote(value, safe="", errors="surrogatepass")
        pairs.append(f"{key}={encoded}" if draw(st.integers(0, 5)) else key)
    query = "&".join(pairs).encode("utf-8", "surrogatepass")
    return path, draw(edited(st.just(query), most=2))


_QUERY_CASES = _query_case()


def check_operator_query(case: tuple[str, bytes]) -> None:
    """A GET with this query string: a documented answer, and nothing changed."""
    template, query = case
    world = WORLDS.current()
    before = world.state()
    path = template.replace("{operation}", world.operation_id()).replace("{name}", RUNNING)
    target = path.encode() + b"?" + query
    answer = request(world.operator, b"GET", target)
    if answer is not None and answer.status == 200 and template == "/1.0/events":
        # A subscription: headers, then the stream (closed by the request helper).
        assert answer.headers.get(b"content-type") == b"application/x-ndjson", answer
        return
    # A byte no request target may hold is twisted.web's 400 before any route (not JSON).
    if answer is not None and answer.status == 400 and answer.body == b"":
        assert any(byte <= 0x20 or byte >= 0x7F for byte in query), (query, answer)
        assert world.state() == before
        return
    check_answer(answer, _QUERY_ROUTES[template][1], before, world)
    assert world.state() == before, "a GET changed the world"


TARGETS = [
    FuzzTarget(
        name="operator-body",
        description="operator API request bodies on every route taking one, as raw HTTP",
        inputs=_BODY_CASES,
        check=check_operator_body,
    ),
    FuzzTarget(
        name="operator-query",
        description="operator API query strings (recursion, timeout, type), as raw HTTP",
        inputs=_QUERY_CASES,
        check=check_operator_query,
    ),
]
