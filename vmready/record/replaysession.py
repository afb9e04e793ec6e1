"""One replay's walk through its transcript: the guest's inputs fed at their recorded times.

From a host transcript, each non-empty ``ring-read`` is what the host's next
``ringbuf-read`` at or after its time returns, byte for byte.  From an agent
transcript, each ``serial-out`` is written into the VM's port at its time, as
the agent did.  ``guest-request``/``host-request`` records are sent through the
guest API at their time; a ``daemon-start`` (or, agent side, a CONNECT naming a
new port) replaces the core with a new one on the same store, as a restart
does.  Operator actions and the guest's own power actions are performed again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from vmready.api import BytesProducer
from vmready.domain import VMReadyError
from vmready.protocols import body_fields, body_from_fields, data_from_fields, looks_secret
from vmready.protocols.transcriptreader import Entry, Transcript
from vmready.record.divergence import ReplayResult, compare
from vmready.record.recording import EVENTS_PATH
from vmready.record.replaycore import ReplayCore
from vmready.record.replayinputs import (
    connect_ports,
    failed_in_recording,
    guest_power_action,
    host_lost,
)
from vmready.record.replayoutputs import Outputs, operator_text, short
from vmready.record.replaysetup import replay_setup

# After the last record: how long the host may still act on what it was fed.
_SETTLE_SECONDS = 3.0
# How long past the last record a ring-read may wait for the host's next read.
_DELIVERY_GRACE = 30.0


class ReplaySession:
    """One replay: the core, the clock, the guest's inputs, the host's outputs."""

    def __init__(self, transcript: Transcript, clock: Clock | None = None) -> None:
        self.transcript = transcript
        self.header = transcript.header
        self.side = transcript.side
        self.setup = replay_setup(transcript)
        self.name = self.setup.name
        self.clock = clock if clock is not None else Clock()
        self.outputs = Outputs(self.clock.seconds, self.side, self.name)
        self.core = ReplayCore(self.setup, self.clock, self.outputs, self.next_recorded_read)
        self._reads: list[Entry] = []
        self._pending_requests: list[Deferred[Any]] = []
        # The records in the order they are replayed: by recorded time.
        self.records = sorted(transcript.entries, key=lambda entry: entry.t)

    # -- the walk ---------------------------------------------------------

    def begin(self) -> None:
        """Build the core (and boot or adopt the VM) as the recorded session began."""
        # Known in advance: each is handed to the first host read at or after its time.
        self._reads = [
            e for e in self.records if e.kind == "ring-read" and data_from_fields(e.fields)
        ]
        self.core.start()

    def play(self, entry: Entry) -> None:
        """Run the core up to ``entry``'s recorded time, then replay it."""
        core = self.core
        core.run_until(entry.t)
        if self.side == "host" and entry.kind == "daemon-start":
            core.restart(int(entry.fields["port"]))
        elif self.side == "agent" and entry.kind == "serial-in":
            for port in connect_ports(data_from_fields(entry.fields)):
                if port != core.port or core.down:
                    core.restart(port)
        else:
            if self.side == "agent" and entry.kind == "serial-out" and self._host_lost(entry):
                core.stop()
            self._feed(entry)

    def finish(self) -> None:
        """Let the host act on what it was fed: late reads, then a few settling seconds."""
        records = self.records
        last = records[-1].t if records else 0.0
        while self._reads and self.clock.seconds() < last + _DELIVERY_GRACE:
            self.core.run_until(self.clock.seconds() + 0.1)
        self.core.run_until(max(self.clock.seconds(), last) + _SETTLE_SECONDS)

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

    def result(self) -> ReplayResult:
        """Compare what the host did with the recording."""
        return compare(self.transcript, self.outputs)

    def close(self) -> None:
        """Let go of everything (nothing real runs; only the temporary run dir remains)."""
        self.core.close()

    # -- inputs -----------------------------------------------------------

    def next_recorded_read(self, size: int) -> bytes:
        """What the host's ``ringbuf-read`` now returns: the next recorded read that is due."""
        if self._reads and self._reads[0].t <= self.clock.seconds() + 1e-9:
            return data_from_fields(self._reads.pop(0).fields)[:size]
        return b""

    def _host_lost(self, entry: Entry) -> bool:
        """Agent side: whether the agent's ``serial-out`` at ``entry`` shows its host is gone."""
        if self.core.down or self.core.port == 0:
            return False
        return host_lost(self.records, entry, self.core.port)

    def _feed(self, entry: Entry) -> None:
        core = self.core
        if entry.kind == "ring-read" and self._reads and self._reads[0] is entry:
            # The recorded host read at this moment: so does this one (a poll at once, as
            # after a QMP event), so what it reads is seen in step with the guest's requests.
            lifecycle = core.lifecycle
            monitor = lifecycle.running.monitors.get(self.name) if lifecycle else None
            if monitor is not None:
                monitor.qmp_event()
                core.settle()
        elif entry.kind == "serial-out" and core.guest is not None and core.guest.open:
            core.guest.write(data_from_fields(entry.fields))
            core.settle()
        elif entry.kind in ("guest-request", "host-request"):
            if failed_in_recording(self.transcript.entries, entry):
                return
            self._send(entry)
            core.settle()
        elif entry.kind == "operator-action":
            self._operate(entry)
        elif entry.kind == "qmp-event":
            action = guest_power_action(entry)
            if action is not None:
                self._guest_does(action)

    def _send(self, entry: Entry) -> None:
        method = str(entry.fields["method"])
        path = str(entry.fields["path"])
        body = body_from_fields(entry.fields)
        request_id = int(entry.fields["id"])
        stream = method == "GET" and path.split("?")[0] == EVENTS_PATH
        headers = Headers({b"Content-Type": [b"application/json"]}) if body else None
        producer = BytesProducer(body) if body or method in ("PATCH", "PUT", "POST") else None
        sent: Deferred[IResponse] = self.core.agent.request(
            method.encode("ascii"), b"http://vmready" + path.encode("utf-8"), headers, producer
        )
        secret = path.startswith("/1.0/config/") and looks_secret(path)
        answered = self.outputs.answered

        def got(response: IResponse) -> Deferred[None] | None:
            status = int(response.code)
            if stream:
                answered(request_id, status, None)
                return None

            def read(raw: bytes) -> None:
                answered(request_id, status, body_fields(raw, secret))

            return readBody(response).addCallback(read)

        done = sent.addCallback(got)
        done.addErrback(lambda failure: answered(request_id, 0, None, failure.value))
        self._pending_requests.append(done)

    def _operate(self, entry: Entry) -> None:
        """An operator's recorded action: the same ``Lifecycle.act`` call, now."""
        action = str(entry.fields["action"])
        params = dict(entry.fields["params"])
        key: Any = ("operator", action)
        text = operator_text(action, params)
        assert self.core.lifecycle is not None
        # The replayed store runs inline: a refusal is known before ``act`` returns.
        refused: list[Failure] = []
        Deferred.fromCoroutine(self.core.lifecycle.act(self.name, action, **params)).addErrback(
            refused.append
        )
        if refused:
            refused[0].trap(VMReadyError)  # anything else is the replay's own failure
            why = short(str(refused[0].value), 100)
            key, text = (*key, "refused"), f"operator {action} refused ({why})"
        self.outputs.acted(key, text)
        self.core.settle()

    def _guest_does(self, action: str) -> None:
        """The guest OS powers off, reboots or panics, through fakeqemu's control channel."""
        core = self.core
        key: Any = ("guest", action)
        text = f"guest {action}"
        vm = core.vm
        control = vm.connect_control() if vm is not None and not vm.exits else None
        core.settle()
        if control is None or not control.open:
            key, text = (*key, "failed"), f"guest {action} impossible: its VM is not running"
        else:
            control.write(action.encode("ascii") + b"\n")
            core.settle()
            if control.received != b"ok\n":
                answer = control.received.decode("utf-8", "replace").strip()
                key, text = (*key, "failed"), f"guest {action} failed ({answer or 'no answer'})"
            if control.open:
                control.close()
                core.settle()
        self.outputs.acted(key, text)
