"""Runs VMs: QEMU (or fakeqemu) processes started from a ``VMSpec`` and followed over QMP.

``HypervisorDriver.launch`` spawns the hypervisor with ``-daemonize`` without
blocking the reactor.  QEMU reports a refused command line or a failed start on
stderr *before* it daemonizes; those lines (warnings dropped) become the
``HypervisorError`` the user sees.  Once daemonized, QEMU's stdin, stdout and
stderr are ``/dev/null``: whatever goes wrong afterwards — a failed
``-incoming`` restore, a crash, a ``kill -9`` — is seen only as the QMP monitor
disconnecting.  ``RunningVM`` turns that into a ``gone`` event whose detail and
power state say whether QEMU announced a ``SHUTDOWN`` first.

The pidfile is trusted only for a live process whose command line names this
VM's QMP socket, so a stale pidfile whose pid was reused is never signalled,
and a fakeqemu VM hosted by ``fakeqemu-host`` (whose pidfile names the shared
host) is never killed by signal: it has no pid of its own here.

Every QMP command ``RunningVM`` sends is bounded by its ``command_timeout``: a
stopped or hung QEMU keeps its socket open and answers nothing, which is a
``MonitorTimeout`` rather than a wait forever.  Stopping such a VM ends in
SIGKILL; ``HypervisorDriver.kill_owned`` does the same for a VM no
``RunningVM`` follows (its monitor socket vanished, or it does not answer).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import enum
import errno
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain.model import HypervisorError
from vmready.domain.states import PowerState
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    AGENT_RING,
    AGENT_SERIAL_PORTS,
    DEFAULT_RING_SIZE,
    LEGACY_PORT,
    SerialPort,
    VMSpec,
    build_command_line,
    device_problem,
    qmp_address,
)
from vmready.protocols.qmp import (
    QMPClientProtocol,
    QMPDisconnected,
    QMPError,
    QMPEvent,
    connect_qmp,
)

__all__ = [
    "AGENT_PORT",
    "AGENT_RING",
    "AGENT_SERIAL_PORTS",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_RING_SIZE",
    "HYPERVISORS",
    "LEGACY_PORT",
    "UNEXPECTED_EXIT",
    "HypervisorDriver",
    "MonitorTimeout",
    "RunningVM",
    "SerialPort",
    "VMEvent",
    "VMEventKind",
    "VMSpec",
    "accelerators_for_host",
    "build_command_line",
    "error_lines",
    "gone_event",
    "kvm_device_problem",
    "power_state_for",
    "read_log_lines",
    "vm_event_for",
]

HYPERVISORS = ("fakeqemu", "qemu")
QEMU_PROGRAM = "qemu-system-x86_64"
UNEXPECTED_EXIT = (
    "QEMU process exited unexpectedly (QMP monitor disconnected without a SHUTDOWN event)"
)
# How long a QMP command may go unanswered before vmready gives up on it.
DEFAULT_COMMAND_TIMEOUT = 10.0
# How long a SIGKILLed VM process may take to disappear.
DEFAULT_KILL_TIMEOUT = 30.0
_OUTPUT_CAP = 64 * 1024
_EXIT_POLL_SECONDS = 0.05


class MonitorTimeout(HypervisorError):
    """A VM's QMP monitor did not answer a command in time (QEMU is stopped or hung)."""

    def __init__(self, name: str, command: str, timeout: float) -> None:
        super().__init__(f"QEMU monitor of VM {name} did not answer {command} within {timeout:g}s")
        self.command = command
        self.timeout = timeout


class VMEventKind(enum.StrEnum):
    """What happened to a VM, as vmready tells its listeners."""

    STOP = "stop"
    RESUME = "resume"
    SHUTDOWN = "shutdown"
    RESET = "reset"
    POWERDOWN = "powerdown"
    PANICKED = "panicked"
    GONE = "gone"


@attrs.frozen
class VMEvent:
    """One VM event: its kind, a sentence for people, and the power state it implies (or None)."""

    kind: VMEventKind
    detail: str
    power_state: PowerState | None


_RUN_STATES = {
    "running": PowerState.RUNNING,
    "colo": PowerState.RUNNING,
    "paused": PowerState.PAUSED,
    "prelaunch": PowerState.PAUSED,
    "postmigrate": PowerState.PAUSED,
    "inmigrate": PowerState.PAUSED,
    "finish-migrate": PowerState.PAUSED,
    "restore-vm": PowerState.PAUSED,
    "save-vm": PowerState.PAUSED,
    "suspended": PowerState.PAUSED,
    "debug": PowerState.PAUSED,
    "shutdown": PowerState.SHUTDOWN,
    "guest-panicked": PowerState.CRASHED,
    "internal-error": PowerState.CRASHED,
    "io-error": PowerState.CRASHED,
    "watchdog": PowerState.CRASHED,
}


def power_state_for(run_state: str) -> PowerState:
    """The power state for a ``query-status`` run state (NOSTATE for one vmready does not know)."""
    return _RUN_STATES.get(run_state, PowerState.NOSTATE)


def _initiator(event: QMPEvent) -> str:
    return "guest" if event.data.get("guest") else "host"


def vm_event_for(event: QMPEvent) -> VMEvent | None:
    """The VMEvent a QMP event stands for, or None for events vmready does not follow."""
    reason = str(event.data.get("reason", "unknown"))
    if event.name == "STOP":
        return VMEvent(VMEventKind.STOP, "paused", PowerState.PAUSED)
    if event.name == "RESUME":
        return VMEvent(VMEventKind.RESUME, "running", PowerState.RUNNING)
    if event.name == "SHUTDOWN":
        detail = f"shut down by the {_initiator(event)} ({reason})"
        return VMEvent(VMEventKind.SHUTDOWN, detail, PowerState.SHUTDOWN)
    if event.name == "RESET":
        return VMEvent(VMEventKind.RESET, f"reset by the {_initiator(event)} ({reason})", None)
    if event.name == "POWERDOWN":
        return VMEvent(VMEventKind.POWERDOWN, "ACPI power button pressed", None)
    if event.name == "GUEST_PANICKED":
        action = str(event.data.get("action", "unknown"))
        detail = f"guest kernel panicked (action: {action})"
        return VMEvent(VMEventKind.PANICKED, detail, PowerState.CRASHED)
    return None


def gone_event(shutdown: QMPEvent | None, killed: str | None = None) -> VMEvent:
    """The ``gone`` event for a VM whose monitor closed and whose process ended.

    ``shutdown`` is the SHUTDOWN event QEMU announced first, if any; ``killed``
    says why vmready itself killed the process, if it did.
    """
    if shutdown is not None:
        reason = str(shutdown.data.get("reason", "unknown"))
        power = PowerState.CRASHED if reason == "guest-panic" else PowerState.SHUTDOWN
        return VMEvent(VMEventKind.GONE, f"shut down ({reason})", power)
    if killed is not None:
        return VMEvent(
            VMEventKind.GONE, f"killed by vmready with SIGKILL ({killed})", PowerState.SHUTDOWN
        )
    return VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED)


def error_lines(stderr: str) -> list[str]:
    """The hypervisor's stderr as the user should see it: every non-empty line but warnings."""
    lines = []
    for line in stderr.splitlines():
        if not line.strip():
            continue
        head, sep, rest = line.partition(": ")
        text = rest if sep and " " not in head else line
        if line.startswith("warning: ") or text.startswith("warning: "):
            continue
        lines.append(line)
    return lines


def read_log_lines(spec: VMSpec, limit: int = _OUTPUT_CAP) -> list[str]:
    """What QEMU wrote to its ``-D`` log (where a daemonized QEMU reports errors), warnings out."""
    try:
        with open(spec.log_file, "rb") as f:
            data = f.read(limit)
    except OSError:
        return []
    return error_lines(data.decode("utf-8", "replace"))


def kvm_device_problem(device: str = "/dev/kvm") -> str | None:
    """Why KVM cannot be used here (``/dev/kvm`` does not open read-write), or None."""
    return device_problem(device)


def accelerators_for_host(device: str = "/dev/kvm") -> list[str]:
    """``["kvm", "tcg"]`` where the KVM device opens for reading and writing, else ``["tcg"]``."""
    return ["tcg"] if kvm_device_problem(device) else ["kvm", "tcg"]


def _read_pidfile(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _is_vm_process(pid: int, qmp_socket: str) -> bool:
    """Whether ``pid`` is alive (not a zombie) and its command line serves ``qmp_socket``."""
    try:
        os.kill(pid, 0)
    except OSError:
        # ESRCH: no such process; EPERM: someone else's, so not a VM we started.
        return False
    if not os.path.isdir("/proc/self"):
        return True  # no procfs: a live pid is all we can know
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    end_of_name = stat.rfind(b")")
    if stat[end_of_name + 2 : end_of_name + 3] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent (init, for a daemonized QEMU)
    marker = os.fsencode(qmp_address(qmp_socket) + ",")
    return any(marker in argument for argument in cmdline.split(b"\0"))


def _owned_pid(spec: VMSpec) -> int | None:
    """The pidfile's pid if it is this VM's own live process, else None."""
    pid = _read_pidfile(spec.pidfile)
    if pid is not None and _is_vm_process(pid, spec.qmp_socket):
        return pid
    return None


def _find_vm_process(spec: VMSpec) -> int | None:
    """This VM's live process found by its command line, for when the pidfile is gone.

    A QEMU whose ``-incoming`` load fails removes its pidfile while it exits,
    sometimes before the launcher looked (measured): its process must still be
    waited for, or the next start finds its monitor socket still answering.
    """
    if not os.path.isdir("/proc/self"):
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _is_vm_process(int(entry), spec.qmp_socket):
            return int(entry)
    return None


def _socket_listens(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path`` (never blocks)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        result = probe.connect_ex(path)
    except OSError:
        return False
    finally:
        probe.close()
    return result in (0, errno.EAGAIN, errno.EINPROGRESS)


def _remove_stale_files(spec: VMSpec) -> None:
    for path in (spec.qmp_socket, spec.pidfile):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    shutil.rmtree(spec.guest_dir, ignore_errors=True)


class _Launcher(ProcessProtocol):
    """The foreground hypervisor process: its stderr and how it ended."""

    def __init__(self) -> None:
        self.stderr = b""
        self.stdout = b""
        self.timed_out = False
        self.ended: Deferred[tuple[int | None, int | None]] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        self.stdout = (self.stdout + data)[:_OUTPUT_CAP]

    def errReceived(self, data: bytes) -> None:
        self.stderr = (self.stderr + data)[:_OUTPUT_CAP]

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        code = getattr(value, "exitCode", None)
        signal_number = getattr(value, "signal", None)
        self.ended.callback((code, signal_number))

    def give_up(self) -> None:
        """Kill the launcher and stop waiting for its pipes."""
        self.timed_out = True
        assert self.transport is not None
        with contextlib.suppress(ProcessExitedAlready):
            self.transport.signalProcess("KILL")
        self.transport.loseConnection()


class RunningVM:
    """A VM process vmready started or adopted, followed through its QMP monitor."""

    log = Logger()
    # How long a process may take to exit once its monitor closed before it is killed.
    exit_grace = 10.0
    # How long a killed process may take to disappear.
    kill_timeout = DEFAULT_KILL_TIMEOUT
    # Seconds between ACPI button presses while a clean stop waits.
    powerdown_repeat = 5.0

    def __init__(
        self,
        reactor: Any,
        spec: VMSpec,
        qmp: QMPClientProtocol,
        pid: int | None,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        self.spec = spec
        self.qmp = qmp
        self.pid = pid
        # How long any QMP command may go unanswered (timed on ``reactor``).
        self.command_timeout = command_timeout
        self._reactor = reactor
        self._listeners: list[Callable[[VMEvent], None]] = []
        self._shutdown: QMPEvent | None = None
        self._killed: str | None = None
        self._gone: VMEvent | None = None
        self._gone_waiters: list[Deferred[VMEvent]] = []
        self._detached = False
        self._watching_exit = False
        qmp.subscribe(self._qmp_event)
        qmp.when_closed().addCallback(self._monitor_closed)

    # -- following the VM -------------------------------------------------

    def subscribe(self, listener: Callable[[VMEvent], None]) -> Callable[[], None]:
        """Call ``listener`` with every VMEvent, ending with ``gone``; returns the unsubscriber."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    @property
    def gone(self) -> bool:
        """Whether the VM process has ended."""
        return self._gone is not None

    def when_gone(self) -> Deferred[VMEvent]:
        """Fires with the ``gone`` event once the VM process has ended."""
        if self._gone is not None:
            return succeed(self._gone)

        def forget(waiter: Deferred[VMEvent]) -> None:
            if waiter in self._gone_waiters:
                self._gone_waiters.remove(waiter)

        waiter: Deferred[VMEvent] = Deferred(forget)
        self._gone_waiters.append(waiter)
        return waiter

    def detach(self) -> Deferred[None]:
        """Hang up the monitor and leave the VM running (daemon shutdown); fires once closed.

        Closing ``qmp`` directly does the same.  A detached handle reports no
        more events (``when_gone`` never fires); ``adopt`` gives a new one.
        """
        self._detached = True
        self.qmp.close()
        return self.qmp.when_closed()

    def _qmp_event(self, event: QMPEvent) -> None:
        if event.name == "SHUTDOWN":
            self._shutdown = event
        vm_event = vm_event_for(event)
        if vm_event is not None:
            self._notify(vm_event)

    def _notify(self, event: VMEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                self.log.failure(
                    "VM event listener failed on {kind} of {name}",
                    kind=event.kind,
                    name=self.spec.name,
                )

    def _hung_up(self) -> bool:
        """Whether vmready itself closed the monitor (detach, or a QMP protocol error)."""
        return self._detached or bool(getattr(self.qmp.transport, "disconnecting", False))

    def _monitor_closed(self, _: object) -> None:
        if self._hung_up():
            # We hung up (detach, or a QMP protocol error): the VM itself is not gone.
            self._detached = True
            self.log.info("stopped following VM {name}; it keeps running", name=self.spec.name)
            return
        self._watch_exit()

    def _watch_exit(self) -> None:
        if self._watching_exit or self._gone is not None:
            return
        self._watching_exit = True
        Deferred.fromCoroutine(self._await_exit()).addErrback(
            lambda failure: self.log.failure(
                "following the exit of VM {name} failed", failure, name=self.spec.name
            )
        )

    async def _await_exit(self) -> None:
        deadline = self._reactor.seconds() + self.exit_grace
        hung = False
        while self.pid is not None and _is_vm_process(self.pid, self.spec.qmp_socket):
            if self._reactor.seconds() >= deadline:
                hung = True
                self.log.warn(
                    "VM {name} (process {pid}) closed its monitor but did not exit; killing it",
                    name=self.spec.name,
                    pid=self.pid,
                )
                self._send_sigkill()
                break
            await deferLater(self._reactor, _EXIT_POLL_SECONDS, lambda: None)
        event = gone_event(self._shutdown, self._killed)
        if hung and self._shutdown is None and self._killed is None:
            event = VMEvent(
                VMEventKind.GONE,
                f"QEMU closed its QMP monitor without a SHUTDOWN event and did not exit "
                f"within {self.exit_grace:g}s; vmready killed it",
                PowerState.CRASHED,
            )
        self._announce_gone(event)

    def _announce_gone(self, event: VMEvent) -> None:
        self._gone = event
        self.log.info("VM {name} is gone: {detail}", name=self.spec.name, detail=event.detail)
        self._notify(event)
        waiters, self._gone_waiters = self._gone_waiters, []
        for waiter in waiters:
            waiter.callback(event)

    # -- commands ---------------------------------------------------------

    async def _execute(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        clock: IReactorTime | None = None,
        timeout: float | None = None,
    ) -> Any:
        """``command``'s return value; MonitorTimeout after ``timeout`` (``command_timeout``)."""
        limit = self.command_timeout if timeout is None else timeout
        timer: IReactorTime = clock if clock is not None else self._reactor
        try:
            return await self.qmp.execute(command, arguments).addTimeout(limit, timer)
        except TimeoutError:
            raise MonitorTimeout(self.spec.name, command, limit) from None

    async def _command(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        try:
            return await self._execute(command, arguments)
        except QMPError as e:
            raise HypervisorError(f"QEMU refused {command} for {self.spec.name}: {e.desc}") from e
        except QMPDisconnected as e:
            why = self._gone.detail if self._gone is not None else str(e)
            raise HypervisorError(f"cannot run {command} on {self.spec.name}: {why}") from e

    async def query_power_state(self) -> PowerState:
        """What QEMU says the VM is doing (``query-status``); a gone VM reports how it went."""
        if self._gone is not None:
            return self._gone.power_state or PowerState.NOSTATE
        try:
            status = await self._execute("query-status")
        except QMPError as e:
            raise HypervisorError(
                f"QEMU refused query-status for {self.spec.name}: {e.desc}"
            ) from e
        except QMPDisconnected as e:
            if self._hung_up():
                raise HypervisorError(
                    f"the QMP monitor of {self.spec.name} is closed; its state is unknown"
                ) from e
            gone = await self.when_gone()
            return gone.power_state or PowerState.NOSTATE
        return power_state_for(str(status.get("status", "")))

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        """Drain up to ``size`` bytes from a ring-buffer chardev (read as base64: no byte lost)."""
        data = await self._command(
            "ringbuf-read", {"device": device, "size": size, "format": "base64"}
        )
        try:
            return base64.b64decode(str(data), validate=True)
        except binascii.Error as e:
            raise HypervisorError(
                f"QEMU answered ringbuf-read of {self.spec.name} with invalid base64: {e}"
            ) from e

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        """Append ``data`` to a ring-buffer chardev; QEMU also delivers it to the guest's port."""
        await self._command(
            "ringbuf-write",
            {"device": device, "data": base64.b64encode(data).decode("ascii"), "format": "base64"},
        )

    async def pause(self) -> None:
        """Pause the vCPUs (QMP ``stop``)."""
        await self._command("stop")

    async def resume(self) -> None:
        """Resume the vCPUs (QMP ``cont``)."""
        await self._command("cont")

    async def shutdown(self, timeout: float, clock: IReactorTime | None = None) -> str:
        """Stop the VM: ACPI button, then quit or SIGKILL after ``timeout``; "clean" or "forced".

        "clean" means the VM went away by itself within ``timeout`` (the gone
        event says how); a VM without a guest OS ignores the button, so it ends
        "forced".  ``timeout`` counts from the call, so it covers sending the
        button (``system_powerdown``) too.  A monitor that does not answer that
        within ``command_timeout`` gets the VM killed at once; in all, a hung
        VM is gone within ``timeout + command_timeout + kill_timeout``.
        """
        timer: IReactorTime = clock if clock is not None else self._reactor
        if self._gone is not None:
            return "clean"
        deadline = timer.seconds() + timeout
        # Whether the VM may still go by itself: its monitor is open or just closed.
        may_go = self.qmp.is_open or self._watching_exit
        if self.qmp.is_open:
            limit = min(timeout, self.command_timeout)
            try:
                await self._execute("system_powerdown", clock=timer, timeout=limit)
            except QMPError as e:
                self.log.warn(
                    "QEMU refused system_powerdown for {name}: {error}",
                    name=self.spec.name,
                    error=e.desc,
                )
            except QMPDisconnected:
                self.log.info("{name} is already going away", name=self.spec.name)
            except MonitorTimeout as e:
                if limit < self.command_timeout:
                    may_go = False  # the stop deadline passed first: on to quit
                else:
                    # The monitor is hung: quit would go unanswered too.
                    self.log.warn("{error}; killing it", error=e.message)
                    why = f"its QMP monitor did not answer system_powerdown within {limit:g}s"
                    await self._kill_and_wait(why, timer)
                    return "forced"
            else:
                self.log.info("pressed the ACPI power button of {name}", name=self.spec.name)
        if may_go and not self._detached:
            if await self._await_power_off(deadline, timer):
                return "clean"
            self.log.info(
                "VM {name} did not power off within {timeout}s; forcing it",
                name=self.spec.name,
                timeout=timeout,
            )
        await self._force(timer)
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
            try:
                await self.when_gone().addTimeout(min(remaining, self.powerdown_repeat), timer)
            except TimeoutError:
                pass
            else:
                return True
            if deadline - timer.seconds() > 0 and self.qmp.is_open:
                try:
                    await self._execute(
                        "system_powerdown", clock=timer, timeout=self.command_timeout
                    )
                except (QMPError, QMPDisconnected, MonitorTimeout):
                    continue  # it is going, or the deadline will force it
                self.log.info("pressed the ACPI power button of {name} again", name=self.spec.name)

    async def force_stop(self) -> None:
        """Stop the VM now: ``quit``, or SIGKILL when the monitor does not answer it in time."""
        await self._force(self._reactor)

    async def _force(self, timer: IReactorTime) -> None:
        if self._gone is not None:
            return
        if not self.qmp.is_open:
            await self._kill_and_wait("its QMP monitor is closed", timer)
            return
        try:
            await self._execute("quit", clock=timer)
        except QMPDisconnected:
            self.log.info("{name}: the monitor closed as QEMU exited", name=self.spec.name)
        except QMPError as e:
            self.log.warn("QEMU refused quit for {name}: {error}", name=self.spec.name, error=e)
            await self._kill_and_wait(f"QEMU refused quit: {e.desc}", timer)
            return
        except MonitorTimeout as e:
            self.log.warn("{error}; killing it", error=e.message)
            why = f"its QMP monitor did not answer quit within {e.timeout:g}s"
            await self._kill_and_wait(why, timer)
            return
        try:
            await self.when_gone().addTimeout(self.kill_timeout, timer)
        except TimeoutError:
            why = f"it did not exit within {self.kill_timeout:g}s of quit"
            await self._kill_and_wait(why, timer)

    async def _kill_and_wait(self, why: str, timer: IReactorTime) -> None:
        """SIGKILL the VM's process because ``why`` and wait for it to be gone."""
        self._kill(why)
        try:
            await self.when_gone().addTimeout(self.kill_timeout, timer)
        except TimeoutError:
            raise HypervisorError(
                f"VM {self.spec.name} (process {self.pid}) survived SIGKILL "
                f"for {self.kill_timeout:g}s"
            ) from None

    def _kill(self, why: str) -> None:
        if self.pid is None:
            raise HypervisorError(
                f"cannot force-stop {self.spec.name}: {why}, and it has no process id "
                f"of its own to kill"
            )
        self._killed = why
        self._send_sigkill()
        if not self.qmp.is_open:
            # No monitor left to report the exit: follow the process itself.
            self._watch_exit()

    def _send_sigkill(self) -> None:
        if self.pid is None or not _is_vm_process(self.pid, self.spec.qmp_socket):
            return
        self.log.warn("killing VM {name} (process {pid})", name=self.spec.name, pid=self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    async def migrate_to_file(self, path: str, timeout: float = 600.0) -> None:
        """Save the VM's state to ``path`` (QMP ``migrate`` to ``exec:cat``); it ends paused.

        Waits for the MIGRATION event saying completed or failed; a failure is a
        HypervisorError with QEMU's description.  ``resume`` continues the VM.
        """
        await self._command(
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

        unsubscribe = self.qmp.subscribe(on_event)
        gone = self.when_gone().addCallback(on_gone)
        gone.addErrback(lambda failure: failure.trap(CancelledError))
        try:
            await self._command("migrate", {"uri": f"exec:cat > {shlex.quote(path)}"})
            try:
                status = await finished.addTimeout(timeout, self._reactor)
            except TimeoutError:
                raise HypervisorError(
                    f"saving the state of {self.spec.name} to {path} did not finish "
                    f"within {timeout:g}s"
                ) from None
        finally:
            unsubscribe()
            gone.cancel()
        if status.startswith("gone: "):
            raise HypervisorError(
                f"VM {self.spec.name} went away while saving its state to {path}: "
                f"{status.removeprefix('gone: ')}"
            )
        if status != "completed":
            info = await self._command("query-migrate")
            desc = info.get("error-desc", f"migration {status}")
            raise HypervisorError(f"saving the state of {self.spec.name} to {path} failed: {desc}")
        # QEMU passes through finish-migrate after the completed event (measured), and
        # refuses cont there ("Migration is not finalized yet"): wait for postmigrate.
        deadline = self._reactor.seconds() + self.command_timeout
        while (await self._command("query-status")).get("status") == "finish-migrate":
            if self._reactor.seconds() >= deadline:
                raise HypervisorError(
                    f"QEMU did not finish the migration of {self.spec.name} "
                    f"within {self.command_timeout:g}s of completing it"
                )
            await deferLater(self._reactor, _EXIT_POLL_SECONDS, lambda: None)


class HypervisorDriver:
    """Starts VMs on fakeqemu or real QEMU, and re-adopts the ones still running."""

    log = Logger()
    # How long the foreground hypervisor may take to daemonize.
    start_timeout = 60.0
    # How long a freshly started VM's monitor may take to answer.
    connect_timeout = 30.0
    # How long an adopted VM's monitor may take to answer.
    adopt_timeout = 5.0
    # How long each QMP command of the VMs this driver starts or adopts may go unanswered.
    command_timeout = DEFAULT_COMMAND_TIMEOUT
    # How long a process killed by ``kill_owned`` may take to disappear.
    kill_timeout = DEFAULT_KILL_TIMEOUT

    def __init__(self, reactor: Any, kind: str, binary: str | None = None) -> None:
        if kind == "fakeqemu":
            program = [binary] if binary else [sys.executable, "-m", "fakeqemu"]
        elif kind == "qemu":
            program = [binary or QEMU_PROGRAM]
        else:
            raise ValueError(
                f"unknown hypervisor {kind!r}: expected one of {', '.join(HYPERVISORS)}"
            )
        self.reactor = reactor
        self.kind = kind
        self.program: list[str] = program
        # What messages call the hypervisor ("python3" would say nothing).
        self.program_name = (
            os.path.basename(binary)
            if binary
            else {
                "fakeqemu": "fakeqemu",
                "qemu": QEMU_PROGRAM,
            }[kind]
        )

    def command_line(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> list[str]:
        """The argv ``launch`` runs for ``spec``."""
        return build_command_line(spec, self.program, paused, incoming)

    async def launch(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> RunningVM:
        """Start ``spec``'s VM; ``paused`` adds ``-S``, ``incoming`` restores that state file."""
        executable = shutil.which(self.program[0])
        if executable is None:
            raise HypervisorError(
                f"cannot start {spec.name}: the hypervisor program {self.program[0]!r} "
                f"is not installed"
            )
        self._prepare_run_dir(spec)
        argv = self.command_line(spec, paused, incoming)
        self.log.info("starting VM {name}: {command}", name=spec.name, command=shlex.join(argv))
        launcher = _Launcher()
        self.reactor.spawnProcess(launcher, executable, argv, env=dict(os.environ))
        timer: IDelayedCall = self.reactor.callLater(self.start_timeout, launcher.give_up)
        try:
            code, signal_number = await launcher.ended
        finally:
            if timer.active():
                timer.cancel()
        if launcher.timed_out:
            self._kill_leftover(spec)
            raise HypervisorError(
                f"{self.program_name} did not finish starting {spec.name} "
                f"within {self.start_timeout:g}s"
            )
        if code != 0:
            raise HypervisorError(self._failure_message(spec, launcher, code, signal_number))
        pid = _owned_pid(spec) or _find_vm_process(spec)
        try:
            client = await connect_qmp(self.reactor, spec.qmp_socket, self.connect_timeout)
        except QMPDisconnected as e:
            if pid is not None and _is_vm_process(pid, spec.qmp_socket):
                self.log.warn(
                    "killing half-started VM {name} (process {pid})", name=spec.name, pid=pid
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                await self._await_killed(spec, pid)
            await self.wait_released(spec)
            lines = read_log_lines(spec)
            if lines:
                # It started, then failed (a restore that could not load): QEMU said why in -D.
                raise HypervisorError("\n".join(lines)) from e
            raise HypervisorError(
                f"{self.program_name} started {spec.name} but its QMP monitor did not answer "
                f"({e}); QEMU's stderr is closed once it daemonizes, so it said nothing more"
            ) from e
        self.log.info("VM {name} runs as process {pid}", name=spec.name, pid=pid)
        return RunningVM(self.reactor, spec, client, pid, self.command_timeout)

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        """Re-attach to ``spec``'s VM if it still runs, not restarting it; else None.

        When it does not run, its stale socket, pidfile and guest directory are
        removed.  A VM whose process is alive but whose monitor does not answer
        (another client holds it, QEMU is stopped or hung, or the socket is gone)
        is neither adopted nor reported absent: that is a HypervisorError naming
        the process, and ``kill_owned`` is how to be rid of it.
        """
        pid = _owned_pid(spec)
        if pid is None and not os.path.exists(spec.qmp_socket):
            _remove_stale_files(spec)
            return None
        try:
            client = await connect_qmp(self.reactor, spec.qmp_socket, self.adopt_timeout)
        except QMPDisconnected as e:
            if pid is not None and _is_vm_process(pid, spec.qmp_socket):
                raise HypervisorError(
                    f"the VM of {spec.name} runs as process {pid} but its QMP monitor "
                    f"did not answer: {e}"
                ) from e
            self.log.info(
                "VM {name} is not running ({error}); removing its stale files",
                name=spec.name,
                error=e,
            )
            _remove_stale_files(spec)
            return None
        self.log.info("adopted VM {name} (process {pid})", name=spec.name, pid=pid)
        return RunningVM(self.reactor, spec, client, pid, self.command_timeout)

    async def wait_released(self, spec: VMSpec) -> None:
        """Wait (up to ``kill_timeout``) until nothing answers on ``spec``'s QMP socket.

        A QEMU that failed an ``-incoming`` load is gone before its socket is:
        the ``exec:`` migration child inherited the listening socket and holds
        it until it notices (measured, about a second); a start in between
        would see the socket in use.
        """
        deadline = self.reactor.seconds() + self.kill_timeout
        while _socket_listens(spec.qmp_socket) and self.reactor.seconds() < deadline:
            await deferLater(self.reactor, _EXIT_POLL_SECONDS, lambda: None)

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        """SIGKILL ``spec``'s VM process when no RunningVM follows it; fires with whether one was.

        For a VM whose monitor socket vanished or does not answer.  Only a live
        process whose command line names ``spec``'s QMP socket is signalled: a
        stale pidfile, a reused pid or a VM hosted by ``fakeqemu-host`` is left
        alone (False).  The signal is sent before this returns; the Deferred
        fires once the process is gone, or fails with a HypervisorError if it
        survives ``kill_timeout``.  Stale files stay for ``adopt`` or ``launch``
        to remove.
        """
        pid = _owned_pid(spec)
        if pid is None:
            return succeed(False)
        self.log.warn("killing VM {name} (process {pid})", name=spec.name, pid=pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return succeed(False)  # it ended on its own meanwhile
        return Deferred.fromCoroutine(self._await_killed(spec, pid))

    async def _await_killed(self, spec: VMSpec, pid: int) -> bool:
        deadline = self.reactor.seconds() + self.kill_timeout
        while _is_vm_process(pid, spec.qmp_socket):
            if self.reactor.seconds() >= deadline:
                raise HypervisorError(
                    f"VM {spec.name} (process {pid}) survived SIGKILL for {self.kill_timeout:g}s"
                )
            await deferLater(self.reactor, _EXIT_POLL_SECONDS, lambda: None)
        return True

    def _prepare_run_dir(self, spec: VMSpec) -> None:
        try:
            os.makedirs(spec.run_dir, mode=0o700, exist_ok=True)
            os.chmod(spec.run_dir, 0o700)
        except OSError as e:
            raise HypervisorError(
                f"cannot create the run directory {spec.run_dir} of {spec.name}: {e.strerror}"
            ) from e
        pid = _owned_pid(spec)
        if pid is not None:
            raise HypervisorError(
                f"cannot start {spec.name}: its VM is already running as process {pid}"
            )
        if _socket_listens(spec.qmp_socket):
            # A VM without a pid of its own (on a fakeqemu host) still serves its monitor.
            raise HypervisorError(
                f"cannot start {spec.name}: its QMP socket {spec.qmp_socket} is in use "
                f"by a running VM"
            )
        for path in (spec.qmp_socket, spec.pidfile):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _kill_leftover(self, spec: VMSpec) -> None:
        pid = _owned_pid(spec)
        if pid is not None:
            self.log.warn(
                "killing half-started VM {name} (process {pid})", name=spec.name, pid=pid
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _failure_message(
        self,
        spec: VMSpec,
        launcher: _Launcher,
        code: int | None,
        signal_number: int | None,
    ) -> str:
        # Once it parsed its options, a QEMU told to daemonize with -D reports there.
        lines = error_lines(launcher.stderr.decode("utf-8", "replace")) + read_log_lines(spec)
        if lines:
            return "\n".join(lines)
        program = self.program_name
        if signal_number is not None:
            return f"{program} was killed by signal {signal_number} while starting"
        said = launcher.stdout.decode("utf-8", "replace").strip()
        suffix = f": {said}" if said else " without saying why"
        return f"{program} exited with status {code}{suffix}"
