"""The agent's side of the ring-buffer handshake, without I/O.

``AgentCore`` decides what the in-guest agent says on its serial port and when
it dials the host, from what it read there and how its dials went:

- it says its current status (``STARTED`` or ``CONNECTED``) whenever the serial
  port (re)opens and on every heartbeat, at once when the status changes, and
  ``STOPPED`` when it exits.  A line said at once is *announced*: the port is
  closed and reopened right after it, so that QEMU reports the change to the
  host as an event and the host reads it then; a heartbeat is written quietly
  (the host reads it on its slow safety read), and so is ``STOPPED``, which
  the port's closing at exit announces;
- ``CONNECT <cid>:<port>`` (vsock) or ``CONNECT tcp:<ipv4>:<port>`` (the
  fallback transport) makes it dial that address; a dial is connect, TLS,
  ``GET /1.0`` and the link watch (a held ``GET /1.0/events``).  A failed dial is
  retried ``retries`` times with a doubling delay, then it says ``STARTED`` and
  waits for the next CONNECT;
- a CONNECT for the address it is already dialing or connected to is the
  host repeating itself (it answers every ``STARTED`` with one) and is ignored;
  a CONNECT for another address (the daemon restarted on a new port) drops the
  old link and dials the new one;
- when the link watch drops it says ``STARTED`` and waits for the next CONNECT;
- after every successful dial it asks for the workload's remembered Ready to be
  reasserted, because a restarted daemon forgot it.

The service feeds it inputs and carries out the returned commands; tests do the
same with a list.  Every dial has an id, so a late result of an abandoned dial
is recognised and ignored.  Garbage on the serial line (including a malformed
``CONNECT``) is logged, precisely, and otherwise ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from vmready.agent.logs import logger
from vmready.protocols import (
    MAX_LINE_BYTES,
    AgentStatus,
    DiscardedFragment,
    HostEcho,
    Noise,
    OverlongLine,
    RingBufferReader,
    StatusLine,
    TcpHostEcho,
    UndecodableLine,
    connect_line_problem,
)

NO_CONNECT_YET = "the host has not sent CONNECT yet"

log = logger(__name__)


@dataclass(frozen=True)
class VsockAddress:
    """Where the host said its guest API listens on vsock (``CONNECT <cid>:<port>``)."""

    cid: int
    port: int

    def __str__(self) -> str:
        return f"{self.cid}:{self.port}"


@dataclass(frozen=True)
class TcpAddress:
    """Where the host said its guest API listens on TCP (``CONNECT tcp:<ipv4>:<port>``)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"tcp:{self.host}:{self.port}"


HostAddress = Union[VsockAddress, TcpAddress]


@dataclass(frozen=True)
class Backoff:
    """Delays between dial attempts: ``first``, doubling, never above ``longest``."""

    first: float = 0.5
    longest: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.first <= self.longest:
            raise ValueError("backoff delays must satisfy 0 <= first <= longest")

    def delay(self, retry: int) -> float:
        """Seconds before retry number ``retry`` (1 for the first retry)."""
        return float(min(self.first * 2 ** (retry - 1), self.longest))


@dataclass(frozen=True)
class WriteStatus:
    """Write this status line to the serial port; ``announce`` it with a close and reopen."""

    status: AgentStatus
    announce: bool = True

    @property
    def line(self) -> bytes:
        """The bytes on the wire: ``STARTED\\n`` and so on."""
        return self.status.name.encode("ascii") + b"\n"


@dataclass(frozen=True)
class Dial:
    """After ``delay`` seconds, connect to ``address``, validate it and open the link watch."""

    dial_id: int
    address: HostAddress
    delay: float = 0.0


@dataclass(frozen=True)
class AbandonDial:
    """Cancel dial ``dial_id``, whether it waits for its delay or is under way."""

    dial_id: int


@dataclass(frozen=True)
class CloseLink:
    """Close the link watch opened by dial ``dial_id``."""

    dial_id: int


@dataclass(frozen=True)
class ReassertReady:
    """Dial ``dial_id`` made a new link: if the workload declared Ready, tell the host again."""

    dial_id: int
    address: HostAddress


Command = Union[WriteStatus, Dial, AbandonDial, CloseLink, ReassertReady]


class Phase(enum.Enum):
    """Where the agent is in reaching the host."""

    WAITING = "waiting for CONNECT"
    DIALING = "dialing"
    CONNECTED = "connected"
    STOPPED = "stopped"


MAX_COOLDOWN_HEARTBEATS = 12


class AgentCore:
    """The agent's handshake state, driven by inputs, answering with commands."""

    def __init__(
        self,
        retries: int = 3,
        backoff: Backoff | None = None,
        describe: Callable[[HostAddress], str] = str,
    ) -> None:
        """``describe`` names an address in reasons (``vsock 2:1234``, a socket path)."""
        if retries < 0:
            raise ValueError("retries must be zero or more")
        self.retries = retries
        self.backoff = backoff or Backoff()
        self.describe = describe
        self.phase = Phase.WAITING
        self.status = AgentStatus.STARTED
        self.address: HostAddress | None = None
        self.unreachable_reason = NO_CONNECT_YET
        self._reader = RingBufferReader(MAX_LINE_BYTES)
        # The connect port is its own stream: a line never continues across the two ports.
        self._connect_reader = RingBufferReader(MAX_LINE_BYTES)
        self._dial_id = 0
        self._attempt = 0
        # After giving up on an address, its CONNECTs wait out this many heartbeats
        # (doubling each time, up to MAX_COOLDOWN_HEARTBEATS), so a host that cannot be
        # reached is not redialed in a tight loop; another address is dialed at once.
        self._give_ups = 0
        self._cooling: HostAddress | None = None
        self._cooldown = 0

    @property
    def link(self) -> HostAddress | None:
        """The host's address while a validated link is up, else None."""
        return self.address if self.phase is Phase.CONNECTED else None

    def serial_opened(self) -> list[Command]:
        """The serial port is (again) open: say where we are."""
        return self._say_current()

    def heartbeat(self) -> list[Command]:
        """A heartbeat is due: repeat the current status, so a restarted host notices us."""
        if self._cooldown > 0:
            self._cooldown -= 1
            if self._cooldown == 0 and self.phase is Phase.WAITING:
                # Ready to dial again: announce STARTED, so the host answers it now
                # rather than on its slow safety read.
                return self._say_current(announce=True)
        return self._say_current(announce=False)

    def data_received(self, data: bytes) -> list[Command]:
        """Bytes that arrived on the status port, in whatever pieces they came."""
        return self._records(self._reader, data)

    def connect_port_data(self, data: bytes) -> list[Command]:
        """Bytes the host wrote to the ``vmready.connect`` port (its CONNECT lines)."""
        return self._records(self._connect_reader, data)

    def _records(self, reader: RingBufferReader, data: bytes) -> list[Command]:
        if self.phase is Phase.STOPPED:
            return []
        commands: list[Command] = []
        for record in reader.feed(data):
            if isinstance(record, HostEcho):
                commands += self.connect_received(VsockAddress(record.cid, record.port))
            elif isinstance(record, TcpHostEcho):
                commands += self.connect_received(TcpAddress(record.host, record.port))
            elif isinstance(record, StatusLine):
                log.info(
                    "ignoring status line %s on the serial port (not ours to act on)",
                    record.status.name,
                )
            elif isinstance(record, Noise):
                problem = connect_line_problem(record.text)
                if record.text.startswith("CONNECT ") and problem:
                    log.warning("ignoring a malformed CONNECT line: %s", problem)
                else:
                    log.warning("ignoring serial line %r", record.text)
            elif isinstance(record, UndecodableLine):
                log.warning("ignoring a serial line that is not UTF-8: %r", record.data)
            elif isinstance(record, OverlongLine):
                log.warning(
                    "ignoring a %d-byte serial line (longer than %d bytes)",
                    record.length,
                    MAX_LINE_BYTES,
                )
            elif isinstance(record, DiscardedFragment):  # only with buffer_size; never here
                continue
        return commands

    def connect_received(self, address: HostAddress) -> list[Command]:
        """The host wrote ``CONNECT <cid>:<port>`` or ``CONNECT tcp:<ipv4>:<port>``."""
        if self.phase is Phase.STOPPED:
            return []
        if self.phase in (Phase.DIALING, Phase.CONNECTED) and address == self.address:
            log.debug("ignoring CONNECT %s: already %s there", address, self.phase.value)
            return []
        if address == self._cooling and self._cooldown > 0:
            log.debug(
                "ignoring CONNECT %s for %d more heartbeats: it just failed",
                address,
                self._cooldown,
            )
            return []
        commands = self._leave_current_link()
        self.address = address
        self.phase = Phase.DIALING
        self._attempt = 1
        self._dial_id += 1
        log.info("host says CONNECT %s: dialing %s", address, self._where)
        self.unreachable_reason = f"connecting to the host at {self._where}"
        commands.append(Dial(self._dial_id, address))
        return commands

    def dial_succeeded(self, dial_id: int) -> list[Command]:
        """Dial ``dial_id`` reached and validated the host, and its link watch is open."""
        if dial_id != self._dial_id or self.phase is not Phase.DIALING:
            return [CloseLink(dial_id)]
        assert self.address is not None
        log.info("connected to the host at %s", self._where)
        self.phase = Phase.CONNECTED
        self.unreachable_reason = ""
        self._give_ups, self._cooling, self._cooldown = 0, None, 0
        return [
            *self._set_status(AgentStatus.CONNECTED),
            ReassertReady(self._dial_id, self.address),
        ]

    def dial_failed(self, dial_id: int, reason: str) -> list[Command]:
        """Dial ``dial_id`` failed: retry after a delay, or give up and wait for a CONNECT."""
        if dial_id != self._dial_id or self.phase is not Phase.DIALING:
            return []
        assert self.address is not None
        self.unreachable_reason = f"cannot connect to the host at {self._where}: {reason}"
        if self._attempt <= self.retries:
            delay = self.backoff.delay(self._attempt)
            log.warning(
                "cannot connect to the host at %s (%s); retry %d of %d in %ss",
                self._where,
                reason,
                self._attempt,
                self.retries,
                delay,
            )
            self._attempt += 1
            self._dial_id += 1
            return [Dial(self._dial_id, self.address, delay)]
        log.warning(
            "giving up on the host at %s after %d attempts (%s); waiting for the next CONNECT",
            self._where,
            self._attempt,
            reason,
        )
        self.phase = Phase.WAITING
        self.status = AgentStatus.STARTED
        self._give_ups += 1
        self._cooling = self.address
        self._cooldown = min(2 ** (self._give_ups - 1), MAX_COOLDOWN_HEARTBEATS)
        return [WriteStatus(AgentStatus.STARTED)]  # said even unchanged: it asks for a CONNECT

    def link_lost(self, dial_id: int, reason: str) -> list[Command]:
        """The link watch opened by dial ``dial_id`` ended: the host went away."""
        if dial_id != self._dial_id or self.phase is not Phase.CONNECTED:
            return []
        log.warning(
            "lost the link to the host at %s (%s); waiting for the next CONNECT",
            self._where,
            reason,
        )
        self.phase = Phase.WAITING
        self.unreachable_reason = f"lost the link to the host at {self._where}: {reason}"
        return self._set_status(AgentStatus.STARTED)

    @property
    def _where(self) -> str:
        return self.describe(self.address) if self.address is not None else "(none)"

    def stop(self) -> list[Command]:
        """The agent exits: drop the link and say STOPPED."""
        if self.phase is Phase.STOPPED:
            return []
        commands = self._leave_current_link(say_started=False)
        self.phase = Phase.STOPPED
        self.unreachable_reason = "the agent is stopping"
        self.status = AgentStatus.STOPPED
        commands.append(WriteStatus(AgentStatus.STOPPED, announce=False))
        return commands

    def _say_current(self, announce: bool = True) -> list[Command]:
        if self.phase is Phase.STOPPED:
            return []
        return [WriteStatus(self.status, announce)]

    def _set_status(self, status: AgentStatus) -> list[Command]:
        """Change the status; a change is said at once."""
        if status is self.status:
            return []
        self.status = status
        return [WriteStatus(status)]

    def _leave_current_link(self, say_started: bool = True) -> list[Command]:
        """Abandon the dial under way or close the link, before dialing elsewhere or stopping."""
        if self.phase is Phase.DIALING:
            self.phase = Phase.WAITING
            return [AbandonDial(self._dial_id)]
        if self.phase is Phase.CONNECTED:
            self.phase = Phase.WAITING
            if not say_started:
                return [CloseLink(self._dial_id)]
            return [CloseLink(self._dial_id), *self._set_status(AgentStatus.STARTED)]
        return []
