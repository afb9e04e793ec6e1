"""The agent's own boot timeline, on the guest's uptime clock, said once on the console.

A reader of the console (and ``benchmarks/real_guest.py``) sees where a boot's
time went: when the agent's process started, when it first said ``STARTED``,
when the host's ``CONNECT`` reached it and when it said ``CONNECTED``, each
in seconds since the guest's kernel started (``CLOCK_BOOTTIME``, the clock of
the kernel's own timestamps).  A line per process at the first ``STARTED``,
the first ``CONNECTED``, and the first Ready the host accepted (with when the
first request to relay to the host reached the agent: the workload's)::

    vmready-agent: boot: process [2.31] STARTED [2.87]
    vmready-agent: boot: CONNECT [3.02] CONNECTED [3.41]
    vmready-agent: boot: relay [3.60] Ready [3.75]
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is for mypy: the agent dates its first STARTED without it
    from typing import Callable


def uptime() -> float:
    """Seconds since the kernel started (suspend included), as the kernel's timestamps count."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(stat: str = "/proc/self/stat") -> float | None:
    """When this process started, in seconds of uptime (field 22 of ``stat``); None if unknown."""
    try:
        with open(stat) as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class BootTimeline:
    """Moments of this process, each kept the first time it happens."""

    def __init__(self, clock: Callable[[], float] = uptime, started: float | None = None) -> None:
        self.clock = clock
        self.marks: dict[str, float] = {}
        if started is not None:
            self.marks["process"] = started

    def note(self, moment: str, at: float) -> bool:
        """Note that ``moment`` happened at uptime ``at``; True only the first time."""
        if moment in self.marks:
            return False
        self.marks[moment] = at
        return True

    def mark(self, moment: str) -> bool:
        """Note ``moment`` now; True only the first time."""
        return moment not in self.marks and self.note(moment, self.clock())

    def line(self, *moments: str) -> str:
        """``boot: process [2.31] STARTED [2.87]``: the known ones among ``moments``."""
        known = " ".join(f"{m} [{self.marks[m]:.2f}]" for m in moments if m in self.marks)
        return f"boot: {known}"
