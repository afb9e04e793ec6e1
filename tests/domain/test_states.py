"""Tests for vmready.domain.states: derived statuses and the lifecycle table."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.states import (
    ACTIONS,
    PowerState,
    StatusCode,
    TaskState,
    VMState,
    derive_status,
    display_status,
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
