"""The VM processes under a run directory, found in ``/proc``, and their killing.

Before it kills a VM the fence writes why into the VM's run directory
(``FENCED_MARKER``): the daemon that sees the VM gone says so rather than
"exited unexpectedly" (``fenced_reason``); the daemon removes the file when
it starts that VM again.

A VM belongs to a member's run directory when its ``-qmp`` monitor socket is
a ``unix:`` path under it: that is on QEMU's (and fakeqemu's) command line
from its first instant, before any pidfile is written.  Processes already
exited (zombies) are none.  A fakeqemu VM hosted by ``fakeqemu-host`` has no
process of its own and is not found.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

PROC = "/proc"
# In a VM's run directory: why the host fence killed it.
FENCED_MARKER = "fenced"


@dataclass(frozen=True)
class VMProcess:
    """A live VM process: its pid, its run directory, and its size from its command line."""

    pid: int
    run_dir: str
    memory_mib: int
    cpus: int


def _arguments(pid: str) -> list[str] | None:
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, not a zombie."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            return f.read().rpartition(") ")[2][:1] not in ("Z", "X", "")
    except OSError:
        return False


def _value(argv: list[str], option: str) -> str | None:
    if option not in argv[:-1]:
        return None
    return argv[argv.index(option) + 1]


def _size(argv: list[str]) -> tuple[int, int]:
    if "-name" in argv:
        argv = argv[argv.index("-name") :]  # past the program (``python -m fakeqemu``)
    memory = _value(argv, "-m") or "0"
    cpus = (_value(argv, "-smp") or "1").split(",")[0]
    try:
        return int(memory.split(",")[0].rstrip("MmGg") or 0), int(cpus or 1)
    except ValueError:
        return 0, 1


def _candidates() -> Iterator[tuple[int, list[str]]]:
    for entry in os.listdir(PROC):
        if entry.isdigit() and (argv := _arguments(entry)) is not None:
            yield int(entry), argv


def vm_processes(run_root: str) -> dict[str, VMProcess]:
    """Every live VM process whose monitor socket is under ``run_root``, by its run dir."""
    # QEMU's option syntax doubles a comma inside a value.
    prefix = "unix:" + os.path.abspath(run_root).replace(",", ",,") + "/"
    found = {}
    for pid, argv in _candidates():
        monitor = _value(argv, "-qmp")
        if monitor is None or not monitor.startswith(prefix) or not _alive(pid):
            continue
        path = monitor.removeprefix("unix:").split(",", 1)[0]
        memory, cpus = _size(argv)
        found[os.path.dirname(path)] = VMProcess(pid, os.path.dirname(path), memory, cpus)
    return found


def kill_vms(run_root: str, reason: str | None = None) -> list[VMProcess]:
    """SIGKILL every VM process under ``run_root``; those that were signalled.

    With ``reason``, each VM's run directory says it first (``FENCED_MARKER``).
    """
    killed = []
    for vm in vm_processes(run_root).values():
        if reason is not None:
            # A run directory that cannot take the note does not spare its VM.
            with (
                contextlib.suppress(OSError),
                open(os.path.join(vm.run_dir, FENCED_MARKER), "w", encoding="utf-8") as note,
            ):
                note.write(reason + "\n")
        with contextlib.suppress(ProcessLookupError):
            os.kill(vm.pid, signal.SIGKILL)
            killed.append(vm)
    return killed


def fenced_reason(run_dir: str) -> str | None:
    """Why the host fence killed the VM of ``run_dir``, or None if it did not."""
    try:
        with open(os.path.join(run_dir, FENCED_MARKER), encoding="utf-8") as note:
            return note.read(1000).strip() or None
    except OSError:
        return None
