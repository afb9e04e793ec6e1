"""A read of what another member changed, tried again until it succeeds.

A member keeps some of the store in memory (the trusted certificates) and
reads it again when a notification says another member changed it.  A read
that fails (PostgreSQL coming back after a restart: the listener may
reconnect, and resync, before the pool has a connection again) is tried
again every ``interval`` seconds until one succeeds, rather than left as it
was until a next notification that may never come.  The failure is logged
once, and the read that succeeds after it once more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

# Seconds between two tries of a read that failed.
REREAD_SECONDS = 2.0


class Reread:
    """Reads ``what`` with ``read`` when told (``now``), and again until a read succeeds."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        read: Callable[[], Deferred[Any]],
        what: str,
        interval: float = REREAD_SECONDS,
    ) -> None:
        self._clock = clock
        self._read = read
        self.what = what
        self.interval = interval
        # The next try of a read that failed (None: the last read succeeded).
        self._retry: IDelayedCall | None = None
        self._failing = False
        self._stopped = False

    def now(self) -> None:
        """Read now (a notification came, or a try is due); a try pending is replaced."""
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        self._read().addCallbacks(self._succeeded, self._failed)

    def stop(self) -> None:
        """No try any more (the daemon stops)."""
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()

    def _succeeded(self, _: object) -> None:
        if self._failing:
            self._failing = False
            self.log.info("read {what} again", what=self.what)

    def _failed(self, failure: Failure) -> None:
        if not self._failing:
            self._failing = True
            self.log.warn(
                "cannot read {what} again: {error}; trying again every {interval:g}s",
                what=self.what,
                error=failure.getErrorMessage(),
                interval=self.interval,
            )
        if not self._stopped and (self._retry is None or not self._retry.active()):
            self._retry = self._clock.callLater(self.interval, self.now)
