"""VMReadyService in-process: recovery first, then the power-sync timer (or none)."""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.application.internet import TimerService
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase

from vmready.daemon import DaemonConfig, VMReadyService


class DaemonServiceTests(TestCase):
    """The service wires the pieces and honours --power-sync-interval."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-svc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    async def started(self, interval: float) -> VMReadyService:
        socket_path = os.path.join(self.directory, "api.sock")
        service = VMReadyService(
            reactor,
            DaemonConfig(
                data_dir=self.directory,
                listen=f"unix:{socket_path}",
                power_sync_interval=interval,
            ),
        )
        service.startService()
        self.addCleanup(service.stopService)
        await service.recovered
        return service

    def timers(self, service: VMReadyService) -> list[TimerService]:
        return [child for child in service if isinstance(child, TimerService)]

    def test_positiveIntervalRunsThePollerOnTheReactorClock(self) -> Deferred[None]:
        async def check() -> None:
            service = await self.started(2.5)
            timers = self.timers(service)
            self.assertEqual(len(timers), 1)
            self.assertEqual(timers[0].step, 2.5)
            self.assertIs(timers[0].clock, reactor)

        return ensureDeferred(check())

    def test_zeroOrNegativeIntervalDisablesThePoller(self) -> Deferred[None]:
        async def check() -> None:
            for interval in (0.0, -1.0):
                service = await self.started(interval)
                self.assertEqual(self.timers(service), [])
                await service.stopService()

        return ensureDeferred(check())

    def test_storeAndSocketLiveInTheDataDir(self) -> Deferred[None]:
        async def check() -> None:
            await self.started(0)
            self.assertTrue(os.path.exists(os.path.join(self.directory, "vmready.sqlite")))
            self.assertTrue(os.path.exists(os.path.join(self.directory, "api.sock")))

        return ensureDeferred(check())
