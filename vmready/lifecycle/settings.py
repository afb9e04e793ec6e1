"""How this daemon starts VMs: what it was told, fixed for its lifetime."""

from __future__ import annotations

import attrs

from vmready.hypervisor import DEFAULT_CONSOLE_MAX_BYTES, BootSource, DriveContents

DEFAULT_KVM_PROBE_TIMEOUT = 30.0
# Why a lifecycle that was not told about /dev/kvm (a test, a replay) never tries KVM.
KVM_NOT_PROBED = "KVM is not probed by this lifecycle"


@attrs.frozen
class LaunchSettings:
    """How this daemon starts VMs: default boot source, transport, KVM probing, console cap."""

    # The guest API transport new VMs get: hvsock, vsock or forward (vmready.agentlink.transport).
    transport: str = "hvsock"
    # What an instance launched without a boot source boots.
    default_boot: BootSource = attrs.field(factory=BootSource)
    # How long a first KVM boot may show no sign of life before it is retried under TCG.
    kvm_probe_timeout: float = DEFAULT_KVM_PROBE_TIMEOUT
    console_max_bytes: int = DEFAULT_CONSOLE_MAX_BYTES
    # What every config drive carries besides the instance's identity.
    drive: DriveContents = attrs.field(factory=DriveContents)
    # Why /dev/kvm cannot be used here (None: it opens; a first guest proves it runs).
    kvm_problem: str | None = KVM_NOT_PROBED
