"""Processes a test left behind: found by the temporary directory their command line names."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def process_state(pid: int) -> bytes | None:
    """The state letter /proc shows for process ``pid`` (R, S, T, Z…), or None if none is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0] if fields else None


def strays(directory: str) -> Iterator[int]:
    """Live processes whose command line names ``directory`` (a test's own temp dir)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and names(int(entry), directory):
            yield int(entry)


def names(pid: int, directory: str) -> bool:
    """Whether process ``pid`` is alive and its command line names ``directory``."""
    needle = os.fsencode(directory.rstrip("/") + "/")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return False
    return any(needle in word for word in words)


def kill_if_named(pid: int, directory: str) -> None:
    """SIGKILL ``pid`` read from a pidfile, only if it is still a process of that test (its
    command line names ``directory``): after the pid counter wraps, a pidfile's number may
    be another test's process."""
    if names(pid, directory):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_strays(directory: str) -> None:
    """SIGKILL every process whose command line names ``directory``: a daemonized VM
    (QEMU or fakeqemu) a test started and lost track of, whatever it was doing when the
    test ended; nothing else names a test's own temporary directory."""
    for pid in strays(directory):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
