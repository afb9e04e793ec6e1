"""One process hosting many fakeqemu VMs, driven over a control socket.

A thousand Python processes would not fit on a small machine; a thousand
Machines in one reactor do.  ``fakeqemu-system-x86_64`` run with
``FAKEQEMU_HOST=<control socket>`` hands its command line to the host instead
of running the VM itself, so a VM outlives the process that asked for it, as a
daemonized QEMU outlives the daemon that started it.

The control protocol is one JSON object per line, QMP-shaped:
``{"execute": "launch"|"wait"|"kill"|"crash"|"terminate"|"list", "arguments": {...}, "id": ...}``
answered by ``{"return": ...}`` or ``{"error": {"class": ..., "desc": ...}}``.

A launch with ``"attached": true`` stands for a QEMU process that was not
daemonized: the launching connection is that process.  The VM's exit status is
kept until that connection ``wait``s for it, even if the VM exits first, and
if the connection goes away while the VM runs (the launcher was SIGKILLed) the
VM vanishes with it, as QEMU would.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from fakeqemu._cmdline import (
    CommandLineError,
    MachineConfig,
    format_messages,
    parse_command_line,
)
from fakeqemu._vm import RunningVM, StartError, guest_directory, write_state_file

HOST_VARIABLE = "FAKEQEMU_HOST"


class HostError(Exception):
    """A control request failed; ``desc`` is the message for the client."""

    def __init__(self, error_class: str, desc: str) -> None:
        super().__init__(desc)
        self.error_class = error_class
        self.desc = desc


def resolve_paths(config: MachineConfig, cwd: str) -> MachineConfig:
    """Make the command line's relative paths relative to the asking process's directory."""

    def absolute(path: str) -> str:
        return os.path.normpath(os.path.join(cwd, path))

    return attrs.evolve(
        config,
        qmp_sockets=tuple(absolute(p) for p in config.qmp_sockets),
        pidfile=absolute(config.pidfile) if config.pidfile else None,
        incoming_path=absolute(config.incoming_path) if config.incoming_path else None,
        logfile=absolute(config.logfile) if config.logfile else None,
    )


DEFAULT_PROGRAM = "fakeqemu-system-x86_64"


def append_to_logfile(path: str, text: str) -> None:
    """Add what a daemonized VM prints to its ``-D`` file (its launcher truncated it)."""
    if not text:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


@attrs.define
class HostedVM:
    """A VM the host runs, and who is waiting for it to exit."""

    vm_id: str
    vm: RunningVM
    attached: bool = False
    output: list[str] = attrs.Factory(list)
    program: str = DEFAULT_PROGRAM
    waiters: list[Deferred[dict[str, Any]]] = attrs.Factory(list)
    result: dict[str, Any] | None = None


class VMHost:
    """Launches and tracks VMs inside this process."""

    log = Logger()

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.vms: dict[str, HostedVM] = {}
        # Attached VMs that exited before their launcher asked how.
        self._unreaped: dict[str, dict[str, Any]] = {}
        self._counter = 0

    def launch(
        self,
        argv: Sequence[str],
        cwd: str,
        environ: Mapping[str, str],
        attached: bool = False,
        program: str = DEFAULT_PROGRAM,
    ) -> HostedVM:
        """Start a VM from a QEMU command line, as a fresh process in ``cwd`` would.

        ``program`` is the name the launcher's messages start with.  A daemonized VM
        with ``-D FILE`` prints to FILE, as QEMU's daemon does (FILE is its stderr);
        what it prints while starting goes back to the launcher, which prints it there.
        """
        config = _vm_config(argv, cwd)
        self._counter += 1
        vm_id = str(self._counter)
        guest_dir = guest_directory(config, environ)
        if guest_dir is not None:
            guest_dir = os.path.normpath(os.path.join(cwd, guest_dir))

        def write_file(path: str, data: bytes) -> None:
            # ``migrate`` to ``exec:cat > PATH`` runs in the launching process's directory.
            write_state_file(os.path.join(cwd, path), data)

        output: list[str] = []
        started = False

        def print_output(text: str) -> None:
            self.log.info("VM {vm_id}: {text}", vm_id=vm_id, text=text.rstrip("\n"))
            if started and config.daemonize and config.logfile:
                append_to_logfile(config.logfile, text)
            else:
                output.append(text)

        vm = RunningVM(
            config,
            self.reactor,
            guest_dir,
            self._exited(vm_id),
            write_file,
            print_output,
            # The launcher's environment stands for QEMU's (guestfwd commands inherit it).
            environ=environ,
            program=program,
        )
        hosted = HostedVM(vm_id, vm, attached, output, program)
        try:
            hosted.vm.start()
        except StartError as e:
            raise HostError("StartError", str(e)) from None
        _write_pidfile(hosted)
        self.vms[vm_id] = hosted
        started = True
        self.log.info("launched VM {vm_id} ({name})", vm_id=vm_id, name=config.name)
        return hosted

    def _exited(self, vm_id: str) -> Any:
        def exited(status: int, lines: list[str]) -> None:
            hosted = self.vms.pop(vm_id, None)
            if hosted is None:
                return
            hosted.result = {"status": status, "stderr": lines}
            self.log.info("VM {vm_id} exited with {status}", vm_id=vm_id, status=status)
            config = hosted.vm.config
            if config.daemonize and config.logfile:
                with contextlib.suppress(OSError):
                    append_to_logfile(config.logfile, format_messages(hosted.program, lines))
            pidfile = hosted.vm.config.pidfile
            if pidfile and status >= 0:
                # QEMU removes its pidfile when it exits, but not when killed or aborted.
                with contextlib.suppress(OSError):
                    os.unlink(pidfile)
            if hosted.attached and not hosted.waiters:
                self._unreaped[vm_id] = hosted.result
            waiters, hosted.waiters = hosted.waiters, []
            for waiter in waiters:
                waiter.callback(hosted.result)

        return exited

    def get(self, vm_id: object) -> HostedVM:
        """The VM with this id, or a clear error."""
        hosted = self.vms.get(str(vm_id))
        if hosted is None:
            raise HostError("VMNotFound", f"no VM '{vm_id}' on this host")
        return hosted

    def wait(self, vm_id: object) -> Deferred[dict[str, Any]]:
        """Fires with ``{"status", "stderr"}`` when the VM exits."""
        unreaped = self._unreaped.pop(str(vm_id), None)
        if unreaped is not None:
            return succeed(unreaped)
        hosted = self.get(vm_id)
        waiter: Deferred[dict[str, Any]] = Deferred()
        hosted.waiters.append(waiter)
        return waiter

    def launcher_gone(self, vm_id: str) -> None:
        """The process an attached VM stands for is gone: so is the VM, as after SIGKILL."""
        self._unreaped.pop(vm_id, None)
        hosted = self.vms.get(vm_id)
        if hosted is not None and hosted.attached:
            self.log.info("the launcher of VM {vm_id} went away; killing it", vm_id=vm_id)
            hosted.attached = False  # nobody is left to collect its exit status
            hosted.vm.kill()

    def list(self) -> list[dict[str, Any]]:
        """Every live VM."""
        return [
            {
                "vm": hosted.vm_id,
                "name": hosted.vm.config.name,
                "qmp": list(hosted.vm.config.qmp_sockets),
                "status": hosted.vm.machine.run_state.value,
                "guest_dir": hosted.vm.guest_dir,
                "attached": hosted.attached,
            }
            for hosted in self.vms.values()
        ]


def _vm_config(argv: Sequence[str], cwd: str) -> MachineConfig:
    """The VM a command line describes, its paths taken from ``cwd``; a refusal as HostError."""
    try:
        config = resolve_paths(parse_command_line(argv, cwd), cwd)
    except CommandLineError as e:
        raise HostError("CommandLineError", str(e)) from None
    if config.show_version:
        raise HostError("CommandLineError", "-version: not a VM")
    return config


def _write_pidfile(hosted: HostedVM) -> None:
    """``-pidfile``: the host's pid, the process the VM runs in; a VM that cannot write it dies."""
    pidfile = hosted.vm.config.pidfile
    if not pidfile:
        return
    try:
        with open(pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError as e:
        hosted.vm.kill()
        raise HostError(
            "StartError",
            f"cannot create PID file: Could not create '{pidfile}': {e.strerror}",
        ) from None


class HostControlProtocol(LineOnlyReceiver):
    """One control client: requests in, replies out, one JSON object per line."""

    delimiter = b"\n"
    MAX_LENGTH = 1024 * 1024

    def __init__(self, host: VMHost) -> None:
        self._host = host
        self._attached: list[str] = []

    def lineReceived(self, line: bytes) -> None:
        try:
            request = json.loads(line)
        except ValueError:
            self._reply(None, error=HostError("GenericError", "request is not JSON"))
            return
        if not isinstance(request, dict):
            self._reply(None, error=HostError("GenericError", "request must be a JSON object"))
            return
        request_id = request.get("id")
        try:
            result = self._dispatch(request)
        except HostError as e:
            self._reply(request_id, error=e)
            return
        if isinstance(result, Deferred):
            result.addCallback(lambda value: self._reply(request_id, value))
        else:
            self._reply(request_id, result)

    def _dispatch(self, request: dict[str, Any]) -> Any:
        command = request.get("execute")
        arguments = request.get("arguments", {})
        if not isinstance(arguments, dict):
            raise HostError("GenericError", "'arguments' must be an object")
        if command == "launch":
            argv = arguments.get("argv")
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise HostError("GenericError", "'argv' must be a list of strings")
            environ = arguments.get("env", {})
            if not isinstance(environ, dict):
                raise HostError("GenericError", "'env' must be an object")
            attached = arguments.get("attached", False) is True
            cwd = str(arguments.get("cwd", "/"))
            program = str(arguments.get("program", DEFAULT_PROGRAM))
            hosted = self._host.launch(argv, cwd, environ, attached, program)
            if attached:
                self._attached.append(hosted.vm_id)
            return {
                "vm": hosted.vm_id,
                "pid": os.getpid(),
                "guest_dir": hosted.vm.guest_dir,
                "output": "".join(hosted.output),
            }
        if command == "wait":
            return self._host.wait(arguments.get("vm"))
        if command == "kill":
            self._host.get(arguments.get("vm")).vm.kill()
            return {}
        if command == "crash":
            message = str(arguments.get("message", "crashed on request (fakeqemu-host crash)"))
            self._host.get(arguments.get("vm")).vm.crash(message)
            return {}
        if command == "terminate":
            signal_number = int(arguments.get("signal", 15))
            machine = self._host.get(arguments.get("vm")).vm.machine
            machine.terminate_on_signal(signal_number)
            return {}
        if command == "list":
            return self._host.list()
        raise HostError("CommandNotFound", f"The command {command} has not been found")

    def _reply(self, request_id: Any, result: Any = None, error: HostError | None = None) -> None:
        if error is not None:
            message: dict[str, Any] = {"error": {"class": error.error_class, "desc": error.desc}}
        else:
            message = {"return": result}
        if request_id is not None:
            message["id"] = request_id
        if self.transport is not None:
            self.sendLine(json.dumps(message).encode())

    def lineLengthExceeded(self, line: bytes) -> None:
        self._reply(None, error=HostError("GenericError", "request too long"))
        assert self.transport is not None
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        attached, self._attached = self._attached, []
        for vm_id in attached:
            self._host.launcher_gone(vm_id)


class HostControlFactory(Factory):
    """Serves the control socket of one VMHost."""

    def __init__(self, host: VMHost) -> None:
        self.host = host

    def buildProtocol(self, addr: object) -> HostControlProtocol:
        return HostControlProtocol(self.host)
