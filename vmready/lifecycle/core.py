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

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from vmready.agentlink.connectport import ConnectPort
from vmready.agentlink.link import AgentLink, PollIntervals, StatusChanged
from vmready.agentlink.monitor import AgentMonitor
from vmready.agentlink.transport import (
    CID_KEY,
    FORWARD_GUEST_NETWORK_ADDRESS,
    TRANSPORT_KEY,
    allocate_cid,
    connect_line,
    forward_mac,
)
from vmready.domain.model import (
    BadRequest,
    Conflict,
    HypervisorError,
    InstanceRecord,
    NotFound,
    VMReadyError,
    task_conflict,
)
from vmready.domain.states import ACTIONS, READY_KEY, PowerState, TaskState, VMState
from vmready.hypervisor.accel import (
    ACCEL_CHOICES,
    ACCEL_KEY,
    ACCEL_REASON_KEY,
    CURRENT_ACCEL_KEY,
    AccelChoice,
    KVMVerdicts,
    choose_accel,
)
from vmready.hypervisor.bootsource import BootSource, ImageInfo, ImageTool, check_files
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    CONSOLE_LOG_NAME,
    CURRENT_LAYOUT,
    LEGACY_PORT,
    SERIAL_LAYOUTS,
    UNRECORDED_LAYOUT,
    GuestForward,
    SerialLayout,
)
from vmready.hypervisor.configdrive import (
    AGENT_CONFIG,
    USER_DATA_KEY,
    DriveContents,
    write_identity,
    write_settings,
)
from vmready.hypervisor.console import (
    DEFAULT_CONSOLE_MAX_BYTES,
    console_size,
    mark_boot,
    read_console,
    rotate_console,
)
from vmready.hypervisor.driver import (
    HypervisorDriver,
    RunningVM,
    VMEvent,
    VMEventKind,
    VMSpec,
    read_log_lines,
)
from vmready.hypervisor.snapshots import (
    STATE_FILE,
    describe_layout,
    remove_instance_snapshots,
    snapshot_directory,
    state_mismatch,
    validate_snapshot_name,
    write_metadata,
)
from vmready.lifecycle.events import EventBus
from vmready.lifecycle.hooks import RECORD_KEY, RecorderLookup
from vmready.lifecycle.operations import Operation, Operations
from vmready.protocols.qmp import QMPEvent
from vmready.protocols.ringbuffer import AgentStatus
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair, generate, write_private

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
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"Invalid value for {key}: not valid Unicode text") from None
        checked[key] = str(value)
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


def parse_memory(value: str) -> int:
    """limits.memory: MiB as a number, or with a MiB/GiB/MB/GB suffix; returns MiB."""
    match = re.fullmatch(r"\s*(\d+)\s*(MiB|GiB|MB|GB|M|G)?\s*", str(value))
    if match is None:
        raise BadRequest(f"Invalid limits.memory {value!r}: expected MiB, e.g. 512 or 2GiB")
    number, unit = int(match.group(1)), match.group(2) or "MiB"
    mib = number * 1024 if unit in ("GiB", "GB", "G") else number
    if not MIN_MEMORY_MIB <= mib <= MAX_MEMORY_MIB:
        raise BadRequest(
            f"Invalid limits.memory {value!r}: "
            f"must be {MIN_MEMORY_MIB} MiB to {MAX_MEMORY_MIB} MiB"
        )
    return mib


def parse_cpus(value: str) -> int:
    """limits.cpu: a count of vCPUs."""
    try:
        cpus = int(str(value).strip())
    except ValueError:
        raise BadRequest(f"Invalid limits.cpu {value!r}: expected a number of CPUs") from None
    if not 1 <= cpus <= MAX_CPUS:
        raise BadRequest(f"Invalid limits.cpu {value!r}: must be 1 to {MAX_CPUS}")
    return cpus


class ActionContext:
    """One running action: its history record, its task walk, its events."""

    def __init__(self, lifecycle: Lifecycle, name: str, action: str, task: TaskState) -> None:
        self.lifecycle = lifecycle
        self.name = name
        self.action = action
        self.task = task
        store = lifecycle.store
        self.action_id = store.start_action(name, action, str(uuid.uuid4()))
        self._step_id = store.start_step(self.action_id, task.value)
        # Whether the task was ended (finished, abandoned or failed): nothing more to do.
        self.ended = False

    def advance(self, task: TaskState) -> None:
        """Move to the next task_state: store CAS, history step, event."""
        store = self.lifecycle.store
        store.finish_step(self._step_id, "success")
        record = store.advance_task(self.name, self.task, task)
        self.task = task
        self._step_id = store.start_step(self.action_id, task.value)
        self.lifecycle.publish_state(record)

    def note(self, step: str, result: str = "success", error: str | None = None) -> None:
        """Record an instantaneous step (e.g. a forced stop after a timeout)."""
        self.lifecycle.store.add_step(self.action_id, step, result, error)

    def finish(
        self,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord:
        """End the task in ``vm_state``."""
        store = self.lifecycle.store
        store.finish_step(self._step_id, "success")
        record = store.finish_task(self.name, self.task, vm_state, power_state, config_updates)
        store.finish_action(self.action_id, "success")
        self.ended = True
        self.lifecycle.publish_state(record)
        return record

    def abandon(self, vm_state: VMState, power_state: PowerState | None, reason: str) -> None:
        """The action failed but left the instance as it was: back to ``vm_state``, no error.

        The failure is in the action history and the operation; the instance
        does not go to error (a failed snapshot of a VM that runs on, say).
        """
        store = self.lifecycle.store
        store.finish_step(self._step_id, "error", reason)
        record = store.finish_task(self.name, self.task, vm_state, power_state)
        store.finish_action(self.action_id, "error", reason)
        self.ended = True
        self.lifecycle.publish_state(record)

    def complete(self) -> None:
        """Close the history record when the instance itself is about to go (delete)."""
        store = self.lifecycle.store
        store.finish_step(self._step_id, "success")
        store.finish_action(self.action_id, "success")

    def fail(self, reason: str) -> None:
        """End the task in vm_state error with ``reason``; the error persists."""
        self.ended = True
        store = self.lifecycle.store
        store.finish_step(self._step_id, "error", reason)
        store.finish_action(self.action_id, "error", reason)
        if store.find_instance(self.name) is None:
            return
        record = store.set_error(self.name, reason, PowerState.NOSTATE)
        self.lifecycle.publish_state(record)
        self.lifecycle.events.lifecycle("instance-error", self.name, {"error": reason})


class Lifecycle:
    """Runs actions on instances against a store and a hypervisor driver."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        store: Store,
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
        self._unsubscribe: dict[str, Callable[[], None]] = {}
        # Set by the daemon once the guest API listens; without it no agent is followed.
        self.guest: GuestLink | None = None
        self.monitors: dict[str, AgentMonitor] = {}
        # Set by the daemon when sessions may be recorded (``vmready.record.recording.Recorders``).
        self.recorders: RecorderLookup | None = None
        self._last_agent_status: dict[str, AgentStatus] = {}

    # -- views ------------------------------------------------------------

    def get(self, name: str) -> InstanceRecord:
        """The instance, or NotFound."""
        return self.store.get_instance(name)

    def list(self) -> list[InstanceRecord]:
        """Every instance."""
        return self.store.list_instances()

    def agent_status(self, name: str) -> AgentStatus:
        """What the instance's agent last said (``stopped`` once its VM is gone)."""
        monitor = self.monitors.get(name)
        if monitor is not None:
            return monitor.status
        return self._last_agent_status.get(name, AgentStatus.UNKNOWN)

    def console_log(self, name: str, limit: int) -> bytes:
        """The tail of the instance's console log (empty before its first boot)."""
        record = self.store.get_instance(name)
        run_dir = os.path.join(self.run_root, run_dir_name(record.uuid))
        return read_console(os.path.join(run_dir, CONSOLE_LOG_NAME), limit)

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

    def update_config(self, name: str, config: dict[str, Any]) -> InstanceRecord:
        """Set user-settable keys (``None`` removes one); limits change only through resize."""
        changes = config_changes(config)
        launch_keys = sorted(key for key in changes if _LAUNCH_KEYS.fullmatch(key))
        if launch_keys:
            raise BadRequest(
                f"Cannot change {launch_keys[0]} of instance {name}: the boot source and "
                "accelerator are chosen at launch (launch a new instance to boot another)"
            )
        record = self.store.get_instance(name)
        if record.task_state is not None:
            raise task_conflict("update", name, record.task_state.value, record.vm_state.value)
        limits = sorted(key for key in changes if key.startswith("limits."))
        if limits and record.vm_state in _RUNNING_STATES:
            # The VM would keep its old size while the config claimed the new one.
            raise Conflict(
                f"Cannot change {limits[0]} of instance {name} while it is "
                f"{record.vm_state.value}: use the resize action"
            )
        updated = self.store.update_config(name, changes)
        self.events.lifecycle("instance-updated", name, {"config": changes})
        return updated

    def set_ready(self, name: str, ready: bool) -> InstanceRecord:
        """The guest's workload declared itself Ready (or withdrew it: Started).

        Ready sets ``volatile.last_state.ready`` to "true" and emits
        ``instance-ready`` every time; Started sets "false" with no event.  An
        instance without a running VM cannot be ready: Conflict.
        """
        record = self.store.get_instance(name)
        if not self._has_vm(name):
            raise Conflict(f"Instance {name} is not running")
        if record.ready != ready or READY_KEY not in record.config:
            record = self.store.update_config(name, {READY_KEY: "true" if ready else "false"})
            self.publish_state(record)
        if ready:
            self.events.lifecycle("instance-ready", name)
        return record

    def issue_agent_identity(self, record: InstanceRecord) -> CertificatePair | None:
        """A fresh client certificate for the instance's agent, and its config drive.

        The store keeps only the fingerprint: whoever presents this certificate
        is this instance, and nothing else is.  Without a guest API (no
        ``guest``) there is nothing to issue.
        """
        guest = self.guest
        if guest is None:
            return None
        pair = generate(f"vmready-agent-{record.name}")
        self.store.set_agent_certificate(record.name, pair.fingerprint)
        write_identity(self.config_drive(record), pair, guest.server_cert_pem)
        self.refresh_config_drive(record)
        return pair

    def refresh_config_drive(
        self,
        record: InstanceRecord,
        layout: SerialLayout | None = None,
        transport: str | None = None,
    ) -> None:
        """Write the drive's settings, agent, loader and cloud-init files for the next boot."""
        guest = self.guest
        if guest is None:
            return
        transport = transport or record.config.get(TRANSPORT_KEY, self.settings.transport)
        spec = self.spec_for(record, layout=layout, transport=transport)
        wired = agent_port_name(spec)
        # A real guest dials vsock (a forward CONNECT names its own address); a fakeqemu
        # guest, a host process, dials the daemon's hybrid vsock sockets.
        dial = guest.transport if self.driver.kind == "fakeqemu" else "vsock"
        settings: dict[str, str] = {"instance": record.name, "transport": dial}
        if wired is not None:
            settings["port"] = wired
        if transport == "forward":
            settings["network_mac"] = forward_mac(record.uuid)
            settings["network_address"] = FORWARD_GUEST_NETWORK_ADDRESS
        if self.driver.kind == "fakeqemu":
            # A fakeqemu guest is a host process: its devices are sockets in the run dir.
            settings.update(fakeqemu_guest_paths(spec))
        write_settings(
            self.config_drive(record),
            settings,
            self.settings.drive,
            record.uuid,
            record.name,
            record.config.get(USER_DATA_KEY, ""),
            record.config.get("user.meta-data", ""),
        )

    def ensure_agent_identities(self) -> int:
        """Issue certificates to instances that have none (created before the guest API).

        A config drive whose ``server.crt`` is not the daemon's (the operator
        issued a new pair) gets the new one, so its agent can pin it again.
        """
        issued = 0
        for record in self.store.list_instances():
            drive = self.config_drive(record)
            self._refresh_pinned_certificate(record, drive)
            missing = not os.path.exists(os.path.join(drive, AGENT_CONFIG))
            if missing and self.issue_agent_identity(record) is not None:
                issued += 1
        return issued

    def _refresh_pinned_certificate(self, record: InstanceRecord, drive: str) -> None:
        guest = self.guest
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

    def publish_state(self, record: InstanceRecord) -> None:
        """An ``instance-state`` event with everything a watcher needs to show the instance."""
        self.events.lifecycle(
            "instance-state",
            record.name,
            {
                "status": record.status.name,
                "status_code": int(record.status.code),
                "display_status": record.display_status,
                "vm_state": record.vm_state.value,
                "task_state": record.task_state.value if record.task_state else None,
                "power_state": record.power_state.value,
                "error": record.error or "",
            },
        )

    # -- actions ----------------------------------------------------------

    async def create(
        self, name: str, config: dict[str, Any], instance_uuid: str | None = None
    ) -> Operation:
        """Create and boot an instance: BUILD → ACTIVE (or ERROR with the reason).

        The boot source (the daemon's default when the config names none) is
        checked first: a file that cannot boot is a 400 before any instance,
        overlay or process exists.
        """
        validate_name(name)
        checked = validate_config(config)
        if self.store.find_instance(name) is not None:
            raise Conflict(f"Instance {name} already exists")
        boot = BootSource.from_config(checked)
        if boot.empty and not self.settings.default_boot.empty:
            boot = self.settings.default_boot
            checked.update(boot.config())
        if checked.get(ACCEL_KEY) == "kvm" and self.kvm_problem is not None:
            raise BadRequest(f"Cannot launch {name} with {ACCEL_KEY}=kvm: {self.kvm_problem}")
        image = await self.check_boot_source(boot)
        record = self.store.create_instance(name, checked, {}, instance_uuid)
        context = ActionContext(self, name, "create", TaskState.SPAWNING)
        self.issue_agent_identity(record)
        self.publish_state(record)
        self.events.lifecycle("instance-created", name)

        async def work() -> None:
            await self._guarded(context, self._spawn(context, record, image))

        return self.operations.run(f"Creating instance {name}", name, work)

    async def check_boot_source(self, boot: BootSource) -> ImageInfo | None:
        """Check what an instance would boot; the image's description, or BadRequest."""
        check_files(boot, self.disk_root)
        if boot.image is None:
            return None
        return await self.images.info(boot.image)

    async def _spawn(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        await self._make_disk(context, record, image)
        await self._launch(record)
        context.finish(VMState.ACTIVE, PowerState.RUNNING)
        self.events.lifecycle("instance-started", record.name)

    async def _make_disk(
        self, context: ActionContext, record: InstanceRecord, image: ImageInfo | None
    ) -> None:
        """A fresh overlay on the instance's image (its old one, if any, is replaced)."""
        disk = self.disk_path(record)
        if image is None or disk is None:
            return
        await self.images.create_overlay(image, disk)
        context.note(f"made the root disk {disk} on {image.describe()}")

    def act(self, name: str, action: str, **params: Any) -> Operation:
        """Run a named action; a 409 is raised here, synchronously, if it cannot start."""
        spec = ACTIONS.get(action)
        if spec is None or action == "create":
            raise BadRequest(f"Unknown action {action!r}")
        runner = getattr(self, "_do_" + action.replace("-", "_"))
        prepared = self._prepare(action, params)
        if action in ("snapshot", "restore"):
            current = self.store.get_instance(name)
            if current.task_state is not None:
                raise task_conflict(action, name, current.task_state.value, current.vm_state.value)
            self._preflight(action, current, prepared)
        record = self.store.claim_task(name, action, spec.allowed_from, spec.tasks[0])
        context = ActionContext(self, name, action, spec.tasks[0])
        recorder = self.recorders.recorder_for(name) if self.recorders is not None else None
        if recorder is not None:
            # Before the state it causes: an input of the session, replayed as such.
            recorder.operator_action(action, prepared)
        self.publish_state(record)

        async def work() -> None:
            await self._guarded(context, runner(context, record, **prepared))

        return self.operations.run(f"{action.capitalize()} instance {name}", name, work)

    def _prepare(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Validate an action's parameters before anything is claimed."""
        if action in ("stop", "restart"):
            timeout = params.get("timeout", self.stop_timeout)
            if (
                not isinstance(timeout, int | float)
                or isinstance(timeout, bool)
                # also refuses nan, inf and integers too large for a float
                or not 0 <= timeout <= MAX_STOP_TIMEOUT
            ):
                raise BadRequest(
                    f"Invalid timeout {timeout!r}: expected seconds from 0 to {MAX_STOP_TIMEOUT:g}"
                )
            force = params.get("force", False)
            if not isinstance(force, bool):
                raise BadRequest(f"Invalid force {force!r}: expected true or false")
            return {"timeout": float(timeout), "force": force}
        if action == "resize":
            memory = params.get("memory")
            cpus = params.get("cpus")
            if memory is None and cpus is None:
                raise BadRequest("resize needs memory and/or cpus")
            return {
                "memory": parse_memory(str(memory)) if memory is not None else None,
                "cpus": parse_cpus(str(cpus)) if cpus is not None else None,
            }
        if action in ("snapshot", "restore"):
            allowed = {"snapshot", "stateful"} | ({"force"} if action == "restore" else set())
            unexpected = sorted(set(params) - allowed)
            if unexpected:
                raise BadRequest(f"Unexpected parameters for {action}: {', '.join(unexpected)}")
            prepared: dict[str, Any] = {"snapshot": validate_snapshot_name(params.get("snapshot"))}
            for flag in sorted(allowed - {"snapshot"}):
                value = params.get(flag, False)
                if not isinstance(value, bool):
                    raise BadRequest(f"Invalid {flag} {value!r}: expected true or false")
                prepared[flag] = value
            if prepared.get("force") and not prepared["stateful"]:
                raise BadRequest("force applies to a stateful restore only: add stateful")
            return prepared
        unexpected = sorted(params)
        if unexpected:
            raise BadRequest(f"Unexpected parameters for {action}: {', '.join(unexpected)}")
        return {}

    def _preflight(self, action: str, record: InstanceRecord, params: dict[str, Any]) -> None:
        """What can be known before a snapshot or restore touches anything: refuse it now."""
        name = params["snapshot"]
        if self.disk_path(record) is not None:
            # A snapshot keeps config (and memory); without the disk's contents its restore
            # would pair a guest with a disk it never wrote: refuse rather than corrupt.
            raise BadRequest(
                f"Cannot {action} instance {record.name}: snapshots of instances that boot a "
                "disk image do not capture the disk yet"
            )
        if action == "snapshot":
            if self.store.find_snapshot(record.name, name) is not None:
                raise Conflict(f"Snapshot {name} of instance {record.name} already exists")
            if params["stateful"] and (
                record.vm_state is not VMState.ACTIVE or not self._has_vm(record.name)
            ):
                raise Conflict(
                    f"Cannot take a stateful snapshot of instance {record.name}: it is not "
                    "running (a stateful snapshot saves the running VM's memory)"
                )
            return
        snapshot = self.store.find_snapshot(record.name, name)
        if snapshot is None:
            raise NotFound(f"Snapshot {name} of instance {record.name} not found")
        if not params["stateful"]:
            return
        if not snapshot["stateful"]:
            raise BadRequest(
                f"Snapshot {name} of instance {record.name} is stateless: it has no VM state "
                "to restore; restore it without --stateful"
            )
        metadata = snapshot["metadata"]
        directory = snapshot_directory(self.snapshot_root, run_dir_name(record.uuid), name)
        if not os.path.isfile(os.path.join(directory, STATE_FILE)):
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: "
                f"its state file {os.path.join(directory, STATE_FILE)} is missing"
            )
        target = self._restored_record(record, metadata)
        saved = metadata.get("device_set", {})
        accel = saved.get("accel") if saved.get("accel") in ("kvm", "tcg") else None
        mismatch = state_mismatch(saved, self._launch_spec(target, accel))
        if mismatch is not None and not params["force"]:
            raise Conflict(
                f"Cannot restore the state of snapshot {name} of instance {record.name}: it "
                f"was saved with serial layout {describe_layout(metadata.get('layout'))} and "
                f"the VM would now start with layout {describe_layout(self.serial_layout.name)}"
                f" ({mismatch}); QEMU cannot load a state into a different device set. "
                f"Restore without --stateful to get the snapshot's config back and boot "
                f"afresh, or add --force to let QEMU try anyway."
            )

    async def _guarded(self, context: ActionContext, work: Awaitable[None]) -> None:
        """Run an action's body; any failure ends the task in error with its reason."""
        try:
            await work
        except VMReadyError as e:
            if not context.ended:
                context.fail(e.message)
            raise
        except Exception as e:
            self.log.failure(
                "action {action} on {name} failed", action=context.action, name=context.name
            )
            if not context.ended:
                context.fail(f"internal error: {e}")
            raise

    async def _do_start(self, context: ActionContext, record: InstanceRecord) -> None:
        leaving_error = record.vm_state is VMState.ERROR
        if leaving_error and self._has_vm(record.name):
            # In error, but its VM still runs and is followed: keep it, do not replace it.
            context.note("kept the VM that was still running")
            power = await self._vm(record.name).query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            context.finish(vm_state, power)
            self.events.lifecycle("instance-started", record.name)
            return
        if (
            leaving_error
            and not self._has_vm(record.name)
            and await self._take_over_running_vm(context, record)
        ):
            power = await self._vm(record.name).query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            context.finish(vm_state, power)
        else:
            # A stray VM of a stopped instance may run an old configuration: replace it.
            if await self.driver.kill_owned(self.spec_for(record)):
                context.note("killed a stray VM before starting")
            await self._launch(record)
            context.finish(VMState.ACTIVE, PowerState.RUNNING)
        self.events.lifecycle("instance-started", record.name)

    async def _take_over_running_vm(self, context: ActionContext, record: InstanceRecord) -> bool:
        """Before starting: a VM that still runs (an instance left in error) is adopted."""
        spec = self.spec_for(record)
        try:
            adopted = await self.driver.adopt(spec)
        except HypervisorError as e:
            await self.driver.kill_owned(spec)
            context.note(f"killed a VM whose monitor did not answer: {e.message}")
            return False
        if adopted is None:
            return False
        self._attach(record.name, adopted, advertise=True)
        context.note("adopted the VM that was still running")
        return True

    async def _do_stop(
        self, context: ActionContext, record: InstanceRecord, timeout: float, force: bool
    ) -> None:
        await self._power_off(context, record.name, timeout, force)
        context.finish(VMState.STOPPED, PowerState.SHUTDOWN, {READY_KEY: "false"})
        self.events.lifecycle("instance-stopped", record.name)

    async def _do_restart(
        self, context: ActionContext, record: InstanceRecord, timeout: float, force: bool
    ) -> None:
        await self._power_off(context, record.name, timeout, force)
        self.store.update_config(record.name, {READY_KEY: "false"})
        await self._launch(self.store.get_instance(record.name))
        context.finish(VMState.ACTIVE, PowerState.RUNNING)
        self.events.lifecycle("instance-restarted", record.name)

    async def _do_freeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self._vm(record.name).pause()
        context.finish(VMState.PAUSED, PowerState.PAUSED)
        self.events.lifecycle("instance-paused", record.name)

    async def _do_unfreeze(self, context: ActionContext, record: InstanceRecord) -> None:
        await self._vm(record.name).resume()
        context.finish(VMState.ACTIVE, PowerState.RUNNING)
        self.events.lifecycle("instance-resumed", record.name)

    async def _do_rebuild(self, context: ActionContext, record: InstanceRecord) -> None:
        await self._power_off(context, record.name, 0, force=True)
        record = self.store.update_config(record.name, {READY_KEY: "false"})
        boot = BootSource.from_config(record.config)
        if boot.image is not None:
            # The image may have changed or gone since launch: check it again.
            await self._make_disk(context, record, await self.check_boot_source(boot))
        await self._launch(record)
        context.finish(VMState.ACTIVE, PowerState.RUNNING)
        self.events.lifecycle("instance-rebuilt", record.name)

    async def _do_resize(
        self,
        context: ActionContext,
        record: InstanceRecord,
        memory: int | None,
        cpus: int | None,
    ) -> None:
        context.advance(TaskState.RESIZE_PREP)
        updates: dict[str, str | None] = {
            _PREVIOUS_MEMORY: str(record.memory_mib),
            _PREVIOUS_CPU: str(record.cpus),
            "limits.memory": str(memory if memory is not None else record.memory_mib),
            "limits.cpu": str(cpus if cpus is not None else record.cpus),
        }
        was_running = self._has_vm(record.name)
        context.advance(TaskState.RESIZE_MIGRATING)
        resized = await self._relaunch_with(context, record.name, updates, was_running)
        context.advance(TaskState.RESIZE_FINISH)
        power = PowerState.RUNNING if was_running else PowerState.SHUTDOWN
        context.finish(VMState.RESIZED, power)
        self.events.lifecycle(
            "instance-resized",
            record.name,
            {"memory_mib": resized.memory_mib, "cpus": resized.cpus},
        )

    async def _do_confirm_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        running = self._has_vm(record.name)
        context.finish(
            VMState.ACTIVE if running else VMState.STOPPED,
            config_updates={_PREVIOUS_MEMORY: None, _PREVIOUS_CPU: None},
        )
        self.events.lifecycle("instance-resize-confirmed", record.name)

    async def _do_revert_resize(self, context: ActionContext, record: InstanceRecord) -> None:
        updates: dict[str, str | None] = {
            "limits.memory": record.config.get(_PREVIOUS_MEMORY, str(record.memory_mib)),
            "limits.cpu": record.config.get(_PREVIOUS_CPU, str(record.cpus)),
            _PREVIOUS_MEMORY: None,
            _PREVIOUS_CPU: None,
        }
        was_running = self._has_vm(record.name)
        await self._relaunch_with(context, record.name, updates, was_running)
        if was_running:
            context.finish(VMState.ACTIVE, PowerState.RUNNING)
        else:
            context.finish(VMState.STOPPED, PowerState.SHUTDOWN)
        self.events.lifecycle("instance-resize-reverted", record.name)

    def _launch_spec(self, record: InstanceRecord, accel: str | None = None) -> dict[str, Any]:
        """The device set the VM would have if it started now (under ``accel``, if given)."""
        spec = self.spec_for(record, self.serial_layout, accel, self.settings.transport)
        if spec.config_drive is None and self.guest is not None:
            # Every VM a daemon with a guest API starts gets its drive (made at launch).
            spec = attrs.evolve(spec, config_drive=self.config_drive(record))
        return spec.device_set()

    def _restored_record(self, record: InstanceRecord, metadata: dict[str, Any]) -> InstanceRecord:
        """The instance as it will be once the snapshot's config is back (not stored)."""
        return attrs.evolve(record, config=_restored_config(record.config, metadata))

    async def _do_snapshot(
        self, context: ActionContext, record: InstanceRecord, snapshot: str, stateful: bool
    ) -> None:
        name = snapshot
        directory = snapshot_directory(self.snapshot_root, run_dir_name(record.uuid), name)
        running = self._has_vm(record.name)
        spec = self.spec_for(record)
        metadata: dict[str, Any] = {
            "config": {key: value for key, value in record.config.items() if _snapshotted(key)},
            "layout": self.layout_of(record).name,
            "device_set": spec.device_set(),
            "state": STATE_FILE if stateful else None,
        }
        shutil.rmtree(directory, ignore_errors=True)  # a leftover of a snapshot that failed
        os.makedirs(directory, mode=0o700)
        try:
            if stateful:
                vm = self._vm(record.name)
                try:
                    await vm.migrate_to_file(os.path.join(directory, STATE_FILE))
                finally:
                    if not vm.gone:
                        await vm.resume()
            write_metadata(directory, metadata)
            self.store.create_snapshot(record.name, name, stateful, metadata)
        except VMReadyError as e:
            shutil.rmtree(directory, ignore_errors=True)
            vm_alive = self._has_vm(record.name)
            if vm_alive == running:
                # The VM runs on as before (or was never running): nothing to put in error.
                context.abandon(
                    VMState.ACTIVE if running else VMState.STOPPED,
                    PowerState.RUNNING if running else None,
                    e.message,
                )
                self.events.lifecycle(
                    "instance-snapshot-failed", record.name, {"snapshot": name, "error": e.message}
                )
            raise
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if running:
            context.finish(VMState.ACTIVE, PowerState.RUNNING)
        else:
            context.finish(VMState.STOPPED)
        self.events.lifecycle(
            "instance-snapshot-created", record.name, {"snapshot": name, "stateful": stateful}
        )

    async def _do_restore(
        self,
        context: ActionContext,
        record: InstanceRecord,
        snapshot: str,
        stateful: bool,
        force: bool,
    ) -> None:
        name = snapshot
        found = self.store.find_snapshot(record.name, name)
        if found is None:
            raise NotFound(f"Snapshot {name} of instance {record.name} not found")
        metadata = found["metadata"]
        was_running = self._has_vm(record.name)
        if was_running or record.vm_state is VMState.ERROR:
            await self._power_off(context, record.name, 0, force=True)
        updates = _config_updates(record.config, _restored_config(record.config, metadata))
        restored = self.store.update_config(record.name, {**updates, READY_KEY: "false"})
        if stateful:
            directory = snapshot_directory(self.snapshot_root, run_dir_name(record.uuid), name)
            saved = metadata.get("device_set", {})
            accel = saved.get("accel") if saved.get("accel") in ("kvm", "tcg") else None
            state = os.path.join(directory, STATE_FILE)
            await self._load_state(context, restored, state, accel)
            context.finish(VMState.ACTIVE, PowerState.RUNNING)
        elif was_running:
            await self._launch(restored)
            context.finish(VMState.ACTIVE, PowerState.RUNNING)
        else:
            context.finish(VMState.STOPPED, PowerState.SHUTDOWN)
        self.events.lifecycle(
            "instance-restored", record.name, {"snapshot": name, "stateful": stateful}
        )

    async def _load_state(
        self, context: ActionContext, record: InstanceRecord, path: str, accel: str | None
    ) -> None:
        """Start the VM from a saved state; QEMU's own lines if it cannot load it."""
        if not os.path.isfile(path):
            # QEMU would wait for the stream forever (measured): say what is missing instead.
            raise HypervisorError(f"Failed restoring state from {path}: the file is missing")
        try:
            vm = await self._launch(record, incoming=path, accel=accel)
        except HypervisorError as e:
            raise HypervisorError(f"Failed restoring state from {path}: {e.message}") from e
        deadline = self.clock.seconds() + RESTORE_TIMEOUT
        while not vm.gone:
            power = await vm.query_power_state()
            if power is PowerState.RUNNING:
                context.note(f"loaded the state from {path}")
                return
            if self.clock.seconds() >= deadline:
                raise HypervisorError(
                    f"Failed restoring state from {path}: QEMU did not finish loading it "
                    f"within {RESTORE_TIMEOUT:g}s"
                )
            await deferLater(self.clock, _RESTORE_POLL_SECONDS, lambda: None)
        gone = await vm.when_gone()
        await self.driver.wait_released(vm.spec)
        # A daemonized QEMU reports a failed load only in its -D log.
        lines = read_log_lines(vm.spec)
        said = "\n".join(lines) if lines else gone.detail
        raise HypervisorError(f"Failed restoring state from {path}: {said}")

    async def _do_delete(self, context: ActionContext, record: InstanceRecord) -> None:
        await self._power_off(context, record.name, 0, force=True)
        context.complete()
        self._forget(record)

    def _forget(self, record: InstanceRecord, reason: str | None = None) -> None:
        """The instance is gone: its row (revoking its certificate), run dir, DELETED event."""
        self.store.delete_instance(record.name)
        self._last_agent_status.pop(record.name, None)
        remove_instance_snapshots(self.snapshot_root, run_dir_name(record.uuid))
        shutil.rmtree(self.spec_for(record).run_dir, ignore_errors=True)
        disk = self.disk_path(record)
        if disk is not None:
            for path in (disk, disk + ".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.events.lifecycle(
            "instance-state",
            record.name,
            {
                "status": "Deleted",
                "display_status": "DELETED",
                "vm_state": VMState.DELETED.value,
                "task_state": None,
                "power_state": PowerState.NOSTATE.value,
                "error": "",
            },
        )
        self.events.lifecycle(
            "instance-deleted", record.name, {"reason": reason} if reason else {}
        )

    # -- hypervisor plumbing ----------------------------------------------

    def _has_vm(self, name: str) -> bool:
        vm = self.vms.get(name)
        return vm is not None and not vm.gone

    def _vm(self, name: str) -> RunningVM:
        vm = self.vms.get(name)
        if vm is None or vm.gone:
            raise HypervisorError(f"Instance {name} has no running VM")
        return vm

    async def _launch(
        self, record: InstanceRecord, incoming: str | None = None, accel: str | None = None
    ) -> RunningVM:
        """Start the VM with this daemon's serial layout and transport, recorded in the instance.

        ``accel`` forces the accelerator (a restored state must run under the
        one it was saved with); otherwise ``choose_accel`` picks it.
        """
        transport = self.settings.transport
        updates: dict[str, str | None] = {
            LAYOUT_KEY: self.serial_layout.name,
            TRANSPORT_KEY: transport,
        }
        if transport == "vsock" and CID_KEY not in record.config:
            updates[CID_KEY] = str(self._new_cid())
        record = self.store.update_config(record.name, updates)
        disk = self.disk_path(record)
        if disk is not None and not os.path.exists(disk):
            raise HypervisorError(
                f"the root disk of {record.name}, {disk}, is missing; rebuild the instance to "
                f"boot its image {BootSource.from_config(record.config).image} afresh"
            )
        self.refresh_config_drive(record)
        if self.driver.kind == "fakeqemu":
            # A new boot: what the guest kept in its tmpfs (the agent's Ready memory) is gone.
            shutil.rmtree(fakeqemu_guest_paths(self.spec_for(record))["state_dir"], True)
        if accel is not None:
            choice = AccelChoice(accel, False, f"{accel.upper()}: the saved state's accelerator")
        else:
            verdict = self.kvm.verdict if self.kvm is not None else None
            choice = choose_accel(record.config.get(ACCEL_KEY, "auto"), self.kvm_problem, verdict)
        return await self._start_vm(record, choice, incoming)

    async def _start_vm(
        self, record: InstanceRecord, choice: AccelChoice, incoming: str | None
    ) -> RunningVM:
        """Launch under ``choice``; a KVM trial that fails is retried under TCG, saying so."""
        spec = self.spec_for(record, accel=choice.accel)
        doing = "restoring" if incoming is not None else "starting"
        started_at = mark_boot(spec.console_log, f"{doing} {record.name}: {choice.reason}")
        try:
            vm = await self.driver.launch(spec, incoming=incoming)
        except HypervisorError as e:
            if not choice.probe:
                raise
            first = e.message.splitlines()[0] if e.message else "no reason given"
            return await self._fall_back_to_tcg(
                record, f"QEMU failed to start a guest under KVM: {first}", incoming
            )
        self.store.update_config(
            record.name, {CURRENT_ACCEL_KEY: choice.accel, ACCEL_REASON_KEY: choice.reason}
        )
        self._attach(record.name, vm)
        booting = not BootSource.from_config(record.config).empty
        if not (choice.probe and incoming is None and booting and self.kvm is not None):
            return vm
        if await self._shows_life(record.name, vm, spec.console_log, started_at):
            self.kvm.record(True, f"guests run under KVM here (first: {record.name})")
            return vm
        timeout = self.settings.kvm_probe_timeout
        reason = (
            f"a guest under KVM showed no sign of life within {timeout:g}s "
            "(nothing on its console, no word from its agent)"
        )
        self._detach(record.name)
        await vm.force_stop()
        return await self._fall_back_to_tcg(record, reason, incoming)

    async def _fall_back_to_tcg(
        self, record: InstanceRecord, reason: str, incoming: str | None
    ) -> RunningVM:
        """KVM does not run guests here: remember it, say it, and start the VM under TCG."""
        if self.kvm is not None:
            self.kvm.record(False, reason)
        self.log.warn(
            "{name}: {reason}; starting it again under TCG", name=record.name, reason=reason
        )
        self._history(record.name, "accelerator", f"{reason}; restarted under TCG")
        self.events.lifecycle(
            "instance-accelerator-changed",
            record.name,
            {"from": "kvm", "to": "tcg", "reason": reason},
        )
        return await self._start_vm(
            record, AccelChoice("tcg", False, f"TCG: KVM failed here ({reason})"), incoming
        )

    async def _shows_life(self, name: str, vm: RunningVM, console: str, since: int) -> bool:
        """Whether the guest writes to its console or its agent speaks within the probe time."""
        deadline = self.clock.seconds() + self.settings.kvm_probe_timeout
        while not vm.gone:
            if console_size(console) > since or self.agent_status(name) is not AgentStatus.UNKNOWN:
                return True
            if self.clock.seconds() >= deadline:
                return False
            await deferLater(self.clock, _SIGN_OF_LIFE_POLL, lambda: None)
        return False

    def _new_cid(self) -> int:
        """A vsock CID no other instance of this daemon holds."""
        used = {
            int(record.config[CID_KEY])
            for record in self.store.list_instances()
            if record.config.get(CID_KEY, "").isdigit()
        }
        return allocate_cid(used)

    def rotate_consoles(self) -> None:
        """Keep every running VM's console log under its cap (called on a timer)."""
        for vm in list(self.vms.values()):
            try:
                if rotate_console(vm.spec.console_log, self.settings.console_max_bytes):
                    self.log.info("rotated the console log of {name}", name=vm.spec.name)
            except OSError as e:
                self.log.warn(
                    "cannot rotate the console log of {name}: {error}", name=vm.spec.name, error=e
                )

    async def _relaunch_with(
        self,
        context: ActionContext,
        name: str,
        updates: dict[str, str | None],
        was_running: bool,
    ) -> InstanceRecord:
        if was_running:
            await self._power_off(context, name, self.stop_timeout, force=False)
        record = self.store.update_config(name, {**updates, READY_KEY: "false"})
        if was_running:
            await self._launch(record)
        return record

    async def _power_off(
        self, context: ActionContext, name: str, timeout: float, force: bool
    ) -> None:
        vm = self.vms.get(name)
        if vm is None or vm.gone:
            self._detach(name)
            record = self.store.get_instance(name)
            if await self.driver.kill_owned(self.spec_for(record)):
                context.note("killed a VM process whose monitor vmready had lost")
            else:
                context.note("power-off: no VM was running")
            return
        self._detach(name)
        if force:
            await vm.force_stop()
            context.note("forced stop")
            return
        how = await vm.shutdown(timeout, self.clock)
        context.note("clean stop" if how == "clean" else f"forced stop after {timeout:g}s timeout")

    def _attach(self, name: str, vm: RunningVM, advertise: bool = False) -> None:
        """Follow ``vm``; ``advertise``: write CONNECT at once (its agent may know an old port)."""
        record = self.store.find_instance(name)
        if record is not None and LAYOUT_KEY not in record.config:
            # Adopted from a vmready that did not record layouts: say which one it runs.
            self.store.update_config(name, {LAYOUT_KEY: UNRECORDED_LAYOUT.name})
        self._detach(name)
        self.vms[name] = vm
        undo = [vm.subscribe(lambda event: self._vm_event(name, vm, event))]
        recorders = self.recorders
        if recorders is not None:
            # Recorded as it arrives, before the core (or the VM handle) reacts to it; the
            # recorder is looked up each time (recording may be switched off and on).
            def record_event(event: QMPEvent) -> None:
                recorder = recorders.recorder_for(name)
                if recorder is not None:
                    recorder.qmp_event(event.name, event.data)

            undo.append(vm.qmp.subscribe(record_event, first=True))
        monitor = self._follow_agent(name, vm)
        if monitor is not None:
            undo.append(vm.qmp.subscribe(lambda _event: self._qmp_event(name)))
            monitor.start(advertise)
            frozen = record is not None and (
                record.vm_state is VMState.PAUSED or record.power_state is PowerState.PAUSED
            )
            if frozen:
                monitor.paused()  # adopted frozen: its agent cannot speak until unfrozen

        def unsubscribe() -> None:
            for step in undo:
                step()

        self._unsubscribe[name] = unsubscribe

    def _follow_agent(self, name: str, vm: RunningVM) -> AgentMonitor | None:
        guest = self.guest
        chardev = agent_chardev(vm.spec)
        if guest is None or chardev is None:
            return None
        record = self.store.find_instance(name)
        transport = record.config.get(TRANSPORT_KEY, "hvsock") if record else "hvsock"
        link = AgentLink(
            name,
            vm.spec.ring_size,
            guest.port,
            guest.intervals,
            connect=connect_line(transport, guest.port),
        )
        recorders = self.recorders
        # A VM started before vmready gave VMs a vmready.connect port has none.
        has_port = os.path.exists(vm.spec.connect_socket)
        monitor = AgentMonitor(
            self.clock,
            vm,
            link,
            chardev,
            lambda change: self._agent_changed(name, change),
            (lambda: recorders.recorder_for(name)) if recorders is not None else None,
            ConnectPort(self.reactor, vm.spec.connect_socket, name) if has_port else None,
        )
        self.monitors[name] = monitor
        return monitor

    def _qmp_event(self, name: str) -> None:
        """Any QMP event: the instance's agent monitor (whichever follows it now) reads at once."""
        monitor = self.monitors.get(name)
        if monitor is not None:
            monitor.qmp_event()

    def _agent_changed(self, name: str, change: StatusChanged) -> None:
        self._last_agent_status[name] = change.current
        self.events.lifecycle(
            change.event_action,
            name,
            {"status": change.current.value, "previous": change.previous.value},
        )

    def _detach(self, name: str, announce: bool = True) -> None:
        unsubscribe = self._unsubscribe.pop(name, None)
        if unsubscribe is not None:
            unsubscribe()
        self.vms.pop(name, None)
        self._stop_following_agent(name, announce)

    def _stop_following_agent(self, name: str, announce: bool = True) -> None:
        monitor = self.monitors.pop(name, None)
        if monitor is not None:
            monitor.stop(announce)
            self._last_agent_status[name] = monitor.status

    def _vm_event(self, name: str, vm: RunningVM, event: VMEvent) -> None:
        """QMP events of a VM we did not ask for: follow power state; a death is an error."""
        record = self.store.find_instance(name)
        if record is None or self.vms.get(name) is not vm:
            return
        if event.kind in (VMEventKind.GONE, VMEventKind.SHUTDOWN, VMEventKind.PANICKED):
            # The guest OS is gone or going, whoever owns the instance now: so is its agent.
            self._stop_following_agent(name)
        monitor = self.monitors.get(name)
        if monitor is not None:
            if event.kind is VMEventKind.STOP:
                monitor.paused()
            elif event.kind is VMEventKind.RESUME:
                monitor.resumed()
        if record.task_state is not None:
            return  # the running action owns the VM now
        if event.kind is VMEventKind.PANICKED and record.vm_state is not VMState.ERROR:
            self.store.update_config(name, {READY_KEY: "false"})
            self._history(name, "guest-panicked", event.detail, ok=False)
            self._fail_idle(
                record,
                f"{event.detail}; its console log may say why (vmready console {name} --show-log)",
                PowerState.CRASHED,
            )
            return
        if event.kind is VMEventKind.RESET:
            self._guest_rebooted(record, vm)
            return
        if event.kind is VMEventKind.GONE:
            self._detach(name)
            self._vm_went_away(record, event)
            return
        if event.power_state is not None and event.power_state is not record.power_state:
            if event.power_state in (PowerState.SHUTDOWN, PowerState.CRASHED) and record.ready:
                # Not ready from the moment it stops, before its process is gone.
                self.store.update_config(name, {READY_KEY: "false"})
            self.publish_state(self.store.set_power_state(name, event.power_state))

    def _guest_rebooted(self, record: InstanceRecord, vm: RunningVM) -> None:
        """A reset is a new boot: its workload has not said Ready yet; its agent starts over."""
        if record.ready:
            self.publish_state(self.store.update_config(record.name, {READY_KEY: "false"}))
        if self.driver.kind == "fakeqemu":
            shutil.rmtree(fakeqemu_guest_paths(vm.spec)["state_dir"], ignore_errors=True)
        self._stop_following_agent(record.name)
        monitor = self._follow_agent(record.name, vm)
        if monitor is not None:
            monitor.start(advertise=False)

    def _vm_went_away(self, record: InstanceRecord, event: VMEvent) -> None:
        # The driver judges the exit: SHUTDOWN for a shutdown QEMU announced, CRASHED otherwise.
        clean = event.power_state is PowerState.SHUTDOWN
        self._history(record.name, "vm-exited", event.detail, ok=clean)
        ready_false: dict[str, str | None] = {READY_KEY: "false"}
        if record.vm_state is VMState.ERROR:
            # The error stays; only note that its VM is gone too.
            self.store.update_config(record.name, ready_false)
            self.publish_state(
                self.store.set_power_state(record.name, event.power_state or PowerState.CRASHED)
            )
            return
        if clean:
            updated = self.store.settle(
                record.name, _RUNNING_STATES, VMState.STOPPED, PowerState.SHUTDOWN, ready_false
            )
            if updated is not None:
                self.publish_state(updated)
                self.events.lifecycle("instance-shutdown", record.name, {"reason": event.detail})
            return
        self.store.update_config(record.name, ready_false)
        self._fail_idle(record, event.detail, PowerState.CRASHED)

    def _fail_idle(self, record: InstanceRecord, reason: str, power: PowerState) -> None:
        """An instance with no task goes to error with ``reason``; the error persists."""
        updated = self.store.set_error(record.name, reason, power)
        self.publish_state(updated)
        self.events.lifecycle("instance-error", record.name, {"error": reason})

    def _history(self, name: str, action: str, detail: str, ok: bool = True) -> None:
        """A one-step action in the history, for things that happen outside an action."""
        action_id = self.store.start_action(name, action, str(uuid.uuid4()))
        if ok:
            # A success has no error: the reason goes in the step's name.
            self.store.add_step(action_id, f"{action}: {detail}", "success")
            self.store.finish_action(action_id, "success")
        else:
            self.store.add_step(action_id, action, "error", detail)
            self.store.finish_action(action_id, "error", detail)

    # -- power sync and restart -------------------------------------------

    async def sync_power_states(self) -> None:
        """One reconciliation round, all instances at once; errors and tasks are left alone."""
        idle = [
            record
            for record in self.store.list_instances()
            if record.vm_state is not VMState.ERROR and record.task_state is None
        ]
        await gatherResults(
            [Deferred.fromCoroutine(self._sync_guarded(record)) for record in idle],
            consumeErrors=True,
        )

    async def _sync_guarded(self, record: InstanceRecord) -> None:
        try:
            await self._sync_one(record)
        except VMReadyError as e:
            self.log.warn("power sync of {name}: {error}", name=record.name, error=e.message)

    async def _sync_one(self, record: InstanceRecord) -> None:
        vm = self.vms.get(record.name)
        should_run = record.vm_state in _RUNNING_STATES and (
            record.power_state is not PowerState.SHUTDOWN
        )
        # QEMU announced SHUTDOWN (a guest power-off) and has not exited yet.
        shutting_down = (
            record.vm_state in _RUNNING_STATES and record.power_state is PowerState.SHUTDOWN
        )
        if vm is None or vm.gone:
            if should_run or shutting_down:
                await self._adopt_or_settle(record, "VM not running: no QEMU process answers")
            elif await self.driver.kill_owned(self.spec_for(record)):
                self._history(
                    record.name,
                    "power-sync",
                    "a VM was running while the instance is stopped; stopped it",
                )
            return
        if shutting_down:
            return  # its exit settles the instance (stopped, with the guest's reason)
        if not should_run:
            self._detach(record.name)
            await vm.force_stop()
            self._history(
                record.name,
                "power-sync",
                "a VM was running while the instance is stopped; stopped it",
            )
            return
        try:
            power = await vm.query_power_state()
        except HypervisorError as e:
            # A monitor that stops answering is not a running VM anyone can manage.
            current = self.store.find_instance(record.name)
            if current is not None and current.task_state is None:
                self._detach(record.name)
                self._history(record.name, "power-sync", e.message, ok=False)
                self._fail_idle(current, e.message, PowerState.NOSTATE)
                await vm.detach()  # hang up on the monitor; the VM itself is left as it is
            return
        current = self.store.find_instance(record.name)
        if current is not None and current.task_state is None and power is not current.power_state:
            self.publish_state(self.store.set_power_state(record.name, power))

    async def _adopt_or_settle(self, record: InstanceRecord, why: str) -> None:
        """Re-attach the instance's VM; if none runs, it is stopped; if it won't answer, error."""
        try:
            adopted = await self.driver.adopt(self.spec_for(record))
        except HypervisorError as e:
            current = self.store.find_instance(record.name)
            if current is not None and current.task_state is None:
                self._fail_idle(current, e.message, PowerState.NOSTATE)
            return
        if adopted is not None:
            self._attach(record.name, adopted, advertise=True)
            return
        updated = self.store.settle(
            record.name,
            _RUNNING_STATES,
            VMState.STOPPED,
            PowerState.SHUTDOWN,
            {READY_KEY: "false"},
        )
        if updated is not None:
            self._history(record.name, "power-sync", why)
            self.publish_state(updated)
            self.events.lifecycle("instance-stopped", record.name, {"reason": why})

    async def recover(self) -> None:
        """At daemon start: clear Ready, close interrupted actions, re-adopt or resolve VMs."""
        cleared = self.store.clear_ready_everywhere()
        self.log.info("cleared {key} on {count} instances", key=READY_KEY, count=cleared)
        for action in self.store.unfinished_actions():
            self.store.finish_action(action.id, "error", "daemon stopped during the action")
        for record in self.store.list_instances():
            try:
                await self._recover_one(record)
            except VMReadyError as e:
                await self._recovery_failed(record, e.message)

    async def _recovery_failed(self, record: InstanceRecord, why: str) -> None:
        """Whatever went wrong re-adopting an instance, it must not stay mid-task: error."""
        self.log.warn("recovering {name}: {error}", name=record.name, error=why)
        vm = self.vms.get(record.name)
        self._detach(record.name)
        if vm is not None:
            await vm.detach()
        try:
            await self.driver.kill_owned(self.spec_for(record))
        except HypervisorError as e:
            why = f"{why}; {e.message}"
        current = self.store.find_instance(record.name)
        if current is None:
            return
        task = current.task_state
        reason = f"daemon stopped during {task.value}; {why}" if task else why
        self._history(record.name, "recover", reason, ok=False)
        self._fail_idle(current, reason, PowerState.NOSTATE)

    async def _recover_one(self, record: InstanceRecord) -> None:
        task = record.task_state
        if task is None:
            should_run = record.vm_state in _RUNNING_STATES and (
                record.power_state is not PowerState.SHUTDOWN
            )
            if should_run:
                await self._adopt_or_settle(record, "VM was not running when the daemon started")
            elif record.vm_state is not VMState.ERROR:
                # Stopped (or resized while stopped): it must not have a VM; stop any that runs.
                await self.driver.kill_owned(self.spec_for(record))
            return
        reason = f"daemon stopped during {task.value}"
        try:
            adopted = await self.driver.adopt(self.spec_for(record))
        except HypervisorError as e:
            await self.driver.kill_owned(self.spec_for(record))
            self._fail_idle(record, f"{reason}; {e.message}", PowerState.NOSTATE)
            return
        if adopted is not None:
            self._attach(record.name, adopted, advertise=True)
        if task is TaskState.DELETING:
            await self._stop_adopted(record.name, adopted)
            self._forget(record, reason)
            return
        if task is TaskState.POWERING_OFF:
            await self._stop_adopted(record.name, adopted)
            self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
            return
        if task is TaskState.SNAPSHOTTING:
            # The snapshot was not recorded (its row is written last); the VM may be paused
            # mid-save: let it run on. A partial directory is replaced by the next snapshot.
            if adopted is None:
                self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
                return
            with contextlib.suppress(HypervisorError):
                await adopted.resume()
            power = await adopted.query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            self._resolve(record, task, vm_state, power)
            return
        if adopted is not None and task in _TASKS_RESOLVED_BY_A_RUNNING_VM:
            power = await adopted.query_power_state()
            vm_state = VMState.PAUSED if power is PowerState.PAUSED else VMState.ACTIVE
            self._resolve(record, task, vm_state, power)
            return
        if task is TaskState.POWERING_ON and adopted is None:
            self._resolve(record, task, VMState.STOPPED, PowerState.SHUTDOWN)
            return
        await self._stop_adopted(record.name, adopted)
        self._resolve_error(record, reason)

    async def _stop_adopted(self, name: str, adopted: RunningVM | None) -> None:
        if adopted is not None:
            self._detach(name)
            await adopted.force_stop()

    def _resolve_error(self, record: InstanceRecord, reason: str) -> None:
        """A task that cannot be finished after a restart ends in error, saying so."""
        self._history(record.name, "recover", reason, ok=False)
        self._fail_idle(record, reason, PowerState.NOSTATE)

    def _resolve(
        self, record: InstanceRecord, task: TaskState, vm_state: VMState, power: PowerState
    ) -> None:
        detail = f"daemon stopped during {task.value}; now {vm_state}"
        self._history(record.name, "recover", detail)
        self.publish_state(self.store.finish_task(record.name, task, vm_state, power))

    def shutdown(self) -> Deferred[None]:
        """Daemon stopping: let go of the VMs (they keep running), without touching the store."""
        self.operations.stop()
        detaching = []
        for name in list(self.vms):
            vm = self.vms[name]
            self._detach(name, announce=False)
            detaching.append(vm.detach())
        return gatherResults(detaching).addCallback(lambda _: None)


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
