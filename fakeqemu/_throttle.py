"""QEMU's rate limit on the events a guest can trigger: at most one a second each.

QEMU 7.2 (``monitor/monitor.c``, ``monitor_qapi_event_conf``) throttles
``RTC_CHANGE``, ``WATCHDOG``, ``BALLOON_CHANGE``, ``QUORUM_REPORT_BAD``,
``QUORUM_FAILURE``, ``VSERPORT_CHANGE`` and ``MEMORY_DEVICE_SIZE_CHANGE`` to
one per second, ``VSERPORT_CHANGE`` per port ``id`` (the others per name and,
for the quorum and memory-device events, per node or device).  The rule:

- an event with no throttle running is sent at once, and starts a one-second
  period;
- an event during a period is held, replacing any held before it (only the
  last survives: it says how things are now);
- when a period ends, a held event is sent and starts another period; with
  nothing held, the throttle is over.

An event keeps the timestamp of the moment it happened, not of its sending.
Measured with a Debian 6.1 guest opening and closing ``/dev/vport0p1``
several times within a second: QEMU reported the first open at once and,
a second later, only the state at the end.  The daemon's agent link reads on
whichever arrives, so it must not count on seeing every change.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

# Seconds between two sendings of one throttled event (QEMU: 1000 * SCALE_MS).
THROTTLED: dict[str, float] = {
    "RTC_CHANGE": 1.0,
    "WATCHDOG": 1.0,
    "BALLOON_CHANGE": 1.0,
    "QUORUM_REPORT_BAD": 1.0,
    "QUORUM_FAILURE": 1.0,
    "VSERPORT_CHANGE": 1.0,
    "MEMORY_DEVICE_SIZE_CHANGE": 1.0,
}
# The data key that makes two events of one name distinct, as QEMU hashes them.
_DISTINCT_BY = {
    "VSERPORT_CHANGE": "id",
    "QUORUM_REPORT_BAD": "node-name",
    "MEMORY_DEVICE_SIZE_CHANGE": "qom-path",
}

Event = dict[str, Any]


class _Period:
    """A running throttle period: its timer and the event held for its end."""

    def __init__(self, timer: IDelayedCall) -> None:
        self.timer = timer
        self.held: Event | None = None


class EventThrottle:
    """Passes events to ``send``, guest-triggerable ones at most once a second each."""

    def __init__(self, clock: IReactorTime, send: Callable[[Event], None]) -> None:
        self.clock = clock
        self.send = send
        self._periods: dict[Hashable, _Period] = {}

    def offer(self, event: Event) -> None:
        """An event happened: send it now, or hold it for the end of its period."""
        name = event["event"]
        rate = THROTTLED.get(name)
        if rate is None:
            self.send(event)
            return
        key = self._key(name, event.get("data") or {})
        period = self._periods.get(key)
        if period is None:
            self.send(event)
            self._periods[key] = _Period(self.clock.callLater(rate, self._period_ended, key, rate))
        else:
            period.held = event

    def stop(self) -> None:
        """QEMU exits: what is held is never sent."""
        periods, self._periods = self._periods, {}
        for period in periods.values():
            if period.timer.active():
                period.timer.cancel()

    def _key(self, name: str, data: dict[str, Any]) -> Hashable:
        distinct = _DISTINCT_BY.get(name)
        return (name, str(data.get(distinct, ""))) if distinct else (name, "")

    def _period_ended(self, key: Hashable, rate: float) -> None:
        period = self._periods[key]
        held, period.held = period.held, None
        if held is None:
            del self._periods[key]
            return
        self.send(held)
        period.timer = self.clock.callLater(rate, self._period_ended, key, rate)
