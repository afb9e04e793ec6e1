"""The vmready daemon as a Twisted service: store, driver, lifecycle, API, power sync."""

from __future__ import annotations

import os
from typing import Any

import attrs
from twisted.application import strports
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.server import Site

from vmready.api import OperatorAPI
from vmready.events import EventBus
from vmready.hypervisor import HypervisorDriver
from vmready.lifecycle import Lifecycle
from vmready.store import Store


@attrs.frozen
class DaemonConfig:
    """Everything ``twistd vmready`` was told."""

    data_dir: str
    listen: str
    hypervisor: str = "fakeqemu"
    qemu_binary: str | None = None
    power_sync_interval: float = 10.0
    stop_timeout: float = 30.0


class VMReadyService(MultiService):
    """Opens the store, recovers every instance, then serves the API and syncs power state."""

    log = Logger()

    def __init__(self, reactor: Any, config: DaemonConfig) -> None:
        super().__init__()
        self.reactor = reactor
        self.config = config
        self.store: Store | None = None
        self.lifecycle: Lifecycle | None = None
        self.recovered: Deferred[None] = Deferred()

    def startService(self) -> None:
        config = self.config
        self.store = Store.open(os.path.join(config.data_dir, "vmready.sqlite"))
        events = EventBus(self.reactor.seconds)
        driver = HypervisorDriver(self.reactor, config.hypervisor, config.qemu_binary)
        self.lifecycle = Lifecycle(
            self.reactor,
            self.store,
            driver,
            events,
            os.path.join(config.data_dir, "run"),
            stop_timeout=config.stop_timeout,
        )
        api = OperatorAPI(self.lifecycle, config.hypervisor)
        strports.service(config.listen, Site(api.app.resource())).setServiceParent(self)
        super().startService()
        Deferred.fromCoroutine(self.lifecycle.recover()).addCallbacks(
            self._recovered, self._recovery_failed
        )

    def _recovered(self, _: object) -> None:
        self.log.info("recovered {count} instances", count=len(self.store.list_instances()))  # type: ignore[union-attr]
        if self.config.power_sync_interval > 0:
            assert self.lifecycle is not None
            lifecycle = self.lifecycle
            timer = TimerService(
                self.config.power_sync_interval,
                lambda: Deferred.fromCoroutine(lifecycle.sync_power_states()),
            )
            timer.clock = self.reactor
            timer.setServiceParent(self)
        self.recovered.callback(None)

    def _recovery_failed(self, failure: Any) -> None:
        self.log.failure("recovering instances failed", failure)
        self.recovered.errback(failure)

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return stopped

    async def _stop(self) -> None:
        await super().stopService()
        if self.lifecycle is not None:
            await self.lifecycle.shutdown()
        if self.store is not None:
            self.store.close()
