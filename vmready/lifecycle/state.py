"""What every part of the lifecycle shares: the store, the driver, the running VMs, the views.

Also the config rules (names, config keys, memory and CPUs) and ``ActionContext``,
the record of one action's steps.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from vmready.agentlink.link import PollIntervals
from vmready.agentlink.monitor import AgentMonitor
from vmready.agentlink.transport import (
    CID_KEY,
    TRANSPORT_KEY,
    forward_mac,
)
from vmready.domain.model import (
    BadRequest,
    Conflict,
    HypervisorError,
    InstanceRecord,
    task_conflict,
)
from vmready.domain.states import ACTIONS, PowerState, TaskState, VMState, describe_state
from vmready.hypervisor.accel import (
    ACCEL_CHOICES,
    ACCEL_KEY,
    CURRENT_ACCEL_KEY,
    KVMVerdicts,
)
from vmready.hypervisor.bootfiles import check_files
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    CONSOLE_LOG_NAME,
    CURRENT_LAYOUT,
    LEGACY_PORT,
    SERIAL_LAYOUTS,
    UNRECORDED_LAYOUT,
    GuestForward,
    SerialLayout,
    VMSpec,
)
from vmready.hypervisor.configdrive import DriveContents
from vmready.hypervisor.console import (
    DEFAULT_CONSOLE_MAX_BYTES,
    read_console,
)
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.guestdata import check_guest_data
from vmready.hypervisor.imagetool import ImageInfo, ImageTool
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.agenthistory import AgentHistory
from vmready.lifecycle.events import EventBus, instance_state_context
from vmready.lifecycle.hooks import RECORD_KEY, RecorderLookup
from vmready.lifecycle.metrics import LifecycleMetrics
from vmready.lifecycle.operations import Operations
from vmready.lifecycle.unawaited import log_failed_write
from vmready.protocols.ringbuffer import AgentStatus
from vmready.store.asyncstore import AsyncStore
from vmready.store.sqlite import Store

DEFAULT_STOP_TIMEOUT = 30.0
MAX_STOP_TIMEOUT = 3600.0
MIN_MEMORY_MIB = 16
MAX_MEMORY_MIB = 1024 * 1024
MAX_CPUS = 64
_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9-]{0,62}")
_RUNNING_STATES = frozenset({VMState.ACTIVE, VMState.PAUSED, VMState.RESIZED})
_TASKS_RESOLVED_BY_A_RUNNING_VM = frozenset(
    {
        TaskState.SPAWNING,
        TaskState.POWERING_ON,
        TaskState.REBOOTING,
        TaskState.PAUSING,
        TaskState.UNPAUSING,
    }
)
_PREVIOUS_MEMORY = "volatile.resize.previous.memory"
_PREVIOUS_CPU = "volatile.resize.previous.cpu"
LAYOUT_KEY = "volatile.serial.layout"
_RESTORE_POLL_SECONDS = 0.05
RESTORE_TIMEOUT = 600.0
_USER_KEYS = re.compile(r"(limits\.memory|limits\.cpu|user\..+|cloud-init\..+|vmready\.record)")
# Set at launch, kept with the instance; a rebuild boots the same source afresh.
_LAUNCH_KEYS = re.compile(r"boot\.(image|kernel|initrd|append|accel)")
_SIGN_OF_LIFE_POLL = 0.25
DEFAULT_KVM_PROBE_TIMEOUT = 30.0


CONFIG_DRIVE = "config-drive"


@attrs.frozen
class GuestLink:
    """How guests reach the daemon's guest API, known once it listens."""

    port: int
    server_cert_pem: bytes
    # What an agent is told to dial in its config drive: "vsock" or "hvsock:<path>".
    transport: str
    intervals: PollIntervals = attrs.field(factory=PollIntervals)
    # The unix socket the forward transport's guestfwd reaches (None: no forward).
    forward_socket: str | None = None


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


def run_dir_name(instance_uuid: str) -> str:
    """An instance's run directory: 64 bits of its uuid, short enough for socket paths."""
    return instance_uuid.replace("-", "")[:16]


def validate_name(name: str) -> None:
    """Instance names as LXD allows them: a letter, then letters, digits, hyphens; 63 at most."""
    if not _NAME.fullmatch(name) or name.endswith("-"):
        raise BadRequest(
            f"Invalid instance name {name!r}: use 1-63 letters, digits and hyphens, "
            "starting with a letter and not ending with a hyphen"
        )


def validate_config(config: dict[str, Any]) -> dict[str, str]:
    """Check user-settable keys and values; returns them as strings."""
    checked: dict[str, str] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not (
            _USER_KEYS.fullmatch(key) or _LAUNCH_KEYS.fullmatch(key)
        ):
            raise BadRequest(
                f"Invalid config key {key!r}: allowed are limits.memory, limits.cpu, user.*, "
                "cloud-init.*, vmready.record, and at launch boot.image, boot.kernel, "
                "boot.initrd, boot.append, boot.accel"
            )
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise BadRequest(f"Invalid value for {key}: expected a string")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"Invalid config key {key!r}: not valid Unicode text") from None
        text = _config_text(value, f"Invalid value for {key}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"Invalid value for {key}: not valid Unicode text") from None
        checked[key] = text
    if checked.get(ACCEL_KEY, "auto") not in ACCEL_CHOICES:
        raise BadRequest(
            f"Invalid value for {ACCEL_KEY}: {checked[ACCEL_KEY]!r}: expected "
            f"{', '.join(ACCEL_CHOICES)}"
        )
    if checked.get(RECORD_KEY, "false") not in ("true", "false"):
        raise BadRequest(
            f"Invalid value for {RECORD_KEY}: {checked[RECORD_KEY]!r}: expected true or false"
        )
    if "limits.memory" in checked:
        checked["limits.memory"] = str(parse_memory(checked["limits.memory"]))
    if "limits.cpu" in checked:
        checked["limits.cpu"] = str(parse_cpus(checked["limits.cpu"]))
    return checked


def config_changes(config: dict[str, Any]) -> dict[str, str | None]:
    """A config update as store changes: values validated, ``None`` (remove) for known keys."""
    setting = {key: value for key, value in config.items() if value is not None}
    changes: dict[str, str | None] = dict(validate_config(setting))
    for key, value in config.items():
        if value is None:
            # Removing a key is allowed exactly when setting it is: check the key alone.
            validate_config({key: _REMOVAL_PROBE.get(key, "")})
            changes[key] = None
    return changes


_REMOVAL_PROBE = {"limits.memory": str(MIN_MEMORY_MIB), "limits.cpu": "1", RECORD_KEY: "false"}


def _config_text(value: str | int, problem: str) -> str:
    """A config value as text: a number is written out (BadRequest when it has too many digits)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"{problem}: a number with too many digits") from None


# More digits than any limit has: such a number is out of range, never converted.
_MAX_LIMIT_DIGITS = 12


def parse_memory(value: str | int) -> int:
    """limits.memory: MiB as a number, or with a MiB/GiB/MB/GB suffix; returns MiB.

    The number is ASCII digits (``\\d`` would take any script's digits).
    """
    text = _config_text(value, "Invalid limits.memory")
    match = re.fullmatch(r"\s*([0-9]+)\s*(MiB|GiB|MB|GB|M|G)?\s*", text)
    if match is None:
        raise BadRequest(f"Invalid limits.memory {text!r}: expected MiB, e.g. 512 or 2GiB")
    digits, unit = match.group(1).lstrip("0") or "0", match.group(2) or "MiB"
    number = int(digits) if len(digits) <= _MAX_LIMIT_DIGITS else MAX_MEMORY_MIB + 1
    mib = number * 1024 if unit in ("GiB", "GB", "G") else number
    if not MIN_MEMORY_MIB <= mib <= MAX_MEMORY_MIB:
        raise BadRequest(
            f"Invalid limits.memory {text!r}: must be {MIN_MEMORY_MIB} MiB to {MAX_MEMORY_MIB} MiB"
        )
    return mib


def parse_cpus(value: str | int) -> int:
    """limits.cpu: a count of vCPUs, in ASCII digits (``int()`` would take ``1_0`` or ``+1``)."""
    text = _config_text(value, "Invalid limits.cpu")
    digits = text.strip()
    if not re.fullmatch(r"-?[0-9]+", digits):
        raise BadRequest(f"Invalid limits.cpu {text!r}: expected a number of CPUs")
    cpus = int(digits) if len(digits.lstrip("-0")) <= _MAX_LIMIT_DIGITS else MAX_CPUS + 1
    if not 1 <= cpus <= MAX_CPUS:
        raise BadRequest(f"Invalid limits.cpu {text!r}: must be 1 to {MAX_CPUS}")
    return cpus


class ActionContext:
    """One running action: its history record, its task walk, its events.

    Begun with ``ActionContext.begin`` (its history record is written first).
    Every step that changes the instance waits for the store's commit before
    its event; history notes are written in order without waiting.
    """

    def __init__(
        self,
        lifecycle: LifecycleState,
        name: str,
        action: str,
        task: TaskState,
        action_id: int,
        step_id: int,
        started_at: float | None = None,
    ) -> None:
        self.lifecycle = lifecycle
        self.name = name
        self.action = action
        self.task = task
        self.action_id = action_id
        self._step_id = step_id
        # Whether the task was ended (finished, abandoned or failed): nothing more to do.
        self.ended = False
        # When it was claimed (its duration is counted once, by the first end it reaches).
        self.started_at = lifecycle.clock.seconds() if started_at is None else started_at
        self._counted = False
        # What the task reported for its operation's metadata, and where it goes (report_to).
        self._progress: dict[str, Any] | None = None
        self._report: Callable[[dict[str, Any]], None] | None = None

    @classmethod
    async def begin(
        cls, lifecycle: LifecycleState, name: str, action: str, task: TaskState
    ) -> ActionContext:
        """The action's history record and its first step, written before it does anything."""
        request_id = str(uuid.uuid4())
        started_at = lifecycle.clock.seconds()

        def start(engine: Store) -> tuple[int, int]:
            action_id = engine.actions.start_action(name, action, request_id)
            return action_id, engine.actions.start_step(action_id, task.value)

        action_id, step_id = await lifecycle.store.run(start)
        return cls(lifecycle, name, action, task, action_id, step_id, started_at)

    def _count(self, result: str) -> None:
        """The action ended with ``result``: counted and timed in the metrics, once."""
        if self._counted:
            return
        self._counted = True
        duration = self.lifecycle.clock.seconds() - self.started_at
        self.lifecycle.metrics.action_ended(self.action, result, duration)

    async def advance(self, task: TaskState) -> None:
        """Move to the next task_state: store CAS, history step, event."""
        store = self.lifecycle.store
        self._end_step("success")
        record = await store.instances.advance_task(self.name, self.task, task)
        self.task = task
        self._step_id = await store.actions.start_step(self.action_id, task.value)
        self.lifecycle.publish_state(record)

    def _end_step(self, result: str, error: str | None = None) -> None:
        """The current step ended; written in order, nobody waits for it."""
        store = self.lifecycle.store
        self.lifecycle.logged(
            store.actions.finish_step(self._step_id, result, error), "a history step"
        )

    def progress(self, metadata: dict[str, Any]) -> None:
        """Where the task is, for whoever follows its operation (the metadata of the operation)."""
        self._progress = metadata
        if self._report is not None:
            self._report(metadata)

    def report_to(self, report: Callable[[dict[str, Any]], None]) -> None:
        """Send progress to ``report`` (the operation), what was reported before it too."""
        self._report = report
        if self._progress is not None:
            report(self._progress)

    def note(self, step: str, result: str = "success", error: str | None = None) -> None:
        """Record an instantaneous step (e.g. a forced stop after a timeout), in order."""
        self.lifecycle.logged(
            self.lifecycle.store.actions.add_step(self.action_id, step, result, error),
            "a history step",
        )

    async def finish(
        self,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
        *,
        store_power: bool = True,
    ) -> InstanceRecord:
        """End the task where ``states.ACTIONS`` says the action ends, its VM in ``power_state``.

        ``store_power=False`` leaves the stored power state as it is (it only
        chooses the end state).
        """
        vm_state = ACTIONS[self.action].end_state(power_state)
        store = self.lifecycle.store
        self._end_step("success")
        record = await store.instances.finish_task(
            self.name, self.task, vm_state, power_state if store_power else None, config_updates
        )
        await store.actions.finish_action(self.action_id, "success")
        self.ended = True
        self._count("success")
        self.lifecycle.publish_state(record)
        return record

    async def abandon(
        self, vm_state: VMState, power_state: PowerState | None, reason: str
    ) -> None:
        """The action failed but left the instance as it was: back to ``vm_state``, no error.

        The failure is in the action history and the operation; the instance
        does not go to error (a failed snapshot of a VM that runs on, say).
        """
        store = self.lifecycle.store
        self._end_step("error", reason)
        record = await store.instances.finish_task(self.name, self.task, vm_state, power_state)
        await store.actions.finish_action(self.action_id, "error", reason)
        self.ended = True
        self._count("error")
        self.lifecycle.publish_state(record)

    async def complete(self) -> None:
        """Close the history record when the instance itself is about to go (delete)."""
        store = self.lifecycle.store
        self._end_step("success")
        await store.actions.finish_action(self.action_id, "success")
        self._count("success")

    async def fail(self, reason: str) -> None:
        """End the task in vm_state error with ``reason``; the error persists."""
        self.ended = True
        store = self.lifecycle.store
        self._end_step("error", reason)
        await store.actions.finish_action(self.action_id, "error", reason)
        self._count("error")
        if store.view.find_instance(self.name) is None:
            return
        record = await store.instances.set_error(self.name, reason, PowerState.NOSTATE)
        self.lifecycle.publish_state(record)
        self.lifecycle.events.lifecycle("instance-error", self.name, {"error": reason})


class LifecycleState:
    """The lifecycle's shared state and views, handed to each of its parts."""

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        store: AsyncStore,
        driver: HypervisorDriver,
        events: EventBus,
        run_root: str,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        serial_layout: SerialLayout = CURRENT_LAYOUT,
        snapshot_root: str | None = None,
        settings: LaunchSettings | None = None,
        disk_root: str | None = None,
    ) -> None:
        self.reactor = reactor
        self.clock: IReactorTime = reactor
        self.store = store
        self.driver = driver
        self.events = events
        self.operations = Operations(reactor, events)
        self.run_root = run_root
        self.stop_timeout = stop_timeout
        # The serial wiring new VMs get; a running VM keeps the one it was started with.
        self.serial_layout = serial_layout
        self.snapshot_root = snapshot_root or os.path.join(
            os.path.dirname(os.path.abspath(run_root)), "snapshots"
        )
        # Each instance's root-disk overlay lives here, named like its run directory.
        self.disk_root = disk_root or os.path.join(
            os.path.dirname(os.path.abspath(run_root)), "disks"
        )
        self.settings = settings or LaunchSettings()
        self.images = ImageTool(reactor)
        # Set by the daemon: the verdict on KVM for this host (None: never try KVM on trial).
        self.kvm: KVMVerdicts | None = None
        self.kvm_problem: str | None = "KVM is not probed by this lifecycle"
        self.vms: dict[str, RunningVM] = {}
        self.unsubscribe: dict[str, Callable[[], None]] = {}
        # Set by the daemon once the guest API listens; without it no agent is followed.
        self.guest: GuestLink | None = None
        self.monitors: dict[str, AgentMonitor] = {}
        # Set by the daemon when sessions may be recorded (``vmready.record.recording.Recorders``).
        self.recorders: RecorderLookup | None = None
        self.last_agent_status: dict[str, AgentStatus] = {}
        # Each instance's recent agent-link changes, with why (``vmready info`` lists them).
        self.agent_history = AgentHistory()
        # What happened since the daemon started, for ``GET /1.0/metrics``.
        self.metrics = LifecycleMetrics(reactor.seconds())

    def get(self, name: str) -> InstanceRecord:
        """The instance, or NotFound."""
        return self.store.view.get_instance(name)

    def list(self) -> list[InstanceRecord]:
        """Every instance."""
        return self.store.view.list_instances()

    def agent_status(self, name: str) -> AgentStatus:
        """What the instance's agent last said (``stopped`` once its VM is gone)."""
        monitor = self.monitors.get(name)
        if monitor is not None:
            return monitor.status
        return self.last_agent_status.get(name, AgentStatus.UNKNOWN)

    def console_log(self, name: str, limit: int) -> bytes:
        """The tail of the instance's console log (empty before its first boot)."""
        return read_console(self.console_log_path(self.store.view.get_instance(name)), limit)

    def console_log_path(self, record: InstanceRecord) -> str:
        """Where QEMU appends the instance's serial console (absent before its first boot)."""
        run_dir = os.path.join(os.path.abspath(self.run_root), run_dir_name(record.uuid))
        return os.path.join(run_dir, CONSOLE_LOG_NAME)

    def config_drive(self, record: InstanceRecord) -> str:
        """The directory handed to the guest as its config drive (certificates, agent.json)."""
        return os.path.join(self.run_root, run_dir_name(record.uuid), CONFIG_DRIVE)

    def disk_path(self, record: InstanceRecord) -> str | None:
        """The instance's root-disk overlay (None: it boots no image)."""
        if BootSource.from_config(record.config).image is None:
            return None
        return os.path.join(self.disk_root, run_dir_name(record.uuid) + ".qcow2")

    def layout_of(self, record: InstanceRecord) -> SerialLayout:
        """The serial layout the instance's VM was last started with.

        Never started by a vmready that records layouts: ``unrecorded``, the
        wiring every earlier vmready gave its VMs.
        """
        recorded = SERIAL_LAYOUTS.get(record.config.get(LAYOUT_KEY, ""))
        return recorded if recorded is not None else UNRECORDED_LAYOUT

    def spec_for(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        accel: str | None = None,
        transport: str | None = None,
    ) -> VMSpec:
        """The hypervisor's view of an instance, as its VM runs (or would start) now.

        The serial layout, accelerator and transport default to those the VM
        was last started with; a launch passes the ones it starts it with.
        """
        boot = BootSource.from_config(record.config)
        drive = self.config_drive(record)
        transport = transport or record.config.get(TRANSPORT_KEY, "hvsock")
        cid = record.config.get(CID_KEY)
        guest = self.guest
        forward = None
        if transport == "forward" and guest is not None and guest.forward_socket is not None:
            forward = GuestForward(guest.forward_socket, forward_mac(record.uuid))
        return VMSpec(
            name=record.name,
            uuid=record.uuid,
            memory_mib=record.memory_mib,
            cpus=record.cpus,
            run_dir=os.path.join(self.run_root, run_dir_name(record.uuid)),
            serial_ports=(layout or self.layout_of(record)).ports,
            accel=accel or record.config.get(CURRENT_ACCEL_KEY, "tcg"),
            config_drive=drive if os.path.isdir(drive) else None,
            disk=self.disk_path(record),
            kernel=boot.kernel,
            initrd=boot.initrd,
            append=boot.append,
            vsock_cid=int(cid) if transport == "vsock" and cid is not None else None,
            forward=forward,
        )

    async def update_config(self, name: str, config: dict[str, Any]) -> InstanceRecord:
        """Set user-settable keys (``None`` removes one); limits change only through resize."""
        changes = config_changes(config)
        launch_keys = sorted(key for key in changes if _LAUNCH_KEYS.fullmatch(key))
        if launch_keys:
            raise BadRequest(
                f"Cannot change {launch_keys[0]} of instance {name}: the boot source and "
                "accelerator are chosen at launch (launch a new instance to boot another)"
            )
        record = self.store.view.get_instance(name)
        if record.task_state is not None:
            raise task_conflict("update", name, record.task_state, record.vm_state)
        after = {**record.config, **changes}
        check_guest_data({key: value for key, value in after.items() if value is not None})
        limits = sorted(key for key in changes if key.startswith("limits."))
        if limits and record.vm_state in _RUNNING_STATES:
            # The VM would keep its old size while the config claimed the new one.
            raise Conflict(
                f"Cannot change {limits[0]} of instance {name} while it is "
                f"{describe_state(record.vm_state, None)}: use the resize action"
            )
        updated = await self.store.instances.update_config(name, changes)
        self.events.lifecycle("instance-updated", name, {"config": changes})
        return updated

    def publish_state(self, record: InstanceRecord) -> None:
        """An ``instance-state`` event with everything a watcher needs to show the instance."""
        self.events.lifecycle("instance-state", record.name, instance_state_context(record))

    async def check_boot_source(self, boot: BootSource) -> ImageInfo | None:
        """Check what an instance would boot; the image's description, or BadRequest."""
        check_files(boot, self.disk_root)
        if boot.image is None:
            return None
        return await self.images.info(boot.image)

    def has_vm(self, name: str) -> bool:
        vm = self.vms.get(name)
        return vm is not None and not vm.gone

    def vm(self, name: str) -> RunningVM:
        vm = self.vms.get(name)
        if vm is None or vm.gone:
            raise HypervisorError(f"Instance {name} has no running VM")
        return vm

    def history(self, name: str, action: str, detail: str, ok: bool = True) -> None:
        """A one-step action in the history, for things that happen outside an action.

        Written in order with every other call, without waiting: history
        announces nothing.
        """
        request_id = str(uuid.uuid4())

        def write(engine: Store) -> None:
            action_id = engine.actions.start_action(name, action, request_id)
            if ok:
                # A success has no error: the reason goes in the step's name.
                engine.actions.add_step(action_id, f"{action}: {detail}", "success")
                engine.actions.finish_action(action_id, "success")
            else:
                engine.actions.add_step(action_id, action, "error", detail)
                engine.actions.finish_action(action_id, "error", detail)

        self.logged(self.store.run(write), "the action history")

    def logged(self, written: Deferred[Any], what: str) -> None:
        """A write nobody waits for: its failure is logged (``log_failed_write``), not lost."""
        written.addErrback(log_failed_write, self.log, what)


def agent_chardev(spec: VMSpec) -> str | None:
    """The ring buffer the VM's agent writes to: the one wired to its agent port, new or old."""
    for wanted in (AGENT_PORT, LEGACY_PORT):
        for port in spec.serial_ports:
            if port.name == wanted and port.chardev is not None:
                return port.chardev
    return None


def agent_port_name(spec: VMSpec) -> str | None:
    """The name of the port wired to the agent's ring buffer (the agent tries it first)."""
    for wanted in (AGENT_PORT, LEGACY_PORT):
        for port in spec.serial_ports:
            if port.name == wanted and port.chardev is not None:
                return port.name
    return None


def fakeqemu_guest_paths(spec: VMSpec) -> dict[str, str]:
    """Where a fakeqemu guest's agent finds its ports, serves its socket, keeps its tmpfs."""
    guest_root = os.path.join(spec.run_dir, "guest")
    return {
        "virtio_ports": os.path.join(spec.guest_dir, "virtio-ports"),
        "tcp_sockets": os.path.join(spec.guest_dir, "tcp"),
        "devlxd_socket": os.path.join(guest_root, "lxd.sock"),
        "state_dir": os.path.join(guest_root, "run"),
    }


def _snapshotted(key: str) -> bool:
    """The config a snapshot keeps and a restore brings back: what users set."""
    return _USER_KEYS.fullmatch(key) is not None


def _restored_config(current: dict[str, str], metadata: dict[str, Any]) -> dict[str, str]:
    """The config after restoring: the snapshot's user keys, the current volatile ones."""
    kept = {key: value for key, value in current.items() if not _snapshotted(key)}
    saved = metadata.get("config") or {}
    return {**kept, **{str(k): str(v) for k, v in saved.items() if _snapshotted(str(k))}}


def _config_updates(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """The store updates that turn ``before`` into ``after``."""
    updates: dict[str, str | None] = {key: None for key in before if key not in after}
    updates.update({key: value for key, value in after.items() if before.get(key) != value})
    return updates
