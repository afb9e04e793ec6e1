"""Replay a recorded session against a fresh daemon core and compare what the host does.

``replay(path)`` builds the real core — an in-memory ``Store``, an ``EventBus``,
a ``Lifecycle`` whose driver runs fakeqemu in-process (``fakeqemu.testing.InMemoryVM``),
the ``GuestAPI`` — all on one ``task.Clock``, then walks the transcript in time
order, stepping the clock from one timer to the next so the daemon polls,
times out and answers exactly as it would, only without waiting:

- the guest's side is fed as recorded.  From a host transcript, each non-empty
  ``ring-read`` is what the host's next ``ringbuf-read`` at or after its time
  returns, byte for byte (overflow fragments included; the host's own echoes
  are part of what was recorded).  From an agent transcript, each
  ``serial-out`` is written into the VM's port at its time, as the agent did.
  ``guest-request``/``host-request`` records are sent through the guest API at
  their time; a ``daemon-start`` (or, agent side, a CONNECT naming a new
  port) replaces the core with a new one on the same store, as a restart does;
- what the host does is collected: its ring-buffer writes, its HTTP answers
  and (host transcripts) the instance's lifecycle events, and compared with
  the recorded ones channel by channel, in order, not by timestamp.

The first divergence is the one with the earliest recorded time.
``ReplayResult.describe()`` says it in one line; ``vmready replay`` prints it.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest, IResponse

from fakeqemu import RingBuffer
from fakeqemu.testing import FakeGuest, InMemoryVM
from vmready.agentlink.link import PollIntervals
from vmready.api.guest import GuestAPI
from vmready.api.web import BytesProducer
from vmready.domain.model import InstanceRecord, VMReadyError
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.bootsource import BOOT_KEYS
from vmready.hypervisor.cmdline import CURRENT_LAYOUT, SERIAL_LAYOUTS, VMSpec, build_command_line
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.core import (
    GuestLink,
    Lifecycle,
    agent_chardev,
    validate_config,
    validate_name,
)
from vmready.lifecycle.events import LIFECYCLE, Event, EventBus
from vmready.lifecycle.hooks import SessionHooks
from vmready.protocols.qmp import QMPClientProtocol
from vmready.protocols.ringbuffer import parse_connect
from vmready.protocols.transcript import (
    FORMAT,
    Entry,
    Transcript,
    TranscriptError,
    body_fields,
    body_from_fields,
    data_from_fields,
    looks_secret,
    read_transcript,
    redact_json,
)
from vmready.record.recording import EVENTS_PATH
from vmready.store.sqlite import Store

__all__ = [
    "Divergence",
    "ReplayResult",
    "ReplaySession",
    "guest_power_action",
    "open_session",
    "replay",
    "replay_realtime",
]

# After the last record: how long the host may still act on what it was fed.
_SETTLE_SECONDS = 3.0
# How long past the last record a ring-read may wait for the host's next read.
_DELIVERY_GRACE = 30.0
_MAX_STEPS = 1_000_000
_FIXED_UUID = "00000000-0000-4000-8000-000000000000"
_SERVER_PEM = b"replay: no certificate\n"
_BODY_FIELDS = ("body", "body_b64", "body_length", "truncated")
# A divergence's texts: whole up to this length; past it, a window around the first
# differing character, this many characters either side.
_TEXT_LIMIT = 160
_WINDOW = 40
_CONFIG_PREFIX = "/1.0/config/"
_META_DATA_PATH = "/1.0/meta-data"


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
class _Output:
    """One thing the replayed host did."""

    t: float
    key: Any
    text: str


@attrs.frozen
class _Expected:
    """One thing the recorded host did."""

    entry: Entry
    key: Any
    text: str


def _quoted(data: bytes) -> str:
    return json.dumps(data.decode("utf-8", "replace"))


def _short(text: str, limit: int = _TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _contrast(expected: str, got: str) -> tuple[str, str]:
    """Both texts, short enough for one line, with their first difference visible.

    Texts that differ early are cut at ``_TEXT_LIMIT``; otherwise each becomes
    ``…<_WINDOW characters before>⟨first differing character⟩<_WINDOW after>…``.
    """
    if len(expected) <= _TEXT_LIMIT and len(got) <= _TEXT_LIMIT:
        return expected, got
    index = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    if index < _TEXT_LIMIT - _WINDOW:
        return _short(expected), _short(got)

    def window(text: str) -> str:
        start = index - _WINDOW
        after = text[index + 1 : index + 1 + _WINDOW]
        tail = "…" if index + 1 + _WINDOW < len(text) else ""
        return f"…{text[start:index]}⟨{text[index : index + 1]}⟩{after}{tail}"

    return window(expected), window(got)


def _normalised(value: Any) -> Any:
    return json.loads(json.dumps(redact_json(value)))


def _body_key(fields: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((name, fields[name]) for name in _BODY_FIELDS if name in fields)


def _answer_text(status: int, fields: dict[str, Any] | None) -> str:
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


class _ScriptedRing(RingBuffer):
    """The agent's ring buffer in a host-transcript replay: reads return what was recorded.

    Whatever the replayed host wrote (its echoes) is dropped: the recorded reads
    already hold the echoes the real host read back.
    """

    def __init__(self, size: int, session: ReplaySession) -> None:
        super().__init__(size)
        self.session = session

    def read(self, size: int) -> bytes:
        super().read(len(self))
        return self.session.next_recorded_read(size)


class _Hooks:
    """The replay's recorder: it captures the host's ring-buffer writes."""

    def __init__(self, session: ReplaySession) -> None:
        self.session = session

    def ring_read(self, chunk: bytes) -> None:
        """Reads are the replay's input (it serves them from the transcript): not compared."""

    def ring_write(self, data: bytes) -> None:
        self.session.host_wrote(data)

    def qmp_event(self, name: str, data: dict[str, Any]) -> None:
        """QMP events are inputs (the guest's) or consequences compared as state: not here."""

    def operator_action(self, action: str, params: dict[str, Any]) -> None:
        """Operator actions are the replay's input: it performs them, so nothing to compare."""


class _HookLookup:
    def __init__(self, hooks: _Hooks) -> None:
        self.hooks = hooks

    def recorder_for(self, name: str) -> SessionHooks | None:
        return self.hooks


class ReplayDriver:
    """A hypervisor driver whose VMs are in-memory fakeqemu machines on the replay clock."""

    kind = "replay"

    def __init__(self, session: ReplaySession) -> None:
        self.session = session
        self.machines: dict[str, InMemoryVM] = {}

    def _connect(self, spec: VMSpec, vm: InMemoryVM) -> RunningVM:
        client = QMPClientProtocol()
        vm.connect_qmp(client)
        return RunningVM(self.session.clock, spec, client, None)

    async def launch(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> RunningVM:
        """Start ``spec``'s VM in memory."""
        argv = build_command_line(spec, ["fakeqemu"], paused, incoming)[1:]
        vm = InMemoryVM(argv, self.session.clock)
        self.machines[spec.name] = vm
        self.session.vm_started(spec, vm)
        return self._connect(spec, vm)

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        """A new monitor connection to the VM that still runs (a restarted daemon's)."""
        vm = self.machines.get(spec.name)
        if vm is None or vm.exits:
            return None
        return self._connect(spec, vm)

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        """Nothing runs that the replay does not follow."""
        return succeed(False)

    async def wait_released(self, spec: VMSpec) -> None:
        """Nothing to wait for in memory."""


class ReplaySession:
    """One replay: the core, the clock, the guest's inputs, the host's outputs."""

    def __init__(self, transcript: Transcript, clock: Clock | None = None) -> None:
        self.transcript = transcript
        self.header = transcript.header
        self.side = transcript.side
        self.name = str(self.header["instance"])
        _check_records(transcript)
        self.config = self._checked_header()
        self.uuid = str(self.header.get("uuid") or _FIXED_UUID)
        if self.side == "agent":
            self._prime_from_answers()
        self.clock = clock if clock is not None else Clock()
        self._base = tempfile.mkdtemp(prefix="vmready-replay-")
        self.store = Store.open(":memory:", clock=self.clock.seconds)
        self.events = EventBus(self.clock.seconds)
        self.events.subscribe(self._event, frozenset({LIFECYCLE}))
        self.driver = ReplayDriver(self)
        self.hooks = _Hooks(self)
        self.lifecycle: Lifecycle | None = None
        self.agent: Any = None
        self.guest: FakeGuest | None = None
        self.vm: InMemoryVM | None = None
        self.port = 0
        self._reads: list[Entry] = []
        self._outputs: dict[str, list[_Output]] = {
            "ring-write": [],
            "http": [],
            "state": [],
            "action": [],
        }
        self._answers: dict[int, _Output] = {}
        self._pending_requests: list[Deferred[Any]] = []
        self._serial_in = b""
        # Agent side: the recorded agent lost its host, so the replayed core is down.
        self._core_down = False
        layout = str(self.header.get("layout", CURRENT_LAYOUT.name))
        self.layout = SERIAL_LAYOUTS.get(layout, CURRENT_LAYOUT)
        self.intervals = self._intervals()
        # The records in the order they are replayed: by recorded time.
        self.records = sorted(transcript.entries, key=lambda entry: entry.t)

    # -- the core ---------------------------------------------------------

    def _intervals(self) -> PollIntervals:
        poll = self.header.get("poll")
        if not isinstance(poll, dict):
            return PollIntervals()
        try:
            return PollIntervals(**{k: float(v) for k, v in poll.items()})
        except (TypeError, ValueError):
            return PollIntervals()

    def _identify(self, request: IRequest) -> InstanceRecord | None:
        return self.store.find_instance(self.name)

    def _build_core(self, port: int) -> Lifecycle:
        from treq.testing import RequestTraversalAgent

        self.port = port
        lifecycle = Lifecycle(
            self.clock,
            self.store,
            self.driver,  # type: ignore[arg-type]
            self.events,
            f"{self._base}/run",
            serial_layout=self.layout,
        )
        lifecycle.state.guest = GuestLink(port, _SERVER_PEM, "hvsock:/replay", self.intervals)
        lifecycle.state.recorders = _HookLookup(self.hooks)
        self.lifecycle = lifecycle
        self.agent = RequestTraversalAgent(GuestAPI(lifecycle, self._identify).app.resource())
        return lifecycle

    def vm_started(self, spec: VMSpec, vm: InMemoryVM) -> None:
        """A VM booted: wire the guest's side to it."""
        self.vm = vm
        chardev = agent_chardev(spec)
        if chardev is None:
            return
        if self.side == "host":
            size = vm.machine.ringbuf_device(chardev).size
            vm.machine.replace_ringbuf(chardev, _ScriptedRing(size, self))
            return
        for wired in spec.serial_ports:
            if wired.chardev == chardev:
                self.guest = vm.connect_guest(wired.name)

    def _bad_header(self, message: str) -> TranscriptError:
        return TranscriptError(self.transcript.source, 1, message)

    def _checked_header(self) -> dict[str, str]:
        """The header's fields the core is built from, checked: TranscriptError if not usable."""
        header = self.header
        if self.side == "host":
            try:
                validate_name(self.name)
            except VMReadyError as e:
                raise self._bad_header(f'"instance": {e}') from None
        config = header.get("config")
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise self._bad_header(f'"config" must be an object, got {config!r}')
        port = header.get("host_port")
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 2**32
        ):
            raise self._bad_header(f'"host_port" must be a port number, got {port!r}')
        for field in ("uuid", "origin", "layout"):
            value = header.get(field)
            if value is not None and not isinstance(value, str):
                raise self._bad_header(f'"{field}" must be a string, got {value!r}')
        wanted = {str(k): v for k, v in config.items() if not str(k).startswith("vmready.")}
        try:
            return validate_config(wanted)
        except VMReadyError as e:
            raise self._bad_header(f'"config": {e}') from None

    def _prime_from_answers(self) -> None:
        """Agent side: the instance as the host's recorded answers show it.

        The agent's header does not say how the instance was configured: its
        successful ``GET /1.0/config/<key>`` answers give those values (keys only
        listed by ``GET /1.0/config`` are set empty), its ``GET /1.0/meta-data``
        answer the uuid, the name and ``user.meta-data``.  Everything else the
        host answers is still compared as recorded.
        """
        requests = {e.fields["id"]: e for e in self.transcript.entries if e.kind == "host-request"}
        config: dict[str, str] = {}
        listed: set[str] = set()
        for entry in self.transcript.entries:
            request = requests.get(entry.fields.get("id"))
            if entry.kind != "host-response" or request is None:
                continue
            if entry.fields["status"] != 200 or request.fields["method"] != "GET":
                continue
            if entry.fields.get("truncated") or not isinstance(entry.fields.get("body"), str):
                continue
            try:
                metadata = json.loads(entry.fields["body"]).get("metadata")
            except (ValueError, AttributeError):
                continue
            path = urllib.parse.urlsplit(str(request.fields["path"])).path
            if path.startswith(_CONFIG_PREFIX) and isinstance(metadata, str):
                config[urllib.parse.unquote(path[len(_CONFIG_PREFIX) :])] = metadata
            elif path == "/1.0/config" and isinstance(metadata, list):
                listed.update(
                    str(url)[len(_CONFIG_PREFIX) :]
                    for url in metadata
                    if str(url).startswith(_CONFIG_PREFIX)
                )
            elif path == _META_DATA_PATH and isinstance(metadata, str):
                head, _, extra = metadata.partition("\n")
                host, _, extra = extra.partition("\n")
                if head.startswith("instance-id: ") and host.startswith("local-hostname: "):
                    self.uuid = head[len("instance-id: ") :]
                    self.name = host[len("local-hostname: ") :]
                    if extra:
                        config["user.meta-data"] = extra
        for key in listed:
            config.setdefault(key, "")
        try:
            self.config = validate_config(
                {k: v for k, v in config.items() if k.startswith(("user.", "cloud-init."))}
            )
        except VMReadyError as e:
            raise self._bad_header(
                f"the recorded config answers cannot be replayed: {e}"
            ) from None

    def _create(self, lifecycle: Lifecycle, instance_uuid: str | None) -> None:
        """Create the instance on the fresh core; its boot source is not replayed.

        The replayed VM boots nothing (it runs in memory), so the recorded
        image and kernel need not exist here: without them nothing in
        ``create`` waits, and the operation starts at once.
        """
        config = {key: value for key, value in self.config.items() if key not in BOOT_KEYS}
        failed: list[Failure] = []
        Deferred.fromCoroutine(lifecycle.create(self.name, config, instance_uuid)).addErrback(
            failed.append
        )
        if failed:
            failed[0].raiseException()

    def _start(self) -> None:
        if self.side == "agent":
            port = self._first_agent_port()
            self._create(self._build_core(port), self.uuid)
            return
        port = int(self.header.get("host_port") or 0)
        instance_uuid = self.uuid
        if self.header.get("origin", "create") == "create":
            self._create(self._build_core(port), instance_uuid)
            return
        # A session that began with a running VM (recorded from a daemon start): boot it
        # unrecorded, then let a fresh core adopt it as a starting daemon does.
        self.store.create_instance(self.name, self.config, {}, instance_uuid)
        self.store.finish_task(self.name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING)
        lifecycle = self._build_core(port)
        record = self.store.get_instance(self.name)
        Deferred.fromCoroutine(self.driver.launch(lifecycle.spec_for(record))).addCallback(
            lambda vm: vm.detach()
        )
        self._settle()
        self._restart(port)

    def _restart(self, port: int) -> None:
        """The daemon restarts: the old core lets go, a new one recovers on the same store."""
        self._stop_core()
        self._core_down = False
        lifecycle = self._build_core(port)
        Deferred.fromCoroutine(lifecycle.recover())
        self._settle()

    def _stop_core(self) -> None:
        """The daemon goes away: its core lets go of the VM (which keeps running)."""
        if self.lifecycle is not None and not self._core_down:
            self.lifecycle.shutdown()
            self._settle()
        self._core_down = True

    def _host_lost(self, entry: Entry) -> bool:
        """Agent side: whether the agent's ``serial-out`` at ``entry`` shows its host is gone.

        The agent writes ``STARTED`` again, after ``CONNECTED``, once its held
        ``/1.0/events`` stream ended: the daemon went away when the next CONNECT the
        agent read names another port (a new daemon), or when none follows at all.
        """
        if self._core_down or self.port == 0:
            return False
        written = data_from_fields(entry.fields).splitlines()
        if b"STARTED" not in written or not self._connected_before(entry):
            return False
        for later in self.records:
            if later.t < entry.t or later.kind != "serial-in":
                continue
            ports = self._connect_ports(data_from_fields(later.fields))
            if ports:
                return ports[0] != self.port
        return True

    def _connected_before(self, entry: Entry) -> bool:
        """Whether the agent's last STARTED/CONNECTED line before ``entry`` was CONNECTED."""
        last = b""
        for earlier in self.records:
            if earlier is entry:
                break
            if earlier.kind == "serial-out":
                for line in data_from_fields(earlier.fields).splitlines():
                    if line in (b"STARTED", b"CONNECTED"):
                        last = line
        return last == b"CONNECTED"

    def _first_agent_port(self) -> int:
        for entry in self.transcript.entries:
            if entry.kind == "serial-in":
                for port in self._connect_ports(data_from_fields(entry.fields)):
                    return port
        return 0

    @staticmethod
    def _connect_ports(data: bytes) -> list[int]:
        ports = []
        for line in data.decode("utf-8", "replace").splitlines():
            with contextlib.suppress(ValueError):
                ports.append(parse_connect(line)[1])
        return ports

    # -- time -------------------------------------------------------------

    def _settle(self) -> None:
        """Deliver every pending byte (QMP, guest port, HTTP) until all is quiet."""
        for _ in range(100):
            if self.vm is not None:
                self.vm.flush()
            for vm in self.driver.machines.values():
                vm.flush()
            if self.agent is not None:
                self.agent.flush()
            self.clock.advance(0)
            if self.vm is not None:
                self.vm.flush()
            if not self._busy():
                return

    def _busy(self) -> bool:
        return bool(self.clock.getDelayedCalls()) and any(
            call.getTime() <= self.clock.seconds() for call in self.clock.getDelayedCalls()
        )

    def _run_until(self, target: float) -> None:
        """Step the clock timer by timer up to ``target``, settling after each."""
        self._settle()
        for _ in range(_MAX_STEPS):
            calls = [call for call in self.clock.getDelayedCalls() if call.active()]
            upcoming = min((call.getTime() for call in calls), default=None)
            if upcoming is None or upcoming > target:
                break
            self.clock.advance(max(0.0, upcoming - self.clock.seconds()))
            self._settle()
        if target > self.clock.seconds():
            self.clock.advance(target - self.clock.seconds())
            self._settle()

    # -- inputs -----------------------------------------------------------

    def next_recorded_read(self, size: int) -> bytes:
        """What the host's ``ringbuf-read`` now returns: the next recorded read that is due."""
        if self._reads and self._reads[0].t <= self.clock.seconds() + 1e-9:
            return data_from_fields(self._reads.pop(0).fields)[:size]
        return b""

    def _send(self, entry: Entry) -> None:
        method = str(entry.fields["method"])
        path = str(entry.fields["path"])
        body = body_from_fields(entry.fields)
        request_id = int(entry.fields["id"])
        stream = method == "GET" and path.split("?")[0] == EVENTS_PATH
        headers = Headers({b"Content-Type": [b"application/json"]}) if body else None
        producer = BytesProducer(body) if body or method in ("PATCH", "PUT", "POST") else None
        sent: Deferred[IResponse] = self.agent.request(
            method.encode("ascii"), b"http://vmready" + path.encode("utf-8"), headers, producer
        )
        secret = path.startswith("/1.0/config/") and looks_secret(path)

        def answered(response: IResponse) -> Deferred[None] | None:
            status = int(response.code)
            if stream:
                self._answered(request_id, status, None)
                return None

            def read(raw: bytes) -> None:
                self._answered(request_id, status, body_fields(raw, secret))

            return readBody(response).addCallback(read)

        done = sent.addCallback(answered)
        done.addErrback(lambda failure: self._answered(request_id, 0, None, failure.value))
        self._pending_requests.append(done)

    def _answered(
        self,
        request_id: int,
        status: int,
        fields: dict[str, Any] | None,
        error: BaseException | None = None,
    ) -> None:
        if error is not None:
            output = _Output(self.clock.seconds(), ("failed",), f"no answer ({error})")
        else:
            key = (status, None if fields is None else _body_key(fields))
            output = _Output(self.clock.seconds(), key, _answer_text(status, fields))
        self._answers[request_id] = output

    # -- outputs ----------------------------------------------------------

    def host_wrote(self, data: bytes) -> None:
        """The host wrote to the agent's ring buffer (for an agent transcript: its port)."""
        for line in data.splitlines(keepends=True):
            self._outputs["ring-write"].append(
                _Output(self.clock.seconds(), line, f"ring-write {_quoted(line)}")
            )

    def _event(self, event: Event) -> None:
        if self.side != "host":
            return
        if event.metadata.get("source") != f"/1.0/instances/{self.name}":
            return
        action = str(event.metadata.get("action", ""))
        context = _normalised(dict(event.metadata.get("context") or {}))
        self._outputs["state"].append(
            _Output(self.clock.seconds(), (action, context), _state_text(action, context))
        )

    # -- the walk ---------------------------------------------------------

    def begin(self) -> None:
        """Build the core (and boot or adopt the VM) as the recorded session began."""
        # Known in advance: each is handed to the first host read at or after its time.
        self._reads = [
            e for e in self.records if e.kind == "ring-read" and data_from_fields(e.fields)
        ]
        self._start()

    def play(self, entry: Entry) -> None:
        """Run the core up to ``entry``'s recorded time, then replay it."""
        self._run_until(entry.t)
        if self.side == "host" and entry.kind == "daemon-start":
            self._restart(int(entry.fields["port"]))
        elif self.side == "agent" and entry.kind == "serial-in":
            for port in self._connect_ports(data_from_fields(entry.fields)):
                if port != self.port or self._core_down:
                    self._restart(port)
        else:
            if self.side == "agent" and entry.kind == "serial-out" and self._host_lost(entry):
                self._stop_core()
            self._feed(entry)

    def finish(self) -> None:
        """Let the host act on what it was fed: late reads, then a few settling seconds."""
        records = self.records
        last = records[-1].t if records else 0.0
        while self._reads and self.clock.seconds() < last + _DELIVERY_GRACE:
            self._run_until(self.clock.seconds() + 0.1)
        self._run_until(max(self.clock.seconds(), last) + _SETTLE_SECONDS)

    def walk(self, on_step: Callable[[Entry], None] | None = None) -> Iterator[float]:
        """Replay record by record: yields each record's time before replaying it.

        The caller may wait until then (``--realtime``); ``on_step`` is told of
        each record once it was replayed.
        """
        self.begin()
        for entry in self.records:
            yield entry.t
            self.play(entry)
            if on_step is not None:
                on_step(entry)
        self.finish()

    def _feed(self, entry: Entry) -> None:
        if entry.kind == "ring-read" and self._reads and self._reads[0] is entry:
            # The recorded host read at this moment: so does this one (a poll at once, as
            # after a QMP event), so what it reads is seen in step with the guest's requests.
            monitor = self.lifecycle.state.monitors.get(self.name) if self.lifecycle else None
            if monitor is not None:
                monitor.qmp_event()
                self._settle()
        elif entry.kind == "serial-out" and self.guest is not None and self.guest.open:
            self.guest.write(data_from_fields(entry.fields))
            self._settle()
        elif entry.kind in ("guest-request", "host-request"):
            if self._failed_in_recording(entry):
                return
            self._send(entry)
            self._settle()
        elif entry.kind == "operator-action":
            self._operate(entry)
        elif entry.kind == "qmp-event":
            action = guest_power_action(entry)
            if action is not None:
                self._guest_does(entry, action)

    def _operate(self, entry: Entry) -> None:
        """An operator's recorded action: the same ``Lifecycle.act`` call, now."""
        action = str(entry.fields["action"])
        params = dict(entry.fields["params"])
        key: Any = ("operator", action)
        text = _operator_text(action, params)
        assert self.lifecycle is not None
        try:
            self.lifecycle.act(self.name, action, **params)
        except VMReadyError as e:
            key, text = (*key, "refused"), f"operator {action} refused ({_short(str(e), 100)})"
        self._outputs["action"].append(_Output(self.clock.seconds(), key, text))
        self._settle()

    def _guest_does(self, entry: Entry, action: str) -> None:
        """The guest OS powers off, reboots or panics, through fakeqemu's control channel."""
        key: Any = ("guest", action)
        text = f"guest {action}"
        vm = self.vm
        control = vm.connect_control() if vm is not None and not vm.exits else None
        self._settle()
        if control is None or not control.open:
            key, text = (*key, "failed"), f"guest {action} impossible: its VM is not running"
        else:
            control.write(action.encode("ascii") + b"\n")
            self._settle()
            if control.received != b"ok\n":
                answer = control.received.decode("utf-8", "replace").strip()
                key, text = (*key, "failed"), f"guest {action} failed ({answer or 'no answer'})"
            if control.open:
                control.close()
                self._settle()
        self._outputs["action"].append(_Output(self.clock.seconds(), key, text))

    def _failed_in_recording(self, entry: Entry) -> bool:
        """An agent request that never reached the host (its answer is status 0): skip it."""
        for other in self.transcript.entries:
            if other.kind == "host-response" and other.fields.get("id") == entry.fields["id"]:
                return int(other.fields["status"]) == 0
        return False

    def close(self) -> None:
        """Let go of everything (nothing real runs; only the temporary run dir remains)."""
        if self.lifecycle is not None:
            self._stop_core()
            self.lifecycle.state.operations.stop()
        for call in self.clock.getDelayedCalls():
            if call.active():
                call.cancel()
        self.store.close()
        shutil.rmtree(self._base, ignore_errors=True)

    # -- comparing --------------------------------------------------------

    def _expected(self) -> dict[str, list[_Expected]]:
        expected: dict[str, list[_Expected]] = {
            "ring-write": [],
            "http": [],
            "state": [],
            "action": [],
        }
        requests = {
            entry.fields["id"]: entry
            for entry in self.transcript.entries
            if entry.kind in ("guest-request", "host-request")
        }
        for entry in self.transcript.entries:
            fields = entry.fields
            if entry.kind in ("ring-write", "serial-in"):
                for line in data_from_fields(fields).splitlines(keepends=True):
                    if entry.kind == "serial-in" and not self._connect_ports(line):
                        continue
                    expected["ring-write"].append(
                        _Expected(entry, line, f"ring-write {_quoted(line)}")
                    )
            elif entry.kind in ("guest-response", "host-response"):
                status = int(fields["status"])
                if status == 0 or fields["id"] not in requests:
                    continue
                body = None if fields.get("stream") else _body_key(fields)
                text = _answer_text(status, None if fields.get("stream") else fields)
                expected["http"].append(_Expected(entry, (fields["id"], (status, body)), text))
            elif entry.kind == "operator-action":
                action = str(fields["action"])
                expected["action"].append(
                    _Expected(
                        entry, ("operator", action), _operator_text(action, fields["params"])
                    )
                )
            elif entry.kind == "qmp-event" and guest_power_action(entry) is not None:
                action = str(guest_power_action(entry))
                expected["action"].append(_Expected(entry, ("guest", action), f"guest {action}"))
            elif entry.kind == "state":
                context = _normalised(fields["context"])
                action = str(fields["action"])
                expected["state"].append(
                    _Expected(entry, (action, context), _state_text(action, context))
                )
        return expected

    def result(self) -> ReplayResult:
        """Compare what the host did with the recording."""
        expected = self._expected()
        requests = {
            entry.fields["id"]: entry
            for entry in self.transcript.entries
            if entry.kind in ("guest-request", "host-request")
        }
        got: dict[str, list[_Output]] = dict(self._outputs)
        got["http"] = [
            attrs.evolve(
                self._answers[key.key[0]], key=(key.key[0], self._answers[key.key[0]].key)
            )
            if key.key[0] in self._answers
            else _Output(key.entry.t, (key.key[0], None), "no answer")
            for key in expected["http"]
        ]
        divergences = []
        for channel, wanted in expected.items():
            outputs = got[channel]
            for index in range(max(len(wanted), len(outputs))):
                want = wanted[index] if index < len(wanted) else None
                have = outputs[index] if index < len(outputs) else None
                if want is not None and have is not None and want.key == have.key:
                    continue
                if want is None:
                    assert have is not None
                    divergences.append(Divergence(have.t, None, "nothing more", _short(have.text)))
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
            self.transcript.source,
            self.side,
            self.name,
            len(self.transcript.entries),
            {channel: len(items) for channel, items in expected.items() if items},
            divergence,
        )


def guest_power_action(entry: Entry) -> str | None:
    """The guest's own power action a recorded ``qmp-event`` shows, as fakeqemu's control word.

    ``SHUTDOWN`` with ``"guest": true`` is the guest powering off, ``RESET`` with
    ``"guest": true`` the guest rebooting, ``GUEST_PANICKED`` a kernel panic (its
    own ``SHUTDOWN``, reason ``guest-panic``, is part of the panic).  Every other
    event is the VM's answer to the host's own actions: not an input.
    """
    if entry.kind != "qmp-event":
        return None
    event = entry.fields.get("event")
    data = entry.fields.get("data")
    data = data if isinstance(data, dict) else {}
    if event == "GUEST_PANICKED":
        return "panic"
    if data.get("guest") is not True:
        return None
    if event == "SHUTDOWN" and data.get("reason") != "guest-panic":
        return "poweroff"
    if event == "RESET":
        return "reboot"
    return None


def _operator_text(action: str, params: Any) -> str:
    return f"operator {action} {json.dumps(params, sort_keys=True)}"


def _state_text(action: str, context: dict[str, Any]) -> str:
    return f"state {action} {json.dumps(context, sort_keys=True)}"


def _check_records(transcript: Transcript) -> None:
    """What the reader lets through but a replay cannot use: a time that is not a number."""
    for entry in transcript.entries:
        if not math.isfinite(entry.t):
            raise TranscriptError(
                transcript.source,
                entry.line,
                f'"t" must be seconds (0 or more), got {entry.t!r}',
            )


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
    reactor: Any,
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
