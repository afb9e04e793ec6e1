"""The host's side of one agent link, without I/O: when to poll, when to write CONNECT.

One ``AgentLink`` per running instance decides, from what the ring buffer
showed and what QEMU reported, the next thing the daemon should do:

- how long until the next ``ringbuf-read``: fast while a CONNECT is
  outstanding, slower while the agent is STARTED or unknown, slowest once it
  is CONNECTED, never while the VM is not running, and at once after any QMP
  event;
- when to write ``CONNECT <cid>:<port>``: whenever a STARTED line arrives (the
  agent repeats STARTED until it reaches the host, so a lost CONNECT is
  retried on the next heartbeat), and once at daemon start for every running
  VM, because the daemon's port is new;
- which status change to announce (``instance-agent-started`` …).

The daemon feeds it inputs (``vm_started``, ``vm_stopped``, ``qmp_event``,
``ring_read``, ``connect_written``, ``tick``) and carries out the returned
``Command`` objects with its QMP client; tests do the same with a list.
"""

from __future__ import annotations

import attrs
from twisted.logger import Logger

from vmready.protocols.ringbuffer import (
    AgentStatus,
    DiscardedFragment,
    HostEcho,
    Noise,
    OverlongLine,
    RingBufferReader,
    StatusLine,
    TcpHostEcho,
    UndecodableLine,
    format_connect,
)

HOST_CID = 2


@attrs.frozen
class PollIntervals:
    """Seconds between ring-buffer reads in each situation (configurable)."""

    connecting: float = 0.05
    started: float = 0.25
    connected: float = 1.0
    connect_timeout: float = 10.0
    # An agent repeats its status every heartbeat (5 s); this long without a line, it is gone.
    silence_timeout: float = 15.0

    def __attrs_post_init__(self) -> None:
        for name in ("connecting", "started", "connected", "connect_timeout", "silence_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"poll interval {name} must be positive")


@attrs.frozen
class WriteConnect:
    """Write this line to the ring buffer with ``ringbuf-write``."""

    line: bytes


@attrs.frozen
class StatusChanged:
    """The agent status changed; announce it (``instance-agent-<new>``)."""

    previous: AgentStatus
    current: AgentStatus

    @property
    def event_action(self) -> str:
        """The lifecycle event name for the new status."""
        return f"instance-agent-{self.current.value}"


Command = WriteConnect | StatusChanged


class AgentLink:
    """The agent-link state of one instance, driven by inputs, answering with commands."""

    log = Logger()

    def __init__(
        self,
        name: str,
        ring_size: int,
        port: int,
        intervals: PollIntervals | None = None,
        connect: bytes | None = None,
    ) -> None:
        """``connect`` is the line to advertise (default: ``CONNECT 2:<port>``)."""
        self.name = name
        self.ring_size = ring_size
        self.port = port
        self.connect_line = connect if connect is not None else format_connect(HOST_CID, port)
        self.intervals = intervals or PollIntervals()
        self.reader = RingBufferReader()
        self.vm_running = False
        self.connect_sent_at: float | None = None
        self._poll_now = False
        # When the agent last said anything, counted only while the VM runs (None: not yet).
        self._last_heard: float | None = None

    @property
    def status(self) -> AgentStatus:
        """What the agent last said (unknown before anything)."""
        return self.reader.status

    @property
    def connect_outstanding(self) -> bool:
        """A CONNECT was written and the agent has not yet said CONNECTED."""
        return self.connect_sent_at is not None

    def vm_started(self, advertise: bool = True) -> list[Command]:
        """The VM runs (launched, or adopted at daemon start): advertise our address at once."""
        self.vm_running = True
        self._poll_now = True
        self._last_heard = None
        return [self._connect()] if advertise else []

    def vm_stopped(self) -> list[Command]:
        """The VM is gone or paused for good: stop polling; the agent is stopped with it."""
        self.vm_running = False
        self.connect_sent_at = None
        self._last_heard = None
        previous = self.reader.status
        self.reader = RingBufferReader()  # the next boot is a new stream
        if previous in (AgentStatus.UNKNOWN, AgentStatus.STOPPED):
            self.reader.status = previous
            return []
        self.reader.status = AgentStatus.STOPPED
        return [StatusChanged(previous, AgentStatus.STOPPED)]

    def vm_paused(self) -> None:
        """The vCPUs stopped (freeze): the agent cannot speak, so do not poll; its status stays."""
        self.vm_running = False
        self._poll_now = False
        self._last_heard = None  # a paused agent is silent, not gone

    def vm_resumed(self) -> None:
        """The vCPUs run again: poll at once, without a new CONNECT (the port is unchanged)."""
        self.vm_running = True
        self._poll_now = True
        self._last_heard = None

    def qmp_event(self) -> None:
        """Something happened to the VM: read the ring buffer once more, right away."""
        self._poll_now = True

    def read_started(self) -> None:
        """A ``ringbuf-read`` is on its way: an event from now on asks for another one."""
        self._poll_now = False

    def read_failed(self) -> None:
        """A ``ringbuf-read`` failed: try again at the usual pace, not at once (no busy loop)."""
        self._poll_now = False

    def connect_written(self, now: float) -> None:
        """The CONNECT line reached QEMU: poll fast until the agent answers."""
        self.connect_sent_at = now

    def ring_read(self, chunk: bytes, now: float) -> list[Command]:
        """One drained ``ringbuf-read`` (raw bytes): status changes and CONNECTs to write."""
        previous = self.reader.status
        commands: list[Command] = []
        ignored: list[Noise | UndecodableLine | OverlongLine] = []
        heard = False
        for record in self.reader.feed(chunk, buffer_size=self.ring_size):
            if isinstance(record, StatusLine):
                heard = True
                if record.status is AgentStatus.STARTED and not any(
                    isinstance(command, WriteConnect) for command in commands
                ):
                    # One answer per read, however many STARTED lines piled up.
                    commands.append(self._connect())
                elif record.status is AgentStatus.CONNECTED:
                    self.connect_sent_at = None
            elif isinstance(record, HostEcho | TcpHostEcho | DiscardedFragment):
                continue
            elif isinstance(record, Noise | UndecodableLine | OverlongLine):
                ignored.append(record)
        if ignored:
            # One line per read, however much noise the guest wrote: a guest cannot flood
            # the daemon's log (a 64 KiB read could otherwise log 30,000 lines).
            self.log.warn(
                "{name}: ignored {count} line(s) on the agent's serial line, the first: {first!r}",
                name=self.name,
                count=len(ignored),
                first=_shortened(ignored[0]),
            )
        if heard or self._last_heard is None:
            self._last_heard = now
        elif (
            self.reader.status in (AgentStatus.STARTED, AgentStatus.CONNECTED)
            and now - self._last_heard >= self.intervals.silence_timeout
        ):
            # Killed without a word (SIGKILL, a guest hang): its heartbeat stopped.
            self.log.info(
                "{name}: the agent said nothing for {silence:g}s; taking it as stopped",
                name=self.name,
                silence=now - self._last_heard,
            )
            self.reader.status = AgentStatus.STOPPED
            self.connect_sent_at = None
        current = self.reader.status
        if current is not previous:
            commands.insert(0, StatusChanged(previous, current))
        return commands

    def tick(self, now: float) -> None:
        """Time passes: an unanswered CONNECT expires, back to the STARTED pace."""
        sent = self.connect_sent_at
        if sent is not None and now - sent >= self.intervals.connect_timeout:
            self.log.info(
                "{name}: no CONNECTED after CONNECT; waiting for STARTED", name=self.name
            )
            self.connect_sent_at = None

    def next_poll_delay(self) -> float | None:
        """Seconds until the next ``ringbuf-read``; None while the VM is not running."""
        if not self.vm_running:
            return None
        if self._poll_now:
            return 0.0
        if self.connect_outstanding:
            return self.intervals.connecting
        if self.reader.status is AgentStatus.CONNECTED:
            return self.intervals.connected
        return self.intervals.started

    def _connect(self) -> WriteConnect:
        return WriteConnect(self.connect_line)


def _shortened(record: Noise | UndecodableLine | OverlongLine) -> object:
    """A record as a log line shows it: at most 80 characters of what the guest wrote."""
    if isinstance(record, Noise) and len(record.text) > 80:
        return Noise(record.text[:80] + "…")
    if isinstance(record, UndecodableLine) and len(record.data) > 80:
        return UndecodableLine(record.data[:80])
    return record
