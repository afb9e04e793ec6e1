"""Runs VMs: QEMU (or fakeqemu) processes started from a ``VMSpec``, or adopted still running.

``HypervisorDriver.launch`` spawns the hypervisor with ``-daemonize`` without
blocking the reactor.  QEMU reports a refused command line or a failed start on
stderr *before* it daemonizes; those lines (warnings dropped) become the
``HypervisorError`` the user sees.  Once daemonized, QEMU's stdin, stdout and
stderr are ``/dev/null``: whatever goes wrong afterwards is seen only as the
QMP monitor disconnecting, which the ``RunningVM`` it returns follows
(``runningvm``).

Only a live process whose command line names the VM's QMP socket is ever
signalled (``vmprocess``).  ``HypervisorDriver.kill_owned`` SIGKILLs a VM no
``RunningVM`` follows (its monitor socket vanished, or it does not answer).
A launch, a kill and every QMP command that is not a read first ask ``guard``
(``acting``): a cluster member whose lease may have run out does not act.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import HypervisorError, IVMReadyReactor
from vmready.fence import FENCED_MARKER
from vmready.hypervisor.acting import ALWAYS, ActingGuard
from vmready.hypervisor.cmdline import VMSpec, build_command_line
from vmready.hypervisor.commands import DEFAULT_COMMAND_TIMEOUT
from vmready.hypervisor.kvmprobe import KVMProbe, probe_kvm
from vmready.hypervisor.qemulog import OUTPUT_CAP, error_lines, read_log_lines
from vmready.hypervisor.runningvm import RunningVM
from vmready.hypervisor.stopping import DEFAULT_KILL_TIMEOUT
from vmready.hypervisor.vmprocess import (
    EXIT_POLL_SECONDS,
    find_vm_process,
    is_vm_process,
    owned_pid,
    remove_stale_files,
    socket_listens,
    vm_process_remains,
)
from vmready.protocols.qmp import QMPDisconnected, connect_qmp

HYPERVISORS = ("fakeqemu", "qemu")
QEMU_PROGRAM = "qemu-system-x86_64"


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
        self.stdout = (self.stdout + data)[:OUTPUT_CAP]

    def errReceived(self, data: bytes) -> None:
        self.stderr = (self.stderr + data)[:OUTPUT_CAP]

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

    def __init__(self, reactor: IVMReadyReactor, kind: str, binary: str | None = None) -> None:
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
        # Asked before each step that changes a VM (a cluster member's lease sets it).
        self.guard: ActingGuard = ALWAYS
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

    async def probe_kvm(self) -> KVMProbe | None:
        """QEMU's own verdict on KVM here, from a probe VM (None: fakeqemu runs no guest code)."""
        if self.kind != "qemu":
            return None
        return await probe_kvm(self.reactor, self.reactor, self.program, self.program_name)

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
        await self.guard.before_acting(spec.name, "start")
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
        pid = owned_pid(spec) or find_vm_process(spec)
        try:
            client = await connect_qmp(self.reactor, spec.qmp_socket, self.connect_timeout)
        except QMPDisconnected as e:
            if pid is not None and is_vm_process(pid, spec.qmp_socket):
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
        return RunningVM(self.reactor, spec, client, pid, self.command_timeout, self.guard)

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        """Re-attach to ``spec``'s VM if it still runs, not restarting it; else None.

        When it does not run, its stale socket, pidfile and guest directory are
        removed.  A VM whose process is alive but whose monitor does not answer
        (another client holds it, QEMU is stopped or hung, or the socket is gone)
        is neither adopted nor reported absent: that is a HypervisorError naming
        the process, and ``kill_owned`` is how to be rid of it.
        """
        pid = owned_pid(spec)
        if pid is None and not os.path.exists(spec.qmp_socket):
            remove_stale_files(spec)
            return None
        try:
            client = await connect_qmp(self.reactor, spec.qmp_socket, self.adopt_timeout)
        except QMPDisconnected as e:
            if pid is not None and is_vm_process(pid, spec.qmp_socket):
                raise HypervisorError(
                    f"the VM of {spec.name} runs as process {pid} but its QMP monitor "
                    f"did not answer: {e}"
                ) from e
            self.log.info(
                "VM {name} is not running ({error}); removing its stale files",
                name=spec.name,
                error=e,
            )
            remove_stale_files(spec)
            return None
        self.log.info("adopted VM {name} (process {pid})", name=spec.name, pid=pid)
        return RunningVM(self.reactor, spec, client, pid, self.command_timeout, self.guard)

    async def wait_released(self, spec: VMSpec) -> None:
        """Wait (up to ``kill_timeout``) until nothing answers on ``spec``'s QMP socket.

        A QEMU that failed an ``-incoming`` load is gone before its socket is:
        the ``exec:`` migration child inherited the listening socket and holds
        it until it notices (measured, about a second); a start in between
        would see the socket in use.
        """
        deadline = self.reactor.seconds() + self.kill_timeout
        while socket_listens(spec.qmp_socket) and self.reactor.seconds() < deadline:
            await deferLater(self.reactor, EXIT_POLL_SECONDS, lambda: None)

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        """SIGKILL ``spec``'s VM process when no RunningVM follows it; fires with whether one was.

        For a VM whose monitor socket vanished or does not answer.  Only a live
        process whose command line names ``spec``'s QMP socket is signalled: a
        stale pidfile, a reused pid or a VM hosted by ``fakeqemu-host`` is left
        alone (False).  The signal is sent before this returns; the Deferred
        fires once the process is gone, or fails with a HypervisorError if it
        survives ``kill_timeout``.  Stale files stay for ``adopt`` or ``launch``
        to remove.  A refusal of ``guard`` fails the Deferred, nothing signalled.
        """
        return Deferred.fromCoroutine(self._kill_owned(spec))

    async def _kill_owned(self, spec: VMSpec) -> bool:
        pid = owned_pid(spec)
        if pid is None:
            return False
        await self.guard.before_acting(spec.name, "SIGKILL")
        self.log.warn("killing VM {name} (process {pid})", name=spec.name, pid=pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False  # it ended on its own meanwhile
        return await self._await_killed(spec, pid)

    async def _await_killed(self, spec: VMSpec, pid: int) -> bool:
        deadline = self.reactor.seconds() + self.kill_timeout
        while vm_process_remains(pid, spec.qmp_socket):
            if self.reactor.seconds() >= deadline:
                raise HypervisorError(
                    f"VM {spec.name} (process {pid}) survived SIGKILL for {self.kill_timeout:g}s"
                )
            await deferLater(self.reactor, EXIT_POLL_SECONDS, lambda: None)
        return True

    def _prepare_run_dir(self, spec: VMSpec) -> None:
        try:
            os.makedirs(spec.run_dir, mode=0o700, exist_ok=True)
            os.chmod(spec.run_dir, 0o700)
        except OSError as e:
            raise HypervisorError(
                f"cannot create the run directory {spec.run_dir} of {spec.name}: {e.strerror}"
            ) from e
        pid = owned_pid(spec)
        if pid is not None:
            raise HypervisorError(
                f"cannot start {spec.name}: its VM is already running as process {pid}"
            )
        if socket_listens(spec.qmp_socket):
            # A VM without a pid of its own (on a fakeqemu host) still serves its monitor.
            raise HypervisorError(
                f"cannot start {spec.name}: its QMP socket {spec.qmp_socket} is in use "
                f"by a running VM"
            )
        # A note of the host fence is about the VM it killed, not the one starting now.
        for path in (spec.qmp_socket, spec.pidfile, os.path.join(spec.run_dir, FENCED_MARKER)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _kill_leftover(self, spec: VMSpec) -> None:
        pid = owned_pid(spec)
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
