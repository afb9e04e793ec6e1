"""Fuzz targets for text the operator hands vmready: transcripts and endpoint strings.

``vmready replay`` reads a transcript file (JSON lines) someone recorded, maybe
elsewhere, maybe damaged; ``twistd vmready`` reads ``vsock:``/``hvsock:``
endpoint descriptions from its command line.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

from hypothesis import strategies as st
from twisted.internet import endpoints
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.testing import MemoryReactor
from twisted.plugin import getPlugins

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.wire_mutations import between, dumps, json_mutated, mutate, mutated, pick
from vmready.agentlink.hvsock import HybridVSockClientEndpoint, HybridVSockServerEndpoint
from vmready.agentlink.vsock import VSockClientEndpoint, VSockServerEndpoint
from vmready.agentlink.vsockaddress import U32_MAX
from vmready.protocols.transcript import (
    AGENT_KINDS,
    FORMAT,
    HOST_KINDS,
    VERSION,
    TranscriptError,
    body_from_fields,
    data_from_fields,
)
from vmready.protocols.transcriptreader import Transcript, read_transcript
from vmready.record.replayinputs import (
    connect_ports,
    failed_in_recording,
    first_agent_port,
    guest_power_action,
    host_lost,
)

# -- transcripts ----------------------------------------------------------------

_DATA = (b"STARTED\n", b"CONNECT 2:1234\n", b"\xff\x00CONNECTED\n", b"")


def _data_fields() -> st.SearchStrategy[dict[str, Any]]:
    # One of the data, then one of its fields: base64 always, text when it is ASCII.
    return st.one_of(
        [
            st.sampled_from(
                [{"data": base64.b64encode(data).decode("ascii")}]
                + ([{"text": data.decode("utf-8")}] if data.isascii() else [])
            )
            for data in _DATA
        ]
    )


_BODY = st.sampled_from(
    [
        {"body": '{"state": "Ready"}'},
        {"body": "x" * 10, "body_length": 70_000, "truncated": True},
        {"body_b64": base64.b64encode(b"\xff\xfe").decode("ascii")},
        {},
    ]
)


def _record(side: str) -> st.SearchStrategy[dict[str, Any]]:
    t = st.floats(0, 1e6)
    request = st.builds(
        lambda body, i: {"id": i, "method": "PATCH", "path": "/1.0", **body},
        _BODY,
        st.integers(1, 3),
    )
    response = st.builds(lambda i: {"id": i, "status": 200}, st.integers(1, 3))
    host = {
        "ring-read": _data_fields(),
        "ring-write": _data_fields(),
        "qmp-event": st.sampled_from(
            [
                {"event": "SHUTDOWN", "data": {"guest": True, "reason": "guest-shutdown"}},
                {"event": "RESET", "data": {"guest": True}},
                {"event": "GUEST_PANICKED", "data": {}},
            ]
        ),
        "guest-request": request,
        "guest-response": response,
        "state": st.just({"action": "launch", "context": {"state": "running"}}),
        "daemon-start": st.just({"port": 1234}),
        "operator-action": st.just({"action": "stop", "params": {"force": True}}),
    }
    agent = {
        "serial-in": _data_fields(),
        "serial-out": _data_fields(),
        "host-request": request,
        "host-response": response,
    }
    kinds = host if side == "host" else agent
    assert set(kinds) == (HOST_KINDS if side == "host" else AGENT_KINDS)
    # A kind, then its fields: one strategy per kind, built once.
    return st.one_of([_entry(kind, t, kinds[kind]) for kind in sorted(kinds)])


def _entry(
    kind: str, t: st.SearchStrategy[float], fields: st.SearchStrategy[dict[str, Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda time, drawn: {"t": time, "kind": kind, **drawn}, t, fields)


def _header(side: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "side": side,
        "instance": "web1",
        "uuid": "7f3c0c1e-0000-4000-8000-000000000001",
        "started": "2026-01-01T00:00:00.000Z",
    }


def _transcript_lines() -> st.SearchStrategy[list[bytes]]:
    def lines(side: str) -> st.SearchStrategy[list[bytes]]:
        line = json_mutated(_record(side)).map(dumps)
        header = json_mutated(st.just(_header(side))).map(dumps)
        return st.tuples(header, st.lists(mutated(line, most=2), max_size=8)).map(
            lambda parts: [parts[0], *parts[1]]
        )

    return lines("host") | lines("agent")


def check_transcript(lines: list[bytes]) -> None:
    """A transcript reads as records a replay can use, or TranscriptError says where not."""
    try:
        transcript = read_transcript(lines)
    except TranscriptError as e:
        assert e.message and 0 <= e.line <= len(lines) + 1, e
        return
    assert isinstance(transcript, Transcript)
    side = transcript.side
    kinds = HOST_KINDS if side == "host" else AGENT_KINDS
    entries = transcript.entries
    for entry in entries:
        assert entry.kind in kinds and math.isfinite(entry.t) and entry.t >= 0, entry
        guest_power_action(entry)
        if entry.kind in ("ring-read", "ring-write", "serial-in", "serial-out"):
            connect_ports(data_from_fields(entry.fields))
        if entry.kind == "serial-out":
            host_lost(entries, entry, 1234)
        if entry.kind in ("guest-request", "host-request"):
            if entry.kind == "host-request":
                failed_in_recording(entries, entry)
            body = body_from_fields(entry.fields)
            assert len(body) <= _REPLAYED_BODY_LIMIT, len(body)
    if side == "agent":
        first_agent_port(entries)


# A replayed request body is padded to its recorded length: never past the API's own cap.
_REPLAYED_BODY_LIMIT = 1024 * 1024 + 1

# -- endpoint strings -----------------------------------------------------------

_DESCRIPTIONS = [
    "vsock:port=0:cid=any",
    "vsock:1234",
    "vsock:port=1234:cid=host:backlog=50",
    "vsock:cid=2:port=1234:timeout=30",
    "vsock:2:1234",
    "hvsock:path=/run/vm/v.sock:port=0:mode=600:backlog=50",
    "hvsock:/run/vm/v.sock",
    "hvsock:path=/run/vm/v.sock:port=1234:timeout=30",
    "hvsock:/run/vm/v.sock:1234",
]
_VALUES = [
    "-1",
    "4294967295",
    "4294967296",
    "0x10",
    "1e3",
    "nan",
    "inf",
    "-inf",
    "\u0663",
    " 5",
    "5_0",
    "",
    "\\:",
    "9" * 5000,
    "777777",
    "any",
    "LOCAL",
]


_VALUE = st.sampled_from(_VALUES) | st.text(max_size=8)


@st.composite
def _description(draw: st.DrawFn) -> str:
    text = pick(draw, _DESCRIPTIONS)
    prefix, _, rest = text.partition(":")
    parts = rest.split(":")
    for _ in range(draw(between(0, 3))):
        at = draw(between(0, len(parts) - 1))
        name = parts[at].partition("=")[0] + "=" if "=" in parts[at] else ""
        parts[at] = name + draw(_VALUE)
    rest = ":".join(parts)
    damaged = mutate(draw, rest.encode("utf-8"), most=2)
    return prefix + ":" + damaged.decode("utf-8", "replace")


def _trailing_escape(description: str) -> bool:
    """Whether the description ends in an unpaired backslash."""
    return (len(description) - len(description.rstrip("\\"))) % 2 == 1


_ENDPOINTS = (
    VSockServerEndpoint,
    VSockClientEndpoint,
    HybridVSockServerEndpoint,
    HybridVSockClientEndpoint,
)


_PLUGINS: dict[Any, list[Any]] = {}


def _remembered_plugins(interface: Any, package: Any = None) -> Iterator[Any]:
    """``twisted.plugin.getPlugins``, each interface's plugins looked up once.

    Twisted rescans its plugin directories (and unpickles their caches) on
    every ``serverFromString``: most of a parse's time, and none of it the
    parsers' under test.  The plugins found are the same ones, matched by the
    same prefix lookup.
    """
    if package is not None:
        return iter(getPlugins(interface, package))
    if interface not in _PLUGINS:
        _PLUGINS[interface] = list(getPlugins(interface))
    return iter(_PLUGINS[interface])


def check_endpoint_string(description: str) -> None:
    """A description makes an endpoint with numbers in range, or ValueError says why not."""
    with mock.patch.object(endpoints, "getPlugins", _remembered_plugins):
        _check_endpoint_string(description)


def _check_endpoint_string(description: str) -> None:
    reactor = MemoryReactor()
    for parse in (serverFromString, clientFromString):
        try:
            endpoint: Any = parse(reactor, description)
        except ValueError as e:
            assert str(e), description
            continue
        except RuntimeError:
            # Twisted's own tokenizer fails on a trailing backslash, before vmready's parser.
            if _trailing_escape(description):
                continue
            raise
        assert isinstance(endpoint, _ENDPOINTS), endpoint
        assert 0 <= endpoint.port <= U32_MAX, endpoint
        if isinstance(endpoint, VSockServerEndpoint | VSockClientEndpoint):
            assert 0 <= endpoint.cid <= U32_MAX, endpoint
        else:
            assert endpoint.path, endpoint
        if hasattr(endpoint, "timeout"):
            assert endpoint.timeout > 0, endpoint
        if hasattr(endpoint, "backlog"):
            assert endpoint.backlog > 0, endpoint


TARGETS = [
    FuzzTarget(
        name="transcript",
        description="read_transcript and the replay's readings of its records: a transcript file",
        inputs=_transcript_lines(),
        check=check_transcript,
    ),
    FuzzTarget(
        name="endpoint-string",
        description="vsock: and hvsock: endpoint descriptions, server and client",
        inputs=_description(),
        check=check_endpoint_string,
    ),
]
