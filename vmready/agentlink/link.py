"""The host's side of one agent link, without I/O: when to read, when to write CONNECT.

One ``AgentLink`` per running instance decides, from what the ring buffer
showed and what QEMU reported, the next thing the daemon should do: read the
ring at once on a port event or any other QMP event, follow up a promised line
with reads from ``follow_up`` seconds doubling, take an agent whose port stayed
closed past ``reopen_grace`` (or that fell silent) as stopped, read an
agentless VM with backoff and everything else at the slow ``safety`` pace;
write ``CONNECT`` whenever a STARTED line arrives and once at daemon start; and
which status change to announce.  docs/protocol.md ("When the daemon reads the
ring") gives the rules and their reasons.

The daemon feeds it inputs (``vm_started``, ``vm_stopped``, ``port_changed``,
``qmp_event``, ``ring_read``, ``connect_written``) and carries out the
returned ``Command`` objects; ``next_poll_delay`` says when to read next.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
from twisted.logger import Logger

from vmready.protocols import (
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
_ALIVE = (AgentStatus.STARTED, AgentStatus.CONNECTED)


@attrs.frozen
class PollIntervals:
    """When the agent link reads without an event, in seconds (configurable)."""

    # The first follow-up read after an event that promises a line; each next waits twice as long.
    follow_up: float = 0.05
    # How long follow-ups go on before the link waits for the next event again.
    follow_up_window: float = 10.0
    # The first read of a VM whose agent never appeared; each next waits twice as long (to safety).
    agentless_first: float = 1.0
    # The slow read that remains without events.
    safety: float = 120.0
    # A port closed this long without a STOPPED line: its agent is gone.  More than QEMU's
    # one-second limit on VSERPORT_CHANGE: an announcing agent's reopening may come that late.
    reopen_grace: float = 2.5
    # An agent repeats its status every heartbeat (5 s); this long without a line, it is gone.
    silence_timeout: float = 15.0

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(PollIntervals):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"agent link interval {field.name} must be positive")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> PollIntervals:
        """The intervals a transcript header recorded; unknown or unusable keys are ignored."""
        known = {field.name for field in attrs.fields(cls)}
        chosen: dict[str, float] = {}
        for key, value in values.items():
            if key not in known or isinstance(value, bool):
                continue
            if isinstance(value, int | float | str):
                try:
                    number = float(value)
                except ValueError:
                    continue
                if math.isfinite(number) and number > 0:
                    chosen[key] = number
        return cls(**chosen)

    def as_mapping(self) -> dict[str, float]:
        """The intervals by name, as a transcript header records them."""
        return {field.name: getattr(self, field.name) for field in attrs.fields(PollIntervals)}


@attrs.frozen
class WriteConnect:
    """Send this line to the guest (its ``vmready.connect`` port)."""

    line: bytes


@attrs.frozen
class StatusChanged:
    """The agent status changed; announce it (``instance-agent-<new>``)."""

    previous: AgentStatus
    current: AgentStatus
    # Why the agent is taken as stopped when it never said so (killed, hung); None: it said.
    lost: str | None = attrs.field(default=None, eq=False)
    # What else made the change, if the caller said (its VM stopped, its guest rebooted).
    cause: str | None = attrs.field(default=None, eq=False)

    @property
    def event_action(self) -> str:
        """The lifecycle event name for the new status."""
        return f"instance-agent-{self.current.value}"


Command = WriteConnect | StatusChanged


@attrs.define
class _FollowUp:
    """Reads after an event that promises a line: since when, how many so far, for what."""

    since: float
    awaiting_connected: bool
    reads: int = 0


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
        self._poll_now = False
        # What the read under way is for: an event's, or a follow-up awaiting a new agent.
        self._reading_on_event = False
        self._reading_for_new_agent = False
        # When the agent last said anything, counted only while the VM runs (None: not yet).
        self._last_heard: float | None = None
        self._follow_up: _FollowUp | None = None
        # The agent's port: None until an event says; then open or closed (since when).
        self._port_open: bool | None = None
        self._port_closed_at: float | None = None
        # Whether an agent ever showed itself (a port event or a line) since the VM started.
        self._agent_seen = False
        self._quiet_reads = 0
        # Why the agent was last taken as stopped without saying STOPPED (None: it said).
        self._lost: str | None = None

    @property
    def status(self) -> AgentStatus:
        """What the agent last said (unknown before anything)."""
        return self.reader.status

    @property
    def connect_outstanding(self) -> bool:
        """A CONNECT was written and the agent has not yet said CONNECTED."""
        return self._follow_up is not None and self._follow_up.awaiting_connected

    @property
    def port_open(self) -> bool | None:
        """Whether the guest holds the agent's port open (None: no event has said yet)."""
        return self._port_open

    def vm_started(self, advertise: bool = True) -> list[Command]:
        """The VM runs (launched, or adopted at daemon start): read at once, maybe advertise."""
        self.vm_running = True
        self._poll_now = True
        self._last_heard = None
        self._agent_seen = False
        self._quiet_reads = 0
        self._port_open = None
        self._port_closed_at = None
        self._follow_up = None
        self._reading_on_event = True  # the advertisement answers the start, an event
        return [self._connect()] if advertise else []

    def vm_stopped(self, cause: str | None = None) -> list[Command]:
        """The VM is gone: no more reads; the agent is stopped with it (``cause``: why)."""
        self.vm_running = False
        self._follow_up = None
        self._last_heard = None
        self._port_open = None
        self._port_closed_at = None
        previous = self.reader.status
        self.reader = RingBufferReader()  # the next boot is a new stream
        if previous in (AgentStatus.UNKNOWN, AgentStatus.STOPPED):
            self.reader.status = previous
            return []
        self.reader.status = AgentStatus.STOPPED
        return [StatusChanged(previous, AgentStatus.STOPPED, cause=cause)]

    def vm_paused(self) -> None:
        """The vCPUs stopped (freeze): the agent cannot speak, so do not read; its status stays."""
        self.vm_running = False
        self._poll_now = False
        self._last_heard = None  # a paused agent is silent, not gone

    def vm_resumed(self, now: float) -> None:
        """The vCPUs run again: read at once, without a new CONNECT (the port is unchanged)."""
        self.vm_running = True
        self._poll_now = True
        self._last_heard = None
        if self._port_closed_at is not None:
            self._port_closed_at = now  # the grace starts again: a frozen agent could not reopen

    def port_changed(self, is_open: bool, now: float) -> None:
        """``VSERPORT_CHANGE`` for the agent's port: read at once.

        A port that opens while no agent is known to run is a new agent: follow
        up until it says something.  A port that closes starts the grace after
        which an agent that said no STOPPED is taken as gone.
        """
        self._poll_now = True
        self._agent_seen = True
        was_closed = self._port_open is False
        self._port_open = is_open
        if not is_open:
            self._port_closed_at = now
            return
        self._port_closed_at = None
        # Maybe a new agent: none ran, or the port was closed (its agent killed and another
        # started, which may not announce).  An announcing agent's reopening looks the same
        # and costs a few reads, until its next heartbeat; status changes are rare.
        new_agent = self.reader.status not in _ALIVE or was_closed
        if new_agent and self._follow_up is None:
            self._follow_up = _FollowUp(since=now, awaiting_connected=False)

    def qmp_event(self) -> None:
        """Something else happened to the VM: read the ring buffer once more, right away."""
        self._poll_now = True

    def read_started(self) -> None:
        """A ``ringbuf-read`` is on its way: an event from now on asks for another one."""
        self._reading_on_event = self._poll_now
        follow_up = self._follow_up
        self._reading_for_new_agent = follow_up is not None and not follow_up.awaiting_connected
        self._poll_now = False

    def read_failed(self, now: float) -> None:
        """A ``ringbuf-read`` failed: try again at the usual pace, not at once (no busy loop).

        A follow-up counts it as one of its reads, and ends with its window as usual.
        """
        self._quiet_reads += 1
        self._follow_up_read(False, now)

    def connect_written(self, now: float) -> None:
        """The CONNECT line reached QEMU: follow up until the agent says CONNECTED.

        Only a CONNECT that answers an event (the VM's start, a port change, a QMP
        event) or a new agent's first line starts follow-ups; one that answers a
        STARTED heard on a follow-up or a safety read does not, and a running
        follow-up keeps its window.  An agent that cannot reach the host repeats
        STARTED every heartbeat: without this rule each CONNECT's follow-ups would
        hear the next one and start another, for ever.
        """
        follow_up = self._follow_up
        if follow_up is not None and follow_up.awaiting_connected:
            return
        if self._reading_on_event or self._reading_for_new_agent:
            self._follow_up = _FollowUp(since=now, awaiting_connected=True)

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
        if heard:
            self._agent_seen = True
            self._quiet_reads = 0
        else:
            self._quiet_reads += 1
        self._follow_up_read(heard, now)
        self._judge_silence(heard, now)
        current = self.reader.status
        if current is not previous:
            lost = self._lost if current is AgentStatus.STOPPED else None
            commands.insert(0, StatusChanged(previous, current, lost))
        self._lost = None
        return commands

    def _follow_up_read(self, heard: bool, now: float) -> None:
        follow_up = self._follow_up
        if follow_up is None:
            return
        if not self._reading_on_event:
            follow_up.reads += 1  # a read the event asked for is not one of its follow-ups
        if follow_up.awaiting_connected:
            done = self.reader.status is AgentStatus.CONNECTED
        else:
            done = heard
        if done:
            self._follow_up = None
        elif now - follow_up.since >= self.intervals.follow_up_window:
            self._follow_up = None
            if follow_up.awaiting_connected:
                self.log.info(
                    "{name}: no CONNECTED after CONNECT; waiting for STARTED", name=self.name
                )

    def _judge_silence(self, heard: bool, now: float) -> None:
        """Whether an agent said to be running is gone: its port closed, or it fell silent."""
        if heard or self._last_heard is None:
            self._last_heard = now
        if self.reader.status not in _ALIVE:
            return
        closed_at = self._port_closed_at
        if closed_at is not None and now - closed_at >= self.intervals.reopen_grace:
            # Closed without a word and not reopened: killed (SIGKILL, an OOM kill).
            self.log.info(
                "{name}: the agent's port closed without STOPPED; taking it as stopped",
                name=self.name,
            )
            self._taken_as_stopped("closed its port without STOPPED")
        elif not heard and now - self._last_heard >= self.intervals.silence_timeout:
            # Its heartbeat stopped while the port stayed open: a hung guest or agent.
            self.log.info(
                "{name}: the agent said nothing for {silence:g}s; taking it as stopped",
                name=self.name,
                silence=now - self._last_heard,
            )
            self._taken_as_stopped(
                f"said nothing for {now - self._last_heard:.1f}s (no heartbeat)"
            )

    def _taken_as_stopped(self, why: str) -> None:
        self.reader.status = AgentStatus.STOPPED
        self._lost = why
        if self._follow_up is not None and self._follow_up.awaiting_connected:
            self._follow_up = None

    def next_poll_delay(self) -> float | None:
        """Seconds from now until the next ``ringbuf-read``; None while the VM is not running.

        Asked right after a read or an event: the delays count from then.
        """
        if not self.vm_running:
            return None
        if self._poll_now:
            return 0.0
        intervals = self.intervals
        if self._port_closed_at is not None and self.reader.status in _ALIVE:
            # One read when the grace ends: STOPPED unless the port reopened by then.
            return intervals.reopen_grace
        follow_up = self._follow_up
        if follow_up is not None:
            return float(min(intervals.follow_up * 2**follow_up.reads, intervals.follow_up_window))
        if not self._agent_seen and self.reader.status is AgentStatus.UNKNOWN:
            # No agent yet: back off, up to the safety read; a port event wakes it at once.
            exponent = min(max(self._quiet_reads - 1, 0), 32)
            return float(min(intervals.agentless_first * 2**exponent, intervals.safety))
        return intervals.safety

    def _connect(self) -> WriteConnect:
        return WriteConnect(self.connect_line)


def _shortened(record: Noise | UndecodableLine | OverlongLine) -> object:
    """A record as a log line shows it: at most 80 characters of what the guest wrote."""
    if isinstance(record, Noise) and len(record.text) > 80:
        return Noise(record.text[:80] + "…")
    if isinstance(record, UndecodableLine) and len(record.data) > 80:
        return UndecodableLine(record.data[:80])
    return record
