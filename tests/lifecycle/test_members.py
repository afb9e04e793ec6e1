"""Membership: the lease renewed on a clock, the members seen, who runs what, where to launch."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar, cast

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, Logger, formatEvent
from twisted.trial.unittest import TestCase

from vmready.domain.members import Fenced, LeaseHeld, LeaseLost, MemberState
from vmready.domain.model import NotFound, Unavailable
from vmready.domain.states import PowerState
from vmready.lifecycle.events import Event, EventBus
from vmready.lifecycle.members import MEMBER_ONLINE, MEMBER_UNREACHABLE, Membership
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.sqlite import Store

T = TypeVar("T")


class _Reachable(InlineExecutor):
    """Inline; while ``refusing`` is set, each call fails with it at once (and is counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing: Exception | None = None
        self.calls = 0

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        self.calls += 1
        if self.refusing is not None:
            return fail(self.refusing)
        return super().submit(work)


def _executor(membership: Membership) -> _Reachable:
    executor = membership.store.executor
    assert isinstance(executor, _Reachable)
    return executor


class MembershipTests(TestCase):
    """Two members ("a" and "b") on one SQLite store file, each its own connection."""

    def setUp(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        self.path = os.path.join(directory, "vmready.sqlite")
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.events: dict[str, list[Event]] = {}
        self.a = self.member("a")
        self.b = self.member("b")

    def member(self, name: str, lease: float = 15.0, fingerprint: str | None = None) -> Membership:
        engine = Store.open(self.path, clock=self.clock.seconds)
        self.addCleanup(engine.close)
        store = AsyncStore(engine, _Reachable(), cached=False, member=name)
        bus = EventBus(self.clock.seconds)
        seen = self.events.setdefault(name, [])
        bus.subscribe(seen.append)
        membership = Membership(
            name,
            f"10.0.0.{ord(name[0]) - 96}:8443",
            fingerprint or name * 64,
            store,
            bus,
            self.clock,
            lease,
        )
        self.addCleanup(self._stopped, membership)
        return membership

    async def _stopped(self, membership: Membership) -> None:
        if membership._loop is not None:
            await membership.stop()

    def announced(self, name: str) -> list[tuple[str, Any]]:
        return [
            (event.metadata["action"], event.metadata["context"].get("member"))
            for event in self.events[name]
        ]

    def launch(self, membership: Membership, instance: str) -> None:
        self.successResultOf(Deferred.fromCoroutine(_create(membership.store, instance)))

    async def test_startJoinsAndRenewsEveryThirdOfTheLease(self) -> None:
        await self.a.start()
        (member,) = self.a.view.members
        self.assertEqual(
            (member.name, member.address, member.fingerprint, member.lease_expires),
            ("a", "10.0.0.1:8443", "a" * 64, 1_000_015.0),
        )
        self.clock.advance(5)
        self.assertEqual(self.a.view.members[0].lease_expires, 1_000_020.0)
        self.clock.advance(5)
        self.assertEqual(self.a.view.members[0].lease_expires, 1_000_025.0)

    async def test_aMemberThatStopsRenewingIsAnnouncedUnreachableThenOnline(self) -> None:
        await self.a.start()
        await self.b.start()
        self.clock.advance(5)
        self.assertEqual(self.announced("a"), [(MEMBER_ONLINE, "b")])
        # b's renewals stop without giving up the lease (a crash): a sees it when it runs out.
        assert self.b._loop is not None
        self.b._loop.stop()
        self.b._loop = None
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(self.announced("a"), [(MEMBER_ONLINE, "b")])
        self.clock.advance(5)  # b's lease ran out at +20; a renews at +20
        self.assertEqual(self.announced("a"), [(MEMBER_ONLINE, "b"), (MEMBER_UNREACHABLE, "b")])
        unreachable = self.events["a"][-1]
        self.assertEqual(unreachable.metadata["source"], "/1.0")
        self.assertEqual(
            unreachable.metadata["context"],
            {
                "member": "b",
                "address": "10.0.0.2:8443",
                "lease_expires_at": "1970-01-12T13:47:00Z",
            },
        )
        await self.b.start()
        self.clock.advance(5)
        self.assertEqual(self.announced("a")[-1], (MEMBER_ONLINE, "b"))
        # Its own state is never announced to itself.
        self.assertNotIn("b", [member for _, member in self.announced("b")])

    async def test_aCleanStopMakesTheMemberUnreachableAtOnce(self) -> None:
        await self.a.start()
        await self.b.start()
        await self.a.refresh()
        await self.b.stop()
        view = await self.a.refresh()
        self.assertIs(view.state_of("b"), MemberState.UNREACHABLE)
        self.assertEqual(self.announced("a")[-1], (MEMBER_UNREACHABLE, "b"))
        # b renews no more.
        expires = view.find("b")
        self.clock.advance(30)
        after = await self.a.refresh()
        self.assertEqual(after.find("b"), expires)

    async def test_aFailingRenewalIsLoggedAndRetried(self) -> None:
        await self.a.start()
        store = _executor(self.a)
        logged: list[dict[str, Any]] = []
        self.a.log = Logger(observer=cast(ILogObserver, logged.append))
        store.refusing = sqlite3.OperationalError("database is locked")
        before = store.calls
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(store.calls - before, 2)  # one renewal each time
        # Said once, not at every retry.
        self.assertEqual(
            [formatEvent(event) for event in logged],
            [
                "renewing the lease of cluster member a failed: database is locked; "
                "trying again every 5s"
            ],
        )
        store.refusing = None
        self.clock.advance(5)
        self.assertEqual(self.a.view.members[0].lease_expires, 1_000_030.0)
        self.assertEqual(formatEvent(logged[-1]), "renewed the lease of cluster member a again")

    async def test_anotherDaemonWithTheSameNameIsRefusedWhileTheLeaseRuns(self) -> None:
        await self.a.start()
        clone = self.member("a", fingerprint="c" * 64)
        with self.assertRaises(LeaseHeld) as refused:
            await clone.start()
        self.assertIn(
            "member name a is held by another daemon at 10.0.0.1:8443", str(refused.exception)
        )
        # It renews nothing, and the holder's lease is untouched.
        self.assertIsNone(clone._loop)
        self.clock.advance(5)
        (held,) = self.a.view.members
        self.assertEqual((held.fingerprint, held.lease_expires), ("a" * 64, 1_000_020.0))

    async def test_aTakeoverSeenInTheMembersStopsAtOnceNotAtTheNextRenewal(self) -> None:
        await self.a.start()
        lost: list[LeaseLost] = []
        self.a.lost.addCallback(lost.append)
        engine = self.a.store.engine
        # a's lease ran out (its store was out of reach) and a new daemon took the name.
        _executor(self.a).refusing = sqlite3.OperationalError("unable to open database file")
        for _ in range(4):
            self.clock.advance(5)
        _executor(self.a).refusing = None
        engine.members.renew_lease("a", "10.0.0.9:8443", "c" * 64, 15.0)
        await self.a.refresh()  # a members notification, before any renewal of a's
        (reported,) = lost
        assert reported.holder is not None
        self.assertEqual(reported.holder.fingerprint, "c" * 64)
        self.assertIsNone(self.a._loop)

    async def test_aWriteAfterATakeoverIsRefusedAndStopsItBeforeTheNextRenewal(self) -> None:
        """a was frozen past its lease (no renewal ran) and a new daemon took its name: a's
        first write is refused by the store, and that loses the lease at once."""
        await self.a.start()
        self.launch(self.a, "web1")
        lost: list[LeaseLost] = []
        self.a.lost.addCallback(lost.append)
        self.clock.advance(4)  # no renewal yet (every 5 s)
        self.a.store.engine.members.give_up_lease("a", "a" * 64)  # as if it ran out
        successor = self.member("a", fingerprint="c" * 64)
        await successor.start()
        before = _executor(self.a).calls
        with self.assertRaises(Fenced) as refused:
            await self.a.store.instances.set_power_state("web1", PowerState.SHUTDOWN)
        self.assertEqual(_executor(self.a).calls, before + 1)  # the write alone: no renewal
        (reported,) = lost
        self.assertEqual(reported.holder, refused.exception.holder)
        assert reported.holder is not None
        self.assertEqual(reported.holder.fingerprint, "c" * 64)
        self.assertIsNone(self.a._loop)

    async def test_aLostLeaseStopsTheRenewalsAndIsReported(self) -> None:
        await self.a.start()
        store = _executor(self.a)
        logged: list[dict[str, Any]] = []
        self.a.log = Logger(observer=cast(ILogObserver, logged.append))
        lost: list[LeaseLost] = []
        self.a.lost.addCallback(lost.append)
        # The store out of a's reach longer than its lease: it ran out, and a new daemon
        # (another certificate) took the name over.
        store.refusing = sqlite3.OperationalError("unable to open database file")
        for _ in range(4):
            self.clock.advance(5)
        self.assertEqual(lost, [])
        successor = self.member("a", fingerprint="c" * 64)
        await successor.start()
        store.refusing = None
        self.clock.advance(5)
        (reported,) = lost
        assert reported.holder is not None
        self.assertEqual(reported.holder.fingerprint, "c" * 64)
        self.assertEqual(formatEvent(logged[-1]), str(reported))
        self.assertIn("member name a was taken over by another daemon", str(reported))
        # No renewal any more; its stop leaves the successor's lease alone.
        self.assertIsNone(self.a._loop)
        before = store.calls
        self.clock.advance(30)
        self.assertEqual(store.calls, before)
        await self.a.stop()
        view = await successor.refresh()
        self.assertIs(view.state_of("a"), MemberState.ONLINE)
        self.assertEqual(view.members[0].fingerprint, "c" * 64)

    async def test_unreachableIsJudgedBetweenRenewalsOnTheStoresClock(self) -> None:
        await self.b.start()
        self.launch(self.b, "web1")
        await self.a.start()
        record = self.a.store.view.get_instance("web1")
        self.assertEqual(record.member, "b")
        self.assertFalse(self.a.is_unreachable(record))
        assert self.b._loop is not None
        self.b._loop.stop()
        self.b._loop = None
        # a read the view at +0; b's lease (from +0) runs out at +15, before a's next read.
        self.clock.advance(4.9)
        self.assertFalse(self.a.is_unreachable(record))
        assert self.a._loop is not None
        self.a._loop.stop()
        self.a._loop = None
        self.clock.advance(10.1)
        self.assertEqual(
            self.a.unreachable_reason(record),
            "host unreachable: member b's lease ran out at 1970-01-12T13:46:55Z",
        )
        # Its own instances are never unreachable to a member, nor those of no member.
        self.assertFalse(self.b.is_unreachable(record))
        self.a.store.engine.instances.create_instance("old", {}, {}, None, "")
        self.assertFalse(self.a.is_unreachable(self.a.store.view.get_instance("old")))
        # A member the store does not know (its row removed): unreachable too.
        self.a.store.engine.instances.create_instance("lost", {}, {}, None, "ghost")
        self.assertEqual(
            self.a.unreachable_reason(self.a.store.view.get_instance("lost")),
            "host unreachable: member ghost is not a known cluster member",
        )

    async def test_chooseTarget(self) -> None:
        await self.a.start()
        await self.b.start()
        await self.a.refresh()
        self.launch(self.a, "web1")
        self.assertEqual(self.a.choose_target(None).name, "b")
        self.launch(self.b, "web2")
        self.launch(self.b, "web3")
        self.assertEqual(self.a.choose_target(None).name, "a")
        self.assertEqual(self.a.choose_target("b").name, "b")
        e = self.assertRaises(NotFound, self.a.choose_target, "c")
        self.assertEqual(e.message, "no cluster member is called 'c' (members: a, b)")
        await self.b.stop()
        await self.a.refresh()
        e2 = self.assertRaises(Unavailable, self.a.choose_target, "b")
        self.assertEqual(
            e2.message,
            "cluster member b is unreachable: its lease ran out at 1970-01-12T13:46:40Z",
        )
        # b is out, so every launch goes to a, however loaded.
        self.assertEqual(self.a.choose_target(None).name, "a")

    async def test_noMemberOnline(self) -> None:
        # a has not joined (a daemon whose store refused its first renewal): b is gone.
        await self.b.start()
        await self.b.stop()
        await self.a.refresh()
        e = self.assertRaises(Unavailable, self.a.choose_target, None)
        self.assertEqual(e.message, "no cluster member is online to launch the instance on")

    async def test_memberForFingerprint(self) -> None:
        await self.a.start()
        await self.b.start()
        await self.a.refresh()
        member = self.a.member_for_fingerprint("b" * 64)
        self.assertEqual(member.name if member else None, "b")
        self.assertIsNone(self.a.member_for_fingerprint("c" * 64))


async def _create(store: AsyncStore, name: str) -> None:
    await store.instances.create_instance(name, {}, {})
