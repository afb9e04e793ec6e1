"""Processes a test left behind: found by the temporary directory their command line names."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def strays(directory: str) -> Iterator[int]:
    """Live processes whose command line names ``directory`` (a test's own temp dir)."""
    needle = os.fsencode(directory.rstrip("/") + "/")
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if any(needle in word for word in words):
            yield int(entry)


def kill_strays(directory: str) -> None:
    """SIGKILL every process whose command line names ``directory``: a daemonized VM
    (QEMU or fakeqemu) a test started and lost track of, whatever it was doing when the
    test ended; nothing else names a test's own temporary directory."""
    for pid in strays(directory):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
