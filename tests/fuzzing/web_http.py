"""What the HTTP fuzz targets share: a daemon core in memory and raw HTTP requests to it.

The core is a real ``Lifecycle`` over a real SQLite store (in memory; its
run directory is a temporary one) whose VMs are fakeqemu machines in memory
(``ReplayDriver``) on a ``Clock``: a request that is accepted runs its action
as the daemon would, with no process started, in the same call.  A request is
sent as bytes to the HTTP channel the daemon serves (``operator_site``, ``guest_site``), so the
request line and query string reach twisted.web exactly as a client wrote
them, and the answer is read back from the bytes written.

``World.state()`` is everything a request could change: the instance rows,
their snapshots and action history, the operations and the events published.
A refused request must leave it as it was.  A request that changed it (it was
accepted) makes the world be built afresh before the next input, so every
input meets the same core.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.server import Site

from fakeqemu.testing import InMemoryVM
from vmready.api.guest import GuestAPI, guest_site
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.domain.model import InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.cmdline import VMSpec
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import Event, EventBus
from vmready.record.replaydriver import ReplayDriver
from vmready.store.sqlite import Store

# The instances every world has: one running (booted through the lifecycle), one stopped.
RUNNING = "web1"
STOPPED = "db1"
SNAPSHOT = "snap0"


@attrs.frozen
class Answer:
    """What a client reads of one response."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        """The body as JSON; AssertionError when it is not."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise AssertionError(f"{self.status} answer is not JSON ({e}): {self.body!r}") from e


def _settle(clock: Clock, machines: dict[str, InMemoryVM]) -> None:
    """Deliver every pending byte and due timer until all is quiet."""
    for _ in range(50):
        for vm in machines.values():
            vm.flush()
        clock.advance(0)
        if not any(call.getTime() <= clock.seconds() for call in clock.getDelayedCalls()):
            return


class World:
    """A daemon core, its two HTTP servers, and a way to tell whether anything changed."""

    def __init__(self, base: str) -> None:
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        # In memory: the same engine and schema as a file, without a file's fsyncs, since
        # every accepted request makes a new world (a file store cost 25 ms a world).
        self.engine = Store.open(":memory:", clock=self.clock.seconds)
        self.events: list[Event] = []
        bus = EventBus(self.clock.seconds)
        bus.subscribe(self.events.append, None)
        self.driver = ReplayDriver(self.clock, self._started)
        self.lifecycle = Lifecycle(
            self.clock,
            self.engine,
            self.driver,
            bus,
            os.path.join(base, "run"),
        )
        self._boot(RUNNING)
        self.engine.instances.create_instance(STOPPED, {"user.role": "db"}, {})
        self.engine.instances.finish_task(
            STOPPED, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        self.engine.snapshots.create_snapshot(STOPPED, SNAPSHOT, False, {})
        # The sites the daemon serves, limits included, their timers on the world's clock.
        self.operator: Site = operator_site(
            OperatorAPI(self.lifecycle, "fakeqemu").app.resource(), self.clock
        )
        guest = GuestAPI(self.lifecycle, self._caller).app.resource()
        self.guest: Site = guest_site(guest, self.clock)
        self.events.clear()
        self.before = self.state()

    def _started(self, spec: VMSpec, vm: InMemoryVM) -> None:
        """A VM booted in memory (``ReplayDriver`` keeps it in ``machines``)."""

    def _boot(self, name: str) -> None:
        failed: list[Failure] = []
        Deferred.fromCoroutine(
            self.lifecycle.create(name, {"user.role": "web", "limits.memory": "256"})
        ).addErrback(failed.append)
        if failed:
            failed[0].raiseException()
        _settle(self.clock, self.driver.machines)
        record = self.engine.instances.get_instance(name)
        assert record.vm_state is VMState.ACTIVE, record

    def _caller(self, request: IRequest) -> InstanceRecord | None:
        """The guest API's caller: the running instance (certificates are another target's)."""
        return self.engine.instances.find_instance(RUNNING)

    def settle(self) -> None:
        """Let whatever an accepted request started run as far as it goes now."""
        _settle(self.clock, self.driver.machines)

    def state(self) -> Any:
        """Everything a request could change, comparable with ``==``."""
        records = sorted(self.engine.instances.list_instances(), key=lambda record: record.name)
        return (
            tuple(records),
            tuple(
                (record.name, tuple(map(repr, self.engine.snapshots.list_snapshots(record.name))))
                for record in records
            ),
            tuple(
                (record.name, len(self.engine.actions.list_actions(record.name)))
                for record in records
            ),
            tuple(sorted(op.id for op in self.lifecycle.operations.list())),
            len(self.events),
        )

    def operation_id(self) -> str:
        """The id of an operation the world has (the running instance's create, done)."""
        return self.lifecycle.operations.list()[0].id

    def close(self) -> None:
        """Let go of the store and every timer."""
        self.lifecycle.operations.stop()
        for call in self.clock.getDelayedCalls():
            if call.active():
                call.cancel()
        self.engine.close()


class Worlds:
    """The one world the inputs of a process share, built afresh after any change."""

    def __init__(self) -> None:
        self._base = tempfile.mkdtemp(prefix="vmready-fuzz-")
        self._world: World | None = None

    def current(self) -> World:
        """The world as built: unchanged since, or rebuilt."""
        if self._world is None:
            self._world = World(self._base)
        return self._world

    def changed(self) -> None:
        """The world is no longer as built: the next input gets a new one."""
        if self._world is not None:
            self._world.close()
            self._world = None
            shutil.rmtree(os.path.join(self._base, "run"), ignore_errors=True)


WORLDS = Worlds()


def request(
    site: Site,
    method: bytes,
    target: bytes,
    body: bytes | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> Answer | None:
    """Send one request as bytes to ``site``; its answer, or None if none came yet."""
    channel: Any = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: vmready", b"Connection: close"]
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    lines.extend(name + b": " + value for name, value in headers)
    channel.dataReceived(b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))
    written = transport.value()
    channel.connectionLost(Failure(ConnectionDone()))
    if not written:
        return None
    return parse_answer(written)


def refused_as_not_text(answer: Answer) -> bool:
    """Whether ``answer`` is the 400 any route gives a URL that is not UTF-8 (``TextURLGuard``)."""
    if answer.status != 400:
        return False
    body = answer.json()
    return isinstance(body, dict) and str(body.get("error", "")).startswith("Invalid URL:")


def parse_answer(written: bytes) -> Answer:
    """A complete HTTP/1.1 response; AssertionError if it is not one."""
    head, separator, rest = written.partition(b"\r\n\r\n")
    assert separator, f"no end of headers in {written[:300]!r}"
    status_line, *header_lines = head.split(b"\r\n")
    version, status, *_reason = status_line.split(b" ", 2)
    assert version == b"HTTP/1.1" and status.isdigit(), status_line
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        body = rest[: int(headers[b"content-length"])]
    elif headers.get(b"transfer-encoding") == b"chunked":
        body = _dechunk(rest)
    else:
        body = rest
    return Answer(int(status), headers, body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


def assert_error_envelope(answer: Answer, guest: bool) -> str:
    """A 4xx answer carries its API's error envelope with a message; the message."""
    body = answer.json()
    assert isinstance(body, dict), body
    assert body.get("type") == "error", body
    assert body.get("error_code") == answer.status, (answer.status, body)
    message = body.get("error")
    assert isinstance(message, str) and message.strip(), body
    if guest:
        assert body.get("metadata", 0) is None and body.get("status_code") == 0, body
    return message
