"""The daemon's recorders: one transcript per recorded instance, fed by hooks in the core.

``Recorders`` decides per instance whether it is recorded (``vmready.record``
in its config wins, else the daemon's ``--record-dir`` records all) and hands
out one ``InstanceRecorder`` per recorded instance.  The core's hooks ask for
it at each call and skip all recording work on None, so an instance that is
not recorded costs only that question.  What is recorded, and when, is in
docs/transcripts.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from zope.interface import implementer

from vmready.api import LocalRequest
from vmready.domain import RECORD_KEY, RUNNING_VM_STATES, InstanceRecord
from vmready.hypervisor import SerialLayout
from vmready.lifecycle import LIFECYCLE, Event
from vmready.protocols import (
    DEFAULT_KEEP,
    DEFAULT_MAX_BYTES,
    PemRedactor,
    TranscriptWriter,
    body_fields,
    data_fields,
    looks_secret,
    redact_json,
)

if TYPE_CHECKING:
    from vmready.lifecycle import Lifecycle

EVENTS_PATH = "/1.0/events"
_SOURCE_PREFIX = "/1.0/instances/"


def transcript_path(directory: str, instance: str) -> str:
    """Where an instance's transcript is written."""
    return os.path.join(directory, f"{instance}.jsonl")


class InstanceRecorder:
    """Writes one instance's session: what the guest sent, what the host did."""

    def __init__(self, writer: TranscriptWriter) -> None:
        self.writer = writer
        # Ids go on from the continued file's: unique per file, so answers pair right.
        self._next_id = writer.last_id
        # One per stream: a PEM block split across chunks is redacted whole.
        self._reads = PemRedactor()
        self._writes = PemRedactor()

    def ring_read(self, chunk: bytes) -> None:
        """A drained ``ringbuf-read`` (only non-empty ones are worth a line)."""
        if chunk:
            self.writer.write("ring-read", **data_fields(chunk, self._reads))

    def ring_write(self, data: bytes) -> None:
        """A ``ringbuf-write`` that QEMU accepted."""
        self.writer.write("ring-write", **data_fields(data, self._writes))

    def qmp_event(self, name: str, data: dict[str, Any]) -> None:
        """An asynchronous QMP event of the instance's VM."""
        self.writer.write("qmp-event", event=name, data=redact_json(data))

    def operator_action(self, action: str, params: dict[str, Any]) -> None:
        """An operator's action on the instance, with its validated parameters.

        The replay cannot know what an operator did: this is one of the host's
        inputs, and ``vmready replay`` runs the same action at the same time.
        """
        self.writer.write("operator-action", action=action, params=redact_json(params))

    def state(self, action: str, context: dict[str, Any]) -> None:
        """A lifecycle event of the instance (``instance-state``, ``instance-agent-*`` …)."""
        self.writer.write("state", action=action, context=redact_json(context))

    def daemon_start(self, port: int | None) -> None:
        """A restarted daemon continues this session, advertising ``port``."""
        self.writer.write("daemon-start", port=port if port is not None else 0)

    def guest_request(self, method: str, path: str, body: bytes) -> int:
        """A guest API request of this instance; returns its id for the answer."""
        self._next_id += 1
        self.writer.write(
            "guest-request", id=self._next_id, method=method, path=path, **body_fields(body)
        )
        return self._next_id

    def guest_response(
        self, request_id: int, status: int, body: bytes, stream: bool, secret: bool
    ) -> None:
        """The answer to request ``request_id`` (a stream: its status only)."""
        if stream:
            self.writer.write("guest-response", id=request_id, status=status, stream=True)
            return
        self.writer.write(
            "guest-response", id=request_id, status=status, **body_fields(body, secret)
        )

    def close(self) -> None:
        """The session ends (instance deleted, recording switched off, daemon stopping)."""
        self.writer.close()


class Recorders:
    """Which instances are recorded, and their recorders."""

    log = Logger()

    def __init__(
        self,
        lifecycle: Lifecycle,
        directory: str,
        record_all: bool = False,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.lifecycle = lifecycle
        self.directory = directory
        self.record_all = record_all
        self.max_bytes = max_bytes
        self.keep = keep
        self._monotonic = monotonic
        self._wall = wall
        self._decided: dict[str, InstanceRecorder | None] = {}
        # Instances whose transcript this daemon already opened: continuing one of them
        # again (recording switched off and on) is no daemon start.
        self._opened: set[str] = set()
        self._keyed = self._any_keyed()
        self._unsubscribe = lifecycle.events.subscribe(self._event, frozenset({LIFECYCLE}))

    @property
    def maybe_recording(self) -> bool:
        """Whether any instance may be recorded at all (else every hook can skip at once)."""
        return self.record_all or self._keyed

    def _any_keyed(self) -> bool:
        return any(
            record.config.get(RECORD_KEY) == "true"
            for record in self.lifecycle.store.view.list_instances()
        )

    def wanted(self, record: InstanceRecord) -> bool:
        """Whether ``record`` is recorded: its ``vmready.record`` key, else the daemon's choice."""
        key = record.config.get(RECORD_KEY)
        if key is not None:
            return key == "true"
        return self.record_all

    def recorder_for(self, name: str) -> InstanceRecorder | None:
        """The instance's recorder, opened on first use; None when it is not recorded."""
        if name in self._decided:
            return self._decided[name]
        if not self.maybe_recording:
            return None
        record = self.lifecycle.store.view.find_instance(name)
        recorder = None
        if record is not None and self.wanted(record):
            try:
                recorder = self._open(record)
            except OSError as e:
                self.log.warn(
                    "cannot record {name} in {directory}: {error}",
                    name=name,
                    directory=self.directory,
                    error=e,
                )
        self._decided[name] = recorder
        return recorder

    def _open(self, record: InstanceRecord) -> InstanceRecorder:
        from vmready.lifecycle import agent_chardev

        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        lifecycle = self.lifecycle
        guest = lifecycle.reach.link
        layout = self.layout_for(record)
        spec = lifecycle.specs.spec_for(record, layout)
        creating = record.vm_state.value == "building"
        header: dict[str, Any] = {
            "side": "host",
            "instance": record.name,
            "uuid": record.uuid,
            "host_port": guest.port if guest is not None else None,
            "origin": "create" if creating else "adopt",
            "memory_mib": record.memory_mib,
            "cpus": record.cpus,
            "config": redact_json(
                {
                    key: value
                    for key, value in record.config.items()
                    if not key.startswith("volatile.")
                }
            ),
            "layout": layout.name,
            "ring_size": spec.ring_size,
            "chardev": agent_chardev(spec),
        }
        if guest is not None:
            header["poll"] = guest.intervals.as_mapping()
        writer = TranscriptWriter(
            transcript_path(self.directory, record.name),
            header,
            monotonic=self._monotonic,
            max_bytes=self.max_bytes,
            keep=self.keep,
            wall=self._wall,
        )
        recorder = InstanceRecorder(writer)
        if writer.appended and record.name not in self._opened:
            recorder.daemon_start(guest.port if guest is not None else None)
        self._opened.add(record.name)
        self.log.info("recording {name} to {path}", name=record.name, path=writer.path)
        return recorder

    def layout_for(self, record: InstanceRecord) -> SerialLayout:
        """The serial layout the instance's VM runs with, or will when it is next started.

        A running VM keeps the layout it was started with; any other is started
        with this daemon's (``Lifecycle._launch`` records it only then).
        """
        # A running VM keeps the layout it was started with.
        if record.vm_state in RUNNING_VM_STATES:
            return self.lifecycle.specs.layout_of(record)
        return self.lifecycle.booting.serial_layout

    def _event(self, event: Event) -> None:
        source = str(event.metadata.get("source", ""))
        if not source.startswith(_SOURCE_PREFIX):
            return
        name = source[len(_SOURCE_PREFIX) :]
        action = str(event.metadata.get("action", ""))
        if action in ("instance-created", "instance-updated"):
            self._keyed = self._any_keyed()
        if action == "instance-updated" and RECORD_KEY in event.metadata.get("context", {}).get(
            "config", {}
        ):
            self._forget(name)
        recorder = self.recorder_for(name)
        if recorder is not None:
            recorder.state(action, dict(event.metadata.get("context") or {}))
        if action == "instance-deleted":
            self._forget(name)

    def _forget(self, name: str) -> None:
        recorder = self._decided.pop(name, None)
        if recorder is not None:
            recorder.close()

    def close(self) -> None:
        """Close every transcript (the daemon stops)."""
        self._unsubscribe()
        for name in list(self._decided):
            self._forget(name)


@implementer(IResource)
class RecordingGuestResource:
    """The guest API's resource, recording each request and answer of a recorded instance."""

    isLeaf = True

    def __init__(
        self,
        inner: IResource,
        identify: Callable[[IRequest], InstanceRecord | None],
        recorders: Recorders,
    ) -> None:
        self.inner = inner
        self.identify = identify
        self.recorders = recorders

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise TypeError("the recorded guest API has fixed routes: add routes to GuestAPI")

    def render(self, request: IRequest) -> Any:
        """The inner resource's answer; a recorded instance's request and answer recorded.

        Served by a ``guest_site``: its ``LocalRequest`` shows the answer as it is written.
        """
        if not isinstance(request, LocalRequest):
            raise TypeError("a recorded guest API is served by a guest_site (LocalRequest)")
        if not self.recorders.maybe_recording:
            return self.inner.render(request)
        record = self.identify(request)
        recorder = self.recorders.recorder_for(record.name) if record is not None else None
        if recorder is None:
            return self.inner.render(request)
        content = request.content
        body = b""
        if content is not None:
            content.seek(0)
            body = content.read()
            content.seek(0)
        method = request.method.decode("ascii", "replace")
        path = request.uri.decode("utf-8", "replace")
        request_id = recorder.guest_request(method, path, body)
        stream = method == "GET" and path.split("?")[0] == EVENTS_PATH
        # A config value whose key looks secret is never written.
        secret = path.startswith("/1.0/config/") and looks_secret(path)
        written: list[bytes] = []

        def observe(data: bytes) -> None:
            if stream and not written:
                recorder.guest_response(request_id, request.code, b"", True, False)
            written.append(data)

        def finished(_: object) -> None:
            if stream:
                if not written:
                    recorder.guest_response(request_id, request.code, b"", True, False)
                return
            recorder.guest_response(request_id, request.code, b"".join(written), False, secret)

        request.body_observer = observe
        request.notifyFinish().addBoth(finished)
        return self.inner.render(request)
