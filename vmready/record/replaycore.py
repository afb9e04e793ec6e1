"""The replayed daemon core and its clock: built, restarted and stopped as the recording says.

An in-memory ``Store``, an ``EventBus``, a ``Lifecycle`` whose driver runs
fakeqemu in-process (``replaydriver.ReplayDriver``) and the ``GuestAPI``, all on
one ``task.Clock``.  ``run_until`` steps the clock from one timer to the next,
so the daemon polls, times out and answers exactly as it would, only without
waiting.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from fakeqemu.testing import FakeGuest, InMemoryVM
from vmready.api import GuestAPI
from vmready.domain import InstanceRecord, PowerState, TaskState, VMState
from vmready.hypervisor import BOOT_KEYS, VMSpec
from vmready.lifecycle import LIFECYCLE, EventBus, GuestLink, Lifecycle, agent_chardev
from vmready.record.replaydriver import HookLookup, ReplayDriver, ReplayHooks, ScriptedRing
from vmready.record.replayoutputs import Outputs
from vmready.record.replaysetup import ReplaySetup
from vmready.store import Store

_MAX_STEPS = 1_000_000
_SERVER_PEM = b"replay: no certificate\n"


class ReplayCore:
    """The daemon core of one replay, its VM and the guest's end of it.

    ``recorded_read(size)`` is what the host's ring-buffer reads return (host
    side); what the host does goes to ``outputs``.
    """

    def __init__(
        self,
        setup: ReplaySetup,
        clock: Clock,
        outputs: Outputs,
        recorded_read: Callable[[int], bytes],
    ) -> None:
        self.setup = setup
        self.name = setup.name
        self.clock = clock
        self._recorded_read = recorded_read
        self._base = tempfile.mkdtemp(prefix="vmready-replay-")
        self.store = Store.open(":memory:", clock=clock.seconds)
        self.events = EventBus(clock.seconds)
        self.events.subscribe(outputs.event, frozenset({LIFECYCLE}))
        self.driver = ReplayDriver(clock, self.vm_started)
        self.hooks = ReplayHooks(outputs.host_wrote)
        self.lifecycle: Lifecycle | None = None
        self.agent: Any = None
        self.guest: FakeGuest | None = None
        self.vm: InMemoryVM | None = None
        self.port = 0
        # Agent side: the recorded agent lost its host, so the replayed core is down.
        self.down = False

    def _identify(self, request: IRequest) -> InstanceRecord | None:
        return self.store.instances.find_instance(self.name)

    def _build(self, port: int) -> Lifecycle:
        from treq.testing import RequestTraversalAgent

        self.port = port
        lifecycle = Lifecycle(
            self.clock,
            self.store,
            self.driver,
            self.events,
            f"{self._base}/run",
            serial_layout=self.setup.layout,
        )
        lifecycle.reach.listening(
            GuestLink(port, _SERVER_PEM, "hvsock:/replay", self.setup.intervals)
        )
        lifecycle.recording.use(HookLookup(self.hooks))
        self.lifecycle = lifecycle
        self.agent = RequestTraversalAgent(GuestAPI(lifecycle, self._identify).app.resource())
        return lifecycle

    def vm_started(self, spec: VMSpec, vm: InMemoryVM) -> None:
        """A VM booted: wire the guest's side to it."""
        self.vm = vm
        chardev = agent_chardev(spec)
        if chardev is None:
            return
        if self.setup.side == "host":
            size = vm.machine.wiring.ringbuf_device(chardev).size
            vm.machine.wiring.replace_ringbuf(chardev, ScriptedRing(size, self._recorded_read))
            return
        for wired in spec.serial_ports:
            if wired.chardev == chardev:
                self.guest = vm.connect_guest(wired.name)

    def _create(self, lifecycle: Lifecycle, instance_uuid: str | None) -> None:
        """Create the instance on the fresh core; its boot source is not replayed.

        The replayed VM boots nothing (it runs in memory), so the recorded
        image and kernel need not exist here: without them nothing in
        ``create`` waits, and the operation starts at once.
        """
        config = {key: value for key, value in self.setup.config.items() if key not in BOOT_KEYS}
        failed: list[Failure] = []
        Deferred.fromCoroutine(lifecycle.create(self.name, config, instance_uuid)).addErrback(
            failed.append
        )
        if failed:
            failed[0].raiseException()

    def start(self) -> None:
        """Build the core as the recorded session began: creating the instance, or adopting it."""
        setup = self.setup
        if not setup.adopts:
            self._create(self._build(setup.port), setup.uuid)
            return
        # A session that began with a running VM (recorded from a daemon start): boot it
        # unrecorded, then let a fresh core adopt it as a starting daemon does.
        self.store.instances.create_instance(self.name, setup.config, {}, setup.uuid)
        self.store.instances.finish_task(
            self.name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )
        lifecycle = self._build(setup.port)
        record = self.store.instances.get_instance(self.name)
        Deferred.fromCoroutine(self.driver.launch(lifecycle.specs.spec_for(record))).addCallback(
            lambda vm: vm.detach()
        )
        self.settle()
        self.restart(setup.port)

    def restart(self, port: int) -> None:
        """The daemon restarts: the old core lets go, a new one recovers on the same store."""
        self.stop()
        self.down = False
        lifecycle = self._build(port)
        Deferred.fromCoroutine(lifecycle.recovery.recover())
        self.settle()

    def stop(self) -> None:
        """The daemon goes away: its core lets go of the VM (which keeps running)."""
        if self.lifecycle is not None and not self.down:
            self.lifecycle.shutdown()
            self.settle()
        self.down = True

    # -- time -------------------------------------------------------------

    def settle(self) -> None:
        """Deliver every pending byte (QMP, guest port, HTTP) until all is quiet."""
        for _ in range(100):
            if self.vm is not None:
                self.vm.flush()
            for vm in self.driver.machines.values():
                vm.flush()
            if self.agent is not None:
                self.agent.flush()
            self.clock.advance(0)
            if self.vm is not None:
                self.vm.flush()
            if not self._busy():
                return

    def _busy(self) -> bool:
        return bool(self.clock.getDelayedCalls()) and any(
            call.getTime() <= self.clock.seconds() for call in self.clock.getDelayedCalls()
        )

    def run_until(self, target: float) -> None:
        """Step the clock timer by timer up to ``target``, settling after each."""
        self.settle()
        for _ in range(_MAX_STEPS):
            calls = [call for call in self.clock.getDelayedCalls() if call.active()]
            upcoming = min((call.getTime() for call in calls), default=None)
            if upcoming is None or upcoming > target:
                break
            self.clock.advance(max(0.0, upcoming - self.clock.seconds()))
            self.settle()
        if target > self.clock.seconds():
            self.clock.advance(target - self.clock.seconds())
            self.settle()

    def close(self) -> None:
        """Let go of everything (nothing real runs; only the temporary run dir remains)."""
        if self.lifecycle is not None:
            self.stop()
            self.lifecycle.operations.stop()
        for call in self.clock.getDelayedCalls():
            if call.active():
                call.cancel()
        self.store.close()
        shutil.rmtree(self._base, ignore_errors=True)
