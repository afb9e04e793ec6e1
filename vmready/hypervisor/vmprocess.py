"""A VM's process as the host sees it: its pidfile, its entry in ``/proc``, its monitor socket.

The pidfile is trusted only for a live process whose command line names this
VM's QMP socket, so a stale pidfile whose pid was reused is never signalled,
and a fakeqemu VM hosted by ``fakeqemu-host`` (whose pidfile names the shared
host) is never killed by signal: it has no pid of its own here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket

from vmready.hypervisor.cmdline import VMSpec, qmp_address

# How often vmready looks whether a process it waits for has ended.
EXIT_POLL_SECONDS = 0.05


def _read_pidfile(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def is_vm_process(pid: int, qmp_socket: str) -> bool:
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
    if _ended(stat):
        return False  # exited, not yet reaped by its parent (init, for a daemonized QEMU)
    marker = os.fsencode(qmp_address(qmp_socket) + ",")
    return any(marker in argument for argument in cmdline.split(b"\0"))


def is_exiting(pid: int) -> bool:
    """Whether ``pid`` is a process on its way out that a thread of it still keeps.

    A process's threads end one by one and its files (a VM's monitor socket
    among them) close only with the last; meanwhile its memory is released,
    so its command line reads empty and its leader may already be a zombie:
    ``is_vm_process`` no longer knows it, yet its socket still answers.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read(1):
                return False
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_thread_lives(pid, thread) for thread in threads)


def _thread_lives(pid: int, thread: str) -> bool:
    try:
        with open(f"/proc/{pid}/task/{thread}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return not _ended(stat)


def _ended(stat: bytes) -> bool:
    """Whether a ``/proc/…/stat`` line is a task that has exited (zombie, or dead)."""
    end_of_name = stat.rfind(b")")  # the name may hold spaces and parentheses
    return stat[end_of_name + 2 : end_of_name + 3] in (b"Z", b"X")


def vm_process_remains(pid: int, qmp_socket: str) -> bool:
    """Whether the VM's process ``pid`` has not ended: alive, or exiting with its files open."""
    return is_vm_process(pid, qmp_socket) or is_exiting(pid)


def owned_pid(spec: VMSpec) -> int | None:
    """The pidfile's pid if it is this VM's own live process, else None."""
    pid = _read_pidfile(spec.pidfile)
    if pid is not None and is_vm_process(pid, spec.qmp_socket):
        return pid
    return None


def find_vm_process(spec: VMSpec) -> int | None:
    """This VM's live process found by its command line, for when the pidfile is gone.

    A QEMU whose ``-incoming`` load fails removes its pidfile while it exits,
    sometimes before the launcher looked (measured): its process must still be
    waited for, or the next start finds its monitor socket still answering.
    """
    if not os.path.isdir("/proc/self"):
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit() and is_vm_process(int(entry), spec.qmp_socket):
            return int(entry)
    return None


def socket_listens(path: str) -> bool:
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


def remove_stale_files(spec: VMSpec) -> None:
    for path in (spec.qmp_socket, spec.pidfile):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    shutil.rmtree(spec.guest_dir, ignore_errors=True)
