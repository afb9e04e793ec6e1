"""Self-fencing: a cluster member acts on its VMs only while its lease surely holds.

``LeaseGuard`` on a ``task.Clock``, then a member "frozen" past its lease (its
clock moved on, no renewal ran) with a real fakeqemu VM it was stopping.
"""

from __future__ import annotations

import os
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from tests.hypervisor.test_hypervisor import EventRecorder, VMTestCase, bounded
from vmready.domain.members import ActingRefused, LeaseLost
from vmready.domain.reactor import IVMReadyReactor
from vmready.domain.states import PowerState
from vmready.hypervisor.cmdline import VMSpec
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.vmevents import VMEventKind
from vmready.lifecycle.announcing import AnnouncementHold
from vmready.lifecycle.events import LIFECYCLE, OPERATION, Event, EventBus
from vmready.lifecycle.leaseguard import LeaseGuard
from vmready.lifecycle.members import Membership
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.sqlite import Store


class _Renewals:
    """Stands in for ``Membership.renew``: each call counted, answering ``outcome``."""

    def __init__(self) -> None:
        self.calls = 0
        self.outcome: Exception | None = None
        self.pending: Deferred[None] | None = None
        self.guard: LeaseGuard | None = None
        self.clock: Clock | None = None

    async def __call__(self) -> None:
        self.calls += 1
        sent = self.clock.seconds() if self.clock is not None else 0.0
        if self.pending is not None:
            await self.pending
        assert self.guard is not None
        if isinstance(self.outcome, LeaseLost):
            self.guard.revoke()  # as ``Membership.renew_lease`` does
        if self.outcome is not None:
            raise self.outcome
        self.guard.confirm(sent)


class _SpawnRecorder:
    """A reactor that records the processes it is asked to spawn (and spawns none)."""

    def __init__(self) -> None:
        self.spawned: list[list[str]] = []

    def spawnProcess(self, protocol: object, executable: str, args: list[str], **kw: Any) -> None:
        self.spawned.append(args)


class _GuardTestCase(SynchronousTestCase):
    """Member m1's guard, a 3 s lease on a ``task.Clock``, renewals answered by ``_Renewals``."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.renewals = _Renewals()
        self.guard = LeaseGuard("m1", 3.0, self.clock.seconds, self.renewals)
        self.renewals.guard, self.renewals.clock = self.guard, self.clock


class LeaseGuardTests(_GuardTestCase):
    def before_acting(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self.guard.before_acting("web1", "quit"))

    def test_aLeaseNeverConfirmedDoesNotAllowActing(self) -> None:
        self.assertFalse(self.guard.may_act())

    def test_aConfirmedLeaseAllowsActingUntilItsLengthHasPassed(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(2.9)
        self.assertTrue(self.guard.may_act())
        self.clock.advance(0.1)
        self.assertFalse(self.guard.may_act())

    def test_withAMarginNothingActsThatCloseToTheLeasesEnd(self) -> None:
        guard = LeaseGuard("m1", 3.0, self.clock.seconds, self.renewals, margin=0.3)
        guard.confirm(self.clock.seconds())
        self.assertEqual(guard.until(), self.clock.seconds() + 2.7)
        self.clock.advance(2.6)
        self.assertTrue(guard.may_act())
        self.clock.advance(0.2)
        self.assertFalse(guard.may_act())

    def test_aLostLeaseHasNoEnd(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.guard.revoke()
        self.assertIsNone(self.guard.until())

    def test_theLeaseIsTimedFromWhenTheRenewalWasSentNotWhenItWasAnswered(self) -> None:
        sent = self.clock.seconds()
        self.clock.advance(2.0)  # the store took 2 s to answer
        self.guard.confirm(sent)
        self.clock.advance(1.0)
        self.assertFalse(self.guard.may_act())

    def test_anOlderRenewalAnsweredLateDoesNotMoveTheConfirmationBack(self) -> None:
        self.guard.confirm(101.0)
        self.guard.confirm(100.5)
        self.assertEqual(self.guard.confirmed_at, 101.0)

    def test_withinTheLeaseAStepRunsWithoutARenewal(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.successResultOf(self.before_acting())
        self.assertEqual(self.renewals.calls, 0)

    def test_pastTheLeaseAStepRenewsFirstAndRunsWhenTheRenewalSucceeds(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)  # frozen, or cut off: no renewal ran
        self.successResultOf(self.before_acting())
        self.assertEqual(self.renewals.calls, 1)
        self.assertTrue(self.guard.may_act())

    def test_pastTheLeaseAStepIsRefusedWhenTheRenewalFindsTheLeaseLost(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)
        self.renewals.outcome = LeaseLost("m1", None)
        refused = self.failureResultOf(self.before_acting(), ActingRefused).value
        self.assertEqual(
            refused.message,
            "not acting on VM web1 (quit): the lease of member m1 was lost: member m1 is no "
            "longer in the store; stopping: its instances are not this daemon's any more",
        )

    def test_pastTheLeaseAStepIsRefusedWhenTheStoreCannotConfirmIt(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)
        self.renewals.outcome = ConnectionError("the store is out of reach")
        refused = self.failureResultOf(self.before_acting(), ActingRefused).value
        self.assertEqual(
            refused.message,
            "not acting on VM web1 (quit): the lease of member m1 may have run out (last "
            "confirmed 10.0s ago, lease 3s) and renewing it failed: the store is out of reach",
        )

    def test_stepsWaitingAtOnceShareOneRenewal(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)
        answer: Deferred[None] = Deferred()
        self.renewals.pending = answer
        first, second = self.before_acting(), self.before_acting()
        answer.callback(None)
        self.successResultOf(first)
        self.successResultOf(second)
        self.assertEqual(self.renewals.calls, 1)

    def test_aRenewalAnsweredMoreThanALeaseAfterItWasSentRefusesTheStep(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)
        answer: Deferred[None] = Deferred()
        self.renewals.pending = answer
        acting = self.before_acting()
        self.clock.advance(3.0)  # the store took the whole lease to answer
        answer.callback(None)
        refused = self.failureResultOf(acting, ActingRefused).value
        self.assertEqual(
            refused.message,
            "not acting on VM web1 (quit): the lease of member m1 was renewed too late to be "
            "sure it holds",
        )

    def test_aLostLeaseRefusesEveryStepWithoutAskingTheStoreAgain(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.guard.revoke()
        self.guard.confirm(self.clock.seconds())  # a renewal that was in flight
        self.assertFalse(self.guard.may_act())
        self.failureResultOf(self.before_acting(), ActingRefused)
        self.assertEqual(self.renewals.calls, 0)

    def test_aRefusedStepStartsNoVMProcess(self) -> None:
        recorder = _SpawnRecorder()
        driver = HypervisorDriver(cast(IVMReadyReactor, recorder), "fakeqemu")
        driver.guard = self.guard
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)
        self.renewals.outcome = LeaseLost("m1", None)
        spec = _spec(self.mktemp())
        self.failureResultOf(Deferred.fromCoroutine(driver.launch(spec)), ActingRefused)
        self.assertEqual(recorder.spawned, [])
        self.assertFalse(os.path.exists(spec.run_dir))


class AnnouncementHoldTests(_GuardTestCase):
    """A member's events about its instances wait while its lease is in doubt."""

    def setUp(self) -> None:
        super().setUp()
        self.bus = EventBus(self.clock.seconds, location="m1")
        self.hold = AnnouncementHold(self.guard, max_held=3)
        self.bus.gate = self.hold
        self.seen: list[str] = []
        self.bus.subscribe(lambda event: self.seen.append(_what(event)))

    def frozen(self) -> None:
        """Joined, then no renewal ran for longer than the lease."""
        self.guard.confirm(self.clock.seconds())
        self.clock.advance(10)

    def test_whileTheLeaseHoldsEventsGoOutAtOnce(self) -> None:
        self.guard.confirm(self.clock.seconds())
        self.bus.lifecycle("instance-started", "web1")
        self.assertEqual(self.seen, ["instance-started web1"])
        self.assertEqual(self.renewals.calls, 0)

    def test_inDoubtTheMembersEventsWaitForARenewalThenGoOutInOrder(self) -> None:
        self.frozen()
        answer: Deferred[None] = Deferred()
        self.renewals.pending = answer
        self.bus.lifecycle("instance-state", "web1")
        self.bus.publish(OPERATION, {"id": "op1", "resources": {}})
        self.assertEqual(self.seen, [])
        self.assertEqual((self.renewals.calls, self.hold.held), (1, 2))
        answer.callback(None)
        self.assertEqual(self.seen, ["instance-state web1", "operation op1"])
        self.assertEqual(self.hold.held, 0)

    def test_aLostLeaseDropsWhatWasHeldAndEverythingAfter(self) -> None:
        self.frozen()
        self.renewals.outcome = LeaseLost("m1", None)
        self.bus.lifecycle("instance-state", "c12")
        self.bus.lifecycle("instance-started", "c12")
        self.assertEqual(self.seen, [])
        self.assertEqual((self.hold.held, self.hold.dropped), (0, 2))
        self.guard.confirm(self.clock.seconds())  # a renewal that was in flight
        self.bus.lifecycle("instance-stopped", "c12")
        self.assertEqual(self.seen, [])

    def test_eventsAboutTheDaemonItselfAreNeverHeld(self) -> None:
        self.frozen()
        self.renewals.outcome = ConnectionError("the store is out of reach")
        self.bus.server("store-write-failed")
        self.assertEqual(self.seen, ["store-write-failed /1.0"])

    def test_withTheStoreOutOfReachTheyWaitForTheNextRenewalThatSucceeds(self) -> None:
        self.frozen()
        self.renewals.outcome = ConnectionError("the store is out of reach")
        self.bus.lifecycle("instance-state", "web1")
        self.assertEqual((self.seen, self.hold.held), ([], 1))
        self.renewals.outcome = None
        self.guard.confirm(self.clock.seconds())  # the membership's own renewal loop
        self.assertEqual(self.seen, ["instance-state web1"])

    def test_pastItsBoundTheOldestHeldEventsAreDropped(self) -> None:
        self.frozen()
        self.renewals.outcome = ConnectionError("the store is out of reach")
        for name in ("a", "b", "c", "d", "e"):
            self.bus.lifecycle("instance-state", name)
        self.guard.confirm(self.clock.seconds())
        self.assertEqual(self.seen, [f"instance-state {name}" for name in "cde"])
        self.assertEqual(self.hold.dropped, 2)

    def test_beforeTheMemberJoinedEventsWaitForItsJoinWithoutARenewal(self) -> None:
        self.bus.lifecycle("instance-state", "web1")
        self.assertEqual((self.seen, self.renewals.calls), ([], 0))
        self.guard.confirm(self.clock.seconds())
        self.assertEqual(self.seen, ["instance-state web1"])


def _what(event: Event) -> str:
    """An event in a few words: its action and subject, or its operation's id."""
    if event.type == OPERATION:
        return f"operation {event.metadata['id']}"
    return f"{event.metadata['action']} {event.metadata['source'].removeprefix('/1.0/instances/')}"


def _spec(directory: str) -> VMSpec:
    path = os.path.abspath(directory)
    return VMSpec(name="web1", uuid="u", memory_mib=64, cpus=1, run_dir=path, ring_size=4096)


class FrozenMemberTests(VMTestCase):
    """Member "a" on a SQLite store and a ``task.Clock``, with a real fakeqemu VM it stops.

    Moving the clock past the lease at once is what a frozen daemon sees when
    it wakes: every timer due meanwhile runs, with the late time.
    """

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.path = os.path.join(self.directory, "vmready.sqlite")
        self.a = self.member("a" * 64)

    def member(self, fingerprint: str) -> Membership:
        engine = Store.open(self.path, clock=self.clock.seconds)
        self.addCleanup(engine.close)
        store = AsyncStore(engine, InlineExecutor(), cached=False, member="a")
        bus = EventBus(self.clock.seconds)
        return Membership("a", "10.0.0.1:8443", fingerprint, store, bus, self.clock, 15.0)

    async def stopping_vm(self) -> tuple[Deferred[str], Any]:
        """A VM launched under a's lease, a stop of it waiting out its 1 s power-off timeout."""
        await self.a.start()
        self.addCleanup(self._stop_renewing)
        driver = self.make_driver()
        driver.guard = self.a.guard
        vm = await self.launch(driver=driver)
        recorder = EventRecorder(vm)
        stopping = Deferred.fromCoroutine(vm.shutdown(1.0, self.clock))
        await recorder.next(VMEventKind.POWERDOWN)  # fakeqemu's guest ignores the button
        return stopping, vm

    def _stop_renewing(self) -> None:
        loop = self.a._loop
        if loop is not None and loop.running:
            loop.stop()

    async def test_aMemberWokenAfterATakeoverDoesNotSendTheQueuedForcedStop(self) -> None:
        stopping, vm = await self.stopping_vm()
        lost: list[LeaseLost] = []
        self.a.lost.addCallback(lost.append)
        # Frozen: a's lease ran out and another daemon took the name "a" over.
        self.a.store.engine.members.give_up_lease("a", "a" * 64)
        await self.member("c" * 64).start()
        self.clock.advance(20)  # woken: the stop's timeout and a renewal are due at once
        refused = self.failureResultOf(stopping, ActingRefused).value
        self.assertIn("not acting on VM vm1 (quit): the lease of member a was lost", str(refused))
        self.assertEqual(len(lost), 1)
        self.assertFalse(vm.gone)
        self.assertEqual(await vm.query_power_state(), PowerState.RUNNING)
        # Nor does it start a VM.
        driver = self.make_driver()
        driver.guard = self.a.guard
        spec = self.spec("vm2")
        with self.assertRaises(ActingRefused):
            await driver.launch(spec)
        self.assertFalse(os.path.exists(spec.pidfile))

    async def test_aMemberWokenWithItsNameStillItsOwnRenewsAndGoesOnStopping(self) -> None:
        stopping, vm = await self.stopping_vm()
        self.clock.advance(20)
        self.assertEqual(await bounded(stopping), "forced")
        self.assertTrue(vm.gone)
        self.assertTrue(self.a.guard.may_act())

    async def woken_announcing(self) -> list[str]:
        """a, frozen past its lease, wakes to an announcement queued behind the freeze."""
        await self.a.start()
        self.addCleanup(self._stop_renewing)
        seen: list[str] = []
        self.a.events.subscribe(lambda event: seen.append(_what(event)), frozenset({LIFECYCLE}))
        # Due before the renewal the freeze also held back, run with the late time.
        self.clock.callLater(0.1, self.a.events.lifecycle, "instance-state", "c12")
        return seen

    async def test_aMemberWokenAfterATakeoverDoesNotAnnounceWhatItHadQueued(self) -> None:
        seen = await self.woken_announcing()
        self.a.store.engine.members.give_up_lease("a", "a" * 64)
        await self.member("c" * 64).start()
        self.clock.advance(20)
        self.assertEqual([what for what in seen if "c12" in what], [])
        self.assertTrue(self.a.lost.called)

    async def test_aMemberWokenWithItsNameStillItsOwnAnnouncesOnceItRenewed(self) -> None:
        seen = await self.woken_announcing()
        self.clock.advance(20)
        self.assertEqual(seen, ["instance-state c12"])
        self.assertTrue(self.a.guard.may_act())
