"""Tests for vmready.domain.states: derived statuses and the lifecycle table."""

from __future__ import annotations

import itertools

from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.model import task_conflict
from vmready.domain.states import (
    ACTIONS,
    OperatorStatus,
    PowerState,
    StatusCode,
    TaskState,
    VMState,
    derive_status,
    describe_state,
    display_status,
    operator_status,
    transition_diagram,
)


class DeriveStatusTests(SynchronousTestCase):
    """LXD's status is derived from the three stored fields and the ready key."""

    def test_runningWithoutReadyKeyIsRunning(self) -> None:
        status = derive_status(VMState.ACTIVE, None, PowerState.RUNNING, ready=False)
        self.assertEqual((status.name, status.code), ("Running", StatusCode.RUNNING))

    def test_readyKeyDuringATransitionIsRunning(self) -> None:
        for task in (TaskState.REBOOTING, TaskState.REBUILDING, TaskState.RESIZE_MIGRATING):
            status = derive_status(VMState.ACTIVE, task, PowerState.RUNNING, ready=True)
            self.assertEqual(status.name, "Running", task)

    def test_runningWithReadyKeyIsReady113(self) -> None:
        status = derive_status(VMState.ACTIVE, None, PowerState.RUNNING, ready=True)
        self.assertEqual((status.name, int(status.code)), ("Ready", 113))

    def test_readyKeyOnAStoppedInstanceIsStillStopped(self) -> None:
        status = derive_status(VMState.STOPPED, None, PowerState.SHUTDOWN, ready=True)
        self.assertEqual((status.name, int(status.code)), ("Stopped", 102))

    def test_errorWinsOverEverything(self) -> None:
        status = derive_status(VMState.ERROR, None, PowerState.RUNNING, ready=True)
        self.assertEqual((status.name, int(status.code)), ("Error", 112))

    def test_frozenIs110(self) -> None:
        status = derive_status(VMState.PAUSED, None, PowerState.PAUSED, ready=True)
        self.assertEqual((status.name, int(status.code)), ("Frozen", 110))

    def test_tasksShowStartingAndStopping(self) -> None:
        starting = derive_status(
            VMState.STOPPED, TaskState.POWERING_ON, PowerState.SHUTDOWN, False
        )
        stopping = derive_status(VMState.ACTIVE, TaskState.POWERING_OFF, PowerState.RUNNING, False)
        self.assertEqual(
            (int(starting.code), int(stopping.code)), (StatusCode.STARTING, StatusCode.STOPPING)
        )

    def test_resizedAndRunningCountsAsRunning(self) -> None:
        status = derive_status(VMState.RESIZED, None, PowerState.RUNNING, ready=False)
        self.assertEqual(status.name, "Running")


class DisplayStatusTests(SynchronousTestCase):
    """The Nova-style display status shows transitions the seed asked for, and nothing else."""

    def test_createShowsBuildNeverShutdown(self) -> None:
        self.assertEqual(display_status(VMState.BUILDING, TaskState.SPAWNING), "BUILD")
        self.assertEqual(display_status(VMState.ACTIVE, None), "ACTIVE")

    def test_rebuildShowsRebuild(self) -> None:
        self.assertEqual(display_status(VMState.ACTIVE, TaskState.REBUILDING), "REBUILD")

    def test_resizeWalksQueuePrepResizeVerify(self) -> None:
        walk = [display_status(VMState.ACTIVE, task) for task in ACTIONS["resize"].tasks] + [
            display_status(VMState.RESIZED, None)
        ]
        collapsed = [s for i, s in enumerate(walk) if i == 0 or walk[i - 1] != s]
        self.assertEqual(collapsed, ["QUEUE_RESIZE", "PREP_RESIZE", "RESIZE", "VERIFY_RESIZE"])

    def test_deleteNeverShowsBuild(self) -> None:
        self.assertEqual(display_status(VMState.ACTIVE, TaskState.DELETING), "ACTIVE")

    def test_powerTasksLeaveTheRestingStateShowing(self) -> None:
        self.assertEqual(display_status(VMState.ACTIVE, TaskState.POWERING_OFF), "ACTIVE")
        self.assertEqual(display_status(VMState.STOPPED, None), "SHUTOFF")


class ActionTableTests(SynchronousTestCase):
    """The table the lifecycle walks is complete and consistent."""

    def test_everyActionStartsFromLiveStatesOnly(self) -> None:
        for action in ACTIONS.values():
            self.assertNotIn(VMState.DELETED, action.allowed_from, action.name)
            self.assertTrue(action.tasks, action.name)

    def test_errorIsLeftOnlyByExplicitStartRebuildRestoreOrDelete(self) -> None:
        leaving = sorted(a.name for a in ACTIONS.values() if VMState.ERROR in a.allowed_from)
        self.assertEqual(leaving, ["delete", "rebuild", "restore", "start"])

    def test_diagramNamesEveryAction(self) -> None:
        diagram = transition_diagram()
        for name in ACTIONS:
            self.assertIn(f": {name} (", diagram)


class EndStateTests(SynchronousTestCase):
    """Where each action leaves an instance comes from ``ACTIONS``, by the VM's power state."""

    def end(self, action: str, power: PowerState) -> VMState:
        return ACTIONS[action].end_state(power)

    def test_aRunningVMEndsWhereTheTableSays(self) -> None:
        self.assertEqual(
            {name: self.end(name, PowerState.RUNNING) for name in ACTIONS},
            {name: action.ends_in for name, action in ACTIONS.items()},
        )

    def test_withoutARunningVMTheStoppedVariantApplies(self) -> None:
        self.assertEqual(
            [
                self.end("confirm-resize", PowerState.SHUTDOWN),
                self.end("revert-resize", PowerState.SHUTDOWN),
                self.end("restore", PowerState.SHUTDOWN),
                self.end("snapshot", PowerState.SHUTDOWN),
                self.end("stop", PowerState.SHUTDOWN),
                self.end("resize", PowerState.SHUTDOWN),
            ],
            [VMState.STOPPED] * 5 + [VMState.RESIZED],
        )

    def test_aStartThatAdoptsAPausedVMLeavesItPaused(self) -> None:
        self.assertEqual(
            [self.end("start", PowerState.PAUSED), self.end("freeze", PowerState.PAUSED)],
            [VMState.PAUSED, VMState.PAUSED],
        )


class TableTests(SynchronousTestCase):
    """``ACTIONS`` is well formed: everything derived from it is well defined."""

    def test_everyTaskBelongsToExactlyOneAction(self) -> None:
        owners = [task for action in ACTIONS.values() for task in action.tasks]
        self.assertEqual(sorted(owners), sorted(TaskState))

    def test_everyActionShowsOneLabelPerTaskOrNone(self) -> None:
        self.assertEqual(
            [
                name
                for name, action in ACTIONS.items()
                if len(action.shows) not in (0, len(action.tasks))
            ],
            [],
        )


# What the operator reads while each task runs, written out here, not derived.
_EXPECTED_DURING_TASK = {
    TaskState.SPAWNING: "LAUNCHING",
    TaskState.POWERING_ON: "STARTING",
    TaskState.POWERING_OFF: "STOPPING",
    TaskState.REBOOTING: "RESTARTING",
    TaskState.PAUSING: "FREEZING",
    TaskState.UNPAUSING: "UNFREEZING",
    TaskState.REBUILDING: "REBUILDING",
    TaskState.RESIZE_QUEUED: "RESIZING",
    TaskState.RESIZE_PREP: "RESIZING",
    TaskState.RESIZE_MIGRATING: "RESIZING",
    TaskState.RESIZE_FINISH: "RESIZING",
    TaskState.RESIZE_CONFIRMING: "CONFIRMING",
    TaskState.RESIZE_REVERTING: "REVERTING",
    TaskState.SNAPSHOTTING: "SNAPSHOTTING",
    TaskState.RESTORING: "RESTORING",
    TaskState.DELETING: "DELETING",
}
# And while none runs: vm_state → status, whatever the power state and the ready key.
_EXPECTED_AT_REST = {
    VMState.BUILDING: "BUILDING",
    VMState.STOPPED: "STOPPED",
    VMState.PAUSED: "FROZEN",
    VMState.RESIZED: "RESIZED",
    VMState.ERROR: "ERROR",
    VMState.DELETED: "DELETED",
}
# ACTIVE: decided by the power state (and the ready key while the VM runs).
_EXPECTED_ACTIVE = {
    (PowerState.RUNNING, True): "READY",
    (PowerState.RUNNING, False): "RUNNING",
    (PowerState.PAUSED, True): "FROZEN",
    (PowerState.PAUSED, False): "FROZEN",
    **{
        (power, ready): "STOPPED"
        for power in (PowerState.NOSTATE, PowerState.SHUTDOWN, PowerState.CRASHED)
        for ready in (True, False)
    },
}


class OperatorStatusTests(SynchronousTestCase):
    """The one status: every combination of the stored fields has a defined, tested output."""

    def test_everyTaskShowsItsTransitionWhateverTheRest(self) -> None:
        self.assertEqual(set(_EXPECTED_DURING_TASK), set(TaskState))
        for task, vm, power, ready in itertools.product(
            TaskState, VMState, PowerState, (True, False)
        ):
            self.assertEqual(
                operator_status(vm, task, power, ready),
                _EXPECTED_DURING_TASK[task],
                (task, vm, power, ready),
            )

    def test_everyRestingStateOtherThanActiveShowsItself(self) -> None:
        self.assertEqual(set(_EXPECTED_AT_REST), set(VMState) - {VMState.ACTIVE})
        for vm, power, ready in itertools.product(_EXPECTED_AT_REST, PowerState, (True, False)):
            self.assertEqual(
                operator_status(vm, None, power, ready), _EXPECTED_AT_REST[vm], (vm, power, ready)
            )

    def test_activeIsDecidedByThePowerStateAndTheReadyKey(self) -> None:
        self.assertEqual(len(_EXPECTED_ACTIVE), len(PowerState) * 2)
        for (power, ready), expected in _EXPECTED_ACTIVE.items():
            self.assertEqual(
                operator_status(VMState.ACTIVE, None, power, ready), expected, (power, ready)
            )

    def test_everyStatusIsReachable(self) -> None:
        """Every status but UNKNOWN comes from the stored states; UNKNOWN never does.

        UNKNOWN is what an unreachable cluster member's instances show, judged
        when they are read (``api.views``), never stored.
        """
        reached = {
            operator_status(vm, task, power, ready)
            for vm, task, power, ready in itertools.product(
                VMState, [None, *TaskState], PowerState, (True, False)
            )
        }
        self.assertEqual(reached, set(OperatorStatus) - {OperatorStatus.UNKNOWN})

    def test_theValueIsTheUpperCaseWord(self) -> None:
        for status in OperatorStatus:
            self.assertEqual(status.value, status.name)


class ConflictWordsTests(SynchronousTestCase):
    """A refused action says why in the operator's words, never a stored field's name."""

    def test_aRestingStateIsNamedAsTheOperatorKnowsIt(self) -> None:
        self.assertEqual(
            task_conflict("start", "web1", None, VMState.ACTIVE).message,
            "Cannot start instance web1: it is running",
        )
        self.assertEqual(
            task_conflict("confirm-resize", "web1", None, VMState.STOPPED).message,
            "Cannot confirm-resize instance web1: it is stopped",
        )

    def test_aTaskInProgressIsNamedWithItsAction(self) -> None:
        self.assertEqual(
            task_conflict("start", "web1", TaskState.POWERING_OFF, VMState.ACTIVE).message,
            "Cannot start instance web1: it is stopping (a stop is in progress)",
        )
        self.assertEqual(
            describe_state(VMState.ACTIVE, TaskState.RESIZE_MIGRATING),
            "resizing (a resize is in progress)",
        )
        self.assertEqual(
            describe_state(VMState.PAUSED, TaskState.UNPAUSING),
            "unfreezing (an unfreeze is in progress)",
        )
        self.assertEqual(
            describe_state(VMState.BUILDING, TaskState.SPAWNING),
            "launching (a launch is in progress)",
        )

    def test_createIsCalledLaunch(self) -> None:
        self.assertEqual(
            task_conflict("create", "web1", None, VMState.ACTIVE).message,
            "Cannot launch instance web1: it is running",
        )

    def test_noMessageNamesAStoredField(self) -> None:
        for task, vm in itertools.product([None, *TaskState], VMState):
            words = task_conflict("stop", "web1", task, vm).message
            for field in ("vm_state", "task_state", "power_state", "resize-", "image-snapshot"):
                self.assertNotIn(field, words, (task, vm))
