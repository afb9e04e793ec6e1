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

import contextlib
import glob
import os
import shutil
import socket

import attrs
from twisted.application import strports
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.abstract import FileDescriptor
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource
from twisted.web.server import Site

from vmready.agentlink.hvsock import HybridVSockServerEndpoint
from vmready.agentlink.link import PollIntervals
from vmready.agentlink.transport import choose_transport, vhost_vsock_problem
from vmready.agentlink.vsockaddress import HybridVSockAddress
from vmready.api.cluster import ClusterContext
from vmready.api.guest import GuestAPI, guest_site, guest_tls_factory
from vmready.api.metrics import CountedGuestResource
from vmready.api.operator import OperatorAPI, operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.daemon.clusteroptions import (
    DEFAULT_LEASE_SECONDS,
    bound_member_address,
    display_location,
)
from vmready.daemon.collector import HeapSweeper
from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.daemon.notify import Notifier, ReconcileProgress
from vmready.daemon.rereads import Reread
from vmready.domain.members import LeaseHeld, LeaseLost, MemberRetired
from vmready.domain.model import InstanceRecord
from vmready.domain.reactor import IVMReadyReactor
from vmready.guestfiles import loader_files
from vmready.hypervisor.accel import KVMVerdicts, kvm_device_problem
from vmready.hypervisor.agentbundle import build_zipapp
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.cmdline import CURRENT_LAYOUT, SERIAL_LAYOUTS
from vmready.hypervisor.configdrive import DriveContents
from vmready.hypervisor.console import DEFAULT_CONSOLE_MAX_BYTES
from vmready.hypervisor.driver import HypervisorDriver
from vmready.lifecycle.core import DEFAULT_KVM_PROBE_TIMEOUT, GuestLink, LaunchSettings, Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.members import Membership
from vmready.lifecycle.recovery import DEFAULT_SYNC_CONCURRENCY
from vmready.lifecycle.relay import CHANNELS, EventRelay
from vmready.protocols.transcript import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from vmready.record.recording import Recorders, RecordingGuestResource
from vmready.store.asyncstore import AsyncStore
from vmready.store.notifications import MEMBERS_CHANNEL, TRUST_CHANNEL, NotificationListener
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair, ensure_server_certificate

GUEST_SOCKET_BASE = "guest-api.sock"
FORWARD_SOCKET_NAME = "guest-fwd.sock"
KVM_VERDICT_FILE = "kvm-verdict.json"
POWER_SYNC_TIMER = "power-sync"
GC_SWEEP_TIMER = "gc-sweep"
CONSOLE_TIMER = "console-rotation"
WATCHDOG_TIMER = "watchdog"


@attrs.frozen
class DaemonConfig:
    """Everything ``twistd vmready`` was told."""

    data_dir: str
    listen: str
    hypervisor: str = "fakeqemu"
    qemu_binary: str | None = None
    # QMP events carry every power change; the sync is the safety net (a hung monitor, a VM
    # started by hand): every 30 s costs a 1,000-VM fleet 33 query-status a second.
    power_sync_interval: float = 30.0
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
    # The guest API transport new VMs get: auto, vsock, forward or hvsock (agentlink.transport).
    guest_transport: str = "auto"
    # What instances launched without a boot source boot.
    default_boot: BootSource = attrs.field(factory=BootSource)
    kvm_probe_timeout: float = DEFAULT_KVM_PROBE_TIMEOUT
    console_max_bytes: int = DEFAULT_CONSOLE_MAX_BYTES
    console_check_interval: float = 5.0
    # Instances reconciled at once (power sync, start-up): ``--sync-concurrency``.
    sync_concurrency: int = DEFAULT_SYNC_CONCURRENCY
    # Seconds between checks whether to sweep the heap (daemon.collector); 0: Python's own
    # schedule only (the default here; twistd vmready's --gc-sweep-interval is 60).
    gc_sweep_interval: float = 0.0
    # Where the operator API is also served over mutual TLS (``--https-address``); None: not.
    https_address: str | None = None
    # The store: a SQLite file or a PostgreSQL URL (``--store``); None: <data_dir>/vmready.sqlite.
    store: str | None = None
    # This daemon's name as a cluster member (``--member-name``); None: a single host.
    member_name: str | None = None
    # host:port the other members dial (``--member-address``); None: from --https-address.
    member_address: str | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def server_config(self, transport: str) -> dict[str, str]:
        """What ``GET /1.0`` shows as the server's ``config``: options by their long names.

        The effective values (defaults filled in, ``guest-transport`` as chosen
        for this host); an option left unset is not shown.  Read-only: the
        daemon reads its options when it starts (``vmready config set`` says so).
        """
        values: dict[str, object] = {
            "data-dir": self.data_dir,
            "listen": self.listen,
            "hypervisor": self.hypervisor,
            "qemu-binary": self.qemu_binary,
            "power-sync-interval": self.power_sync_interval,
            "stop-timeout": self.stop_timeout,
            "sync-concurrency": self.sync_concurrency,
            "serial-layout": self.serial_layout,
            "guest-transport": transport,
            "guest-listen": self.guest_endpoint,
            "record-dir": self.transcript_dir,
            "record-max-bytes": self.record_max_bytes,
            "record-keep": self.record_keep,
            "default-image": self.default_boot.image,
            "default-kernel": self.default_boot.kernel,
            "default-initrd": self.default_boot.initrd,
            "default-append": self.default_boot.append,
            "kvm-probe-timeout": self.kvm_probe_timeout,
            "console-max-bytes": self.console_max_bytes,
            "gc-sweep-interval": self.gc_sweep_interval,
        }
        if self.member_name is not None:
            # A cluster member's own (a single host shows none of them).
            values["store"] = display_location(self.store_location)
            values["member-name"] = self.member_name
            values["member-address"] = self.member_address
            values["lease-seconds"] = self.lease_seconds
        return {
            key: f"{value:g}" if isinstance(value, float) else str(value)
            for key, value in values.items()
            if value is not None
        }

    @property
    def store_location(self) -> str:
        """The store's file path or URL."""
        return self.store or os.path.join(self.data_dir, "vmready.sqlite")

    @property
    def forward_socket(self) -> str:
        """The unix socket the forward transport's guestfwd reaches (one for all VMs)."""
        return os.path.join(self.data_dir, FORWARD_SOCKET_NAME)

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
        self.store: AsyncStore | None = None
        self.lifecycle: Lifecycle | None = None
        self.recovered: Deferred[None] = Deferred()
        self.sweeper = HeapSweeper()
        self.serving: Deferred[None] = Deferred()
        self.guest_port: IListeningPort | None = None
        self.forward_port: IListeningPort | None = None
        self.https_port: IListeningPort | None = None
        self.trust: TrustRegistry | None = None
        self._trust_reads: Reread | None = None  # the trust store read again when told
        self.server_certificate: CertificatePair | None = None
        self._api: IResource | None = None
        self.recorders: Recorders | None = None
        # A cluster member's: its lease and members' view, the relay of events, its listener.
        self.membership: Membership | None = None
        self.operator_api: OperatorAPI | None = None
        # Whether this member holds its lease (given up on a clean stop).
        self._joined = False
        self.relay: EventRelay | None = None
        self.listener: NotificationListener | None = None
        self._listening: Deferred[None] | None = None

    def startService(self) -> None:
        config = self.config
        driver = HypervisorDriver(self.reactor, config.hypervisor, config.qemu_binary)
        # Asked first: the hypervisor's --version runs while the store loads its instances.
        version = Deferred.fromCoroutine(_program_version(self.reactor, driver.program))
        engine = Store.open(config.store_location)
        self.store = AsyncStore.threaded(self.reactor, engine, member=config.member_name)
        events = EventBus(self.reactor.seconds, location=config.member_name or "")
        if config.member_name is not None:
            self._join_notifications(events, config.member_name)
        transport = choose_transport(
            config.hypervisor, config.guest_transport, vhost_vsock_problem()
        )
        settings = LaunchSettings(
            transport=transport,
            default_boot=config.default_boot,
            kvm_probe_timeout=config.kvm_probe_timeout,
            console_max_bytes=config.console_max_bytes,
            drive=drive_contents(config.data_dir),
        )
        lifecycle = self.lifecycle = Lifecycle(
            self.reactor,
            self.store,
            driver,
            events,
            os.path.join(config.data_dir, "run"),
            stop_timeout=config.stop_timeout,
            serial_layout=SERIAL_LAYOUTS[config.serial_layout],
            settings=settings,
            sync_concurrency=config.sync_concurrency,
        )
        lifecycle.state.kvm_problem = kvm_device_problem()
        self.log.info(
            "new VMs reach the guest API over {transport}; KVM: {kvm}",
            transport=transport,
            kvm=lifecycle.state.kvm_problem or "the device opens (a first guest proves it runs)",
        )

        # Always present: an instance may ask to be recorded (vmready.record=true).
        self.recorders = lifecycle.state.recorders = Recorders(
            lifecycle,
            config.transcript_dir,
            record_all=config.record_dir is not None,
            max_bytes=config.record_max_bytes,
            keep=config.record_keep,
        )
        self.trust = TrustRegistry(self.store, self.reactor.seconds)
        self._trust_reads = Reread(self.reactor, self.trust.refresh, "the trusted certificates")
        self.operator_api = api = OperatorAPI(
            lifecycle, config.hypervisor, self.trust, config.server_config(transport)
        )
        self._api = api.app.resource()
        site = operator_site(self._api)
        if self.notifier.watchdog is not None:
            # On the reactor: a reactor that hangs stops feeding systemd's watchdog.
            watchdog = TimerService(self.notifier.watchdog, self.notifier.ping)
            watchdog.setName(WATCHDOG_TIMER)
            watchdog.clock = self.reactor
            watchdog.setServiceParent(self)
        super().startService()
        # A single host clears Ready (on the database thread) while the guest API starts; a
        # cluster member only once it holds its lease: until then, no instance is its own.
        preparing = (
            Deferred.fromCoroutine(lifecycle.prepare_recovery())
            if config.member_name is None
            else None
        )
        Deferred.fromCoroutine(self._start_guest_api(version)).addCallbacks(
            lambda _: self._start_recovery(site, preparing),
            self._guest_api_failed,
            errbackArgs=(preparing,),
        )

    def _join_notifications(self, events: EventBus, member: str) -> None:
        """A cluster member hears the others (LISTEN) from now on and tells them its events.

        Started before anything else, so no write of another member's after
        the store was first read goes unheard; once LISTEN is in effect every
        row is read again (``_recover`` waits for both before serving).
        """
        assert self.store is not None
        relay = self.relay = EventRelay(events, self.store, member)
        relay.start()
        self.listener = NotificationListener(
            self.reactor,
            self.config.store_location,
            (*CHANNELS, MEMBERS_CHANNEL, TRUST_CHANNEL),
            self._notified,
            self._resync,
        )
        store = self.store
        self._listening = self.listener.start().addCallback(lambda _: store.reload_instances())

    def _notified(self, channel: str, payload: str) -> None:
        """A notification from the store: members or trust changed, or the relay's (rows,
        events)."""
        if channel == MEMBERS_CHANNEL:
            self._members_changed()
        elif channel == TRUST_CHANNEL:
            self._trust_changed()
        elif self.relay is not None:
            self.relay.deliver(channel, payload)

    def _resync(self) -> None:
        """The listener was cut off and is back: whatever it missed is read again."""
        if self.relay is not None:
            self.relay.resync()
        self._members_changed()
        self._trust_changed()

    def _trust_changed(self) -> None:
        """A client certificate was trusted or removed (maybe through another member): read
        the trust store now; one gone is revoked here too (its requests end)."""
        if self._trust_reads is not None:
            self._trust_reads.now()

    def _members_changed(self) -> None:
        """A member joined, came back, moved or left: read the members now, not at renewal."""
        membership = self.membership
        if membership is None or not self._joined:
            return
        Deferred.fromCoroutine(membership.refresh()).addErrback(
            lambda failure: self.log.warn(
                "cannot read the cluster's members again: {error}",
                error=failure.getErrorMessage(),
            )
        )

    def _start_recovery(
        self, site: Site, preparing: Deferred[list[InstanceRecord]] | None
    ) -> None:
        Deferred.fromCoroutine(self._recover(site, preparing)).addCallbacks(
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
        self.notifier.status(f"cannot serve the guest API: {failure.getErrorMessage()}")
        self.reactor.callWhenRunning(self.reactor.stop)
        self.recovered.errback(failure)

    async def _start_guest_api(self, version: Deferred[str]) -> None:
        """Listen for agents on a fresh random port (and the forward socket); advertise it."""
        assert self.store is not None and self.lifecycle is not None
        await self._judge_kvm(version)
        server = self.server_certificate = ensure_server_certificate(self.config.data_dir)
        endpoint_string = self.config.guest_endpoint
        self._remove_stale_guest_sockets()
        factory = guest_tls_factory(server, self.store.view, guest_site(self._guest_resource()))
        port = self.guest_port = await serverFromString(self.reactor, endpoint_string).listen(
            factory
        )
        # Guests on the forward transport arrive here, one socat per connection (QEMU's
        # guestfwd): the same TLS, the same identification by client certificate.
        forward = self.config.forward_socket
        _remove_stale_socket(forward)
        escaped = forward.replace("\\", "\\\\").replace(":", "\\:")
        self.forward_port = await serverFromString(
            self.reactor, f"unix:{escaped}:mode=600"
        ).listen(factory)
        address = port.getHost()
        transport = (
            f"hvsock:{address.path}" if isinstance(address, HybridVSockAddress) else "vsock"
        )
        self.lifecycle.state.guest = GuestLink(
            address.port, server.cert_pem, transport, self.config.agent_poll, forward
        )
        self.log.info(
            "guest API on {endpoint}: agents are told CONNECT 2:{port}",
            endpoint=endpoint_string,
            port=address.port,
        )

    def _guest_resource(self) -> IResource:
        """The guest API's resource, recorded when sessions may be."""
        assert self.lifecycle is not None
        api = GuestAPI(self.lifecycle)
        resource: IResource = api.app.resource()
        if self.recorders is not None:
            resource = RecordingGuestResource(resource, api.identify, self.recorders)
        # Outermost: every answer is counted, whoever wrote it.
        return CountedGuestResource(resource, self.lifecycle.state.metrics)

    async def _judge_kvm(self, version: Deferred[str]) -> None:
        """Load what this host taught earlier daemons about KVM (per kernel and QEMU build)."""
        assert self.lifecycle is not None
        driver = self.lifecycle.state.driver
        key = f"{os.uname().release}|{driver.program_name}|{await version}"
        path = os.path.join(self.config.data_dir, KVM_VERDICT_FILE)
        self.lifecycle.state.kvm = KVMVerdicts(path, key)
        verdict = self.lifecycle.state.kvm.verdict
        if verdict is not None:
            self.log.info(
                "KVM on this host: {works} ({reason})",
                works="runs guests" if verdict.works else "does not run guests",
                reason=verdict.reason,
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

    async def _recover(self, site: Site, preparing: Deferred[list[InstanceRecord]] | None) -> None:
        """Join (a member), prepare recovery, serve, then reconcile every instance.

        A member takes its lease before it touches any instance: which ones
        are its own depends on its name being its own (``_join_cluster``).
        Its remote API is bound first, for the address its lease row gives,
        but accepts nobody until Ready is cleared (as the operator API).
        """
        assert self.lifecycle is not None
        if self.config.member_name is not None:
            self._become_member(self.config.member_name)
        if self.config.https_address is not None and not await self._serve_remote():
            return
        if self.membership is not None and not await self._join_cluster(self.membership):
            return
        if preparing is None:
            preparing = Deferred.fromCoroutine(self.lifecycle.prepare_recovery())
        records = await preparing
        if self.https_port is not None:
            _release(self.https_port)
        if not self._serve(site):
            return
        progress = ReconcileProgress(self.notifier, len(records), self.reactor.seconds)
        for record in records:
            self.lifecycle.recovery.reconciled(record.name).addCallback(progress.one_done)
        await self.lifecycle.reconcile(records)
        self.log.info("recovered {count} instances", count=len(records))
        self.notifier.status(f"serving {len(records)} instances")
        self._start_timers()

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

    async def _serve_remote(self) -> bool:
        """Serve the operator API over mutual TLS on ``--https-address``; else stop, saying why.

        Bound, but held (accepting nobody) until ``_recover`` releases it.
        """
        assert self.trust is not None and self._api is not None
        assert self.server_certificate is not None and self.config.https_address is not None
        address = HTTPSAddress.parse(self.config.https_address)
        self.trust.server_fingerprint = self.server_certificate.fingerprint
        await self.trust.load()
        site = remote_site(self._api, self.trust, self.membership)
        factory = remote_tls_factory(self.server_certificate, site)
        try:
            port = self.https_port = await serverFromString(
                self.reactor, address.endpoint()
            ).listen(factory)
            _hold(port)  # until Ready is cleared (_recover)
        except Exception as e:  # something took the port since makeService checked it
            self.log.error(
                "cannot serve the remote API on {address}: {error}; stopping",
                address=self.config.https_address,
                error=e,
            )
            self.notifier.status(f"cannot serve the remote API: {e}")
            self.reactor.callWhenRunning(self.reactor.stop)
            return False
        self.trust.addresses = address.advertised(port.getHost().port)
        self.log.info(
            "remote API (mutual TLS) on {address} (port {port}), certificate {fingerprint}",
            address=self.config.https_address,
            port=port.getHost().port,
            fingerprint=self.server_certificate.fingerprint,
        )
        return True

    def _become_member(self, name: str) -> None:
        """The member's parts, before its APIs serve: its membership, forwarding in the API.

        The remote API trusts the other members' certificates through the
        membership; the operator API relays requests about their instances.
        """
        assert self.store is not None and self.lifecycle is not None
        assert self.server_certificate is not None and self.operator_api is not None
        membership = self.membership = Membership(
            name,
            # Known once the remote API listens, unless --member-address said it.
            self.config.member_address or "",
            self.server_certificate.fingerprint,
            self.store,
            self.lifecycle.state.events,
            self.reactor,
            self.config.lease_seconds,
        )
        self.operator_api.cluster = ClusterContext.over_tls(
            membership, self.reactor, self.server_certificate
        )

    async def _join_cluster(self, membership: Membership) -> bool:
        """Hear the other members, then take this member's lease; else stop, saying why.

        The remote API listens already: a member whose lease others see can be
        forwarded to at once.
        """
        assert self._listening is not None and self.store is not None
        config = self.config
        assert config.https_address is not None
        if not membership.address:
            assert self.https_port is not None
            bound = self.https_port.getHost()
            assert isinstance(bound, IPv4Address | IPv6Address)
            membership.address = bound_member_address(config.https_address, bound.port)
        try:
            await self._listening
            await membership.start()
        except (LeaseHeld, MemberRetired) as e:
            # Another daemon is this member, or the name is retired: one line, touching nothing.
            self.log.error("{refusal}; stopping", refusal=str(e))
            self.notifier.status(f"cannot join the cluster: {e}")
            self.reactor.callWhenRunning(self.reactor.stop)
            return False
        except Exception as e:
            self.log.error(
                "cannot join the cluster as member {member} on {store}: {error}; stopping",
                member=membership.name,
                store=self.store.engine.path,
                error=e,
            )
            self.notifier.status(f"cannot join the cluster: {e}")
            self.reactor.callWhenRunning(self.reactor.stop)
            return False
        self._joined = True
        membership.lost.addCallback(self._lease_lost)
        return True

    def _lease_lost(self, lost: LeaseLost) -> None:
        """Another daemon holds this member's lease now (Membership logged it): stop at once.

        The instances of this member's name are that daemon's: this one must
        not go on reconciling or syncing them.  Its lease is not given up (it
        is not its own).
        """
        self._joined = False
        self.notifier.status(str(lost))
        self.reactor.callWhenRunning(self.reactor.stop)

    def _start_timers(self) -> None:
        """Console rotation and power sync: only for a daemon that serves its API."""
        assert self.lifecycle is not None
        consoles = TimerService(self.config.console_check_interval, self.lifecycle.rotate_consoles)
        consoles.setName(CONSOLE_TIMER)
        consoles.clock = self.reactor
        consoles.setServiceParent(self)
        if self.config.power_sync_interval > 0:
            lifecycle = self.lifecycle
            timer = TimerService(
                self.config.power_sync_interval,
                lambda: Deferred.fromCoroutine(lifecycle.sync_power_states()),
            )
            timer.setName(POWER_SYNC_TIMER)
            timer.clock = self.reactor
            timer.setServiceParent(self)
        if self.config.gc_sweep_interval > 0:
            # The heap is built (every instance followed): sweep it now, then when it grew.
            self.sweeper.start()
            sweeps = TimerService(self.config.gc_sweep_interval, self.sweeper.check)
            sweeps.setName(GC_SWEEP_TIMER)
            sweeps.clock = self.reactor
            sweeps.setServiceParent(self)

    def _recovery_failed(self, failure: Failure, site: Site) -> None:
        self.log.failure("recovering instances failed", failure)
        if self.https_port is not None:
            _release(self.https_port)  # it serves, as the operator API does, for a look
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
        if self._trust_reads is not None:
            self._trust_reads.stop()
        for port in (self.https_port, self.guest_port, self.forward_port):
            if port is not None:
                stopped = port.stopListening()
                if stopped is not None:
                    await stopped
        if self.operator_api is not None and self.operator_api.cluster is not None:
            # The connections kept to the other members (forwarding) close now.
            await self.operator_api.cluster.close()
        if self.lifecycle is not None:
            await self.lifecycle.shutdown()
        if self.sweeper.sweeps:
            self.sweeper.stop()
        if self.recorders is not None:
            self.recorders.close()
        if self.relay is not None:
            self.relay.stop()
        if self.membership is not None and self._joined:
            # The others see this member unreachable at once, not when the lease runs out.
            await self.membership.stop()
        if self.listener is not None:
            await self.listener.stop()
        if self.store is not None:
            await self.store.close()


def drive_contents(data_dir: str) -> DriveContents:
    """What every config drive carries besides the instance's identity: the agent, the loader.

    The agent's zipapp is built afresh at every start (deterministically: the
    same sources give the same bytes), so a guest boots the agent of the
    daemon that starts it.
    """
    directory = os.path.join(data_dir, "agent")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    return DriveContents(agent_zipapp=build_zipapp(directory), loader=loader_files())


async def _program_version(reactor: IVMReadyReactor, program: list[str]) -> str:
    """The hypervisor's ``--version`` line (what a KVM verdict is kept for), or "unknown"."""
    executable = shutil.which(program[0])
    if executable is None:
        return "unknown"
    try:
        out, _err, code = await getProcessOutputAndValue(
            executable, [*program[1:], "--version"], env=dict(os.environ), reactor=reactor
        )
    except Exception:
        return "unknown"
    lines = out.decode("utf-8", "replace").splitlines()
    return lines[0].strip() if code == 0 and lines else "unknown"


def _hold(port: IListeningPort) -> None:
    """Keep ``port`` bound but accept nobody yet: whoever dials waits in the listen backlog.

    Called as ``listen`` returned, before the reactor runs again: no
    connection was accepted in between (only the reactor accepts).
    """
    assert isinstance(port, FileDescriptor), port
    port.stopReading()


def _release(port: IListeningPort) -> None:
    """Accept on ``port`` from now on (those waiting in the backlog first)."""
    assert isinstance(port, FileDescriptor), port
    port.startReading()


def _remove_stale_socket(path: str) -> None:
    """A socket a killed daemon left behind (nobody answers on it) is removed."""
    if os.path.exists(path) and not _answers(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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
