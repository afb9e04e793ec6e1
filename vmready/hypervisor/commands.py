"""The QMP commands vmready sends one VM, each bounded in time.

Every command is bounded by ``command_timeout``: a stopped or hung QEMU keeps
its socket open and answers nothing, which is a ``MonitorTimeout`` rather than
a wait forever.  Every command that is not a read (``acting.READS``) first
asks ``guard`` whether this daemon may act on the VM now.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from vmready.domain import HypervisorError, PowerState
from vmready.hypervisor.acting import ALWAYS, READS, ActingGuard
from vmready.hypervisor.following import VMFollower
from vmready.hypervisor.vmevents import VMEvent, power_state_for
from vmready.hypervisor.vmprocess import EXIT_POLL_SECONDS
from vmready.protocols.qmp import QMPDisconnected, QMPError, QMPEvent

# How long a QMP command may go unanswered before vmready gives up on it.
DEFAULT_COMMAND_TIMEOUT = 10.0


class MonitorTimeout(HypervisorError):
    """A VM's QMP monitor did not answer a command in time (QEMU is stopped or hung)."""

    def __init__(self, name: str, command: str, timeout: float) -> None:
        super().__init__(f"QEMU monitor of VM {name} did not answer {command} within {timeout:g}s")
        self.command = command
        self.timeout = timeout


class VMCommands:
    """QMP commands to the VM ``follower`` follows, as HypervisorErrors when they fail."""

    def __init__(
        self,
        reactor: IReactorTime,
        follower: VMFollower,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        guard: ActingGuard = ALWAYS,
    ) -> None:
        self.follower = follower
        self.guard = guard
        # How long any QMP command may go unanswered (timed on ``reactor``).
        self.command_timeout = command_timeout
        self._reactor = reactor

    @property
    def _name(self) -> str:
        return self.follower.spec.name

    async def execute(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        clock: IReactorTime | None = None,
        timeout: float | None = None,
    ) -> Any:
        """``command``'s return value; MonitorTimeout after ``timeout`` (``command_timeout``).

        A command that is not a read is sent only once ``guard`` allows it.
        """
        if command not in READS:
            await self.guard.before_acting(self._name, command)
        limit = self.command_timeout if timeout is None else timeout
        timer: IReactorTime = clock if clock is not None else self._reactor
        try:
            return await self.follower.qmp.execute(command, arguments).addTimeout(limit, timer)
        except TimeoutError:
            raise MonitorTimeout(self._name, command, limit) from None

    async def command(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        """``command``'s return value; a refusal or a closed monitor is a HypervisorError."""
        try:
            return await self.execute(command, arguments)
        except QMPError as e:
            raise HypervisorError(f"QEMU refused {command} for {self._name}: {e.desc}") from e
        except QMPDisconnected as e:
            gone = self.follower.gone_event
            why = gone.detail if gone is not None else str(e)
            raise HypervisorError(f"cannot run {command} on {self._name}: {why}") from e

    async def query_power_state(self) -> PowerState:
        """What QEMU says the VM is doing (``query-status``); a gone VM reports how it went."""
        gone = self.follower.gone_event
        if gone is not None:
            return gone.power_state or PowerState.NOSTATE
        try:
            status = await self.execute("query-status")
        except QMPError as e:
            raise HypervisorError(f"QEMU refused query-status for {self._name}: {e.desc}") from e
        except QMPDisconnected as e:
            if self.follower.hung_up():
                raise HypervisorError(
                    f"the QMP monitor of {self._name} is closed; its state is unknown"
                ) from e
            event = await self.follower.when_gone()
            return event.power_state or PowerState.NOSTATE
        return power_state_for(str(status.get("status", "")))

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        """Drain up to ``size`` bytes from a ring-buffer chardev (read as base64: no byte lost)."""
        data = await self.command(
            "ringbuf-read", {"device": device, "size": size, "format": "base64"}
        )
        try:
            return base64.b64decode(str(data), validate=True)
        except binascii.Error as e:
            raise HypervisorError(
                f"QEMU answered ringbuf-read of {self._name} with invalid base64: {e}"
            ) from e

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        """Append ``data`` to a ring-buffer chardev; QEMU also delivers it to the guest's port."""
        await self.command(
            "ringbuf-write",
            {"device": device, "data": base64.b64encode(data).decode("ascii"), "format": "base64"},
        )

    async def migrate_to_file(self, path: str, timeout: float = 600.0) -> None:
        """Save the VM's state to ``path`` (QMP ``migrate`` to ``exec:cat``); it ends paused.

        Waits for the MIGRATION event saying completed or failed; a failure is a
        HypervisorError with QEMU's description.  ``resume`` continues the VM.
        """
        name = self._name
        await self.command(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "events", "state": True}]},
        )
        # Fires with the migration's final status, or with the gone event's detail.
        finished: Deferred[str] = Deferred()

        def on_event(event: QMPEvent) -> None:
            status = event.data.get("status")
            final = status in ("completed", "failed", "cancelled")
            if event.name == "MIGRATION" and final and not finished.called:
                finished.callback(str(status))

        def on_gone(event: VMEvent) -> VMEvent:
            if not finished.called:
                finished.callback(f"gone: {event.detail}")
            return event

        unsubscribe = self.follower.qmp.subscribe(on_event)
        gone = self.follower.when_gone().addCallback(on_gone)
        gone.addErrback(lambda failure: failure.trap(CancelledError))
        try:
            await self.command("migrate", {"uri": f"exec:cat > {shlex.quote(path)}"})
            try:
                status = await finished.addTimeout(timeout, self._reactor)
            except TimeoutError:
                raise HypervisorError(
                    f"saving the state of {name} to {path} did not finish within {timeout:g}s"
                ) from None
        finally:
            unsubscribe()
            gone.cancel()
        if status.startswith("gone: "):
            raise HypervisorError(
                f"VM {name} went away while saving its state to {path}: "
                f"{status.removeprefix('gone: ')}"
            )
        if status != "completed":
            info = await self.command("query-migrate")
            desc = info.get("error-desc", f"migration {status}")
            raise HypervisorError(f"saving the state of {name} to {path} failed: {desc}")
        # QEMU passes through finish-migrate after the completed event (measured), and
        # refuses cont there ("Migration is not finalized yet"): wait for postmigrate.
        deadline = self._reactor.seconds() + self.command_timeout
        while (await self.command("query-status")).get("status") == "finish-migrate":
            if self._reactor.seconds() >= deadline:
                raise HypervisorError(
                    f"QEMU did not finish the migration of {name} "
                    f"within {self.command_timeout:g}s of completing it"
                )
            await deferLater(self._reactor, EXIT_POLL_SECONDS, lambda: None)
