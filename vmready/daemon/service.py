"""The vmready daemon as a Twisted service: store, driver, lifecycle, APIs, power sync.

Start-up order matters: the guest API listens first (on a new random port),
so recovery can advertise that port to every running VM's agent as it
re-adopts the VM; the operator API listens once every Ready key is cleared,
and serves while the instances are reconciled (at most ``--sync-concurrency``
at a time; an action on an instance waits for that instance's turn).  A
cluster member first takes its lease (its mutual-TLS API bound, for the
address it joins with, but accepting nobody yet), and touches its instances
only then: which instances are its own depends on its name being its own.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.application import strports
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Site

from vmready.api import ClusterContext, guest_site, guest_tls_factory, operator_site
from vmready.daemon.assembly import DaemonParts, assemble
from vmready.daemon.clustermember import ClusterMember
from vmready.daemon.collector import HeapSweeper
from vmready.daemon.daemonconfig import DaemonConfig
from vmready.daemon.guestlisteners import GuestListeners
from vmready.daemon.hostkvm import load_kvm_verdicts, program_version
from vmready.daemon.notify import Notifier, ReconcileProgress
from vmready.daemon.remoteapi import CannotServe, RemoteAPI
from vmready.domain import InstanceRecord, IVMReadyReactor, LeaseLost
from vmready.hypervisor import HypervisorDriver
from vmready.lifecycle import Lifecycle, Membership
from vmready.store import AsyncStore
from vmready.trust import CertificatePair, ensure_server_certificate

POWER_SYNC_TIMER = "power-sync"
GC_SWEEP_TIMER = "gc-sweep"
CONSOLE_TIMER = "console-rotation"
WATCHDOG_TIMER = "watchdog"


class VMReadyService(MultiService):
    """Opens the store, recovers every instance, then serves the API and syncs power state.

    Start-up recovery is in two parts: Ready is cleared everywhere and
    interrupted actions are closed (bulk writes) before the API listens
    (``serving`` fires then); the per-instance reconciliation (re-adopting VMs,
    issuing missing agent identities) runs afterwards, ``sync_concurrency`` at
    a time, while the API serves: an action on an instance waits for its
    reconciliation, and nothing shows Ready before its agent says so again.
    ``recovered`` fires once every instance is reconciled (with the failure, if
    recovery failed: the daemon serves anyway, for an operator to look); power
    sync starts then.  The store runs on its own database thread.
    """

    log = Logger()

    def __init__(
        self, reactor: IVMReadyReactor, config: DaemonConfig, notifier: Notifier | None = None
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.config = config
        # systemd's Type=notify (daemon.notify): silent unless $NOTIFY_SOCKET asked for it.
        self.notifier = notifier or Notifier()
        # What the daemon is made of, built as it starts (daemon.assembly).
        self.parts: DaemonParts | None = None
        self.recovered: Deferred[None] = Deferred()
        self.sweeper = HeapSweeper()
        self.serving: Deferred[None] = Deferred()
        self.guest_listeners = GuestListeners(
            reactor, config.guest_endpoint, config.forward_socket
        )
        self.server_certificate: CertificatePair | None = None
        # The operator API over mutual TLS (--https-address; None: not served so).
        self.remote: RemoteAPI | None = None

    @property
    def store(self) -> AsyncStore | None:
        """The store (None before the service starts)."""
        return self.parts.store if self.parts is not None else None

    @property
    def lifecycle(self) -> Lifecycle | None:
        """The lifecycle (None before the service starts)."""
        return self.parts.lifecycle if self.parts is not None else None

    @property
    def https_port(self) -> IListeningPort | None:
        """Where the operator API is served over mutual TLS (None: not, or not yet)."""
        return self.remote.port if self.remote is not None else None

    @property
    def membership(self) -> Membership | None:
        """A cluster member's lease and members' view (None: a single host, or not yet)."""
        cluster = self.parts.cluster if self.parts is not None else None
        return cluster.membership if cluster is not None else None

    def startService(self) -> None:
        config = self.config
        driver = HypervisorDriver(self.reactor, config.hypervisor, config.qemu_binary)
        # Asked first: the hypervisor's --version runs while the store loads its instances.
        version = Deferred.fromCoroutine(program_version(self.reactor, driver.program))
        parts = self.parts = assemble(self.reactor, config, driver)
        site = operator_site(parts.api)
        if self.notifier.watchdog is not None:
            # On the reactor: a reactor that hangs stops feeding systemd's watchdog.
            self._timer(WATCHDOG_TIMER, self.notifier.watchdog, self.notifier.ping)
        super().startService()
        # A single host clears Ready (on the database thread) while the guest API starts; a
        # cluster member only once it holds its lease: until then, no instance is its own.
        preparing = (
            Deferred.fromCoroutine(parts.lifecycle.recovery.prepare())
            if config.member_name is None
            else None
        )
        Deferred.fromCoroutine(self._start_guest_api(parts, driver, version)).addCallbacks(
            lambda _: self._start_recovery(parts, site, preparing),
            self._guest_api_failed,
            errbackArgs=(preparing,),
        )

    def _timer(self, name: str, interval: float, call: Callable[[], object]) -> None:
        """``call`` every ``interval`` seconds on the reactor, while the service runs."""
        timer = TimerService(interval, call)
        timer.setName(name)
        timer.clock = self.reactor
        timer.setServiceParent(self)

    def _stop_saying(self, status: str) -> None:
        """The daemon cannot go on: ``status`` for systemd, then the reactor stops."""
        self.notifier.status(status)
        self.reactor.callWhenRunning(self.reactor.stop)

    def _start_recovery(
        self, parts: DaemonParts, site: Site, preparing: Deferred[list[InstanceRecord]] | None
    ) -> None:
        Deferred.fromCoroutine(self._recover(parts, site, preparing)).addCallbacks(
            self._recovered, self._recovery_failed, errbackArgs=(site,)
        )

    def _guest_api_failed(
        self, failure: Failure, preparing: Deferred[list[InstanceRecord]] | None
    ) -> None:
        """Without the guest API no agent can report: the daemon stops, saying why."""
        if preparing is not None:
            preparing.addErrback(lambda _: None)  # the daemon stops anyway
        self.log.error(
            "cannot serve the guest API on {endpoint}: {error}; stopping",
            endpoint=self.config.guest_endpoint,
            error=failure.getErrorMessage(),
        )
        self._stop_saying(f"cannot serve the guest API: {failure.getErrorMessage()}")
        self.recovered.errback(failure)

    async def _start_guest_api(
        self, parts: DaemonParts, driver: HypervisorDriver, version: Deferred[str]
    ) -> None:
        """Listen for agents on a fresh random port (and the forward socket); advertise it."""
        lifecycle = parts.lifecycle
        verdicts = await load_kvm_verdicts(self.config.data_dir, driver, version)
        lifecycle.booting.use_kvm_verdicts(verdicts)
        server = self.server_certificate = ensure_server_certificate(self.config.data_dir)
        factory = guest_tls_factory(server, parts.store.view, guest_site(parts.guest_resource()))
        link = await self.guest_listeners.listen(factory, server.cert_pem, self.config.agent_poll)
        lifecycle.reach.listening(link)

    async def _recover(
        self, parts: DaemonParts, site: Site, preparing: Deferred[list[InstanceRecord]] | None
    ) -> None:
        """Join (a member), prepare recovery, serve, then reconcile every instance.

        A member takes its lease before it touches any instance: which ones
        are its own depends on its name being its own (``_join_cluster``).
        Its remote API is bound first, for the address its lease row gives,
        but accepts nobody until Ready is cleared (as the operator API).
        """
        recovery = parts.lifecycle.recovery
        if parts.cluster is not None:
            self._become_member(parts)
        if self.config.https_address is not None:
            self.remote = RemoteAPI(self.reactor, self.config.https_address, parts.trust)
            if not await self._serve_remote(parts, self.remote):
                return
        if parts.cluster is not None and not await self._join_cluster(parts.cluster):
            return
        if preparing is None:
            preparing = Deferred.fromCoroutine(recovery.prepare())
        records = await preparing
        if self.remote is not None:
            self.remote.accept()
        if not self._serve(site):
            return
        progress = ReconcileProgress(self.notifier, len(records), self.reactor.seconds)
        for record in records:
            recovery.reconciled(record.name).addCallback(progress.one_done)
        await recovery.reconcile(records)
        self.log.info("recovered {count} instances", count=len(records))
        self.notifier.status(f"serving {len(records)} instances")
        self._start_timers(parts.lifecycle)

    def _recovered(self, _: object) -> None:
        self.recovered.callback(None)

    def _serve(self, site: Site) -> bool:
        """Listen on ``--listen`` (once); whether the API serves."""
        if self.serving.called:
            return True
        listening = self._listen(site)
        if listening:
            self.notifier.ready("serving the API; reconciling instances")
            self.serving.callback(None)
        return listening

    async def _serve_remote(self, parts: DaemonParts, remote: RemoteAPI) -> bool:
        """Serve the operator API over mutual TLS on ``--https-address``; else stop, saying why.

        Bound, but held (accepting nobody) until ``_recover`` releases it.
        """
        assert self.server_certificate is not None
        try:
            await remote.bind(parts.api, self.server_certificate, self.membership)
        except CannotServe as e:  # something took the port since makeService checked it
            self.log.error(
                "cannot serve the remote API on {address}: {error}; stopping",
                address=remote.address,
                error=e,
            )
            self._stop_saying(f"cannot serve the remote API: {e}")
            return False
        return True

    def _become_member(self, parts: DaemonParts) -> None:
        """The member's parts, before its APIs serve: its membership, forwarding in the API.

        The remote API trusts the other members' certificates through the
        membership; the operator API relays requests about their instances;
        the hypervisor driver acts on VMs only while the lease surely holds.
        """
        assert parts.cluster is not None and self.server_certificate is not None
        membership = parts.cluster.become(
            # Known once the remote API listens, unless --member-address said it.
            self.config.member_address or "",
            self.server_certificate.fingerprint,
            self.config.lease_seconds,
        )
        parts.operator_api.cluster = ClusterContext.over_tls(
            membership, self.reactor, self.server_certificate, views=parts.cluster.relay.views
        )
        # No step on a VM once the lease may have run out (a freeze, a partition).
        parts.driver.guard = membership.guard

    async def _join_cluster(self, cluster: ClusterMember) -> bool:
        """Hear the other members, then take this member's lease; else stop, saying why.

        The remote API listens already: a member whose lease others see can be
        forwarded to at once.
        """
        assert self.config.https_address is not None
        bound = self.remote.port if self.remote is not None else None
        try:
            lost = await cluster.join(self.config.https_address, bound)
        except Exception as e:  # said by the cluster member
            self._stop_saying(f"cannot join the cluster: {e}")
            return False
        lost.addCallback(self._lease_lost)
        return True

    def _lease_lost(self, lost: LeaseLost) -> None:
        """Another daemon holds this member's lease now (Membership logged it): stop at once.

        The instances of this member's name are that daemon's: this one must
        not go on reconciling or syncing them.  Its lease is not given up (it
        is not its own).
        """
        self._stop_saying(str(lost))

    def _start_timers(self, lifecycle: Lifecycle) -> None:
        """Console rotation and power sync: only for a daemon that serves its API."""
        self._timer(CONSOLE_TIMER, self.config.console_check_interval, lifecycle.rotate_consoles)
        if self.config.power_sync_interval > 0:
            self._timer(
                POWER_SYNC_TIMER,
                self.config.power_sync_interval,
                lambda: Deferred.fromCoroutine(lifecycle.power_sync.sync_power_states()),
            )
        if self.config.gc_sweep_interval > 0:
            # The heap is built (every instance followed): sweep it now, then when it grew.
            self.sweeper.start()
            self._timer(GC_SWEEP_TIMER, self.config.gc_sweep_interval, self.sweeper.check)

    def _recovery_failed(self, failure: Failure, site: Site) -> None:
        self.log.failure("recovering instances failed", failure)
        if self.remote is not None:
            self.remote.accept()  # it serves, as the operator API does, for a look
        self._serve(site)
        self.notifier.status(f"serving; recovering instances failed: {failure.getErrorMessage()}")
        self.recovered.errback(failure)

    def _listen(self, site: Site) -> bool:
        """Serve the API on ``--listen``; a daemon that cannot do that stops."""
        listener = strports.service(self.config.listen, site)
        try:
            listener.setServiceParent(self)
        except Exception:
            # makeService checked the address, but something took it since.
            self.log.failure("cannot listen on {listen}; stopping", listen=self.config.listen)
            listener.disownServiceParent()
            self.reactor.callWhenRunning(self.reactor.stop)
            return False
        return True

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return stopped

    async def _stop(self) -> None:
        self.notifier.stopping("stopping: letting go of the VMs (they keep running)")
        await super().stopService()
        if self.remote is not None:
            await self.remote.stop()
        await self.guest_listeners.stop()
        parts = self.parts
        if parts is None:
            return
        if parts.operator_api.cluster is not None:
            # The connections kept to the other members (forwarding) close now.
            await parts.operator_api.cluster.close()
        await parts.lifecycle.shutdown()
        if self.sweeper.sweeps:
            self.sweeper.stop()
        parts.recorders.close()
        if parts.cluster is not None:
            await parts.cluster.stop()
        await parts.store.close()
