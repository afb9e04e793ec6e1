"""The instance state model: three stored fields, everything else derived.

As in OpenStack Nova, an instance has a stable ``vm_state``, the ``task_state``
of the transition in progress (or none), and the ``power_state`` the
hypervisor last reported.  The LXD-style ``status``/``status_code`` and the
Nova-style display status are *derived* from those (and from the
``volatile.last_state.ready`` key), never stored, so they cannot disagree.

``ACTIONS`` is the lifecycle as data: for each action, the vm_states it may
start from, the task_states it passes through in order, and the vm_state it
ends in.  The lifecycle code walks it; the docs' diagram is generated from it.
"""

from __future__ import annotations

import enum

import attrs

READY_KEY = "volatile.last_state.ready"


class VMState(enum.StrEnum):
    """Where an instance rests between transitions."""

    BUILDING = "building"
    ACTIVE = "active"
    STOPPED = "stopped"
    PAUSED = "paused"
    RESIZED = "resized"
    ERROR = "error"
    DELETED = "deleted"


# The vm_states in which an instance's VM runs (frozen or not), unless it was shut down.
RUNNING_VM_STATES = frozenset({VMState.ACTIVE, VMState.PAUSED, VMState.RESIZED})


class TaskState(enum.StrEnum):
    """The transition in progress."""

    SPAWNING = "spawning"
    POWERING_ON = "powering-on"
    POWERING_OFF = "powering-off"
    REBOOTING = "rebooting"
    PAUSING = "pausing"
    UNPAUSING = "unpausing"
    REBUILDING = "rebuilding"
    RESIZE_QUEUED = "resize-queued"
    RESIZE_PREP = "resize-prep"
    RESIZE_MIGRATING = "resize-migrating"
    RESIZE_FINISH = "resize-finish"
    RESIZE_CONFIRMING = "resize-confirming"
    RESIZE_REVERTING = "resize-reverting"
    DELETING = "deleting"
    SNAPSHOTTING = "image-snapshot"
    RESTORING = "restoring"


class PowerState(enum.StrEnum):
    """What the hypervisor says about the VM."""

    NOSTATE = "nostate"
    RUNNING = "running"
    PAUSED = "paused"
    SHUTDOWN = "shutdown"
    CRASHED = "crashed"


class StatusCode(enum.IntEnum):
    """LXD's api.StatusCode values vmready reports."""

    OPERATION_CREATED = 100
    STARTED = 101
    STOPPED = 102
    RUNNING = 103
    CANCELLING = 104
    PENDING = 105
    STARTING = 106
    STOPPING = 107
    ABORTING = 108
    FREEZING = 109
    FROZEN = 110
    THAWED = 111
    ERROR = 112
    READY = 113
    SUCCESS = 200
    FAILURE = 400
    CANCELLED = 401


@attrs.frozen
class Action:
    """One lifecycle action: where it may start, the tasks it passes through, where it ends."""

    name: str
    allowed_from: frozenset[VMState]
    tasks: tuple[TaskState, ...]
    ends_in: VMState
    # Where it ends instead when the instance has no running VM (a stopped resize).
    ends_in_when_stopped: VMState | None = None
    # It ends where it started (a snapshot): ``ends_in`` is then only the usual case.
    returns_to_start: bool = False
    # Nova's display status during each task (None: the resting state shows).
    shows: tuple[str | None, ...] = ()
    # LXD's status while it runs (None: the resting status shows).
    lxd_status: str | None = None

    def end_state(self, power: PowerState) -> VMState:
        """Where the action leaves an instance whose VM ends in ``power``.

        ``ends_in``; with no VM running, ``ends_in_when_stopped`` if the action
        has one, or STOPPED for one that returns to where it started (a
        snapshot of a stopped instance); an action that ends ACTIVE with a
        paused VM (a start that adopts one) leaves it PAUSED.
        """
        if power not in (PowerState.RUNNING, PowerState.PAUSED):
            if self.ends_in_when_stopped is not None:
                return self.ends_in_when_stopped
            if self.returns_to_start:
                return VMState.STOPPED
        elif power is PowerState.PAUSED and self.ends_in is VMState.ACTIVE:
            return VMState.PAUSED
        return self.ends_in


_ANY_LIVE = frozenset(VMState) - {VMState.DELETED}

ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        Action(
            "create",
            frozenset({VMState.BUILDING}),
            (TaskState.SPAWNING,),
            VMState.ACTIVE,
            # LXD's create without start: built, no VM started.
            ends_in_when_stopped=VMState.STOPPED,
            shows=("BUILD",),
            lxd_status="Starting",
        ),
        Action(
            "start",
            frozenset({VMState.STOPPED, VMState.ERROR}),
            (TaskState.POWERING_ON,),
            VMState.ACTIVE,
            lxd_status="Starting",
        ),
        Action(
            "stop",
            frozenset({VMState.ACTIVE, VMState.PAUSED}),
            (TaskState.POWERING_OFF,),
            VMState.STOPPED,
            lxd_status="Stopping",
        ),
        Action(
            "restart",
            frozenset({VMState.ACTIVE}),
            (TaskState.REBOOTING,),
            VMState.ACTIVE,
            shows=("REBOOT",),
        ),
        Action(
            "freeze",
            frozenset({VMState.ACTIVE}),
            (TaskState.PAUSING,),
            VMState.PAUSED,
            lxd_status="Freezing",
        ),
        Action("unfreeze", frozenset({VMState.PAUSED}), (TaskState.UNPAUSING,), VMState.ACTIVE),
        Action(
            "rebuild",
            frozenset({VMState.ACTIVE, VMState.STOPPED, VMState.ERROR}),
            (TaskState.REBUILDING,),
            VMState.ACTIVE,
            shows=("REBUILD",),
        ),
        Action(
            "resize",
            frozenset({VMState.ACTIVE, VMState.STOPPED}),
            (
                TaskState.RESIZE_QUEUED,
                TaskState.RESIZE_PREP,
                TaskState.RESIZE_MIGRATING,
                TaskState.RESIZE_FINISH,
            ),
            VMState.RESIZED,
            shows=("QUEUE_RESIZE", "PREP_RESIZE", "RESIZE", "RESIZE"),
        ),
        Action(
            "confirm-resize",
            frozenset({VMState.RESIZED}),
            (TaskState.RESIZE_CONFIRMING,),
            VMState.ACTIVE,
            ends_in_when_stopped=VMState.STOPPED,
        ),
        Action(
            "revert-resize",
            frozenset({VMState.RESIZED}),
            (TaskState.RESIZE_REVERTING,),
            VMState.ACTIVE,
            ends_in_when_stopped=VMState.STOPPED,
            shows=("REVERT_RESIZE",),
        ),
        Action(
            "snapshot",
            frozenset({VMState.ACTIVE, VMState.STOPPED}),
            (TaskState.SNAPSHOTTING,),
            VMState.ACTIVE,
            returns_to_start=True,
            shows=("SNAPSHOT",),
        ),
        Action(
            "restore",
            frozenset({VMState.ACTIVE, VMState.STOPPED, VMState.PAUSED, VMState.ERROR}),
            (TaskState.RESTORING,),
            VMState.ACTIVE,
            ends_in_when_stopped=VMState.STOPPED,
            shows=("RESTORE",),
        ),
        Action("delete", _ANY_LIVE, (TaskState.DELETING,), VMState.DELETED, lxd_status="Stopping"),
    )
}


# Derived from ACTIONS: LXD's status while each task runs.
_TASK_STATUS = {
    task: action.lxd_status
    for action in ACTIONS.values()
    if action.lxd_status is not None
    for task in action.tasks
}


@attrs.frozen
class Status:
    """An instance's LXD-style status, derived."""

    name: str
    code: StatusCode


def derive_status(
    vm_state: VMState,
    task_state: TaskState | None,
    power_state: PowerState,
    ready: bool,
) -> Status:
    """LXD's status for the stored fields: Ready only when running, idle, and the key is set."""
    if vm_state is VMState.ERROR:
        return Status("Error", StatusCode.ERROR)
    transition = _TASK_STATUS.get(task_state) if task_state is not None else None
    if transition is not None:
        return Status(transition, StatusCode[transition.upper()])
    if vm_state is VMState.PAUSED or power_state is PowerState.PAUSED:
        return Status("Frozen", StatusCode.FROZEN)
    if power_state is PowerState.RUNNING and vm_state in (VMState.ACTIVE, VMState.RESIZED):
        # A transition (restart, rebuild, resize…) takes the workload down: not Ready then.
        if ready and task_state is None:
            return Status("Ready", StatusCode.READY)
        return Status("Running", StatusCode.RUNNING)
    return Status("Stopped", StatusCode.STOPPED)


# Derived from ACTIONS: what each task shows while it runs.
_TASK_DISPLAY = {
    task: label
    for action in ACTIONS.values()
    for task, label in zip(action.tasks, action.shows or (None,) * len(action.tasks), strict=True)
    if label is not None
}
_VM_DISPLAY = {
    VMState.BUILDING: "BUILD",
    VMState.ACTIVE: "ACTIVE",
    VMState.STOPPED: "SHUTOFF",
    VMState.PAUSED: "PAUSED",
    VMState.RESIZED: "VERIFY_RESIZE",
    VMState.ERROR: "ERROR",
    VMState.DELETED: "DELETED",
}


def display_status(vm_state: VMState, task_state: TaskState | None) -> str:
    """The Nova-style display status: the transition if one shows, else the resting state.

    Tasks that do not change what the instance *is* (powering on/off, pausing,
    confirming, deleting) leave the resting state showing, so a delete reads
    ACTIVE → DELETED and never passes through BUILD.
    """
    if task_state is not None and task_state in _TASK_DISPLAY:
        return _TASK_DISPLAY[task_state]
    return _VM_DISPLAY[vm_state]


class OperatorStatus(enum.StrEnum):
    """The one status an operator reads: what the instance is, or what is being done to it.

    LXD's status folds the transitions it knows into Starting/Stopping/Freezing
    and shows nothing of a resize or a snapshot; Nova's display status leaves
    the resting state showing during a stop.  This one word says either the
    transition in progress (a verb in -ing) or where the instance rests.
    """

    LAUNCHING = "LAUNCHING"
    STARTING = "STARTING"
    STOPPING = "STOPPING"
    RESTARTING = "RESTARTING"
    FREEZING = "FREEZING"
    UNFREEZING = "UNFREEZING"
    REBUILDING = "REBUILDING"
    RESIZING = "RESIZING"
    CONFIRMING = "CONFIRMING"
    REVERTING = "REVERTING"
    SNAPSHOTTING = "SNAPSHOTTING"
    RESTORING = "RESTORING"
    DELETING = "DELETING"
    READY = "READY"
    RUNNING = "RUNNING"
    FROZEN = "FROZEN"
    STOPPED = "STOPPED"
    RESIZED = "RESIZED"
    BUILDING = "BUILDING"
    ERROR = "ERROR"
    DELETED = "DELETED"
    # Its host (a cluster member) is unreachable: shown at read time, never stored.
    UNKNOWN = "UNKNOWN"


# Every task, as the transition the operator sees.
_TASK_OPERATOR_STATUS = {
    TaskState.SPAWNING: OperatorStatus.LAUNCHING,
    TaskState.POWERING_ON: OperatorStatus.STARTING,
    TaskState.POWERING_OFF: OperatorStatus.STOPPING,
    TaskState.REBOOTING: OperatorStatus.RESTARTING,
    TaskState.PAUSING: OperatorStatus.FREEZING,
    TaskState.UNPAUSING: OperatorStatus.UNFREEZING,
    TaskState.REBUILDING: OperatorStatus.REBUILDING,
    TaskState.RESIZE_QUEUED: OperatorStatus.RESIZING,
    TaskState.RESIZE_PREP: OperatorStatus.RESIZING,
    TaskState.RESIZE_MIGRATING: OperatorStatus.RESIZING,
    TaskState.RESIZE_FINISH: OperatorStatus.RESIZING,
    TaskState.RESIZE_CONFIRMING: OperatorStatus.CONFIRMING,
    TaskState.RESIZE_REVERTING: OperatorStatus.REVERTING,
    TaskState.SNAPSHOTTING: OperatorStatus.SNAPSHOTTING,
    TaskState.RESTORING: OperatorStatus.RESTORING,
    TaskState.DELETING: OperatorStatus.DELETING,
}
# Where an instance rests, when its VM's power state does not decide it (ACTIVE does).
_RESTING_OPERATOR_STATUS = {
    VMState.BUILDING: OperatorStatus.BUILDING,
    VMState.STOPPED: OperatorStatus.STOPPED,
    VMState.PAUSED: OperatorStatus.FROZEN,
    VMState.RESIZED: OperatorStatus.RESIZED,
    VMState.ERROR: OperatorStatus.ERROR,
    VMState.DELETED: OperatorStatus.DELETED,
}


def operator_status(
    vm_state: VMState,
    task_state: TaskState | None,
    power_state: PowerState,
    ready: bool,
) -> OperatorStatus:
    """The one status for the stored fields: the task in progress, else the resting state.

    A task wins over everything, an error too (a rebuild of an instance in
    error reads REBUILDING).  An ACTIVE instance is READY when its VM runs and
    the workload said Ready, RUNNING when it runs, FROZEN when the VM is
    paused, and STOPPED when the VM is gone (until power sync catches up).
    """
    if task_state is not None:
        return _TASK_OPERATOR_STATUS[task_state]
    if vm_state is not VMState.ACTIVE:
        return _RESTING_OPERATOR_STATUS[vm_state]
    if power_state is PowerState.RUNNING:
        return OperatorStatus.READY if ready else OperatorStatus.RUNNING
    if power_state is PowerState.PAUSED:
        return OperatorStatus.FROZEN
    return OperatorStatus.STOPPED


# What an action is called where an operator reads it (the CLI command that starts it).
_ACTION_WORDS = {"create": "launch"}
# Which action each task belongs to (each belongs to exactly one).
_TASK_ACTION = {task: action.name for action in ACTIONS.values() for task in action.tasks}
# A resting state in a sentence: "it is ...".
_RESTING_WORDS = {
    VMState.BUILDING: "being launched",
    VMState.ACTIVE: "running",
    VMState.STOPPED: "stopped",
    VMState.PAUSED: "frozen",
    VMState.RESIZED: "resized (confirm-resize or revert-resize it first)",
    VMState.ERROR: "in error",
    VMState.DELETED: "deleted",
}


def action_word(action: str) -> str:
    """An action's name as the operator's command line calls it (``create``: ``launch``)."""
    return _ACTION_WORDS.get(action, action)


def describe_state(vm_state: VMState, task_state: TaskState | None) -> str:
    """Where an instance is, in the operator's words, to follow "it is": never a field name.

    ``stopping (a stop is in progress)``, ``running``, ``in error``.
    """
    if task_state is not None:
        doing = _TASK_OPERATOR_STATUS[task_state].value.lower()
        action = action_word(_TASK_ACTION[task_state])
        article = "an" if action[0] in "aeiou" else "a"
        return f"{doing} ({article} {action} is in progress)"
    return _RESTING_WORDS[vm_state]


def transition_diagram() -> str:
    """A Mermaid state diagram of ACTIONS, for the docs."""
    lines = ["stateDiagram-v2"]
    for action in ACTIONS.values():
        steps = " → ".join(action.tasks)
        for source in sorted(action.allowed_from):
            if action.returns_to_start:
                lines.append(f"    {source} --> {source}: {action.name} ({steps})")
                continue
            lines.append(f"    {source} --> {action.ends_in}: {action.name} ({steps})")
            if action.ends_in_when_stopped is not None:
                lines.append(
                    f"    {source} --> {action.ends_in_when_stopped}: "
                    f"{action.name} ({steps}, no VM running)"
                )
    lines.append("    active --> stopped: VM exited cleanly (guest power-off, SHUTDOWN event)")
    lines.append("    active --> error: VM died (no SHUTDOWN event) or any action failed")
    return "\n".join(lines)
