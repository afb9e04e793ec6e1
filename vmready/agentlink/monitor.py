"""Carries out one instance's ``AgentLink`` against its VM: ring-buffer reads and CONNECT writes.

``AgentLink`` decides (sans I/O); ``AgentMonitor`` hands it the VM's QMP
events (``VSERPORT_CHANGE`` of the agent's port as a port change, any other
as a reason to read once), schedules the next ``ringbuf-read`` when the link
asks for one, hands what it read to the link, writes the ``CONNECT`` lines the
link asks for, and passes status changes on.  One read or write is in flight
at a time; an event that arrives meanwhile asks for another read after it.  A
monitor that stops answering is the power sync's business: here a failed read
is logged and retried at the slow pace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from vmready.agentlink.link import AgentLink, StatusChanged, WriteConnect
from vmready.domain import HypervisorError, Listeners
from vmready.protocols import AgentStatus


class RingBufferDevice(Protocol):
    """What the monitor needs of a VM (``RunningVM`` provides it)."""

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        """Drain up to ``size`` bytes."""

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        """Append ``data`` (QEMU delivers it to the guest)."""


class ConnectWriter(Protocol):
    """Where CONNECT lines go: the VM's ``vmready.connect`` port (``ConnectPort``)."""

    async def write(self, line: bytes) -> None:
        """Send ``line`` to the guest."""

    def close(self) -> None:
        """Hang up."""


class RingRecorder(Protocol):
    """Where a recorded instance's ring-buffer traffic goes (``InstanceRecorder``)."""

    def ring_read(self, chunk: bytes) -> None:
        """A drained read."""

    def ring_write(self, data: bytes) -> None:
        """A write QEMU accepted."""


StatusListener = Callable[[StatusChanged], None]


class AgentMonitor:
    """Reads one VM's agent ring buffer when its QMP events (or its ``AgentLink``) say so."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        vm: RingBufferDevice,
        link: AgentLink,
        chardev: str,
        on_status: StatusListener,
        recorder: Callable[[], RingRecorder | None] | None = None,
        connect: ConnectWriter | None = None,
        port_id: str | None = None,
    ) -> None:
        """``connect`` carries CONNECT lines to the guest; without one (a VM started by a
        vmready that gave it no ``vmready.connect`` port) they go to the ring buffer, which
        only fakeqemu delivers and real QEMU never does.  ``port_id`` is the ``id=`` of the
        port the agent writes to: its ``VSERPORT_CHANGE`` events are port changes."""
        self.clock = clock
        self.vm = vm
        self.link = link
        self.chardev = chardev
        self._status_listeners: Listeners[StatusChanged] = Listeners(
            self.log, "announcing the agent status of {name} failed"
        )
        self._status_listeners.subscribe(on_status)
        # Looked up at each read and write (recording may be switched off and on while
        # the VM runs); None when sessions are never recorded: then nothing here costs more.
        self.recorder_for = recorder
        self.reads = 0
        self.connect = connect
        self.port_id = port_id
        self._timer: IDelayedCall | None = None
        self._busy = False
        self._stopped = False
        self._missing_device = False

    @property
    def status(self) -> AgentStatus:
        """What the agent last said."""
        return self.link.status

    def start(self, advertise: bool) -> None:
        """The VM runs: poll at once; ``advertise`` writes CONNECT first (daemon start)."""
        self._stopped = False
        self._carry_out(self.link.vm_started(advertise))

    def stop(self, announce: bool = True, cause: str | None = None) -> None:
        """The VM is gone (or the daemon stops: ``announce=False``): no more polling.

        ``cause`` (its VM stopped, its guest rebooted…) goes with the announced change.
        """
        self._stopped = True
        self._cancel()
        if self.connect is not None:
            self.connect.close()
        changes = self.link.vm_stopped(cause)
        if announce:
            for change in changes:
                if isinstance(change, StatusChanged):
                    self._announce(change)

    def paused(self) -> None:
        """The vCPUs stopped: the agent cannot speak; stop polling until resumed."""
        self.link.vm_paused()
        self._cancel()

    def resumed(self) -> None:
        """The vCPUs run again."""
        self.link.vm_resumed(self.clock.seconds())
        self._schedule()

    def qmp_event(self, name: str = "", data: Mapping[str, object] | None = None) -> None:
        """A QMP event of the VM: the agent's port opened or closed, or anything else.

        Either way the ring buffer is read right away (after the read in flight, if any).
        """
        if (
            name == "VSERPORT_CHANGE"
            and data is not None
            and self.port_id is not None
            and data.get("id") == self.port_id
            and isinstance(data.get("open"), bool)
        ):
            self.link.port_changed(bool(data["open"]), self.clock.seconds())
        else:
            self.link.qmp_event()
        self._schedule()

    # -- the loop ---------------------------------------------------------

    def _cancel(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _schedule(self) -> None:
        if self._stopped or self._busy or self._missing_device:
            return
        delay = self.link.next_poll_delay()
        self._cancel()
        if delay is None:
            return
        self._timer = self.clock.callLater(delay, self._poll)

    def _poll(self) -> None:
        self._timer = None
        self._busy = True
        self.link.read_started()
        Deferred.fromCoroutine(self._read_once()).addBoth(self._polled)

    def _polled(self, result: Any) -> None:
        self._busy = False
        self._schedule()

    async def _read_once(self) -> None:
        try:
            chunk = await self.vm.ringbuf_read(self.chardev, self.link.ring_size)
        except HypervisorError as e:
            self.link.read_failed(self.clock.seconds())
            self._read_failed(e)
            return
        if self._stopped:
            return
        self.reads += 1
        recorder = self.recorder_for() if self.recorder_for is not None else None
        if recorder is not None:
            recorder.ring_read(chunk)
        now = self.clock.seconds()
        commands = self.link.ring_read(chunk, now)
        await self._write_all(commands)

    def _read_failed(self, error: HypervisorError) -> None:
        if f"Device '{self.chardev}' not found" in error.message:
            # A VM started without this chardev (another serial layout): nothing to poll.
            self._missing_device = True
            self.log.warn(
                "{name}: no agent ring buffer {chardev}: {error}",
                name=self.link.name,
                chardev=self.chardev,
                error=error.message,
            )
            return
        if not self._stopped:
            self.log.info(
                "{name}: reading the agent ring buffer failed: {error}",
                name=self.link.name,
                error=error.message,
            )

    def _carry_out(self, commands: list[Any]) -> None:
        self._busy = True
        Deferred.fromCoroutine(self._write_all(commands)).addBoth(self._polled)

    async def _write_all(self, commands: list[Any]) -> None:
        for command in commands:
            if self._stopped:
                return
            if isinstance(command, StatusChanged):
                self._announce(command)
            elif isinstance(command, WriteConnect):
                try:
                    if self.connect is not None:
                        await self.connect.write(command.line)
                    else:
                        await self.vm.ringbuf_write(self.chardev, command.line)
                except HypervisorError as e:
                    self.log.info(
                        "{name}: writing CONNECT failed: {error}",
                        name=self.link.name,
                        error=e.message,
                    )
                    continue
                recorder = self.recorder_for() if self.recorder_for is not None else None
                if recorder is not None:
                    recorder.ring_write(command.line)
                self.link.connect_written(self.clock.seconds())

    def _announce(self, change: StatusChanged) -> None:
        self._status_listeners.notify(change, name=self.link.name)
