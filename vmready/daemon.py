"""The vmready daemon as a Twisted service: store, driver, lifecycle, APIs, power sync.

Start-up order matters: the guest API listens first (on a new random port),
so recovery can advertise that port to every running VM's agent as it
re-adopts the VM; the operator API listens only once recovery is over.
"""

from __future__ import annotations

import glob
import os
import socket
from typing import Any

import attrs
from twisted.application import strports
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Site

from vmready.agentlink import PollIntervals
from vmready.api import OperatorAPI
from vmready.certs import ensure_server_certificate
from vmready.events import EventBus
from vmready.guestapi import GuestAPI, guest_site, guest_tls_factory
from vmready.hypervisor import HypervisorDriver
from vmready.lifecycle import GuestLink, Lifecycle
from vmready.qemu_cmdline import CURRENT_LAYOUT, SERIAL_LAYOUTS
from vmready.recording import Recorders
from vmready.store import Store
from vmready.transcript import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from vmready.vsock import HybridVSockAddress, HybridVSockServerEndpoint
from vmready.web import local_site

GUEST_SOCKET_BASE = "guest-api.sock"


@attrs.frozen
class DaemonConfig:
    """Everything ``twistd vmready`` was told."""

    data_dir: str
    listen: str
    hypervisor: str = "fakeqemu"
    qemu_binary: str | None = None
    power_sync_interval: float = 10.0
    stop_timeout: float = 30.0
    # The guest API's endpoint string; None: hvsock:path=<data_dir>/guest-api.sock.
    guest_listen: str | None = None
    agent_poll: PollIntervals = attrs.field(factory=PollIntervals)
    # The serial wiring of VMs this daemon starts ("legacy" reproduces an older daemon).
    serial_layout: str = CURRENT_LAYOUT.name
    # Where transcripts go; None: <data_dir>/transcripts, for instances with vmready.record=true.
    record_dir: str | None = None
    record_max_bytes: int = DEFAULT_MAX_BYTES
    record_keep: int = DEFAULT_KEEP

    @property
    def transcript_dir(self) -> str:
        """Where instances' transcripts are written."""
        return self.record_dir or os.path.join(self.data_dir, "transcripts")

    @property
    def guest_endpoint(self) -> str:
        """The guest API's endpoint string."""
        if self.guest_listen:
            return self.guest_listen
        base = os.path.join(self.data_dir, GUEST_SOCKET_BASE).replace(":", "\\:")
        return f"hvsock:path={base}"


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
        self.guest_port: IListeningPort | None = None
        self.recorders: Recorders | None = None

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
            serial_layout=SERIAL_LAYOUTS[config.serial_layout],
        )
        # Always present: an instance may ask to be recorded (vmready.record=true).
        self.recorders = lifecycle.recorders = Recorders(
            lifecycle,
            config.transcript_dir,
            record_all=config.record_dir is not None,
            max_bytes=config.record_max_bytes,
            keep=config.record_keep,
        )
        site = local_site(OperatorAPI(lifecycle, config.hypervisor).app.resource())
        super().startService()
        Deferred.fromCoroutine(self._start_guest_api()).addCallbacks(
            lambda _: self._start_recovery(site), self._guest_api_failed
        )

    def _start_recovery(self, site: Site) -> None:
        Deferred.fromCoroutine(self._recover()).addCallbacks(
            self._recovered, self._recovery_failed, callbackArgs=(site,), errbackArgs=(site,)
        )

    def _guest_api_failed(self, failure: Failure) -> None:
        """Without the guest API no agent can report: the daemon stops, saying why."""
        self.log.error(
            "cannot serve the guest API on {endpoint}: {error}; stopping",
            endpoint=self.config.guest_endpoint,
            error=failure.getErrorMessage(),
        )
        self.recovered.errback(failure)
        self.reactor.callWhenRunning(self.reactor.stop)

    async def _start_guest_api(self) -> None:
        """Listen for agents on a fresh random port; the lifecycle advertises it."""
        assert self.store is not None and self.lifecycle is not None
        server = ensure_server_certificate(self.config.data_dir)
        endpoint_string = self.config.guest_endpoint
        self._remove_stale_guest_sockets()
        factory = guest_tls_factory(
            server, self.store, guest_site(GuestAPI(self.lifecycle), self.recorders)
        )
        port = self.guest_port = await serverFromString(self.reactor, endpoint_string).listen(
            factory
        )
        address = port.getHost()
        transport = (
            f"hvsock:{address.path}" if isinstance(address, HybridVSockAddress) else "vsock"
        )
        self.lifecycle.guest = GuestLink(
            address.port, server.cert_pem, transport, self.config.agent_poll
        )
        self.log.info(
            "guest API on {endpoint}: agents are told CONNECT 2:{port}",
            endpoint=endpoint_string,
            port=address.port,
        )

    def _remove_stale_guest_sockets(self) -> None:
        """Sockets of a daemon that was killed (one daemon per data dir holds the lock)."""
        endpoint = serverFromString(self.reactor, self.config.guest_endpoint)
        if not isinstance(endpoint, HybridVSockServerEndpoint):
            return
        for path in glob.glob(glob.escape(endpoint.path) + "_*"):
            if not path.removeprefix(endpoint.path + "_").isdigit() or _answers(path):
                continue  # not a guest API socket, or a live one (another daemon's)
            try:
                os.unlink(path)
            except OSError as e:
                self.log.warn("cannot remove stale {path}: {error}", path=path, error=e)

    async def _recover(self) -> None:
        assert self.lifecycle is not None
        issued = self.lifecycle.ensure_agent_identities()
        if issued:
            self.log.info("issued agent certificates to {count} instances", count=issued)
        await self.lifecycle.recover()

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
        if self.guest_port is not None:
            stopped = self.guest_port.stopListening()
            if stopped is not None:
                await stopped
        if self.lifecycle is not None:
            await self.lifecycle.shutdown()
        if self.recorders is not None:
            self.recorders.close()
        if self.store is not None:
            self.store.close()


def _answers(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
