"""How the failure of a write nobody waits for is logged: one line for an expected fault."""

from __future__ import annotations

from typing import Any, cast

from twisted.logger import ILogObserver, Logger, LogLevel, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.members import Fenced
from vmready.lifecycle.unawaited import log_failed_write
from vmready.store.executor import StoreWriteFailed


class LogFailedWriteTests(SynchronousTestCase):
    def logged(self, error: Exception) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        log_failed_write(
            Failure(error), Logger(observer=cast(ILogObserver, events.append)), "a history step"
        )
        return events

    def test_aStoreThatRefusedTheWriteIsOneLineOfWarning(self) -> None:
        for error in (
            StoreWriteFailed("the store could not write: no connection"),
            Fenced("m1", 1, None),
        ):
            (event,) = self.logged(error)
            self.assertEqual(event["log_level"], LogLevel.warn)
            self.assertNotIn("log_failure", event)
            self.assertEqual(formatEvent(event), f"writing a history step failed: {error}")

    def test_anythingElseIsLoggedWithItsTraceback(self) -> None:
        (event,) = self.logged(RuntimeError("the store is closed"))
        self.assertEqual(event["log_level"], LogLevel.critical)
        self.assertIsInstance(event["log_failure"].value, RuntimeError)
