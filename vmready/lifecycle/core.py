"""The instance lifecycle: actions as claimed tasks, truthful events, errors that stay.

Every action follows ``vmready.domain.states.ACTIONS``: it *claims* its first
task_state with a compare-and-swap in the store (so of two racing actions one
wins and the other gets a 409 at once, before any operation exists), walks its
task_states — each change published as an ``instance-state`` lifecycle event
and recorded as a step in the action history — and ends in its vm_state.  A
failure ends in vm_state ``error`` with the reason, and nothing but an explicit
action (rebuild, delete, start after a failed stop…) moves it from there.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from twisted.internet.defer import Deferred, DeferredLock, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain.model import (
    BadRequest,
    Conflict,
    InstanceRecord,
    task_conflict,
)
from vmready.domain.states import ACTIONS, TaskState
from vmready.hypervisor.accel import (
    ACCEL_KEY,
)
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.cmdline import (
    CURRENT_LAYOUT,
    SerialLayout,
    VMSpec,
)
from vmready.hypervisor.console import (
    rotate_console,
)
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.guestdata import check_guest_data
from vmready.hypervisor.imagetool import ImageInfo
from vmready.lifecycle.actions import Actions
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.operations import Operation
from vmready.lifecycle.recovery import DEFAULT_SYNC_CONCURRENCY, Recovery
from vmready.lifecycle.renaming import Renaming
from vmready.lifecycle.snapshotting import Snapshotting
from vmready.lifecycle.state import (
    _LAUNCH_KEYS,
    _NAME,
    _PREVIOUS_CPU,
    _PREVIOUS_MEMORY,
    _REMOVAL_PROBE,
    _RESTORE_POLL_SECONDS,
    _RUNNING_STATES,
    _SIGN_OF_LIFE_POLL,
    _TASKS_RESOLVED_BY_A_RUNNING_VM,
    _USER_KEYS,
    CONFIG_DRIVE,
    DEFAULT_KVM_PROBE_TIMEOUT,
    DEFAULT_STOP_TIMEOUT,
    LAYOUT_KEY,
    MAX_CPUS,
    MAX_MEMORY_MIB,
    MAX_STOP_TIMEOUT,
    MIN_MEMORY_MIB,
    RESTORE_TIMEOUT,
    ActionContext,
    GuestLink,
    LaunchSettings,
    LifecycleState,
    _config_updates,
    _restored_config,
    _snapshotted,
    agent_chardev,
    agent_port_name,
    config_changes,
    fakeqemu_guest_paths,
    parse_cpus,
    parse_memory,
    run_dir_name,
    validate_config,
    validate_name,
)
from vmready.lifecycle.watching import Watching
from vmready.protocols.prometheus import MetricFamily
from vmready.protocols.ringbuffer import AgentStatus
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import OutcomeUnknown, StoreWriteFailed
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair

__all__ = [
    "CONFIG_DRIVE",
    "DEFAULT_KVM_PROBE_TIMEOUT",
    "DEFAULT_STOP_TIMEOUT",
    "LAYOUT_KEY",
    "MAX_CPUS",
    "MAX_MEMORY_MIB",
    "MAX_STOP_TIMEOUT",
    "MIN_MEMORY_MIB",
    "RESTORE_TIMEOUT",
    "_LAUNCH_KEYS",
    "_NAME",
    "_PREVIOUS_CPU",
    "_PREVIOUS_MEMORY",
    "_REMOVAL_PROBE",
    "_RESTORE_POLL_SECONDS",
    "_RUNNING_STATES",
    "_SIGN_OF_LIFE_POLL",
    "_TASKS_RESOLVED_BY_A_RUNNING_VM",
    "_USER_KEYS",
    "ActionContext",
    "GuestLink",
    "LaunchSettings",
    "Lifecycle",
    "LifecycleState",
    "_config_updates",
    "_restored_config",
    "_snapshotted",
    "agent_chardev",
    "agent_port_name",
    "config_changes",
    "fakeqemu_guest_paths",
    "parse_cpus",
    "parse_memory",
    "run_dir_name",
    "validate_config",
    "validate_name",
]

P = ParamSpec("P")
T = TypeVar("T")


def _runs_to_its_end(
    method: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """``method``, whose run goes on to its end when its caller's wait is cancelled.

    A request's handler is cancelled when its client goes away (Klein does
    so); a claim taken must still get its history and its operation, or the
    task stays claimed with nothing to run it.  Whatever the run ends in after
    the wait was cancelled has nobody to hear it: the operation reports itself.
    """

    @functools.wraps(method)
    async def to_its_end(*args: P.args, **kwargs: P.kwargs) -> T:
        running = Deferred.fromCoroutine(method(*args, **kwargs))
        waiting: Deferred[T] = Deferred()

        def passed_on(result: T | Failure) -> None:
            if waiting.called:
                return  # cancelled: nobody waits any more
            if isinstance(result, Failure):
                waiting.errback(result)
            else:
                waiting.callback(result)

        running.addBoth(passed_on)
        return await waiting

    return to_its_end


class Lifecycle:
    """Runs actions on instances against a store and a hypervisor driver.

    A facade over its parts, each one concern: ``state`` (what they share, the
    views), ``guestside`` (Ready, identities, config drives), ``watching`` (QMP
    events and agents), ``booting`` (starting QEMU), ``actions``, ``snapshotting``
    and ``recovery`` (power sync, daemon start).
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        store: AsyncStore | Store,
        driver: HypervisorDriver,
        events: EventBus,
        run_root: str,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        serial_layout: SerialLayout = CURRENT_LAYOUT,
        snapshot_root: str | None = None,
        settings: LaunchSettings | None = None,
        disk_root: str | None = None,
        sync_concurrency: int = DEFAULT_SYNC_CONCURRENCY,
    ) -> None:
        self.state = state = LifecycleState(
            reactor=reactor,
            # A bare engine runs inline (tests, replays); the daemon hands a threaded store.
            store=store if isinstance(store, AsyncStore) else AsyncStore.inline(store),
            driver=driver,
            events=events,
            run_root=run_root,
            stop_timeout=stop_timeout,
            serial_layout=serial_layout,
            snapshot_root=snapshot_root,
            settings=settings,
            disk_root=disk_root,
        )
        # Per instance, while a claim (and its giving back) is under way: claims wait in turn.
        self._claims: dict[str, DeferredLock] = {}
        self.guestside = GuestSide(state)
        self.watching = Watching(state)
        self.booting = Booting(state, self.guestside, self.watching)
        self.snapshotting = Snapshotting(state, self.booting)
        self.actions = Actions(state, self.booting, self.snapshotting, self.watching)
        self.recovery = Recovery(
            state, self.actions, self.watching, self.guestside, sync_concurrency
        )
        self.renaming = Renaming(state, self.recovery, self.guestside)

    @_runs_to_its_end
    async def create(
        self,
        name: str,
        config: dict[str, Any],
        instance_uuid: str | None = None,
        start: bool = True,
    ) -> Operation:
        """Create and boot an instance: BUILD → ACTIVE (or ERROR with the reason).

        ``start=False``: LXD's create without start: its disk is made, no VM
        starts, and it rests STOPPED (BUILD → STOPPED) until started.

        The boot source (the daemon's default when the config names none) is
        checked first: a file that cannot boot is a 400 before any instance,
        overlay or process exists.
        """
        validate_name(name)
        checked = validate_config(config)
        check_guest_data(checked)
        if self.state.store.view.find_instance(name) is not None:
            raise Conflict(f"Instance {name} already exists")
        boot = BootSource.from_config(checked)
        if boot.empty and not self.state.settings.default_boot.empty:
            boot = self.state.settings.default_boot
            checked.update(boot.config())
        if checked.get(ACCEL_KEY) == "kvm" and self.state.kvm_problem is not None:
            raise BadRequest(
                f"Cannot launch {name} with {ACCEL_KEY}=kvm: {self.state.kvm_problem}"
            )
        image = await self.state.check_boot_source(boot)
        record = await self.state.store.instances.create_instance(name, checked, {}, instance_uuid)
        context = await ActionContext.begin(self.state, name, "create", TaskState.SPAWNING)
        await self.guestside.issue_agent_identity(record)
        self.state.publish_state(record)
        self.state.events.lifecycle("instance-created", name)

        async def work() -> None:
            build = self.booting.spawn if start else self.booting.build_stopped
            await self.actions.guarded(context, build(context, record, image))

        return self.state.operations.run(f"Creating instance {name}", name, work)

    @_runs_to_its_end
    async def act(self, name: str, action: str, **params: Any) -> Operation:
        """Run a named action; a 409 is raised here, before the operation, if it cannot start."""
        spec = ACTIONS.get(action)
        if spec is None or action == "create":
            raise BadRequest(f"Unknown action {action!r}")
        runner = getattr(
            self.snapshotting if action in ("snapshot", "restore") else self.actions,
            "do_" + action.replace("-", "_"),
        )
        prepared = self.actions.prepare(action, params)
        # A restore holds its snapshot from now on: a delete either came first or is refused.
        release = (
            self.snapshotting.reserve_for_restore(name, prepared["snapshot"])
            if action == "restore"
            else _nothing_to_release
        )
        try:
            return await self._start_action(name, action, prepared, runner, release)
        except BaseException:
            release()
            raise

    async def _start_action(
        self,
        name: str,
        action: str,
        prepared: dict[str, Any],
        runner: Callable[..., Coroutine[Any, Any, None]],
        release: Callable[[], None],
    ) -> Operation:
        """``act`` once its parameters are checked: claim the task, then run it."""
        spec = ACTIONS[action]
        # Not before the daemon's start-up reconciliation of the instance is over.
        await self.recovery.reconciled(name)
        if action in ("snapshot", "restore"):
            current = self.state.store.view.get_instance(name)
            if current.task_state is not None:
                raise task_conflict(action, name, current.task_state, current.vm_state)
            await self.actions.preflight(action, current, prepared)
        task = spec.tasks[0]
        async with self._claiming(name):
            try:
                record = await self.state.store.instances.claim_task(
                    name, action, spec.allowed_from, task
                )
            except OutcomeUnknown:
                # The claim may have been kept: no action will run it, so give it back.
                await self._give_back_claim(name, task)
                raise
            try:
                context = await ActionContext.begin(self.state, name, action, task)
            except StoreWriteFailed:
                # The claim was kept, the action's history could not be: no action runs.
                await self._give_back_claim(name, task)
                raise
        recorders = self.state.recorders
        recorder = recorders.recorder_for(name) if recorders is not None else None
        if recorder is not None:
            # Before the state it causes: an input of the session, replayed as such.
            recorder.operator_action(action, prepared)
        self.state.publish_state(record)

        async def work() -> None:
            try:
                await self.actions.guarded(context, runner(context, record, **prepared))
            finally:
                release()

        operations = self.state.operations
        operation = operations.run(f"{action.capitalize()} instance {name}", name, work)
        context.report_to(lambda metadata: operations.report(operation, metadata))
        return operation

    @contextlib.asynccontextmanager
    async def _claiming(self, name: str) -> AsyncIterator[None]:
        """One claim of instance ``name`` at a time, with its history record or giving back.

        The store's compare-and-swap decides between claims; this keeps a
        claim given back (its outcome unknown) from ending another request's
        claim of the same task that the store took meanwhile.
        """
        lock = self._claims.setdefault(name, DeferredLock())
        await lock.acquire()
        try:
            yield
        finally:
            lock.release()
            if not lock.locked:
                self._claims.pop(name, None)

    async def _give_back_claim(self, name: str, task: TaskState) -> None:
        """End a claimed task no action will run, leaving the instance where it was.

        A compare-and-swap on the task: if the claim was not kept after all,
        there is nothing to give back.  If the store still fails, the task stays
        until the daemon's next start resolves it (as for any interrupted task).
        """
        current = self.state.store.view.find_instance(name)
        if current is None:
            return
        try:
            await self.state.store.instances.finish_task(name, task, current.vm_state)
        except Conflict:
            return  # not claimed after all (or claimed by another action meanwhile)
        except StoreWriteFailed as e:
            self.log.warn(
                "instance {name} keeps task {task} until the daemon restarts: {error}",
                name=name,
                task=task.value,
                error=e.message,
            )
            return
        self.log.info(
            "gave back the {task} task of {name}: its action could not start",
            name=name,
            task=task.value,
        )

    async def rename(self, name: str, new_name: str) -> Operation:
        """Rename a stopped instance (LXD's rename); a 400, 404 or 409 before the operation."""
        return await self.renaming.rename(name, new_name)

    async def delete_snapshot(self, name: str, snapshot: str) -> dict[str, Any]:
        """Forget a snapshot and its files; 409 while a restore from it runs, 404 if none."""
        return await self.snapshotting.delete_snapshot(name, snapshot)

    def rotate_consoles(self) -> None:
        """Keep every running VM's console log under its cap (called on a timer)."""
        for vm in list(self.state.vms.values()):
            try:
                if rotate_console(vm.spec.console_log, self.state.settings.console_max_bytes):
                    self.log.info("rotated the console log of {name}", name=vm.spec.name)
            except OSError as e:
                self.log.warn(
                    "cannot rotate the console log of {name}: {error}", name=vm.spec.name, error=e
                )

    def shutdown(self) -> Deferred[None]:
        """Daemon stopping: let go of the VMs (they keep running), without touching the store."""
        self.recovery.stopping = True
        self.state.operations.stop()
        detaching = []
        for name in list(self.state.vms):
            vm = self.state.vms[name]
            self.watching.detach(name, announce=False)
            detaching.append(vm.detach())
        return gatherResults(detaching).addCallback(lambda _: None)

    def get(self, name: str) -> InstanceRecord:
        """The instance, or NotFound."""
        return self.state.get(name)

    def list(self) -> list[InstanceRecord]:
        """Every instance."""
        return self.state.list()

    def agent_status(self, name: str) -> AgentStatus:
        """What the instance's agent last said (``stopped`` once its VM is gone)."""
        return self.state.agent_status(name)

    def metrics(self) -> builtins.list[MetricFamily]:
        """Every metric as it stands now: counters so far, gauges read from the store now.

        The instances this daemon runs (all, on a single host): a cluster's
        members are each scraped, and summing them counts each instance once.
        """
        return self.state.metrics.families(
            [record.operator_status.value for record in self.state.store.view.owned_instances()],
            [monitor.status for monitor in self.state.monitors.values()],
        )

    def console_log(self, name: str, limit: int) -> bytes:
        """The tail of the instance's console log (empty before its first boot)."""
        return self.state.console_log(name, limit)

    def console_log_path(self, record: InstanceRecord) -> str:
        """The console log's absolute path (``vmready info`` shows it)."""
        return self.state.console_log_path(record)

    def config_drive(self, record: InstanceRecord) -> str:
        """The directory handed to the guest as its config drive (certificates, agent.json)."""
        return self.state.config_drive(record)

    def disk_path(self, record: InstanceRecord) -> str | None:
        """The instance's root-disk overlay (None: it boots no image)."""
        return self.state.disk_path(record)

    def layout_of(self, record: InstanceRecord) -> SerialLayout:
        """The serial layout the instance's VM was last started with."""
        return self.state.layout_of(record)

    async def update_config(self, name: str, config: dict[str, Any]) -> InstanceRecord:
        """Set user-settable keys (``None`` removes one); limits change only through resize."""
        return await self.state.update_config(name, config)

    def publish_state(self, record: InstanceRecord) -> None:
        """An ``instance-state`` event with everything a watcher needs to show the instance."""
        return self.state.publish_state(record)

    async def check_boot_source(self, boot: BootSource) -> ImageInfo | None:
        """Check what an instance would boot; the image's description, or BadRequest."""
        return await self.state.check_boot_source(boot)

    async def set_ready(self, name: str, ready: bool) -> InstanceRecord:
        """The guest's workload declared itself Ready (or withdrew it: Started)."""
        return await self.guestside.set_ready(name, ready)

    async def issue_agent_identity(self, record: InstanceRecord) -> CertificatePair | None:
        """A fresh client certificate for the instance's agent, and its config drive."""
        return await self.guestside.issue_agent_identity(record)

    async def ensure_agent_identities(self) -> int:
        """Issue certificates to instances that have none (created before the guest API)."""
        return await self.guestside.ensure_agent_identities()

    async def sync_power_states(self) -> None:
        """One reconciliation round, ``--sync-concurrency`` at a time; errors and tasks left."""
        return await self.recovery.sync_power_states()

    async def recover(self) -> None:
        """At daemon start: clear Ready, close interrupted actions, re-adopt or resolve VMs."""
        return await self.recovery.recover()

    async def prepare_recovery(self) -> builtins.list[InstanceRecord]:
        """Daemon start, before serving: clear Ready, close interrupted actions."""
        return await self.recovery.prepare()

    async def reconcile(self, records: builtins.list[InstanceRecord]) -> None:
        """Daemon start, while serving: re-adopt or resolve each VM, bounded."""
        await self.recovery.reconcile(records)

    def spec_for(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        accel: str | None = None,
        transport: str | None = None,
    ) -> VMSpec:
        """The hypervisor's view of an instance, as its VM runs (or would start) now."""
        return self.state.spec_for(record, layout, accel, transport)

    def refresh_config_drive(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        transport: str | None = None,
    ) -> None:
        """Write the drive's settings, agent, loader and cloud-init files for the next boot."""
        self.guestside.refresh_config_drive(record, layout, transport)


def _nothing_to_release() -> None:
    """What an action that holds no snapshot releases when it ends."""
