"""vmready.daemon.collector: a sweep at start, then whenever full collections grow slow."""

from __future__ import annotations

import gc
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from vmready.daemon.collector import SLOW_COLLECTION, HeapSweeper


class RecordingCollector:
    """The gc module's calls, recorded in order; its callbacks called by the test."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.callbacks: list[Any] = []

    def collect(self) -> int:
        self.calls.append("collect")
        return 0

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def full_collection(self, clock: list[float], seconds: float) -> None:
        """An automatic collection of the oldest generation that takes ``seconds``."""
        for callback in list(self.callbacks):
            callback("start", {"generation": 2})
        clock[0] += seconds
        for callback in list(self.callbacks):
            callback("stop", {"generation": 2, "collected": 0, "uncollectable": 0})


class HeapSweeperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.collector = RecordingCollector()
        self.now = [0.0]
        self.sweeper = HeapSweeper(self.collector, clock=lambda: self.now[0])

    def test_startSweepsOnceTheHeapIsBuilt(self) -> None:
        self.sweeper.start()
        self.assertEqual(self.collector.calls, ["unfreeze", "collect", "freeze"])
        self.assertEqual(self.sweeper.sweeps, 1)

    def test_quickFullCollectionsNeedNoSweep(self) -> None:
        self.sweeper.start()
        self.collector.full_collection(self.now, SLOW_COLLECTION / 2)
        self.sweeper.check()
        self.assertEqual(self.sweeper.sweeps, 1)

    def test_aSlowFullCollectionIsFollowedBySweepAtTheNextCheck(self) -> None:
        self.sweeper.start()
        self.collector.full_collection(self.now, 0.19)
        self.assertEqual(self.sweeper.sweeps, 1)  # not from inside the collector
        self.sweeper.check()
        self.assertEqual(self.sweeper.sweeps, 2)
        self.sweeper.check()  # nothing slow since: no sweep
        self.assertEqual(self.sweeper.sweeps, 2)

    def test_stoppingGivesTheHeapBackAndStopsTiming(self) -> None:
        self.sweeper.start()
        self.sweeper.stop()
        self.assertEqual(self.collector.calls[-1], "unfreeze")
        self.assertEqual(self.collector.callbacks, [])

    def test_theRealCollectorFreezesWhatSurvived(self) -> None:
        """With Python's gc: after a sweep the survivors are out of the collector's sight."""
        sweeper = HeapSweeper()
        self.addCleanup(sweeper.stop)
        survivors = [object() for _ in range(1000)]
        sweeper.start()
        self.assertGreaterEqual(gc.get_freeze_count(), len(survivors))
        sweeper.stop()
        self.assertEqual(gc.get_freeze_count(), 0)
