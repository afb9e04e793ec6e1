"""Following one VM until it is gone: its QMP events, its monitor closing, its process ending.

Once daemonized, QEMU's stdin, stdout and stderr are ``/dev/null``: whatever
goes wrong — a failed ``-incoming`` restore, a crash, a ``kill -9`` — is seen
only as the QMP monitor disconnecting.  ``VMFollower`` turns that into a
``gone`` event whose detail and power state say whether QEMU announced a
``SHUTDOWN`` first, once the process itself has ended (or been killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from vmready.domain import HypervisorError, Listeners, PowerState
from vmready.fence import fenced_reason
from vmready.hypervisor.cmdline import VMSpec
from vmready.hypervisor.vmevents import VMEvent, VMEventKind, gone_event, vm_event_for
from vmready.hypervisor.vmprocess import EXIT_POLL_SECONDS, is_vm_process, vm_process_remains
from vmready.protocols.qmp import QMPClientProtocol, QMPEvent


class VMFollower:
    """A VM's events for its listeners, and its process until it is gone (or killed).

    ``log`` is the logger of the ``RunningVM`` this follows for (so its lines
    carry that VM handle's namespace).
    """

    # How long a process may take to exit once its monitor closed before it is killed.
    exit_grace = 10.0

    def __init__(
        self,
        reactor: IReactorTime,
        spec: VMSpec,
        qmp: QMPClientProtocol,
        pid: int | None,
        log: Logger,
    ) -> None:
        self.spec = spec
        self.qmp = qmp
        self.pid = pid
        self.log = log
        self._reactor = reactor
        self._listeners: Listeners[VMEvent] = Listeners(
            log, "VM event listener failed on {kind} of {name}"
        )
        self._shutdown: QMPEvent | None = None
        self._killed: str | None = None
        self._gone: VMEvent | None = None
        self._gone_waiters: list[Deferred[VMEvent]] = []
        self.detached = False
        self.watching_exit = False
        qmp.subscribe(self._qmp_event)
        qmp.when_closed().addCallback(self._monitor_closed)

    def subscribe(self, listener: Callable[[VMEvent], None]) -> Callable[[], None]:
        """Call ``listener`` with every VMEvent, ending with ``gone``; returns the unsubscriber."""
        return self._listeners.subscribe(listener)

    @property
    def gone_event(self) -> VMEvent | None:
        """The ``gone`` event once the VM process has ended, else None."""
        return self._gone

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
        """Hang up the monitor and leave the VM running; fires once closed."""
        self.detached = True
        self.qmp.close()
        return self.qmp.when_closed()

    def hung_up(self) -> bool:
        """Whether vmready itself closed the monitor (detach, or a QMP protocol error)."""
        return self.detached or bool(getattr(self.qmp.transport, "disconnecting", False))

    def kill(self, why: str) -> None:
        """SIGKILL the VM's process because ``why``; the gone event will say so."""
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

    def _qmp_event(self, event: QMPEvent) -> None:
        if event.name == "SHUTDOWN":
            self._shutdown = event
        vm_event = vm_event_for(event)
        if vm_event is not None:
            self._notify(vm_event)

    def _notify(self, event: VMEvent) -> None:
        self._listeners.notify(event, kind=event.kind, name=self.spec.name)

    def _monitor_closed(self, _: object) -> None:
        if self.hung_up():
            # We hung up (detach, or a QMP protocol error): the VM itself is not gone.
            self.detached = True
            self.log.info("stopped following VM {name}; it keeps running", name=self.spec.name)
            return
        self._watch_exit()

    def _watch_exit(self) -> None:
        if self.watching_exit or self._gone is not None:
            return
        self.watching_exit = True
        Deferred.fromCoroutine(self._await_exit()).addErrback(
            lambda failure: self.log.failure(
                "following the exit of VM {name} failed", failure, name=self.spec.name
            )
        )

    async def _await_exit(self) -> None:
        deadline = self._reactor.seconds() + self.exit_grace
        hung = False
        while self.pid is not None and vm_process_remains(self.pid, self.spec.qmp_socket):
            if self._reactor.seconds() >= deadline:
                hung = True
                self.log.warn(
                    "VM {name} (process {pid}) closed its monitor but did not exit; killing it",
                    name=self.spec.name,
                    pid=self.pid,
                )
                self._send_sigkill()
                break
            await deferLater(self._reactor, EXIT_POLL_SECONDS, lambda: None)
        event = gone_event(self._shutdown, self._killed, fenced_reason(self.spec.run_dir))
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

    def _send_sigkill(self) -> None:
        if self.pid is None or not is_vm_process(self.pid, self.spec.qmp_socket):
            return
        self.log.warn("killing VM {name} (process {pid})", name=self.spec.name, pid=self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
