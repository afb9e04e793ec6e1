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
from twisted.python.failure import Failure
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
    """Opens the store, recovers every instance, then serves the API and syncs power state.

    The API listens only once recovery is over, so no request races the
    re-adoption of a VM; ``recovered`` fires then (with recovery's failure, if
    it failed: the daemon serves anyway, for an operator to look).
    """

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
        lifecycle = self.lifecycle = Lifecycle(
            self.reactor,
            self.store,
            driver,
            events,
            os.path.join(config.data_dir, "run"),
            stop_timeout=config.stop_timeout,
        )
        site = Site(OperatorAPI(lifecycle, config.hypervisor).app.resource())
        super().startService()
        Deferred.fromCoroutine(lifecycle.recover()).addCallbacks(
            self._recovered, self._recovery_failed, callbackArgs=(site,), errbackArgs=(site,)
        )

    def _recovered(self, _: object, site: Site) -> None:
        assert self.store is not None and self.lifecycle is not None
        self.log.info("recovered {count} instances", count=len(self.store.list_instances()))
        if self.config.power_sync_interval > 0:
            lifecycle = self.lifecycle
            timer = TimerService(
                self.config.power_sync_interval,
                lambda: Deferred.fromCoroutine(lifecycle.sync_power_states()),
            )
            timer.clock = self.reactor
            timer.setServiceParent(self)
        self._listen(site)
        self.recovered.callback(None)

    def _recovery_failed(self, failure: Failure, site: Site) -> None:
        self.log.failure("recovering instances failed", failure)
        self._listen(site)
        self.recovered.errback(failure)

    def _listen(self, site: Site) -> None:
        """Serve the API on ``--listen``; a daemon that cannot do that stops."""
        listener = strports.service(self.config.listen, site)
        try:
            listener.setServiceParent(self)
        except Exception:
            # makeService checked the address, but something took it since.
            self.log.failure("cannot listen on {listen}; stopping", listen=self.config.listen)
            listener.disownServiceParent()
            self.reactor.callWhenRunning(self.reactor.stop)

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return stopped

    async def _stop(self) -> None:
        await super().stopService()
        if self.lifecycle is not None:
            await self.lifecycle.shutdown()
        if self.store is not None:
            self.store.close()
