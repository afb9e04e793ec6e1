"""Following a running VM: its QMP events, its agent, and what its going away means."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from functools import partial
from typing import cast

import attrs
from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.interfaces import IReactorTime, IReactorUNIX
from twisted.logger import Logger

from vmready.agentlink import AgentLink, AgentMonitor, ConnectPort, StatusChanged
from vmready.agentlink.transport import TRANSPORT_KEY, connect_line
from vmready.domain import READY_KEY, RUNNING_VM_STATES, InstanceRecord, PowerState, VMState
from vmready.hypervisor import (
    UNRECORDED_LAYOUT,
    RunningVM,
    VMEvent,
    VMEventKind,
    fakeqemu_guest_paths,
)
from vmready.lifecycle.agentdeadline import AgentDeadline
from vmready.lifecycle.agenthistory import AgentHistory, LinkChange
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestlink import GuestReach
from vmready.lifecycle.hooks import Recording
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.metrics import CountedRingDevice, LifecycleMetrics
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.specs import LAYOUT_KEY, agent_chardev, agent_port_name
from vmready.protocols.qmp import QMPEvent
from vmready.store import AsyncStore, StoreHealth

# Set on an instance put in error because its VM's QMP monitor could not be reached while
# the VM still ran: power sync tries to adopt that VM again, and clears it when it can.
MONITOR_LOST_KEY = "volatile.monitor.lost"
# Every state an idle instance may be in when its VM dies.
ANY_VM_STATE = frozenset(VMState)


# Why an agent's first change after its VM was adopted comes: it was sent CONNECT again.
_READVERTISED = "the VM was adopted; CONNECT advertised again"
# Why the agent stops with its VM, by the VM event that ended it.
_VM_ENDED_CAUSES = {
    VMEventKind.GONE: "its VM went away",
    VMEventKind.SHUTDOWN: "its VM shut down",
    VMEventKind.PANICKED: "its guest panicked",
}


@attrs.define(kw_only=True, eq=False)
class Watching:
    """Following a running VM: its QMP events, its agent, and what its going away means."""

    log = Logger()

    # The daemon's reactor (its agents' connect ports); ``clock``: the agents' polls, timers.
    reactor: IReactorTime
    clock: IReactorTime
    store: AsyncStore
    events: EventBus
    journal: Journal
    metrics: LifecycleMetrics
    running: RunningVMs
    reach: GuestReach
    recording: Recording
    agent_history: AgentHistory
    driver_kind: str
    # What undoes each followed VM's subscriptions.
    _unsubscribe: dict[str, Callable[[], None]] = attrs.field(init=False, factory=dict)
    # One per instance: its VM events are handled one after the other.
    _event_locks: dict[str, DeferredLock] = attrs.field(init=False, factory=dict)
    # Instances whose VM was adopted and its agent sent CONNECT again, until the agent's
    # next change (its history entry says so).
    _advertised: set[str] = attrs.field(init=False, factory=set)
    # Real guests' agents not yet judged connected or missing (``qemu`` driver only).
    _deadlines: dict[str, AgentDeadline] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.store.health.subscribe(self._store_health_changed)

    @property
    def fakeqemu(self) -> bool:
        """Whether guests are fakeqemu's: a reboot empties the tmpfs they keep in the run dir."""
        return self.driver_kind == "fakeqemu"

    def _store_health_changed(self, health: StoreHealth) -> None:
        """The store's writes started failing (the disk is full) or succeed again: say so."""
        if health.failing_since is not None:
            self.events.server("store-write-failed", {"error": health.error or ""})
        else:
            self.events.server("store-write-recovered")

    def attach(self, name: str, vm: RunningVM, advertise: bool = False) -> None:
        """Follow ``vm``; ``advertise``: write CONNECT at once (its agent may know an old port)."""
        record = self.store.view.find_instance(name)
        if record is not None and LAYOUT_KEY not in record.config:
            # Adopted from a vmready that did not record layouts: say which one it runs (until
            # it is committed, ``layout_of`` reads the same layout from the key's absence).
            self.journal.logged(
                self.store.instances.update_config(name, {LAYOUT_KEY: UNRECORDED_LAYOUT.name}),
                "the serial layout",
            )
        if record is not None and MONITOR_LOST_KEY in record.config:
            # Its VM is followed again (a start adopted or replaced it): the loss is over.
            self.journal.logged(
                self.store.instances.update_config(name, {MONITOR_LOST_KEY: None}),
                "the end of a lost monitor",
            )
            self.events.lifecycle(
                "instance-monitor-restored", name, {"reason": "its VM is followed again"}
            )
        self.detach(name)
        self.running.vms[name] = vm
        undo = [vm.subscribe(lambda event: self._vm_event(name, vm, event))]
        recording = self.recording
        if recording.enabled:
            # Recorded as it arrives, before the core (or the VM handle) reacts to it; the
            # recorder is looked up each time (recording may be switched off and on).
            def record_event(event: QMPEvent) -> None:
                recorder = recording.recorder_for(name)
                if recorder is not None:
                    recorder.qmp_event(event.name, event.data)

            undo.append(vm.qmp.subscribe(record_event, first=True))
        monitor = self._follow_agent(name, vm)
        if monitor is not None:
            undo.append(vm.qmp.subscribe(lambda event: self._qmp_event(name, event)))
            if advertise:
                self._advertised.add(name)
            monitor.start(advertise)
            frozen = record is not None and (
                record.vm_state is VMState.PAUSED or record.power_state is PowerState.PAUSED
            )
            if frozen:
                monitor.paused()  # adopted frozen: its agent cannot speak until unfrozen
            if self.driver_kind == "qemu":
                # A real guest whose agent never connects: say why, as its console tells it.
                live = partial(self._live, name, vm)
                deadline = self._deadlines[name] = AgentDeadline(
                    name, self.clock, self.events, vm.spec.console_log, live
                )
                undo.append(lambda: self._deadlines.pop(name).cancel())
                deadline.start()

        def unsubscribe() -> None:
            for step in undo:
                step()

        self._unsubscribe[name] = unsubscribe

    def _live(self, name: str, vm: RunningVM) -> bool:
        """Whether ``vm`` still runs as the instance's, its vCPUs too (not paused)."""
        record = self.store.view.find_instance(name)
        return not vm.gone and record is not None and record.power_state is PowerState.RUNNING

    def _follow_agent(self, name: str, vm: RunningVM) -> AgentMonitor | None:
        guest = self.reach.link
        chardev = agent_chardev(vm.spec)
        if guest is None or chardev is None:
            return None
        record = self.store.view.find_instance(name)
        transport = record.config.get(TRANSPORT_KEY, "hvsock") if record else "hvsock"
        link = AgentLink(
            name,
            vm.spec.ring_size,
            guest.port,
            guest.intervals,
            connect=connect_line(transport, guest.port),
        )
        recording = self.recording
        # A VM started before vmready gave VMs a vmready.connect port has none.
        has_port = os.path.exists(vm.spec.connect_socket)
        monitor = AgentMonitor(
            self.clock,
            CountedRingDevice(vm, self.metrics),
            link,
            chardev,
            lambda change: self._agent_changed(name, change),
            (lambda: recording.recorder_for(name)) if recording.enabled else None,
            ConnectPort(
                # The daemon's reactor (a replay's clock never has such a port).
                cast(IReactorUNIX, self.reactor),
                vm.spec.connect_socket,
                name,
            )
            if has_port
            else None,
            port_id=agent_port_name(vm.spec),
        )
        self.running.monitors[name] = monitor
        return monitor

    def _qmp_event(self, name: str, event: QMPEvent) -> None:
        """Any QMP event: the instance's agent monitor (whichever follows it now) reads at once."""
        monitor = self.running.monitors.get(name)
        if monitor is not None:
            monitor.qmp_event(event.name, event.data)

    def _agent_changed(self, name: str, change: StatusChanged) -> None:
        self.running.last_agent_status[name] = change.current
        if (deadline := self._deadlines.get(name)) is not None:
            deadline.heard(change.current)
        event = self.events.lifecycle(
            change.event_action,
            name,
            {"status": change.current.value, "previous": change.previous.value},
        )
        readvertised = name in self._advertised
        self._advertised.discard(name)
        reason = None
        if change.lost is not None:
            reason = f"lost: the agent {change.lost}"
        elif change.cause is not None:
            reason = change.cause
        elif readvertised:
            reason = _READVERTISED
        self.agent_history.record(name, LinkChange(change.current.value, event.timestamp, reason))
        if change.lost is not None:
            # Gone without a word (killed) or hung (no heartbeat): a fault until it is back.
            self.events.lifecycle("agent-link-lost", name, {"reason": f"the agent {change.lost}"})

    def detach(self, name: str, announce: bool = True, cause: str = "its VM stopped") -> None:
        """Stop following the instance's VM; ``cause``: why its agent stops with it."""
        unsubscribe = self._unsubscribe.pop(name, None)
        if unsubscribe is not None:
            unsubscribe()
        self.running.vms.pop(name, None)
        self.metrics.boot_ended(name)
        self._stop_following_agent(name, announce, cause)

    async def force_stop(self, name: str, vm: RunningVM | None) -> None:
        """Stop following the instance's VM and kill it (None: no VM to stop)."""
        if vm is not None:
            self.detach(name)
            await vm.force_stop()

    def _stop_following_agent(
        self, name: str, announce: bool = True, cause: str = "its VM stopped"
    ) -> None:
        self._advertised.discard(name)
        monitor = self.running.monitors.pop(name, None)
        if monitor is not None:
            monitor.stop(announce, cause)
            self.running.last_agent_status[name] = monitor.status

    def _vm_event(self, name: str, vm: RunningVM, event: VMEvent) -> None:
        """A VM event: handled after the instance's earlier ones (each waits for its writes)."""
        lock = self._event_locks.setdefault(name, DeferredLock())
        handled = lock.run(lambda: Deferred.fromCoroutine(self._handle_vm_event(name, vm, event)))
        handled.addErrback(
            lambda failure: self.log.failure(
                "handling {event} of {name}", failure, event=event.kind, name=name
            )
        )

    async def _handle_vm_event(self, name: str, vm: RunningVM, event: VMEvent) -> None:
        """QMP events of a VM we did not ask for: follow power state; a death is an error."""
        record = self.store.view.find_instance(name)
        if record is None or self.running.vms.get(name) is not vm:
            return
        if event.kind in (VMEventKind.GONE, VMEventKind.SHUTDOWN, VMEventKind.PANICKED):
            # The guest OS is gone or going, whoever owns the instance now: so is its agent.
            self._stop_following_agent(name, cause=_VM_ENDED_CAUSES[event.kind])
        monitor = self.running.monitors.get(name)
        if monitor is not None:
            if event.kind is VMEventKind.STOP:
                monitor.paused()
            elif event.kind is VMEventKind.RESUME:
                monitor.resumed()
        if record.task_state is not None:
            return  # the running action owns the VM now
        if event.kind is VMEventKind.PANICKED and record.vm_state is not VMState.ERROR:
            await self.store.instances.update_config(name, {READY_KEY: "false"})
            self.journal.history(name, "guest-panicked", event.detail, ok=False)
            await self.fail(
                record,
                f"{event.detail}; its console log may say why (vmready console {name} --show-log)",
                PowerState.CRASHED,
                idle=True,
            )
            return
        if event.kind is VMEventKind.RESET:
            await self._guest_rebooted(record, vm)
            return
        if event.kind is VMEventKind.GONE:
            self.detach(name)
            await self._vm_went_away(record, event)
            return
        if event.power_state is not None and event.power_state is not record.power_state:
            if event.power_state in (PowerState.SHUTDOWN, PowerState.CRASHED) and record.ready:
                # Not ready from the moment it stops, before its process is gone.
                await self.store.instances.update_config(name, {READY_KEY: "false"})
            self.journal.publish_state(
                await self.store.instances.set_power_state(name, event.power_state)
            )

    async def _guest_rebooted(self, record: InstanceRecord, vm: RunningVM) -> None:
        """A reset is a new boot: its workload has not said Ready yet; its agent starts over."""
        self.metrics.boot_started(record.name, self.clock.seconds())
        if record.ready:
            self.journal.publish_state(
                await self.store.instances.update_config(record.name, {READY_KEY: "false"})
            )
        if self.fakeqemu:
            shutil.rmtree(fakeqemu_guest_paths(vm.spec)["state_dir"], ignore_errors=True)
        self._stop_following_agent(record.name, cause="its guest rebooted")
        monitor = self._follow_agent(record.name, vm)
        if monitor is not None:
            monitor.start(advertise=False)

    async def _vm_went_away(self, record: InstanceRecord, event: VMEvent) -> None:
        # The driver judges the exit: SHUTDOWN for a shutdown QEMU announced, CRASHED otherwise.
        clean = event.power_state is PowerState.SHUTDOWN
        self.journal.history(record.name, "vm-exited", event.detail, ok=clean)
        ready_false: dict[str, str | None] = {READY_KEY: "false"}
        if record.vm_state is VMState.ERROR:
            # The error stays; only note that its VM is gone too.
            await self.store.instances.update_config(record.name, ready_false)
            self.journal.publish_state(
                await self.store.instances.set_power_state(
                    record.name, event.power_state or PowerState.CRASHED
                )
            )
            return
        if clean:
            updated = await self.store.instances.settle(
                record.name, RUNNING_VM_STATES, VMState.STOPPED, PowerState.SHUTDOWN, ready_false
            )
            if updated is not None:
                self.journal.publish_state(updated)
                self.events.lifecycle("instance-shutdown", record.name, {"reason": event.detail})
            return
        await self.store.instances.update_config(record.name, ready_false)
        await self.fail(record, event.detail, PowerState.CRASHED, idle=True)

    async def fail(
        self, record: InstanceRecord, reason: str, power: PowerState, idle: bool = False
    ) -> bool:
        """Error with ``reason``, persisting, ending any task (recovery's); with ``idle``, only
        if no task claimed it since ``record`` was read (else it is the task's: False)."""
        if idle:
            updated = await self.store.instances.settle(
                record.name, ANY_VM_STATE, VMState.ERROR, power, error=reason
            )
        else:
            updated = await self.store.instances.set_error(record.name, reason, power)
        if updated is not None:
            self.journal.publish_state(updated)
            self.events.lifecycle("instance-error", record.name, {"error": reason})
        return updated is not None
