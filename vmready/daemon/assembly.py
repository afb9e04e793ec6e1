"""The daemon's parts, built as its service starts: the store, the lifecycle, the APIs.

Built in one go and in this order: the store on its database thread (a
cluster member starts hearing the others at once, before anything reads
it), the lifecycle with its sessions' recorders, the operator API.  What
listens and when is the service's (``daemon.service``).
"""

from __future__ import annotations

import os

import attrs
from twisted.logger import Logger
from twisted.web.resource import IResource

from vmready.agentlink.transport import choose_transport, vhost_vsock_problem
from vmready.api import CountedGuestResource, GuestAPI, OperatorAPI, TrustRegistry
from vmready.daemon.clustermember import ClusterMember
from vmready.daemon.daemonconfig import DaemonConfig
from vmready.daemon.hostfence import HostFence
from vmready.domain import IVMReadyReactor
from vmready.guestfiles import loader_files
from vmready.hypervisor import SERIAL_LAYOUTS, DriveContents, HypervisorDriver, kvm_device_problem
from vmready.hypervisor.agentbundle import build_zipapp
from vmready.lifecycle import EventBus, LaunchSettings, Lifecycle, OwnViews
from vmready.record import Recorders, RecordingGuestResource
from vmready.store import AsyncStore, Store

log = Logger()


@attrs.frozen
class DaemonParts:
    """What the daemon is made of once built."""

    store: AsyncStore
    trust: TrustRegistry
    lifecycle: Lifecycle
    # Always present: an instance may ask to be recorded (vmready.record=true).
    recorders: Recorders
    operator_api: OperatorAPI
    # The operator API's resource, served on --listen and on --https-address.
    api: IResource
    # A cluster member's (--member-name): hearing the others, its lease; None on one host.
    cluster: ClusterMember | None
    # The lifecycle's: a member's lease guards its steps on VMs.
    driver: HypervisorDriver

    def guest_resource(self) -> IResource:
        """The guest API's resource: recorded when sessions may be, every answer counted."""
        api = GuestAPI(self.lifecycle)
        resource: IResource = RecordingGuestResource(
            api.app.resource(), api.identify, self.recorders
        )
        # Outermost: every answer is counted, whoever wrote it.
        return CountedGuestResource(resource, self.lifecycle.metrics)


def assemble(
    reactor: IVMReadyReactor, config: DaemonConfig, driver: HypervisorDriver
) -> DaemonParts:
    """Open the store and build the lifecycle and the operator API over it."""
    store = AsyncStore.threaded(
        reactor, Store.open(config.store_location), member=config.member_name
    )
    trust = TrustRegistry(store, reactor.seconds)
    events = EventBus(reactor.seconds, location=config.member_name or "")
    cluster = None
    if config.member_name is not None:
        fence = None
        if config.fence_vms:
            run_root = os.path.join(config.data_dir, "run")
            fence = HostFence(reactor, run_root, config.data_dir, config.member_name)
        cluster = ClusterMember(
            reactor, store, config.store_location, events, trust, config.member_name, fence
        )
        cluster.hear()
    transport = choose_transport(config.hypervisor, config.guest_transport, vhost_vsock_problem())
    lifecycle = build_lifecycle(reactor, config, store, driver, events, transport)
    if cluster is not None:
        # What only this member knows of its instances goes out with their events.
        cluster.own_views = OwnViews(
            cluster.name,
            store.view,
            lifecycle.running.agent_status,
            lifecycle.events.faults,
            lifecycle.agent_history.of,
            lifecycle.specs.console_log_path,
        )
    recorders = Recorders(
        lifecycle,
        config.transcript_dir,
        record_all=config.record_dir is not None,
        max_bytes=config.record_max_bytes,
        keep=config.record_keep,
    )
    lifecycle.recording.use(recorders)
    api = OperatorAPI(lifecycle, config.hypervisor, trust, config.server_config(transport))
    return DaemonParts(
        store, trust, lifecycle, recorders, api, api.app.resource(), cluster, driver
    )


def build_lifecycle(
    reactor: IVMReadyReactor,
    config: DaemonConfig,
    store: AsyncStore,
    driver: HypervisorDriver,
    events: EventBus,
    transport: str,
) -> Lifecycle:
    """The lifecycle as ``config`` asks for it: new VMs on ``transport``, KVM if it opens."""
    settings = LaunchSettings(
        transport=transport,
        default_boot=config.default_boot,
        kvm_probe_timeout=config.kvm_probe_timeout,
        console_max_bytes=config.console_max_bytes,
        drive=drive_contents(config.data_dir),
        kvm_problem=kvm_device_problem(),
    )
    log.info(
        "new VMs reach the guest API over {transport}; KVM: {kvm}",
        transport=transport,
        kvm=settings.kvm_problem or "the device opens (a first guest proves it runs)",
    )
    return Lifecycle(
        reactor,
        store,
        driver,
        events,
        os.path.join(config.data_dir, "run"),
        stop_timeout=config.stop_timeout,
        serial_layout=SERIAL_LAYOUTS[config.serial_layout],
        settings=settings,
        sync_concurrency=config.sync_concurrency,
    )


def drive_contents(data_dir: str) -> DriveContents:
    """What every config drive carries besides the instance's identity: the agent, the loader.

    The agent's zipapp is built afresh at every start (deterministically: the
    same sources give the same bytes), so a guest boots the agent of the
    daemon that starts it.
    """
    directory = os.path.join(data_dir, "agent")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    return DriveContents(agent_zipapp=build_zipapp(directory), loader=loader_files())
