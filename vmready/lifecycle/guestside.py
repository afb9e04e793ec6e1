"""The guest's side of an instance: Ready, its agent identity, its config drive."""

from __future__ import annotations

import os

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from vmready.agentlink.transport import FORWARD_GUEST_NETWORK_ADDRESS, TRANSPORT_KEY, forward_mac
from vmready.domain import READY_KEY, Conflict, InstanceRecord
from vmready.hypervisor import (
    AGENT_CONFIG,
    SerialLayout,
    fakeqemu_guest_paths,
    guest_data,
    write_identity,
    write_settings,
)
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestlink import GuestReach
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.settings import LaunchSettings
from vmready.lifecycle.specs import InstanceSpecs, agent_port_name
from vmready.store import AsyncStore
from vmready.trust import CertificatePair, fingerprint, generate, write_private


@attrs.define(kw_only=True, eq=False)
class GuestSide:
    """The guest's side of an instance: Ready, its agent identity, its config drive."""

    log = Logger()

    clock: IReactorTime
    store: AsyncStore
    events: EventBus
    journal: Journal
    metrics: LifecycleMetrics
    running: RunningVMs
    specs: InstanceSpecs
    reach: GuestReach
    settings: LaunchSettings
    driver_kind: str
    # Instances whose config-drive certificate files could not be read, and why.
    unreadable: dict[str, str] = attrs.field(init=False, factory=dict)

    @property
    def fakeqemu(self) -> bool:
        """Whether guests are fakeqemu's: host processes whose devices are sockets."""
        return self.driver_kind == "fakeqemu"

    async def set_ready(self, name: str, ready: bool) -> InstanceRecord:
        """The guest's workload declared itself Ready (or withdrew it: Started).

        Ready sets ``volatile.last_state.ready`` to "true" and emits
        ``instance-ready`` every time; Started sets "false" with no event.  An
        instance without a running VM cannot be ready: Conflict.
        """
        record = self.store.view.get_instance(name)
        if not self.running.has_vm(name):
            raise Conflict(f"Instance {name} is not running")
        if record.ready != ready or READY_KEY not in record.config:
            # Announced once committed: instance-ready never names a state the store lost.
            record = await self.store.instances.update_config(
                name, {READY_KEY: "true" if ready else "false"}
            )
            if ready:
                self.metrics.ready(name, self.clock.seconds())
            self.journal.publish_state(record)
        if ready:
            self.events.lifecycle("instance-ready", name)
        return record

    async def issue_agent_identity(self, record: InstanceRecord) -> CertificatePair | None:
        """A fresh client certificate for the instance's agent, and its config drive.

        The store keeps only the fingerprint: whoever presents this certificate
        is this instance, and nothing else is.  Without a guest API (no link
        yet) there is nothing to issue.
        """
        guest = self.reach.link
        if guest is None:
            return None
        pair = generate(f"vmready-agent-{record.name}")
        await self.store.certificates.set_agent_certificate(record.name, pair.fingerprint)
        write_identity(self.specs.config_drive(record), pair, guest.server_cert_pem)
        self.refresh_config_drive(record)
        return pair

    def refresh_config_drive(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        transport: str | None = None,
    ) -> None:
        """Write the drive's settings, agent, loader and guest data (and its NoCloud seed)."""
        guest = self.reach.link
        if guest is None:
            return
        transport = transport or record.config.get(TRANSPORT_KEY, self.settings.transport)
        spec = self.specs.spec_for(record, layout=layout, transport=transport)
        wired = agent_port_name(spec)
        # A real guest dials vsock (a forward CONNECT names its own address); a fakeqemu
        # guest, a host process, dials the daemon's hybrid vsock sockets.
        dial = guest.transport if self.fakeqemu else "vsock"
        settings: dict[str, str] = {"instance": record.name, "transport": dial}
        if wired is not None:
            settings["port"] = wired
        if transport == "forward":
            settings["network_mac"] = forward_mac(record.uuid)
            settings["network_address"] = FORWARD_GUEST_NETWORK_ADDRESS
        if self.fakeqemu:
            # A fakeqemu guest is a host process: its devices are sockets in the run dir.
            settings.update(fakeqemu_guest_paths(spec))
        write_settings(
            self.specs.config_drive(record),
            settings,
            self.settings.drive,
            guest_data(record),
        )

    async def ensure_agent_identities(self) -> int:
        """Issue certificates to instances that have none (created before the guest API).

        A config drive whose ``server.crt`` is not the daemon's (the operator
        issued a new pair) gets the new one, so its agent can pin it again.
        """
        issued = 0
        for record in self.store.view.owned_instances():
            if await self.ensure_agent_identity(record):
                issued += 1
        return issued

    async def ensure_agent_identity(self, record: InstanceRecord) -> bool:
        """One instance's part of ``ensure_agent_identities``: whether it was issued one.

        Certificate files that cannot be read or written are that instance's
        fault alone (``instance-certificate-error``), never the daemon's: the
        others, and this one's VM, are recovered as usual.
        """
        drive = self.specs.config_drive(record)
        try:
            self._refresh_pinned_certificate(record, drive)
            missing = not os.path.exists(os.path.join(drive, AGENT_CONFIG))
            issued = missing and await self.issue_agent_identity(record) is not None
        except OSError as e:
            self._certificates_failed(record.name, f"{e.filename}: {e.strerror}")
            return False
        self.recheck_identity(record)
        return issued

    def recheck_identity(self, record: InstanceRecord) -> None:
        """Read the instance's certificate files: a fault while they cannot be, cleared after.

        Only what the guest's agent needs: ``agent.crt`` (a PEM certificate),
        ``agent.key`` and ``server.crt``, once the drive has an identity.
        """
        drive = self.specs.config_drive(record)
        if self.reach.link is None or not os.path.exists(os.path.join(drive, AGENT_CONFIG)):
            return
        problem = unreadable_identity(drive, self.reach.link.server_cert_pem)
        if problem is not None:
            self._certificates_failed(record.name, problem)
        elif self.unreadable.pop(record.name, None) is not None:
            self.log.info("{name}: its certificate files are readable again", name=record.name)
            self.events.lifecycle("instance-certificate-restored", record.name)

    def renamed(self, name: str, new_name: str) -> None:
        """A stopped instance was renamed: a certificate fault standing goes with it."""
        problem = self.unreadable.pop(name, None)
        if problem is not None:
            self.unreadable[new_name] = problem

    def _certificates_failed(self, name: str, problem: str) -> None:
        if self.unreadable.get(name) == problem:
            return  # said already
        self.unreadable[name] = problem
        error = f"the agent's certificate files cannot be used: {problem}"
        self.log.warn("{name}: {error}", name=name, error=error)
        self.events.lifecycle("instance-certificate-error", name, {"error": error})

    def _refresh_pinned_certificate(self, record: InstanceRecord, drive: str) -> None:
        guest = self.reach.link
        path = os.path.join(drive, "server.crt")
        if guest is None or not os.path.exists(path):
            return
        with open(path, "rb") as f:
            if f.read() == guest.server_cert_pem:
                return
        write_private(path, guest.server_cert_pem)
        self.log.warn(
            "{name}: the daemon's certificate changed; wrote the new one to its config drive "
            "(its agent reads it when it restarts)",
            name=record.name,
        )


def unreadable_identity(drive: str, server_pem: bytes) -> str | None:
    """What is wrong with a config drive's certificate files (None: all readable, PEM).

    A ``server.crt`` that is the daemon's own certificate (``server_pem``, as the
    daemon loaded and checked it) is taken as it is.
    """
    for file in ("agent.crt", "agent.key", "server.crt"):
        path = os.path.join(drive, file)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            return f"{path}: {e.strerror}"
        if file == "server.crt" and data == server_pem:
            continue
        marker = b"PRIVATE KEY-----" if file == "agent.key" else b"-----BEGIN CERTIFICATE-----"
        if marker not in data:
            return f"{path}: not a PEM {'key' if file == 'agent.key' else 'certificate'}"
        if file != "agent.key":
            try:
                fingerprint(data)
            except ValueError:
                return f"{path}: not a valid certificate"
    return None
