"""The emulated machine: its run state, its events, and power as host and guest ask for it.

No I/O happens here.  Time comes from an injected ``IReactorTime``; events go
to subscribers; the process-level effects (exit, files) are requested through
callbacks.  What flows between guest and host is the machine's ``wiring``
(:mod:`fakeqemu._wiring`); migration is its ``migration``
(:mod:`fakeqemu._migration`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.interfaces import IReactorTime

from fakeqemu._config import MachineConfig
from fakeqemu._migration import Migration
from fakeqemu._runstate import MachineError, RunState
from fakeqemu._throttle import EventThrottle
from fakeqemu._wiring import ChardevFile, GuestSink, Wiring

Event = dict[str, Any]
EventListener = Callable[[Event], None]
ExitHandler = Callable[[int, list[str]], None]

# pvpanic's ``events`` bit for a guest kernel panic (bit 1 is "crash loaded").
PVPANIC_PANICKED = 1


class Machine:
    """A virtual machine as QMP and a guest see it."""

    def __init__(
        self,
        config: MachineConfig,
        clock: IReactorTime,
        exit_handler: ExitHandler | None = None,
        chardev_files: Mapping[str, ChardevFile] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self._exit_handler = exit_handler
        # A guest kernel that panicked without a pvpanic device to tell the host: it hangs.
        self.guest_hung = False
        self.exited: int | None = None
        self.wiring = Wiring(self, config, chardev_files or {})
        self.migration = Migration(self)
        self._listeners: list[EventListener] = []
        self._throttle = EventThrottle(clock, self._send)
        self._controllers: list[GuestSink] = []
        if config.incoming_path is not None:
            self.run_state = RunState.INMIGRATE
        elif config.start_paused:
            self.run_state = RunState.PRELAUNCH
        else:
            self.run_state = RunState.RUNNING

    # -- events -----------------------------------------------------------

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        """Deliver every future event to ``listener``; returns the unsubscriber."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def emit(self, name: str, data: dict[str, Any] | None = None) -> None:
        """Send an event to every subscriber, stamped as QEMU stamps them."""
        seconds, microseconds = divmod(round(self.clock.seconds() * 1_000_000), 1_000_000)
        event: Event = {
            "timestamp": {"seconds": seconds, "microseconds": microseconds},
            "event": name,
        }
        if data is not None:
            event["data"] = data
        # Guest-triggerable events are rate-limited as QEMU limits them (stamped now, sent
        # now or at the end of their one-second period).
        self._throttle.offer(event)

    def _send(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)

    # -- run state --------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the vCPUs run."""
        return self.run_state is RunState.RUNNING

    def query_status(self) -> dict[str, Any]:
        """``query-status``."""
        return {"status": self.run_state.value, "singlestep": False, "running": self.running}

    def cont(self) -> None:
        """``cont``: resume the vCPUs (during an incoming migration: once it completes)."""
        if self.run_state is RunState.INMIGRATE:
            self.migration.autostart = True
            return
        if self.run_state in (RunState.SHUTDOWN, RunState.GUEST_PANICKED):
            raise MachineError("Resetting the Virtual Machine is required")
        if self.running:
            return
        self.run_state = RunState.RUNNING
        self.emit("RESUME")

    def stop(self) -> None:
        """``stop``: pause the vCPUs (during an incoming migration: keep them paused)."""
        if self.run_state is RunState.INMIGRATE:
            self.migration.autostart = False
        elif self.running:
            self.run_state = RunState.PAUSED
            self.emit("STOP")

    def system_reset(self) -> None:
        """``system_reset``: the guest reboots, so its open ports close.

        QEMU resets the devices before it announces RESET, so a port with an id
        that the guest held reports ``VSERPORT_CHANGE`` (closed) first.
        """
        self._reboot_guest()
        self.emit("RESET", {"guest": False, "reason": "host-qmp-system-reset"})

    def system_powerdown(self) -> None:
        """``system_powerdown``: press the ACPI button; a guest may react (a hung one cannot)."""
        self.emit("POWERDOWN")
        if self.guest_hung:
            return
        for controller in list(self._controllers):
            controller.write(b"POWERDOWN\n")

    def quit(self) -> None:
        """``quit``: QEMU announces SHUTDOWN, answers, then exits."""
        self.emit("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"})
        self.clock.callLater(0, self.exit, 0, [])

    def terminate_on_signal(self, signal_number: int) -> None:
        """SIGTERM/SIGINT/SIGHUP to QEMU: SHUTDOWN with reason host-signal, then exit."""
        self.emit("SHUTDOWN", {"guest": False, "reason": "host-signal"})
        self.exit(0, [f"terminating on signal {signal_number}"])

    def exit(self, status: int, stderr_lines: list[str]) -> None:
        """Stop the machine for good; the runner closes sockets and ends the process."""
        if self.exited is not None:
            return
        self.exited = status
        self.run_state = RunState.SHUTDOWN
        self._throttle.stop()
        self.wiring.close()
        for controller in list(self._controllers):
            controller.close()
        self._controllers.clear()
        if self._exit_handler is not None:
            self._exit_handler(status, stderr_lines)

    # -- guest side -------------------------------------------------------

    def guest_actions(self) -> dict[str, Callable[[], None]]:
        """What a guest can do through its control socket."""
        return {
            "poweroff": self.guest_poweroff,
            "reboot": self.guest_reboot,
            "panic": self.guest_panic,
        }

    def guest_poweroff(self) -> None:
        """The guest OS powers itself off: SHUTDOWN from the guest, and QEMU exits."""
        self.emit("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"})
        self.clock.callLater(0, self.exit, 0, [])

    def guest_reboot(self) -> None:
        """The guest OS reboots: its devices reset (ports close), then QEMU reports RESET."""
        self._reboot_guest()
        self.emit("RESET", {"guest": True, "reason": "guest-reset"})

    def guest_panic(self) -> None:
        """The guest kernel panics.

        With a pvpanic device the kernel tells QEMU, and QEMU 7.2's default
        ``-action panic=shutdown`` follows.  Measured with a Debian 6.1 guest
        (``echo c > /proc/sysrq-trigger``, pvpanic-mmio loaded): GUEST_PANICKED
        with action poweroff, then SHUTDOWN guest-panic, exit 0 -- and no STOP:
        the vCPU only requests the stop, and QEMU exits before it handles the
        request.  (A panic written from the main thread, through qtest, does
        show STOP between the two.)  Without a pvpanic device the host sees
        nothing, as on real QEMU: the kernel hangs, or with ``panic=N`` on its
        command line (``-append``) reboots N seconds later (N < 0: at once).
        Measured without pvpanic and with ``panic=3``: no event, then RESET
        (guest, guest-reset) about three seconds later.  fakeqemu does not add
        the firmware's second RESET that followed it.
        """
        events = self.config.pvpanic_events
        if events is not None and events & PVPANIC_PANICKED:
            self.emit("GUEST_PANICKED", {"action": "poweroff"})
            self.emit("SHUTDOWN", {"guest": True, "reason": "guest-panic"})
            self.clock.callLater(0, self.exit, 0, [])
            return
        self.guest_hung = True
        timeout = self.config.kernel.panic_timeout() if self.config.kernel is not None else 0
        if timeout:
            self.clock.callLater(max(timeout, 0), self._reboot_after_panic)

    def _reboot_after_panic(self) -> None:
        if self.exited is None and self.guest_hung:
            self.guest_reboot()

    def attach_controller(self, sink: GuestSink) -> Callable[[], None]:
        """A guest's power management listens for ACPI events; returns the detacher."""
        self._controllers.append(sink)
        return lambda: self._controllers.remove(sink) if sink in self._controllers else None

    def _reboot_guest(self) -> None:
        self.guest_hung = False
        self.wiring.reset_guest()
