"""``fakeqemu-system-x86_64`` / ``python -m fakeqemu``: a QEMU-compatible command line."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, NoReturn

from fakeqemu import __version__
from fakeqemu._cmdline import (
    QEMU_VERSION,
    CommandLineError,
    MachineConfig,
    format_messages,
    parse_arguments,
    program_name,
)
from fakeqemu._help import HelpRequested
from fakeqemu._host import HOST_VARIABLE
from fakeqemu._hostclient import HostClient, HostRequestError, HostUnreachable
from fakeqemu._vm import RunningVM, StartError, guest_directory

_DRAIN_SECONDS = 2.0


def _print_lines(prog: str, messages: list[str]) -> None:
    sys.stderr.write(format_messages(prog, messages))
    sys.stderr.flush()


def _die_like(status: int) -> NoReturn:
    """Leave with ``status`` as a subprocess would show it: negative means a signal."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run one VM from a QEMU command line, standalone or on a fakeqemu host."""
    args = sys.argv[1:] if argv is None else argv
    prog = program_name()
    major, minor, micro = QEMU_VERSION
    version_line = f"QEMU emulator version {major}.{minor}.{micro} (fakeqemu {__version__})"
    try:
        parsed = parse_arguments(args)
    except CommandLineError as e:
        _print_lines(prog, [str(e)])
        sys.exit(1)
    except HelpRequested as e:
        sys.stdout.write(e.text(prog, version_line))
        sys.exit(0)
    if parsed.show_version:
        print(version_line)
        print("fakeqemu emulates QEMU's monitor and vmready's devices; it runs no guest code")
        sys.exit(0)
    if parsed.logfile is not None:
        _open_logfile(parsed.logfile, parsed.daemonize, prog)
    try:
        config = parsed.configure()
    except CommandLineError as e:
        _print_lines(prog, e.messages)
        sys.exit(1)
    _print_lines(prog, list(config.warnings))
    host = os.environ.get(HOST_VARIABLE)
    if host:
        _die_like(_run_on_host(host, args, config, prog))
    _die_like(_run_standalone(config, prog))


def _open_logfile(path: str, daemonize: bool, prog: str) -> None:
    """``-D FILE`` as QEMU 7.2 opens it, between its option loop and its other checks.

    The file is truncated at every start.  With ``-daemonize`` it takes stderr's
    place from here on: every later error, warning and exit message of this process
    and of the daemon it becomes lands in it, and none on the caller's stderr.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as e:
        _print_lines(prog, [f"Error opening logfile {path}: {e.strerror}"])
        sys.exit(1)
    if daemonize:
        sys.stderr.flush()
        os.dup2(fd, 2)
    os.close(fd)


_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _run_on_host(control: str, args: list[str], config: MachineConfig, prog: str) -> int:
    environ = dict(os.environ)
    if not config.daemonize:
        # QEMU handles these from its first moment; hold them until the VM they are
        # for exists, rather than die of one while its monitor already answers.
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED_SIGNALS)
    try:
        client = HostClient(control)
    except HostUnreachable as e:
        _print_lines(prog, [str(e)])
        return 1
    with client:
        # Not daemonized, this process stands for the VM: the host ties the VM to this
        # connection, so the exit status waits for us and our death is the VM's.
        try:
            launched = client.call(
                "launch",
                argv=args,
                cwd=os.getcwd(),
                env=environ,
                attached=not config.daemonize,
                program=prog,
            )
        except HostRequestError as e:
            # A start failure is one QEMU message per line; a command-line error is one message.
            _print_lines(prog, e.desc.split("\n") if e.error_class == "StartError" else [e.desc])
            return 1
        except HostUnreachable as e:
            _print_lines(prog, [str(e)])
            return 1
        # What the VM printed while starting (cat's complaint about a missing stream).
        sys.stderr.write(launched.get("output", ""))
        sys.stderr.flush()
        if config.daemonize:
            return 0
        vm_id = launched["vm"]

        def forward_signal(signal_number: int, frame: Any) -> None:
            try:
                with HostClient(control) as other:
                    other.call("terminate", vm=vm_id, signal=signal_number)
            except (HostRequestError, HostUnreachable):
                return  # the VM is already gone

        for signal_number in _FORWARDED_SIGNALS:
            signal.signal(signal_number, forward_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED_SIGNALS)
        client.settimeout(None)
        try:
            result = client.call("wait", vm=vm_id)
        except (HostRequestError, HostUnreachable) as e:
            _print_lines(prog, [f"lost the VM on the fakeqemu host: {e}"])
            return 1
    _print_lines(prog, result["stderr"])
    return int(result["status"])


def _daemonize() -> int:
    """Fork away from the caller; the caller exits once the child reports readiness."""
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        report = b""
        while chunk := os.read(read_end, 4096):
            report += chunk
        if report.startswith(b"\0"):
            os._exit(0)
        sys.stderr.write(report.decode("utf-8", "replace"))
        sys.stderr.flush()
        os._exit(1)
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    return write_end


def _detach_stdio(keep_stderr: bool) -> None:
    """Point the daemon's standard streams at /dev/null; a ``-D`` log file keeps stderr."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1) if keep_stderr else (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _run_standalone(config: MachineConfig, prog: str) -> int:
    ready_fd = _daemonize() if config.daemonize else None

    def fail(lines: list[str]) -> int:
        if ready_fd is not None:
            os.write(ready_fd, format_messages(prog, lines).encode())
            os.close(ready_fd)
        else:
            _print_lines(prog, lines)
        return 1

    # Imported here, after any daemonizing fork, so the process that runs the
    # reactor is the one that created it.
    from twisted.internet import reactor as installed_reactor

    # The global reactor is declared as a narrow interface; this one also runs
    # without its own signal handlers and takes calls from signal handlers.
    reactor: Any = installed_reactor

    exit_status = [0]

    def on_exit(status: int, lines: list[str]) -> None:
        exit_status[0] = status
        _print_lines(prog, lines)
        vm.qmp_factory.when_idle(reactor, _DRAIN_SECONDS).addBoth(lambda _: reactor.stop())

    def on_output(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    vm = RunningVM(
        config, reactor, guest_directory(config, os.environ), on_exit, on_output=on_output
    )
    try:
        vm.start()
    except StartError as e:
        return fail(e.lines)
    if config.pidfile:
        try:
            with open(config.pidfile, "w") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as e:
            return fail(
                [f"cannot create PID file: Could not create '{config.pidfile}': {e.strerror}"]
            )

    def on_signal(signal_number: int, frame: Any) -> None:
        reactor.callFromThread(vm.machine.terminate_on_signal, signal_number)

    for signal_number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signal_number, on_signal)
    if ready_fd is not None:
        os.write(ready_fd, b"\0")
        os.close(ready_fd)
        _detach_stdio(keep_stderr=config.logfile is not None)
    reactor.run(installSignalHandlers=False)
    if config.pidfile:
        with contextlib.suppress(OSError):
            os.unlink(config.pidfile)
    return exit_status[0]
