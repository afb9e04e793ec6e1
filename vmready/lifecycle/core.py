"""The instance lifecycle: actions as claimed tasks, truthful events, errors that stay.

Every action follows ``vmready.domain.states.ACTIONS``: it *claims* its first
task_state with a compare-and-swap in the store (so of two racing actions one
wins and the other gets a 409 at once, before any operation exists), walks its
task_states — each change published as an ``instance-state`` lifecycle event
and recorded as a step in the action history — and ends in its vm_state.  A
failure ends in vm_state ``error`` with the reason, and nothing but an explicit
action (rebuild, delete, start after a failed stop…) moves it from there.

``Lifecycle`` is the face the API, the daemon and the replay use: it starts
actions and creates instances, and it hands out its parts for the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import attrs
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import (
    ACCEL_KEY,
    ACTIONS,
    BadRequest,
    Conflict,
    TaskState,
    task_conflict,
    validate_config,
    validate_name,
)
from vmready.hypervisor import (
    CURRENT_LAYOUT,
    BootSource,
    SerialLayout,
    check_guest_data,
    rotate_console,
)
from vmready.lifecycle.actionchecks import (
    DEFAULT_STOP_TIMEOUT,
    ActionChecks,
)
from vmready.lifecycle.actions import Actions
from vmready.lifecycle.agenthistory import AgentHistory
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.claims import Claims
from vmready.lifecycle.configuring import Configuring
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.guestlink import GuestReach
from vmready.lifecycle.guestside import GuestSide
from vmready.lifecycle.hooks import Hypervisor, Recording
from vmready.lifecycle.journal import Journal
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.operations import Operation, Operations
from vmready.lifecycle.powersync import PowerSync
from vmready.lifecycle.recovery import DEFAULT_SYNC_CONCURRENCY, Recovery
from vmready.lifecycle.renaming import Renaming
from vmready.lifecycle.running import RunningVMs
from vmready.lifecycle.settings import LaunchSettings
from vmready.lifecycle.snapshotting import Snapshotting
from vmready.lifecycle.specs import (
    InstanceSpecs,
)
from vmready.lifecycle.watching import Watching
from vmready.protocols.prometheus import MetricFamily
from vmready.store import AsyncStore, Store

_Part = TypeVar("_Part", bound=attrs.AttrsInstance)
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

    Its parts, each one concern with the collaborators it uses: ``guestside``
    (Ready, identities, config drives), ``watching`` (QMP events and agents),
    ``booting`` (starting QEMU), ``checks``, ``claims`` and ``actions``,
    ``snapshotting``, ``power_sync``, ``recovery`` (daemon start),
    ``configuring`` and ``renaming``.  What they share: the ``store``, the
    ``events``, the ``journal`` (history, state events), the ``running`` VMs,
    the instances' ``specs``, the guest API's ``reach`` and the session
    ``recording``.  What the daemon learns after construction it hands over
    explicitly: ``reach.listening(link)`` once the guest API listens,
    ``recording.use(recorders)``, ``booting.use_kvm_verdicts(verdicts)``.
    """

    log = Logger()
    # How long a stopping daemon lets its running operations end before it stops without them.
    stop_grace = 5.0

    def __init__(
        self,
        reactor: IReactorTime,
        store: AsyncStore | Store,
        driver: Hypervisor,
        events: EventBus,
        run_root: str,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        serial_layout: SerialLayout = CURRENT_LAYOUT,
        snapshot_root: str | None = None,
        settings: LaunchSettings | None = None,
        disk_root: str | None = None,
        sync_concurrency: int = DEFAULT_SYNC_CONCURRENCY,
    ) -> None:
        self.clock = reactor
        # A bare engine runs inline (tests, replays); the daemon hands a threaded store.
        self.store = store if isinstance(store, AsyncStore) else AsyncStore.inline(store)
        self.driver = driver
        self.events = events
        self.settings = settings or LaunchSettings()
        self.operations = Operations(reactor, events)
        # What happened since the daemon started, for ``GET /1.0/metrics``.
        self.metrics = LifecycleMetrics(reactor.seconds())
        # Each instance's recent agent-link changes, with why (``vmready info`` lists them).
        self.agent_history = AgentHistory()
        self.reach = GuestReach()
        self.recording = Recording()
        self.running = RunningVMs()
        self.specs = InstanceSpecs(run_root, self.reach, snapshot_root, disk_root)
        self.journal = self._part(Journal)
        self.claims = self._part(Claims)
        self.configuring = self._part(Configuring)
        kind = driver.kind
        self.guestside = self._part(GuestSide, driver_kind=kind)
        self.watching = self._part(Watching, reactor=reactor, driver_kind=kind)
        self.booting = self._part(Booting, serial_layout=serial_layout)
        self.snapshotting = self._part(Snapshotting)
        self.checks = self._part(ActionChecks, stop_timeout=stop_timeout)
        self.actions = self._part(Actions, stop_timeout=stop_timeout)
        self.power_sync = self._part(PowerSync, concurrency=sync_concurrency)
        self.recovery = self._part(Recovery, concurrency=sync_concurrency)
        self.renaming = self._part(Renaming)

    def _part(self, part: type[_Part], **own: Any) -> _Part:
        """``part`` built with ``own`` and, for each other field it declares, this lifecycle's.

        Each part names in its fields the collaborators it uses (and gets no
        other); those built before it are handed in, so parts are built in one
        direction: a part naming one not built yet fails here, at construction;
        that each one's type is the declared one, mypy cannot see here:
        ``tests/lifecycle/test_parts.py`` checks it.
        """
        wanted = (field.name for field in attrs.fields(part) if field.init)
        return part(**{name: getattr(self, name) for name in wanted if name not in own}, **own)

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
        if self.store.view.find_instance(name) is not None:
            raise Conflict(f"Instance {name} already exists")
        boot = BootSource.from_config(checked)
        if boot.empty and not self.settings.default_boot.empty:
            boot = self.settings.default_boot
            checked.update(boot.config())
        kvm_problem = self.booting.kvm_problem
        if checked.get(ACCEL_KEY) == "kvm" and kvm_problem is not None:
            raise BadRequest(f"Cannot launch {name} with {ACCEL_KEY}=kvm: {kvm_problem}")
        image = await self.booting.check_boot_source(boot)
        record = await self.store.instances.create_instance(name, checked, {}, instance_uuid)
        context = await self.journal.begin(name, "create", TaskState.SPAWNING)
        await self.guestside.issue_agent_identity(record)
        self.journal.publish_state(record)
        self.events.lifecycle("instance-created", name)

        async def work() -> None:
            build = self.booting.spawn if start else self.booting.build_stopped
            await self.actions.guarded(context, build(context, record, image))

        return self.operations.run(f"Creating instance {name}", name, work)

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
        prepared = self.checks.prepare(action, params)
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
            current = self.store.view.get_instance(name)
            if current.task_state is not None:
                raise task_conflict(action, name, current.task_state, current.vm_state)
            await self.checks.preflight(action, current, prepared)
        record, context = await self.claims.claim(name, action, spec.allowed_from, spec.tasks[0])
        recorder = self.recording.recorder_for(name)
        if recorder is not None:
            # Before the state it causes: an input of the session, replayed as such.
            recorder.operator_action(action, prepared)
        self.journal.publish_state(record)

        async def work() -> None:
            try:
                await self.actions.guarded(context, runner(context, record, **prepared))
            finally:
                release()

        operations = self.operations
        operation = operations.run(f"{action.capitalize()} instance {name}", name, work)
        context.report_to(lambda metadata: operations.report(operation, metadata))
        return operation

    def metric_families(self) -> list[MetricFamily]:
        """Every metric as it stands now: counters so far, gauges read from the store now.

        The instances this daemon runs (all, on a single host): a cluster's
        members are each scraped, and summing them counts each instance once.
        """
        return self.metrics.families(
            [record.operator_status.value for record in self.store.view.owned_instances()],
            [monitor.status for monitor in self.running.monitors.values()],
        )

    def rotate_consoles(self) -> None:
        """Keep every running VM's console log under its cap (called on a timer)."""
        for vm in list(self.running.vms.values()):
            try:
                if rotate_console(vm.spec.console_log, self.settings.console_max_bytes):
                    self.log.info("rotated the console log of {name}", name=vm.spec.name)
            except OSError as e:
                self.log.warn(
                    "cannot rotate the console log of {name}: {error}", name=vm.spec.name, error=e
                )

    def shutdown(self) -> Deferred[None]:
        """Daemon stopping (no request taken any more): let the running operations end, for
        ``stop_grace`` seconds at most, then let go of the VMs (they keep running)."""
        return Deferred.fromCoroutine(self._shutdown())

    async def _shutdown(self) -> None:
        self.recovery.stop()
        await self.operations.settle(self.stop_grace)
        self.operations.stop()
        detaching = []
        for name in list(self.running.vms):
            vm = self.running.vms[name]
            self.watching.detach(name, announce=False)
            detaching.append(vm.detach())
        await gatherResults(detaching)


def _nothing_to_release() -> None:
    """What an action that holds no snapshot releases when it ends."""
