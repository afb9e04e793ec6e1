"""Everything ``twistd vmready`` was told, as the daemon's service reads it."""

from __future__ import annotations

import os

import attrs

from vmready.agentlink import PollIntervals
from vmready.hypervisor import CURRENT_LAYOUT, DEFAULT_CONSOLE_MAX_BYTES, BootSource
from vmready.lifecycle import (
    DEFAULT_KVM_PROBE_TIMEOUT,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_SYNC_CONCURRENCY,
)
from vmready.protocols import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from vmready.store import display_location

GUEST_SOCKET_BASE = "guest-api.sock"
FORWARD_SOCKET_NAME = "guest-fwd.sock"


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
    # A host fence kills the member's VMs once its lease may have run out (``--fence vms``).
    fence_vms: bool = False

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
            values["fence"] = "vms" if self.fence_vms else "none"
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
