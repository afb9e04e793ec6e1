"""Reread: a read of what another member changed is tried again until it succeeds."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, Logger, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from vmready.daemon.rereads import Reread
from vmready.store.executor import StoreWriteFailed


class _Store:
    """A read that fails ``failures`` times first (the store is coming back)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.reads = 0

    def read(self) -> Deferred[None]:
        self.reads += 1
        if self.reads <= self.failures:
            return fail(StoreWriteFailed("couldn't get a connection after 2.00 sec"))
        return succeed(None)


class RereadTests(SynchronousTestCase):
    def reread(self, failures: int) -> tuple[Reread, _Store, Clock, list[dict[str, Any]]]:
        store, clock = _Store(failures), Clock()
        logged: list[dict[str, Any]] = []
        reread = Reread(clock, store.read, "the trusted certificates", interval=2.0)
        reread.log = Logger(observer=cast(ILogObserver, logged.append))
        return reread, store, clock, logged

    def test_aFailedReadIsTriedAgainWithoutANotification(self) -> None:
        reread, store, clock, logged = self.reread(failures=2)
        reread.now()  # a notification, or the listener's resync
        clock.advance(2.0)
        self.assertEqual(store.reads, 2)
        clock.advance(2.0)
        self.assertEqual(store.reads, 3)
        clock.advance(60)
        self.assertEqual((store.reads, clock.getDelayedCalls()), (3, []))
        self.assertEqual(
            [formatEvent(event) for event in logged],
            [
                "cannot read the trusted certificates again: couldn't get a connection after "
                "2.00 sec; trying again every 2s",
                "read the trusted certificates again",
            ],
        )

    def test_aNotificationMeanwhileReadsAtOnceAndKeepsOneTryPending(self) -> None:
        reread, store, clock, _ = self.reread(failures=2)
        reread.now()
        reread.now()
        self.assertEqual((store.reads, len(clock.getDelayedCalls())), (2, 1))
        clock.advance(2.0)
        self.assertEqual((store.reads, clock.getDelayedCalls()), (3, []))

    def test_noTryAfterStop(self) -> None:
        reread, store, clock, _ = self.reread(failures=5)
        reread.now()
        reread.stop()
        clock.advance(60)
        self.assertEqual((store.reads, clock.getDelayedCalls()), (1, []))
