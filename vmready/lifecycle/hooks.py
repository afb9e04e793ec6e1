"""What the lifecycle needs from outside, as interfaces: a session recorder and a hypervisor.

The lifecycle sits below record and replay: it knows only these protocols,
and the daemon (or a replay) hands it something that provides them.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.internet.defer import Deferred

from vmready.hypervisor import KVMProbe, RunningVM, VMSpec


class SessionHooks(Protocol):
    """What the core tells about a recorded instance as it happens (``InstanceRecorder``)."""

    def ring_read(self, chunk: bytes) -> None:
        """A drained ``ringbuf-read``."""

    def ring_write(self, data: bytes) -> None:
        """A ``ringbuf-write`` QEMU accepted."""

    def qmp_event(self, name: str, data: dict[str, Any]) -> None:
        """An asynchronous QMP event."""

    def operator_action(self, action: str, params: dict[str, Any]) -> None:
        """An operator's action (start, stop, restart …) claimed the instance's task."""


class RecorderLookup(Protocol):
    """Hands out the hooks of recorded instances (``Recorders``; the replay has its own)."""

    def recorder_for(self, name: str) -> SessionHooks | None:
        """The instance's hooks, or None when nothing about it is recorded."""


class Recording:
    """The recorder lookup the lifecycle's parts ask: none until one is handed over (``use``).

    The daemon's recorders are built over the lifecycle, so they are handed
    over once both exist, before any VM is followed.
    """

    def __init__(self) -> None:
        self._lookup: RecorderLookup | None = None

    @property
    def enabled(self) -> bool:
        """Whether sessions may be recorded at all (else no hook is ever asked for)."""
        return self._lookup is not None

    def use(self, lookup: RecorderLookup) -> None:
        """Sessions may be recorded from now on: ``lookup`` says whose."""
        self._lookup = lookup

    def recorder_for(self, name: str) -> SessionHooks | None:
        """The instance's hooks, or None when it is not recorded (or nothing is)."""
        return self._lookup.recorder_for(name) if self._lookup is not None else None


class Hypervisor(Protocol):
    """What the lifecycle asks of a hypervisor driver (``HypervisorDriver``, the replay's own)."""

    # "fakeqemu", "qemu", or another driver's name: a fakeqemu guest is a host process.
    kind: str

    async def launch(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> RunningVM:
        """Start ``spec``'s VM (``incoming``: restore that state file)."""

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        """Re-attach to ``spec``'s VM if it still runs; None if it does not."""

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        """Kill ``spec``'s VM process that nothing follows; fires with whether there was one."""

    async def wait_released(self, spec: VMSpec) -> None:
        """Wait until nothing answers on ``spec``'s monitor socket any more."""

    async def probe_kvm(self) -> KVMProbe | None:
        """QEMU's own verdict on KVM here, from a VM with no image (None: no verdict)."""
