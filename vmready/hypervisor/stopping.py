"""Stopping one VM: the ACPI power button, then ``quit``, then SIGKILL.

A stopped or hung QEMU answers nothing on its monitor; stopping such a VM ends
in SIGKILL, and a process that survives SIGKILL for ``kill_timeout`` is a
HypervisorError.
"""

from __future__ import annotations

import contextlib

from twisted.internet.defer import TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from vmready.domain import HypervisorError
from vmready.hypervisor.commands import MonitorTimeout, VMCommands
from vmready.hypervisor.following import VMFollower
from vmready.protocols.qmp import QMPDisconnected, QMPError

# How long a SIGKILLed VM process may take to disappear.
DEFAULT_KILL_TIMEOUT = 30.0


class VMStopper:
    """Stops the VM ``follower`` follows, over ``commands`` or by signal.

    ``log`` is the logger of the ``RunningVM`` this stops for.
    """

    # How long a killed process may take to disappear.
    kill_timeout = DEFAULT_KILL_TIMEOUT
    # Seconds between ACPI button presses while a clean stop waits. A guest drops a
    # press until its power daemon (systemd-logind) runs, and a guest that declares
    # Ready early in its boot is often asked to stop before that: each second waited
    # here is a second added to its restart. Another press costs the guest nothing.
    powerdown_repeat = 1.0

    def __init__(
        self, reactor: IReactorTime, follower: VMFollower, commands: VMCommands, log: Logger
    ) -> None:
        self.follower = follower
        self.commands = commands
        self.log = log
        self._reactor = reactor

    @property
    def _name(self) -> str:
        return self.follower.spec.name

    async def shutdown(self, timeout: float, clock: IReactorTime | None = None) -> str:
        """Stop the VM: ACPI button, then quit or SIGKILL after ``timeout``; "clean" or "forced".

        See ``RunningVM.shutdown``.
        """
        timer: IReactorTime = clock if clock is not None else self._reactor
        follower = self.follower
        if follower.gone_event is not None:
            return "clean"
        deadline = timer.seconds() + timeout
        command_timeout = self.commands.command_timeout
        # Whether the VM may still go by itself: its monitor is open or just closed.
        may_go = follower.qmp.is_open or follower.watching_exit
        if follower.qmp.is_open:
            limit = min(timeout, command_timeout)
            try:
                await self.commands.execute("system_powerdown", clock=timer, timeout=limit)
            except QMPError as e:
                self.log.warn(
                    "QEMU refused system_powerdown for {name}: {error}",
                    name=self._name,
                    error=e.desc,
                )
            except QMPDisconnected:
                self.log.info("{name} is already going away", name=self._name)
            except MonitorTimeout as e:
                if limit < command_timeout:
                    may_go = False  # the stop deadline passed first: on to quit
                else:
                    # The monitor is hung: quit would go unanswered too.
                    self.log.warn("{error}; killing it", error=e.message)
                    why = f"its QMP monitor did not answer system_powerdown within {limit:g}s"
                    await self.kill_and_wait(why, timer)
                    return "forced"
            else:
                self.log.info("pressed the ACPI power button of {name}", name=self._name)
        if may_go and not follower.detached:
            if await self._await_power_off(deadline, timer):
                return "clean"
            # Asked first: a daemon woken past its lease neither forces nor says it will.
            await self.commands.guard.before_acting(self._name, "force")
            self.log.info(
                "VM {name} did not power off within {timeout}s; forcing it",
                name=self._name,
                timeout=timeout,
            )
        await self.force(timer)
        return "forced"

    async def _await_power_off(self, deadline: float, timer: IReactorTime) -> bool:
        """Wait until the VM is gone or ``deadline``, pressing the button again now and then.

        A guest that is still booting (or whose power daemon is not up yet)
        drops the ACPI request without a trace, so one press is not enough.
        """
        while True:
            remaining = deadline - timer.seconds()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await self.follower.when_gone().addTimeout(
                    min(remaining, self.powerdown_repeat), timer
                )
                return True
            if deadline - timer.seconds() > 0 and self.follower.qmp.is_open:
                try:
                    await self.commands.execute(
                        "system_powerdown", clock=timer, timeout=self.commands.command_timeout
                    )
                except (QMPError, QMPDisconnected, MonitorTimeout):
                    continue  # it is going, or the deadline will force it
                self.log.info("pressed the ACPI power button of {name} again", name=self._name)

    async def force(self, timer: IReactorTime) -> None:
        """Stop the VM now: ``quit``, or SIGKILL when the monitor does not answer it in time."""
        if self.follower.gone_event is not None:
            return
        if not self.follower.qmp.is_open:
            await self.kill_and_wait("its QMP monitor is closed", timer)
            return
        try:
            await self.commands.execute("quit", clock=timer)
        except QMPDisconnected:
            self.log.info("{name}: the monitor closed as QEMU exited", name=self._name)
        except QMPError as e:
            self.log.warn("QEMU refused quit for {name}: {error}", name=self._name, error=e)
            await self.kill_and_wait(f"QEMU refused quit: {e.desc}", timer)
            return
        except MonitorTimeout as e:
            self.log.warn("{error}; killing it", error=e.message)
            why = f"its QMP monitor did not answer quit within {e.timeout:g}s"
            await self.kill_and_wait(why, timer)
            return
        try:
            await self.follower.when_gone().addTimeout(self.kill_timeout, timer)
        except TimeoutError:
            why = f"it did not exit within {self.kill_timeout:g}s of quit"
            await self.kill_and_wait(why, timer)

    async def kill_and_wait(self, why: str, timer: IReactorTime) -> None:
        """SIGKILL the VM's process because ``why`` and wait for it to be gone."""
        await self.commands.guard.before_acting(self._name, "SIGKILL")
        self.follower.kill(why)
        try:
            await self.follower.when_gone().addTimeout(self.kill_timeout, timer)
        except TimeoutError:
            raise HypervisorError(
                f"VM {self._name} (process {self.follower.pid}) survived SIGKILL "
                f"for {self.kill_timeout:g}s"
            ) from None
