"""``benchmarks._history``: the checker catches each violation on a synthetic history."""

from __future__ import annotations

import json
from typing import Any

import attrs
from twisted.trial.unittest import SynchronousTestCase

from benchmarks._history import (
    Act,
    ClientOp,
    FinalInstance,
    Grant,
    History,
    Outcome,
    Span,
    Verdict,
    check,
    history_from_json,
    spans_from_events,
    with_acts,
)

RUNNING = FinalInstance("c1", "c1", "m1", "active", None, "running", 128, 1)
STOPPED = attrs.evolve(RUNNING, vm_state="stopped", power_state="shutdown")


def op(
    id: int,
    kind: str,
    invoked: float,
    outcome: Outcome = "ok",
    instance: str = "c1",
    **params: Any,
) -> ClientOp:
    """An operation on ``instance`` that took a second."""
    return ClientOp(id, kind, instance, instance, "m1", invoked, invoked + 1, outcome, "", params)


LAUNCH = op(1, "launch", 1.0)
CREATED = Span("c1", "create", 1.1, 1.9, "m1")


def history(**changes: Any) -> History:
    """One instance launched on m1, running, listed as the store holds it: nothing wrong."""
    final = changes.get("final", [RUNNING])
    base = History(
        ops=[LAUNCH],
        store_spans=[CREATED],
        final=final,
        members={"m1": True},
        views={"m1": {f.instance: f.shown() for f in final}},
    )
    return attrs.evolve(base, **changes)


def verdict(**changes: Any) -> Verdict:
    return check(history(**changes))


class CleanTests(SynchronousTestCase):
    def test_aCleanHistoryHasNoViolation(self) -> None:
        self.assertEqual(verdict().violations, [])

    def test_theSummaryCountsEachRule(self) -> None:
        self.assertEqual(verdict().summary(), "lost=0 stuck=0 inconsistent=0 double_master=0")


class LostTests(SynchronousTestCase):
    """An acknowledged operation's fact the final state lacks, with nothing to explain it."""

    def assertLost(self, found: Verdict, count: int = 1) -> None:
        self.assertEqual(found.count("lost"), count, [v.line() for v in found.violations])

    def test_anAcknowledgedLaunchMissingAtTheEndIsLost(self) -> None:
        found = verdict(final=[])
        self.assertLost(found)
        self.assertIn("should be exists", found.violations[0].detail)

    def test_anAcknowledgedDeleteStillPresentIsLost(self) -> None:
        self.assertLost(verdict(ops=[LAUNCH, op(2, "delete", 5.0)]))

    def test_aDeleteThatWasAcknowledgedAndIsGoneIsNotLost(self) -> None:
        found = verdict(ops=[LAUNCH, op(2, "delete", 5.0)], final=[])
        self.assertEqual(found.violations, [])

    def test_anAcknowledgedStopOfAnInstanceThatRunsIsLost(self) -> None:
        self.assertLost(verdict(ops=[LAUNCH, op(2, "stop", 5.0)]))

    def test_anAcknowledgedStartOfAStoppedInstanceIsLost(self) -> None:
        ops = [LAUNCH, op(2, "stop", 5.0), op(3, "start", 8.0)]
        self.assertLost(verdict(ops=ops, final=[STOPPED]))

    def test_anAcknowledgedRenameUnderItsOldNameIsLost(self) -> None:
        self.assertLost(verdict(ops=[LAUNCH, op(2, "rename", 5.0, new_name="c1-r1")]))

    def test_anAcknowledgedSnapshotMissingIsLost(self) -> None:
        self.assertLost(verdict(ops=[LAUNCH, op(2, "snapshot", 5.0, snapshot="s1")]))

    def test_aSnapshotThatIsThereIsNotLost(self) -> None:
        final = [attrs.evolve(RUNNING, snapshots=frozenset({"s1"}))]
        found = verdict(ops=[LAUNCH, op(2, "snapshot", 5.0, snapshot="s1")], final=final)
        self.assertEqual(found.violations, [])

    def test_aConfirmedSizeNotHeldIsLost(self) -> None:
        ops = [LAUNCH, op(2, "resize", 5.0), op(3, "confirm-resize", 8.0, memory=256, cpus=2)]
        self.assertLost(verdict(ops=ops))

    def test_aLaterStartExplainsARunningInstanceAfterAStop(self) -> None:
        ops = [LAUNCH, op(2, "stop", 5.0), op(3, "start", 8.0, outcome="failed")]
        self.assertEqual(verdict(ops=ops).violations, [])

    def test_aRefusedLaterStartDoesNotExplain(self) -> None:
        ops = [LAUNCH, op(2, "stop", 5.0), op(3, "start", 8.0, outcome="refused")]
        self.assertLost(verdict(ops=ops))

    def test_anUnknownStartTheStoreShowsRunningAfterwardExplains(self) -> None:
        # The start was sent first and answered nothing; the store shows it ran after the stop.
        ops = [LAUNCH, op(3, "start", 4.0, outcome="unknown"), op(2, "stop", 5.0)]
        spans = [CREATED, Span("c1", "stop", 5.1, 5.9, "m1"), Span("c1", "start", 7.0, 7.5)]
        self.assertEqual(verdict(ops=ops, store_spans=spans).violations, [])

    def test_anUnknownStartTheStoreNeverRanAfterDoesNotExplain(self) -> None:
        ops = [LAUNCH, op(3, "start", 4.0, outcome="unknown"), op(2, "stop", 5.0)]
        spans = [CREATED, Span("c1", "start", 4.1, 4.5), Span("c1", "stop", 5.1, 5.9, "m1")]
        self.assertLost(verdict(ops=ops, store_spans=spans))

    def test_aVMThatExitedExplainsAStoppedInstance(self) -> None:
        notes = [Span("c1", "vm-exited", 9.0, 9.0, "m1")]
        self.assertEqual(verdict(final=[STOPPED], notes=notes).violations, [])

    def test_aNoteBeforeTheOperationDoesNotExplain(self) -> None:
        notes = [Span("c1", "vm-exited", 0.5, 0.5, "m1")]
        self.assertLost(verdict(final=[STOPPED], notes=notes))

    def test_aReadyHasNoFactToLose(self) -> None:
        found = verdict(ops=[LAUNCH, op(2, "ready", 5.0)])
        self.assertEqual(found.violations, [])


class StuckTests(SynchronousTestCase):
    def test_anInstanceLeftInATaskIsStuck(self) -> None:
        final = [attrs.evolve(RUNNING, task_state="powering-off")]
        found = verdict(final=final)
        self.assertEqual(found.count("stuck"), 1, found.violations)
        self.assertIn("still in task powering-off", found.violations[0].detail)

    def test_anActionNeverEndedIsStuck(self) -> None:
        spans = [CREATED, Span("c1", "stop", 5.0, None, "m1")]
        found = verdict(store_spans=spans)
        self.assertEqual(found.count("stuck"), 1, found.violations)
        self.assertIn("stop started at 5.000 never ended", found.violations[0].detail)


class InconsistentTests(SynchronousTestCase):
    def assertInconsistent(self, found: Verdict, words: str) -> None:
        self.assertEqual(found.count("inconsistent"), 1, [v.line() for v in found.violations])
        self.assertIn(words, found.violations[0].detail)

    def test_anInstanceOfNoMemberIsInconsistent(self) -> None:
        self.assertInconsistent(verdict(final=[attrs.evolve(RUNNING, member="")]), "no member")

    def test_anInstanceOfAnUnknownMemberIsInconsistent(self) -> None:
        found = verdict(final=[attrs.evolve(RUNNING, member="m9")], views={})
        self.assertInconsistent(found, "its member m9 is no member")

    def test_anInstanceOfAnOfflineMemberIsInconsistent(self) -> None:
        self.assertInconsistent(verdict(members={"m1": False}), "m1 is not online")

    def test_aMemberWhoseListingDisagreesWithTheStoreIsInconsistent(self) -> None:
        views = {"m1": {"c1": RUNNING.shown()}, "m2": {"c1": STOPPED.shown()}}
        self.assertInconsistent(verdict(views=views), "member m2 shows")

    def test_aMemberMissingAnInstanceIsInconsistent(self) -> None:
        self.assertInconsistent(verdict(views={"m1": {}}), "shows None")

    def test_aVMProblemIsInconsistent(self) -> None:
        found = verdict(problems=["c1: active/running but no VM process serves"])
        self.assertInconsistent(found, "no VM process serves")


class DoubleMasterTests(SynchronousTestCase):
    def assertDoubleMaster(self, found: Verdict, words: str) -> None:
        self.assertEqual(found.count("double_master"), 1, [v.line() for v in found.violations])
        self.assertIn(words, found.violations[0].detail)

    def test_overlappingActionsInTheStoreAreADoubleMaster(self) -> None:
        spans = [CREATED, Span("c1", "stop", 5.0, 7.0), Span("c1", "restart", 6.0, 8.0)]
        self.assertDoubleMaster(verdict(store_spans=spans), "overlap (as the store recorded")

    def test_overlappingTasksOfTwoDaemonsAreADoubleMaster(self) -> None:
        spans = [
            Span("c1", "powering-off", 5.0, 7.0, "m1", "m1#1", 1),
            Span("c1", "rebooting", 6.5, 8.0, "m1", "m1#2", 2),
        ]
        self.assertDoubleMaster(verdict(member_spans=spans), "rebooting by m1#2")

    def test_actionsOneAfterTheOtherAreNoDoubleMaster(self) -> None:
        spans = [CREATED, Span("c1", "stop", 5.0, 7.0), Span("c1", "start", 7.0, 8.0)]
        self.assertEqual(verdict(store_spans=spans).count("double_master"), 0)

    def test_anActionNeverEndedIsJudgedStuckNotDoubleMaster(self) -> None:
        spans = [CREATED, Span("c1", "stop", 5.0, None), Span("c1", "start", 7.0, 8.0)]
        found = verdict(store_spans=spans)
        self.assertEqual((found.count("double_master"), found.count("stuck")), (0, 1))

    def test_anActionUnderATakenOverEpochIsADoubleMaster(self) -> None:
        grants = [Grant("m1", 1, 0.0, "m1#1"), Grant("m1", 2, 10.0, "m1#2")]
        spans = [Span("c1", "powering-off", 12.0, 12.5, "m1", "m1#1", 1)]
        found = verdict(member_spans=spans, grants=grants)
        self.assertDoubleMaster(
            found, "ran at 12.000 under epoch 1 of member m1, taken over at 10.000"
        )

    def test_anActionBeforeTheTakeoverIsNoDoubleMaster(self) -> None:
        grants = [Grant("m1", 1, 0.0), Grant("m1", 2, 10.0)]
        spans = [Span("c1", "powering-off", 8.0, 9.0, "m1", "m1#1", 1)]
        self.assertEqual(verdict(member_spans=spans, grants=grants).violations, [])

    def test_anotherMembersEpochIsNoTakeover(self) -> None:
        grants = [Grant("m2", 5, 1.0)]
        spans = [Span("c1", "powering-off", 8.0, 9.0, "m1", "m1#1", 1)]
        self.assertEqual(verdict(member_spans=spans, grants=grants).violations, [])

    def test_aDaemonThatRanOnAfterATakeoverIsADoubleMaster(self) -> None:
        found = verdict(lingering=[("m1", "m1#1 still ran 33s after it woke")])
        self.assertDoubleMaster(found, "still ran")

    def test_aVMThatOutlivedItsMembersLeaseIsADoubleMaster(self) -> None:
        found = verdict(outlived=[("m1", "VM 1a2b of frozen m1#1 still ran once its lease")])
        self.assertDoubleMaster(found, "VM 1a2b of frozen m1#1")

    def test_aFrozenDaemonsOpenTaskIsJudgedUpToItsLastEventNotItsEnd(self) -> None:
        # m1#1 announced a stop at 5, was frozen, taken over at 10, woke and stopped at 20,
        # doing nothing on c1 after 6; m1#2 powered c1 on from 12 to 14.
        frozen = spans_from_events(
            [(5.0, "c1", "powering-off"), (6.0, "c1", "powering-off")], "m1", "m1#1", 1, until=20.0
        )
        spans = [*frozen, Span("c1", "powering-on", 12.0, 14.0, "m1", "m1#2", 2)]
        grants = [Grant("m1", 1, 0.0, "m1#1"), Grant("m1", 2, 10.0, "m1#2")]
        self.assertEqual(verdict(member_spans=spans, grants=grants).violations, [])

    def test_aFrozenDaemonsEventAfterWakingOverlapsTheNewHolder(self) -> None:
        frozen = spans_from_events(
            [(5.0, "c1", "powering-off"), (13.0, "c1", "powering-off")],
            "m1",
            "m1#1",
            1,
            until=20.0,
        )
        spans = [*frozen, Span("c1", "powering-on", 12.0, 14.0, "m1", "m1#2", 2)]
        self.assertDoubleMaster(verdict(member_spans=spans), "last seen acting at 13.000")

    def test_aFrozenDaemonsActAfterWakingOverlapsTheNewHolder(self) -> None:
        frozen = spans_from_events([(5.0, "c1", "powering-off")], "m1", "m1#1", 1, until=20.0)
        acts = [Act("c1", 13.0, "VM c1 did not power off within 1s; forcing it", "m1", "m1#1", 1)]
        spans = [*with_acts(frozen, acts), Span("c1", "powering-on", 12.0, 14.0, "m1", "m1#2", 2)]
        self.assertDoubleMaster(verdict(member_spans=spans), "powering-off by m1#1")

    def test_anActAfterATakeoverIsADoubleMaster(self) -> None:
        grants = [Grant("m1", 1, 0.0, "m1#1"), Grant("m1", 2, 10.0, "m1#2")]
        acts = [Act("c1", 11.0, "starting VM c1: fakeqemu", "m1", "m1#1", 1)]
        found = verdict(acts=acts, grants=grants)
        self.assertDoubleMaster(
            found, "m1#1 acted on its VM (starting VM c1: fakeqemu) at 11.000 under epoch 1"
        )

    def test_anActBeforeTheTakeoverOrOfTheNewHolderIsNoDoubleMaster(self) -> None:
        grants = [Grant("m1", 1, 0.0, "m1#1"), Grant("m1", 2, 10.0, "m1#2")]
        acts = [
            Act("c1", 9.0, "pressed the ACPI power button of c1", "m1", "m1#1", 1),
            Act("c1", 11.0, "starting VM c1: fakeqemu", "m1", "m1#2", 2),
        ]
        self.assertEqual(verdict(acts=acts, grants=grants).violations, [])

    def test_actsOutsideASpanOrOfAnotherDaemonDoNotExtendIt(self) -> None:
        frozen = spans_from_events([(5.0, "c1", "powering-off")], "m1", "m1#1", 1, until=20.0)
        acts = [
            Act("c1", 21.0, "starting VM c1: fakeqemu", "m1", "m1#1", 1),
            Act("c1", 13.0, "starting VM c1: fakeqemu", "m1", "m1#2", 2),
            Act("c2", 13.0, "starting VM c2: fakeqemu", "m1", "m1#1", 1),
        ]
        (span,) = with_acts(frozen, acts)
        self.assertEqual(span.acted_until, 5.0)

    def test_doubleMastersAreCountedOncePerInstance(self) -> None:
        spans = [Span("c1", "a", 5.0, 9.0), Span("c1", "b", 6.0, 7.0), Span("c1", "c", 8, 10)]
        found = verdict(store_spans=[CREATED, *spans])
        self.assertEqual(len([v for v in found.violations if v.rule == "double_master"]), 2)
        self.assertEqual(found.count("double_master"), 1)


class SpansFromEventsTests(SynchronousTestCase):
    def test_aTaskRunsFromItsFirstEventToTheEventWithoutOne(self) -> None:
        events = [(1.0, "c1", "resize-queued"), (2.0, "c1", "resize-prep"), (3.0, "c1", None)]
        self.assertEqual(
            spans_from_events(events, "m1", "m1#1", 1),
            [Span("c1", "resize-queued", 1.0, 3.0, "m1", "m1#1", 1)],
        )

    def test_aTaskOfADaemonThatEndedRanUntilThenLastSeenActingAtItsLastEvent(self) -> None:
        events = [(1.0, "c1", "powering-on"), (2.0, "c1", "powering-on")]
        spans = spans_from_events(events, "m1", "m1#1", 1, until=4.0)
        self.assertEqual(spans, [Span("c1", "powering-on", 1.0, 4.0, "m1", "m1#1", 1, 2.0)])

    def test_aTaskStillRunningNeverEnded(self) -> None:
        spans = spans_from_events([(1.0, "c1", "powering-on")], "m1", "m1#1", None)
        self.assertEqual(spans, [Span("c1", "powering-on", 1.0, None, "m1", "m1#1", None)])

    def test_eventsWithoutATaskOpenNothing(self) -> None:
        self.assertEqual(spans_from_events([(1.0, "c1", None)], "m1", "m1#1", 1), [])


class JSONTests(SynchronousTestCase):
    def test_aHistoryWrittenAsJSONReadsBackTheSame(self) -> None:
        written = history(
            ops=[LAUNCH, op(2, "snapshot", 5.0, snapshot="s1")],
            member_spans=[Span("c1", "spawning", 1.1, 1.9, "m1", "m1#1", 1)],
            notes=[Span("c1", "vm-exited", 9.0, 9.0, "m1")],
            grants=[Grant("m1", 1, 0.5, "m1#1")],
            final=[attrs.evolve(RUNNING, snapshots=frozenset({"s1"}))],
            problems=["a problem"],
            lingering=[("m1", "m1#1 still ran")],
            acts=[Act("c1", 3.0, "starting VM c1: fakeqemu", "m1", "m1#1", 1)],
            outlived=[("m1", "VM 1a2b still ran")],
        )
        text = json.dumps(attrs.asdict(written), default=sorted)
        self.assertEqual(history_from_json(json.loads(text)), written)
