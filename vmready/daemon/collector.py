"""Short garbage-collector pauses for a daemon whose heap is large and long-lived.

A daemon following 1,000 VMs holds a few hundred thousand objects that live
as long as it does (monitors, links, protocols, records).  CPython's cyclic
collector walks every one of them on each collection of its oldest
generation, which it starts by itself whenever enough new objects survived:
measured with ``benchmarks/agent_link.py --vms 1000``, pauses of up to 194 ms
at idle, three in four minutes.  A request that arrives then (a guest's
Ready, an agent's STOPPED) waits that long.

So the daemon *sweeps*: it collects everything once (``gc.unfreeze``,
``gc.collect``) and moves what survived out of the collector's sight
(``gc.freeze``).  The automatic collections then walk only what was made
since, which is little.  It sweeps once its start-up has built the heap, and
afterwards whenever an automatic full collection took longer than
``SLOW_COLLECTION`` (the heap outside the frozen part has grown: VMs were
launched), checked every ``interval`` seconds: one long pause, at a time of
the daemon's choosing, instead of one every minute or so.  Garbage cycles
among frozen objects are collected at the next sweep.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

DEFAULT_SWEEP_INTERVAL = 60.0
# An automatic full collection this long (seconds) means the unfrozen heap has grown.
SLOW_COLLECTION = 0.02

GCCallback = Callable[[str, dict[str, Any]], None]


class Collector(Protocol):
    """What the sweeper needs of the ``gc`` module (tests give a recording one)."""

    callbacks: list[GCCallback]

    def collect(self) -> int:
        """A full collection."""

    def freeze(self) -> None:
        """Move every tracked object to the permanent generation."""

    def unfreeze(self) -> None:
        """Move the permanent generation back to the oldest one."""


class HeapSweeper:
    """Sweeps when the collector's own full collections grow slow; see the module."""

    def __init__(
        self, collector: Collector | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.collector: Collector = collector if collector is not None else cast(Collector, gc)
        self.clock = clock
        self.sweeps = 0
        self.slowest = 0.0  # the longest automatic full collection since the last sweep
        self._began = 0.0
        self._sweeping = False
        self._watching = False

    def start(self) -> None:
        """The heap is built: sweep now, and time the collector's full collections."""
        if not self._watching:
            self.collector.callbacks.append(self._timed)
            self._watching = True
        self.sweep()

    def check(self) -> None:
        """Sweep if an automatic full collection was slow since the last sweep."""
        if self.slowest > SLOW_COLLECTION:
            self.sweep()

    def sweep(self) -> None:
        """Collect everything once, then freeze what survived."""
        self._sweeping = True
        try:
            self.collector.unfreeze()
            self.collector.collect()
            self.collector.freeze()
        finally:
            self._sweeping = False
        self.sweeps += 1
        self.slowest = 0.0

    def stop(self) -> None:
        """The daemon stops: give the collector its whole heap back, stop timing it."""
        if self._watching:
            self.collector.callbacks.remove(self._timed)
            self._watching = False
        self.collector.unfreeze()

    def _timed(self, phase: str, info: dict[str, Any]) -> None:
        if self._sweeping or info.get("generation") != 2:
            return
        if phase == "start":
            self._began = self.clock()
        else:
            self.slowest = max(self.slowest, self.clock() - self._began)
