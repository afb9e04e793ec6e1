"""What the benchmark scripts share: percentiles, what ``/proc`` says of a process (CPU time,
memory, open files), output, and the reactor's sleep.

The scripts import it as ``benchmarks._measure``: they run from the checkout,
whose root the editable install puts on ``sys.path``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.logger import ILogObserver, LogEvent, LogLevel, formatEvent
from zope.interface import provider

from vmready.domain import default_reactor

installed_reactor = default_reactor()

reactor: Any = installed_reactor


def nearest_rank(samples: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest sample with ``fraction`` of them at or below."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used (its own, not its children's)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # Fields after the parenthesised command name start at field 3 (state).
    fields = stat.rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ms(seconds: float) -> str:
    """Seconds as a millisecond figure."""
    return f"{seconds * 1000:.1f} ms"


def report(line: str = "") -> None:
    """One line of the benchmark's output."""
    print(line, flush=True)


@provider(ILogObserver)
def show_problems(event: LogEvent) -> None:
    """In-process vmready warnings and failures go to stderr; the rest is not shown."""
    level = event.get("log_level")
    namespace = str(event.get("log_namespace", ""))
    if namespace.startswith("vmready") and level is not None and level >= LogLevel.warn:
        text = formatEvent(event)
        failure = event.get("log_failure")
        if failure is not None:
            text += "\n" + failure.getTraceback()
        print(f"  [log] {text}", file=sys.stderr, flush=True)


async def sleep(seconds: float) -> None:
    """Let the reactor run for ``seconds``."""
    await task.deferLater(reactor, seconds, lambda: None)


def react(
    run: Callable[[], Coroutine[Any, Any, None]], out: list[str], cleanup: Callable[[], None]
) -> None:
    """Run ``run`` on the reactor until it ends (a SystemExit of status 0 is an end too), then
    ``cleanup``, then print ``out``: the lines ``run`` left for last, its figures."""

    def entry(_reactor: Any) -> Deferred[None]:
        return Deferred.fromCoroutine(run())

    try:
        task.react(entry, [])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        cleanup()
        for line in out:
            print(line, flush=True)


def status_kib(pid: int, field: str = "VmRSS") -> int:
    """A KiB field (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """``field`` of ``/proc/<pid>/status`` in MiB (nan if the process has none)."""
    try:
        return status_kib(pid, field) / 1024
    except RuntimeError:
        return math.nan


def mib(kib: float) -> str:
    """KiB as a MiB figure."""
    return f"{kib / 1024:.1f} MiB"


def open_files(pid: int) -> int:
    """How many file descriptors ``pid`` holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))
