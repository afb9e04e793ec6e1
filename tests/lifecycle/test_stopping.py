"""A daemon that stops lets its running operations end before its store closes."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, Logger, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from vmready.lifecycle.events import EventBus
from vmready.lifecycle.operations import Operation, Operations
from vmready.store.executor import StoreClosed


class SettleTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.operations = Operations(self.clock, EventBus(self.clock.seconds))
        self.logged: list[dict[str, Any]] = []
        self.operations.log = Logger(observer=cast(ILogObserver, self.logged.append))
        self.step: Deferred[None] = Deferred()

    def running(self) -> Operation:
        async def work() -> None:
            await self.step  # its next store write

        return self.operations.run("Stop instance web1", "web1", work)

    def test_theStopWaitsForARunningOperationToEnd(self) -> None:
        operation = self.running()
        settled = Deferred.fromCoroutine(self.operations.settle(5.0))
        self.assertNoResult(settled)
        self.step.callback(None)
        self.assertEqual(self.successResultOf(settled), [])
        self.assertEqual(operation.status.name, "SUCCESS")

    def test_anOperationCutOffByTheStopEndsInOneWarningNotATraceback(self) -> None:
        operation = self.running()
        settled = Deferred.fromCoroutine(self.operations.settle(5.0))
        self.clock.advance(5.0)
        self.assertEqual(self.successResultOf(settled), [operation])
        self.step.errback(StoreClosed())  # the store closed under it
        self.assertEqual(operation.error, "the daemon stopped: the store is closed")
        self.assertEqual(
            [(event["log_level"].name, formatEvent(event)) for event in self.logged],
            [
                (
                    "warn",
                    "operation Stop instance web1 still runs 5s after the daemon began to "
                    "stop; stopping without it",
                ),
                (
                    "warn",
                    "operation Stop instance web1 ended as the daemon stopped: "
                    "the store is closed",
                ),
            ],
        )
        self.assertEqual(self.flushLoggedErrors(), [])
