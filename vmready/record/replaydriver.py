"""The replay's stand-ins for the hypervisor and the recorder, on fakeqemu in memory.

``ReplayDriver`` runs each VM as a ``fakeqemu.testing.InMemoryVM`` on the
replay's clock; ``ScriptedRing`` is the agent's ring buffer whose reads return
what the transcript recorded; ``ReplayHooks`` is the recorder the replayed
lifecycle reports the host's ring-buffer writes to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from fakeqemu import RingBuffer
from fakeqemu.testing import InMemoryVM
from vmready.hypervisor import KVMProbe, RunningVM, VMSpec, build_command_line
from vmready.lifecycle import SessionHooks
from vmready.protocols.qmp import QMPClientProtocol


class ScriptedRing(RingBuffer):
    """The agent's ring buffer in a host-transcript replay: reads return what was recorded.

    Whatever the replayed host wrote (its echoes) is dropped: the recorded reads
    already hold the echoes the real host read back.  ``recorded_read(size)``
    gives what a read returns now.
    """

    def __init__(self, size: int, recorded_read: Callable[[int], bytes]) -> None:
        super().__init__(size)
        self.recorded_read = recorded_read

    def read(self, size: int) -> bytes:
        super().read(len(self))
        return self.recorded_read(size)


class ReplayHooks:
    """The replay's recorder: it captures the host's ring-buffer writes (``wrote``)."""

    def __init__(self, wrote: Callable[[bytes], None]) -> None:
        self.wrote = wrote

    def ring_read(self, chunk: bytes) -> None:
        """Reads are the replay's input (it serves them from the transcript): not compared."""

    def ring_write(self, data: bytes) -> None:
        self.wrote(data)

    def qmp_event(self, name: str, data: dict[str, Any]) -> None:
        """QMP events are inputs (the guest's) or consequences compared as state: not here."""

    def operator_action(self, action: str, params: dict[str, Any]) -> None:
        """Operator actions are the replay's input: it performs them, so nothing to compare."""


class HookLookup:
    """The lifecycle's ``RecorderLookup``: the same hooks for every instance."""

    def __init__(self, hooks: ReplayHooks) -> None:
        self.hooks = hooks

    def recorder_for(self, name: str) -> SessionHooks | None:
        return self.hooks


class ReplayDriver:
    """A hypervisor driver whose VMs are in-memory fakeqemu machines on the replay clock.

    ``started(spec, vm)`` is told of each VM booted.
    """

    kind = "replay"

    def __init__(self, clock: Clock, started: Callable[[VMSpec, InMemoryVM], None]) -> None:
        self.clock = clock
        self.started = started
        self.machines: dict[str, InMemoryVM] = {}

    def _connect(self, spec: VMSpec, vm: InMemoryVM) -> RunningVM:
        client = QMPClientProtocol()
        vm.connect_qmp(client)
        return RunningVM(self.clock, spec, client, None)

    async def launch(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> RunningVM:
        """Start ``spec``'s VM in memory."""
        argv = build_command_line(spec, ["fakeqemu"], paused, incoming)[1:]
        vm = InMemoryVM(argv, self.clock)
        self.machines[spec.name] = vm
        self.started(spec, vm)
        return self._connect(spec, vm)

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        """A new monitor connection to the VM that still runs (a restarted daemon's)."""
        vm = self.machines.get(spec.name)
        if vm is None or vm.exits:
            return None
        return self._connect(spec, vm)

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        """Nothing runs that the replay does not follow."""
        return succeed(False)

    async def wait_released(self, spec: VMSpec) -> None:
        """Nothing to wait for in memory."""

    async def probe_kvm(self) -> KVMProbe | None:
        """A replay runs no guest code: no verdict."""
        return None
