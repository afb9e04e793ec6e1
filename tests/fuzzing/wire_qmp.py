"""Fuzz targets for QMP: vmready's client against a fuzzing monitor, fakeqemu's server.

The client reads a greeting, replies and events from QEMU (or from whatever
holds the monitor socket); fakeqemu's server reads commands from any client.
Both are fed their peer's bytes through a ``StringTransport``, in chunks.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from hypothesis import strategies as st
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from fakeqemu.testing import InMemoryVM, raw_qmp_transport
from tests.fakeqemu.commandlines import MACHINE, agent_port, qmp_option
from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.wire_mutations import (
    dumps,
    json_mutated,
    mutated,
    noise,
    stream,
    with_chunks,
)
from vmready.protocols.qmp import (
    QMPClientProtocol,
    QMPDisconnected,
    QMPError,
    QMPEvent,
    QMPProtocolError,
)

# -- what a monitor says: vmready's client reads it -------------------------

_GREETING = {
    "QMP": {
        "version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""},
        "capabilities": ["oob"],
    }
}
_IDS = st.sampled_from([1, 2, 3, 4])


def _server_messages() -> st.SearchStrategy[dict[str, Any]]:
    reply = st.builds(lambda i, r: {"return": r, "id": i}, _IDS, st.sampled_from([{}, [], "x", 0]))
    error = st.builds(
        lambda i, c: {"error": {"class": c, "desc": "no"}, "id": i},
        _IDS,
        st.sampled_from(["GenericError", "CommandNotFound", "DeviceNotFound"]),
    )
    event = st.builds(
        lambda name, s, us: {
            "event": name,
            "data": {"id": "vmready", "open": True},
            "timestamp": {"seconds": s, "microseconds": us},
        },
        st.sampled_from(["VSERPORT_CHANGE", "STOP", "RESUME", "SHUTDOWN"]),
        st.integers(0, 2**40),
        st.integers(0, 999_999),
    )
    return st.just(_GREETING) | reply | error | event


def _server_line() -> st.SearchStrategy[bytes]:
    line = json_mutated(_server_messages()).map(lambda m: dumps(m) + b"\r\n")
    return mutated(line, most=2)


# A small line cap, so that fuzzing crosses it; the mechanism is the one the 16 MiB cap uses.
_CLIENT_MAX_LENGTH = 4096


def _client_inputs() -> st.SearchStrategy[list[bytes]]:
    # The greeting first, usually: otherwise nothing past it is ever looked at.
    opening = st.sampled_from([dumps(_GREETING) + b"\r\n", b""])
    body = stream(_server_line(), 8) | noise()
    return with_chunks(st.tuples(opening, body).map(b"".join)).map(_pieces)


def _pieces(example: tuple[bytes, list[bytes]]) -> list[bytes]:
    return example[1]


def _reply_ids(data: bytes) -> set[int]:
    """The ids of every complete line that is a JSON reply (a reference reading)."""
    ids: set[int] = set()
    for line in data.split(b"\n")[:-1]:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(message, dict) or "QMP" in message or "event" in message:
            continue
        request_id = message.get("id")
        if ("return" in message or "error" in message) and type(request_id) is int:
            ids.add(request_id)
    return ids


def check_qmp_client(chunks: list[bytes]) -> None:
    """The client answers commands only from replies with their id; anything else is refused."""
    protocol = QMPClientProtocol()
    protocol.MAX_LENGTH = _CLIENT_MAX_LENGTH
    transport = StringTransport()
    protocol.makeConnection(transport)
    outcomes: dict[int, object] = {}
    events: list[QMPEvent] = []
    protocol.subscribe(events.append)

    def keep(result: object, number: int) -> None:
        outcomes[number] = result

    for number in (2, 3):  # ids 2 and 3: qmp_capabilities takes 1 once greeted
        protocol.execute("query-status").addBoth(keep, number)
    ready: list[object] = []
    protocol.when_ready().addBoth(ready.append)
    fed = b""
    for chunk in chunks:
        if transport.disconnecting:
            break  # a closing connection reads no more
        protocol.dataReceived(chunk)
        fed += chunk
        if not transport.disconnecting:
            assert len(protocol._buffer) <= _CLIENT_MAX_LENGTH, len(protocol._buffer)
    lost = protocol._lost
    if lost is not None:
        assert transport.disconnecting, "a protocol error must close the monitor"
        assert lost.check(QMPProtocolError), lost
    answered = {n for n, outcome in outcomes.items() if _answered(outcome)}
    if ready and ready[0] is None:
        answered.add(1)
    assert answered <= _reply_ids(fed), (answered, fed)
    for event in events:
        assert isinstance(event.name, str) and isinstance(event.data, dict), event
        assert isinstance(event.timestamp, float) and math.isfinite(event.timestamp), event
    protocol.connectionLost(Failure(ConnectionError("fuzzing done")))
    for outcome in [*outcomes.values(), *ready]:
        if isinstance(outcome, Failure):
            assert outcome.check(QMPError, QMPDisconnected), outcome
    assert set(outcomes) == {2, 3}, outcomes


def _answered(outcome: object) -> bool:
    """A result, or QEMU's error for the command itself (not for the negotiation before it)."""
    if not isinstance(outcome, Failure):
        return True
    error = outcome.value
    return isinstance(error, QMPError) and error.command == "query-status"


# -- what a client says: fakeqemu's server reads it -------------------------

# fakeqemu's JSON streamer's caps (fakeqemu._jsonstream, not public: tests outside
# tests/fakeqemu use fakeqemu's public API only), as QEMU's.
MAX_PENDING_BYTES = 64 * 1024 * 1024
MAX_NESTING = 1024
_COMMANDS = [
    "qmp_capabilities",
    "query-version",
    "query-status",
    "query-commands",
    "cont",
    "stop",
    "system_powerdown",
    "system_reset",
    "quit",
    "query-chardev",
    "ringbuf-read",
    "ringbuf-write",
    "migrate",
    "query-migrate",
    "migrate-set-capabilities",
    "query-migrate-capabilities",
    "no-such-command",
]

_VM_ARGV = [*MACHINE, *qmp_option(), *agent_port(64)]

_ARGUMENTS: dict[str, dict[str, Any]] = {
    "qmp_capabilities": {"enable": ["oob"]},
    "ringbuf-read": {"device": "vmready", "size": 64, "format": "base64"},
    "ringbuf-write": {"device": "vmready", "data": "U1RBUlRFRAo=", "format": "base64"},
    "migrate": {"uri": "exec:cat > /vm/state"},
    "migrate-set-capabilities": {
        "capabilities": [{"capability": "x-ignore-shared", "state": True}]
    },
}


def _client_messages() -> st.SearchStrategy[dict[str, Any]]:
    command = st.sampled_from(_COMMANDS)
    return st.builds(
        lambda name, with_args, request_id, oob: {
            ("exec-oob" if oob else "execute"): name,
            **({"arguments": _ARGUMENTS.get(name, {})} if with_args else {}),
            **({"id": request_id} if request_id is not None else {}),
        },
        command,
        st.booleans(),
        st.none() | st.integers(0, 9) | st.just("x"),
        st.booleans(),
    ) | st.builds(lambda name: {"execute": name, "exec-oob": name}, command)


def _client_request() -> st.SearchStrategy[bytes]:
    framing = st.sampled_from([b"", b"\n", b"\r\n", b" "])
    line = st.tuples(json_mutated(_client_messages()).map(dumps), framing).map(b"".join)
    return mutated(line, most=2)


def _server_inputs() -> st.SearchStrategy[list[bytes]]:
    negotiate = st.sampled_from([b'{"execute": "qmp_capabilities"}\n', b""])
    body = stream(_client_request(), 8) | noise()
    return with_chunks(st.tuples(negotiate, body).map(b"".join)).map(_pieces)


def _served(chunks: list[bytes]) -> tuple[InMemoryVM, Any, bytes]:
    """A fresh VM's monitor fed ``chunks``: the VM, its session, what the monitor said."""
    vm = InMemoryVM(_VM_ARGV)
    server, transport = raw_qmp_transport(vm)
    session: Any = server._session  # type: ignore[attr-defined]
    for chunk in chunks:
        server.dataReceived(chunk)
        assert len(session._splitter._pending) <= MAX_PENDING_BYTES
        assert session._splitter._depth <= MAX_NESTING
    output = transport.value()
    server.connectionLost(Failure(ConnectionError("fuzzing done")))
    return vm, session, output


@functools.cache
def _fresh_status() -> dict[str, Any]:
    """A fresh VM's ``query-status``: the same for every input, so built once."""
    return InMemoryVM(_VM_ARGV).machine.query_status()


def check_qmp_server(chunks: list[bytes]) -> None:
    """fakeqemu answers every client input with QMP; a refused one changes nothing."""
    status = _fresh_status()
    vm, session, output = _served(chunks)
    lines = output.split(b"\r\n")
    assert lines[-1] == b"", lines[-1]
    replies = [json.loads(line) for line in lines[1:-1]]
    accepted = 0
    for reply in replies:
        assert isinstance(reply, dict), reply
        if "event" in reply:
            continue
        if "return" in reply:
            accepted += 1
            continue
        error = reply.get("error")
        assert isinstance(error, dict), reply
        assert error.get("class") in ("GenericError", "CommandNotFound"), reply
        assert isinstance(error.get("desc"), str) and error["desc"], reply
    if accepted == 0:
        assert not session.negotiated
        assert vm.machine.query_status() == status, "a refused command changed the machine"
    if not session.negotiated:
        assert accepted == 0, "a command ran before qmp_capabilities"


# -- the QMP input splitter on its own ----------------------------------------


def _splitter_inputs() -> st.SearchStrategy[tuple[bytes, list[bytes]]]:
    data = stream(_client_request(), 6) | noise()
    return with_chunks(data)


def check_qmp_splitter(example: tuple[bytes, list[bytes]]) -> None:
    """fakeqemu's JSON streamer: any split of the input gets the same answers as the whole."""
    data, chunks = example
    _, _, whole = _served([data])
    _, _, pieces = _served(chunks)
    assert pieces == whole, (pieces, whole)


TARGETS = [
    FuzzTarget(
        name="qmp-client",
        description="vmready's QMP client: a greeting, replies and events from the monitor",
        inputs=_client_inputs(),
        check=check_qmp_client,
    ),
    FuzzTarget(
        name="qmp-server",
        description="fakeqemu's QMP server: commands from any monitor client",
        inputs=_server_inputs(),
        check=check_qmp_server,
    ),
    FuzzTarget(
        name="qmp-splitter",
        description="fakeqemu's JSON streamer: a client's bytes in pieces, answered as whole",
        inputs=_splitter_inputs(),
        check=check_qmp_splitter,
    ),
]
