"""``RunningVM``: one VM process vmready started or adopted, as the rest of vmready sees it.

It is made of three parts, one concern each: ``following.VMFollower`` (its
events and its process until it is gone), ``commands.VMCommands`` (the QMP
commands, each bounded by ``command_timeout``) and ``stopping.VMStopper``
(the ACPI button, ``quit``, SIGKILL).  Each command that is not a read, and
each SIGKILL, first asks ``guard`` (``acting``).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from vmready.domain import PowerState
from vmready.hypervisor.acting import ALWAYS, ActingGuard
from vmready.hypervisor.cmdline import VMSpec
from vmready.hypervisor.commands import DEFAULT_COMMAND_TIMEOUT, VMCommands
from vmready.hypervisor.following import VMFollower
from vmready.hypervisor.stopping import VMStopper
from vmready.hypervisor.vmevents import VMEvent
from vmready.protocols.qmp import QMPClientProtocol


class RunningVM:
    """A VM process vmready started or adopted, followed through its QMP monitor."""

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        spec: VMSpec,
        qmp: QMPClientProtocol,
        pid: int | None,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        guard: ActingGuard = ALWAYS,
    ) -> None:
        self.spec = spec
        self.qmp = qmp
        self._reactor = reactor
        self.follower = VMFollower(reactor, spec, qmp, pid, self.log)
        self.commands = VMCommands(reactor, self.follower, command_timeout, guard)
        self.stopper = VMStopper(reactor, self.follower, self.commands, self.log)

    @property
    def pid(self) -> int | None:
        """The VM's own process id (None for one without a process of its own here)."""
        return self.follower.pid

    @property
    def command_timeout(self) -> float:
        """How long any QMP command may go unanswered."""
        return self.commands.command_timeout

    @command_timeout.setter
    def command_timeout(self, value: float) -> None:
        self.commands.command_timeout = value

    # -- following the VM -------------------------------------------------

    def subscribe(self, listener: Callable[[VMEvent], None]) -> Callable[[], None]:
        """Call ``listener`` with every VMEvent, ending with ``gone``; returns the unsubscriber."""
        return self.follower.subscribe(listener)

    @property
    def gone(self) -> bool:
        """Whether the VM process has ended."""
        return self.follower.gone_event is not None

    def when_gone(self) -> Deferred[VMEvent]:
        """Fires with the ``gone`` event once the VM process has ended."""
        return self.follower.when_gone()

    def detach(self) -> Deferred[None]:
        """Hang up the monitor and leave the VM running (daemon shutdown); fires once closed.

        Closing ``qmp`` directly does the same.  A detached handle reports no
        more events (``when_gone`` never fires); ``adopt`` gives a new one.
        """
        return self.follower.detach()

    # -- commands ---------------------------------------------------------

    async def query_power_state(self) -> PowerState:
        """What QEMU says the VM is doing (``query-status``); a gone VM reports how it went."""
        return await self.commands.query_power_state()

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        """Drain up to ``size`` bytes from a ring-buffer chardev (read as base64: no byte lost)."""
        return await self.commands.ringbuf_read(device, size)

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        """Append ``data`` to a ring-buffer chardev; QEMU also delivers it to the guest's port."""
        await self.commands.ringbuf_write(device, data)

    async def pause(self) -> None:
        """Pause the vCPUs (QMP ``stop``)."""
        await self.commands.command("stop")

    async def resume(self) -> None:
        """Resume the vCPUs (QMP ``cont``)."""
        await self.commands.command("cont")

    async def migrate_to_file(self, path: str, timeout: float = 600.0) -> None:
        """Save the VM's state to ``path`` (QMP ``migrate`` to ``exec:cat``); it ends paused.

        Waits for the MIGRATION event saying completed or failed; a failure is a
        HypervisorError with QEMU's description.  ``resume`` continues the VM.
        """
        await self.commands.migrate_to_file(path, timeout)

    # -- stopping ---------------------------------------------------------

    async def shutdown(self, timeout: float, clock: IReactorTime | None = None) -> str:
        """Stop the VM: ACPI button, then quit or SIGKILL after ``timeout``; "clean" or "forced".

        "clean" means the VM went away by itself within ``timeout`` (the gone
        event says how); a VM without a guest OS ignores the button, so it ends
        "forced".  ``timeout`` counts from the call, so it covers sending the
        button (``system_powerdown``) too.  A monitor that does not answer that
        within ``command_timeout`` gets the VM killed at once; in all, a hung
        VM is gone within ``timeout + command_timeout + kill_timeout``.
        """
        return await self.stopper.shutdown(timeout, clock)

    async def force_stop(self) -> None:
        """Stop the VM now: ``quit``, or SIGKILL when the monitor does not answer it in time."""
        await self.stopper.force(self._reactor)
