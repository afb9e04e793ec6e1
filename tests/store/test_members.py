"""Cluster members in the store: leases, instance ownership, and ready keys cleared per member.

On SQLite leases follow the daemon's clock (a ``task.Clock`` here, so the
tests say exactly when a lease runs out); on PostgreSQL they follow the
server's, the one clock every member shares: the ``…OnPostgreSQL`` classes
check what holds whatever the time.
"""

from __future__ import annotations

import datetime
import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from tests.postgres import postgres_location
from vmready.domain.members import (
    Fenced,
    LeaseHeld,
    LeaseLost,
    MemberRetired,
    MemberState,
    lease_time,
)
from vmready.domain.model import Conflict, NotFound
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.sqlite import Store


class _MembersTestCase(SynchronousTestCase):
    """A store at ``self.location``: a fresh SQLite file; ``OnPostgreSQL``: a fresh database."""

    def setUp(self) -> None:
        self.location = self.new_location()
        self.clock = Clock()
        self.clock.advance(1000)
        self.store = Store.open(self.location, clock=self.clock.seconds)
        self.addCleanup(self.store.close)

    def new_location(self) -> str:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        return os.path.join(directory, "vmready.sqlite")

    def assertOnlyMember(
        self, address: str, fingerprint: str, joined_at: float, lease_expires: float
    ) -> None:
        """The store holds one member, with that address, certificate, join time and lease."""
        (member,) = self.store.members.list_members().members
        self.assertEqual(
            (member.address, member.fingerprint, member.joined_at, member.lease_expires),
            (address, fingerprint, joined_at, lease_expires),
        )


class OnPostgreSQL(_MembersTestCase):
    def new_location(self) -> str:
        return postgres_location(self)


class MemberStoreTests(_MembersTestCase):
    """Leases on the daemon's clock (SQLite)."""

    def test_aMemberJoinsWithALeaseAndIsOnlineUntilItRunsOut(self) -> None:
        expires = self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.assertEqual(expires, 1015.0)
        view = self.store.members.list_members()
        self.assertEqual([m.name for m in view.members], ["host1"])
        member = view.members[0]
        self.assertEqual(
            (member.address, member.fingerprint, member.joined_at, member.lease_expires),
            ("10.0.0.1:8443", "aa" * 32, 1000.0, 1015.0),
        )
        self.assertIs(view.state_of("host1"), MemberState.ONLINE)
        self.clock.advance(15)
        self.assertIs(self.store.members.list_members().state_of("host1"), MemberState.UNREACHABLE)

    def test_renewingMovesTheLeaseAndTheAddressButKeepsTheJoinTime(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.clock.advance(10)
        expires = self.store.members.renew_held_lease("host1", "10.0.0.9:8443", "aa" * 32, 15.0)
        self.assertEqual(expires, 1025.0)
        self.assertOnlyMember("10.0.0.9:8443", "aa" * 32, 1000.0, 1025.0)

    def test_anotherDaemonIsRefusedUntilTheLeaseRunsOutThenTakesTheNameOver(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.clock.advance(14.5)
        with self.assertRaises(LeaseHeld) as refused:
            self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        self.assertEqual(
            str(refused.exception),
            "member name host1 is held by another daemon at 10.0.0.1:8443 (certificate "
            f"{'aa' * 8}…) until {lease_time(1015.0)}; give this daemon another "
            "--member-name, or stop that one",
        )
        self.clock.advance(0.5)  # the lease ran out: a reinstalled host1 keeps its name
        self.assertEqual(
            self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0), 1030.0
        )
        self.assertOnlyMember("10.0.0.2:8443", "bb" * 32, 1015.0, 1030.0)

    def test_aLeaseThatRanOutIsRenewedByItsDaemonIfNobodyTookItOver(self) -> None:
        # The store was out of reach for longer than the lease: once back, it renews.
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        self.clock.advance(60)
        self.assertEqual(
            self.store.members.renew_held_lease("host1", "a:1", "aa" * 32, 15.0), 1075.0
        )
        self.assertIs(self.store.members.list_members().state_of("host1"), MemberState.ONLINE)


class MembersTests(_MembersTestCase):
    """The ``members`` table and the ``member`` of each instance, whatever the clock."""

    def test_aLeaseRunsForItsSecondsFromTheStoresClock(self) -> None:
        expires = self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        view = self.store.members.list_members()
        (member,) = view.members
        self.assertEqual(member.lease_expires, expires)
        self.assertAlmostEqual(member.lease_expires - member.joined_at, 15.0, places=6)
        self.assertLessEqual(member.joined_at, view.now)
        self.assertIs(view.state_of("host1"), MemberState.ONLINE)
        self.assertIs(member.state_at(expires), MemberState.UNREACHABLE)

    def test_aRenewalKeepsTheJoinTimeAndTakesTheNewAddress(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        (joined,) = self.store.members.list_members().members
        expires = self.store.members.renew_held_lease("host1", "10.0.0.9:8443", "aa" * 32, 30.0)
        self.assertOnlyMember("10.0.0.9:8443", "aa" * 32, joined.joined_at, expires)
        self.assertGreaterEqual(expires, joined.lease_expires)

    def test_theSameDaemonJoinsAgainWhileItsLeaseRuns(self) -> None:
        # A daemon restarted at once (killed, its lease still running) is the same member.
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.members.renew_lease("host1", "10.0.0.1:9443", "aa" * 32, 15.0)
        (member,) = self.store.members.list_members().members
        self.assertEqual((member.address, member.fingerprint), ("10.0.0.1:9443", "aa" * 32))
        self.store.members.check_join("host1", "aa" * 32)

    def test_anotherDaemonIsRefusedWhileTheLeaseRuns(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        (held,) = self.store.members.list_members().members
        with self.assertRaises(LeaseHeld) as refused:
            self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        self.assertEqual(refused.exception.holder, held)
        message = str(refused.exception)
        self.assertIn("member name host1 is held by another daemon at 10.0.0.1:8443", message)
        self.assertIn(f"(certificate {'aa' * 8}…) until {lease_time(held.lease_expires)}", message)
        self.assertNotIn("\n", message)
        self.assertRaises(LeaseHeld, self.store.members.check_join, "host1", "bb" * 32)
        # Nothing of the row changed.
        self.assertEqual(self.store.members.list_members().members, (held,))

    def test_anotherDaemonTakesOverALeaseThatRanOut(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 0.0)  # ran out already
        self.store.members.check_join("host1", "bb" * 32)
        expires = self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        (member,) = self.store.members.list_members().members
        self.assertEqual(
            (member.address, member.fingerprint, member.lease_expires),
            ("10.0.0.2:8443", "bb" * 32, expires),
        )
        self.assertIs(self.store.members.list_members().state_of("host1"), MemberState.ONLINE)

    def test_anotherDaemonTakesOverALeaseGivenUp(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.instances.create_instance("web1", {}, {}, member="host1")
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        view = self.store.members.list_members()
        self.assertEqual(view.members[0].fingerprint, "bb" * 32)
        # Its instances go with the name.
        self.assertEqual(view.instance_counts, {"host1": 1})

    def test_theOldHoldersRenewalFailsAfterATakeover(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.store.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        (taken,) = self.store.members.list_members().members
        with self.assertRaises(LeaseLost) as lost:
            self.store.members.renew_held_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.assertEqual(lost.exception.holder, taken)
        self.assertEqual(
            str(lost.exception),
            "member name host1 was taken over by another daemon at 10.0.0.2:8443 (certificate "
            f"{'bb' * 8}…) after this daemon's lease ran out; stopping: its instances are not "
            "this daemon's any more",
        )
        # Nor does its giving up end the new holder's lease.
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.assertEqual(self.store.members.list_members().members, (taken,))
        self.assertIs(self.store.members.list_members().state_of("host1"), MemberState.ONLINE)

    def test_aConnectionThatDidNotJoinRenewsByTheCertificateAlone(self) -> None:
        """No fence to check (it never joined): the row's certificate decides."""
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        other = Store.open(self.location, clock=self.clock.seconds)
        self.addCleanup(other.close)
        expires = other.members.renew_held_lease("host1", "a:1", "aa" * 32, 15.0)
        (member,) = other.members.list_members().members
        self.assertEqual((member.lease_expires, member.epoch), (expires, 1))

    def test_aRenewalOfARemovedMemberFails(self) -> None:
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        self.store.members.give_up_lease("host1", "aa" * 32)  # stopped, then retired
        self.store.members.remove_member("host1")
        with self.assertRaises(LeaseLost) as lost:
            self.store.members.renew_held_lease("host1", "a:1", "aa" * 32, 15.0)
        self.assertIsNone(lost.exception.holder)
        self.assertIn("member host1 is no longer in the store", str(lost.exception))

    def test_givingUpTheLeaseMakesTheMemberUnreachableAtOnce(self) -> None:
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.assertIs(self.store.members.list_members().state_of("host1"), MemberState.UNREACHABLE)

    def test_instancesAreCountedByTheirMember(self) -> None:
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        self.store.members.renew_lease("host2", "b:1", "bb" * 32, 15.0)
        self.store.instances.create_instance("web1", {}, {}, member="host1")
        self.store.instances.create_instance("web2", {}, {}, member="host1")
        self.store.instances.create_instance("db1", {}, {}, member="host2")
        view = self.store.members.list_members()
        self.assertEqual(view.instance_counts, {"host1": 2, "host2": 1})
        self.assertEqual(self.store.instances.get_instance("db1").member, "host2")
        least = view.least_loaded()
        assert least is not None
        self.assertEqual(least.name, "host2")

    def test_leastLoadedSkipsUnreachableMembers(self) -> None:
        self.store.members.renew_lease("host1", "a:1", "aa" * 32, 15.0)
        self.store.members.renew_lease("host2", "b:1", "bb" * 32, 15.0)
        self.store.instances.create_instance("web1", {}, {}, member="host1")
        self.store.members.give_up_lease("host2", "bb" * 32)
        least = self.store.members.list_members().least_loaded()
        assert least is not None
        self.assertEqual(least.name, "host1")
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.assertIsNone(self.store.members.list_members().least_loaded())

    def test_clearingReadyForOneMemberLeavesTheOthersReady(self) -> None:
        for name, member in (("web1", "host1"), ("db1", "host2")):
            self.store.instances.create_instance(name, {}, {}, member=member)
            self.store.instances.finish_task(
                name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING, {READY_KEY: "true"}
            )
        self.assertEqual(self.store.instances.clear_ready_everywhere("host1"), 1)
        self.assertFalse(self.store.instances.get_instance("web1").ready)
        self.assertTrue(self.store.instances.get_instance("db1").ready)
        self.assertEqual(self.store.instances.clear_ready_everywhere(), 1)
        self.assertFalse(self.store.instances.get_instance("db1").ready)

    def test_aMemberFindsOnlyItsOwnUnfinishedActionsAndOrphanedOnes(self) -> None:
        for name, member in (("web1", "host1"), ("db1", "host2"), ("gone", "host2")):
            self.store.instances.create_instance(name, {}, {}, member=member)
        mine = self.store.actions.start_action("web1", "start", "r1")
        theirs = self.store.actions.start_action("db1", "stop", "r2")
        orphaned = self.store.actions.start_action("gone", "delete", "r3")
        self.store.instances.delete_instance("gone")
        self.assertEqual(
            [action.id for action in self.store.actions.unfinished_actions("host1")],
            [mine, orphaned],
        )
        self.assertEqual(
            [action.id for action in self.store.actions.unfinished_actions()],
            [mine, theirs, orphaned],
        )


class OwnedInstancesTests(_MembersTestCase):
    """``AsyncStore`` of a member: creates instances as its own, runs and clears only those."""

    def setUp(self) -> None:
        super().setUp()
        self.engine = self.store

    def test_aMemberCreatesItsOwnInstancesAndRunsOnlyThose(self) -> None:
        self.engine.instances.create_instance("other", {}, {}, member="host2")
        store = AsyncStore(self.engine, InlineExecutor(), cached=False, member="host1")
        created = self.successResultOf(store.instances.create_instance("mine", {}, {}))
        self.assertEqual(created.member, "host1")
        self.assertEqual([r.name for r in store.view.list_instances()], ["mine", "other"])
        self.assertEqual([r.name for r in store.view.owned_instances()], ["mine"])
        self.assertTrue(store.view.owns(created))
        self.assertFalse(store.view.owns(store.view.get_instance("other")))

    def test_aSingleHostRunsEveryInstance(self) -> None:
        self.engine.instances.create_instance("old", {}, {})
        store = AsyncStore.inline(self.engine)
        self.assertEqual(
            self.successResultOf(store.instances.create_instance("new", {}, {})).member, ""
        )
        self.assertEqual([r.name for r in store.view.owned_instances()], ["new", "old"])

    def test_startingMemberClearsOnlyItsOwnReadyKeys(self) -> None:
        for name, member in (("mine", "host1"), ("theirs", "host2")):
            self.engine.instances.create_instance(name, {}, {}, member=member)
            self.engine.instances.finish_task(
                name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING, {READY_KEY: "true"}
            )
        store = AsyncStore(self.engine, InlineExecutor(), cached=False, member="host1")
        self.assertEqual(self.successResultOf(store.instances.clear_ready_everywhere()), 1)
        self.assertFalse(store.view.get_instance("mine").ready)
        self.assertTrue(store.view.get_instance("theirs").ready)

    def test_refreshReadsWhatAnotherMemberWrote(self) -> None:
        other = Store.open(self.location)
        self.addCleanup(other.close)
        other.instances.create_instance("theirs", {}, {}, member="host2")
        store = AsyncStore(self.engine, InlineExecutor(), cached=True, member="host1")
        self.assertEqual(store.view.get_instance("theirs").vm_state, VMState.BUILDING)
        other.instances.finish_task(
            "theirs", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )
        # Until told, it reads the rows as its own commits left them.
        self.assertEqual(store.view.get_instance("theirs").vm_state, VMState.BUILDING)
        refreshed = self.successResultOf(store.refresh_instance("theirs"))
        assert refreshed is not None
        self.assertEqual(store.view.get_instance("theirs").vm_state, VMState.ACTIVE)
        other.instances.delete_instance("theirs")
        self.assertIsNone(self.successResultOf(store.refresh_instance("theirs")))
        self.assertIsNone(store.view.find_instance("theirs"))


class AgentCertificatesOfMembersTests(_MembersTestCase):
    """The guest API on one member's host knows only the agents of the instances it runs."""

    def test_anotherMembersAgentIsUnknownHere(self) -> None:
        self.store.instances.create_instance("mine", {}, {}, member="host1")
        self.store.instances.create_instance("theirs", {}, {}, member="host2")
        self.store.certificates.set_agent_certificate("mine", "aa" * 32)
        self.store.certificates.set_agent_certificate("theirs", "bb" * 32)
        for cached in (False, True):
            store = AsyncStore(self.store, InlineExecutor(), cached=cached, member="host1")
            found = store.view.instance_for_fingerprint("aa" * 32)
            assert found is not None
            self.assertEqual(found.name, "mine")
            self.assertIsNone(store.view.instance_for_fingerprint("bb" * 32))
        alone = AsyncStore(self.store, InlineExecutor(), cached=True)
        self.assertIsNotNone(alone.view.instance_for_fingerprint("bb" * 32))


class AgentCertificatesOfMembersTestsOnPostgreSQL(OnPostgreSQL, AgentCertificatesOfMembersTests):
    """The same tests on a real PostgreSQL server."""


class MembersTestsOnPostgreSQL(OnPostgreSQL, MembersTests):
    """The same tests on a real PostgreSQL server."""


class OwnedInstancesTestsOnPostgreSQL(OnPostgreSQL, OwnedInstancesTests):
    """The same tests on a real PostgreSQL server."""


class RetireTests(_MembersTestCase):
    """``remove_member``: only a member out of its lease, with no instance left, is removed."""

    def test_anOnlineMemberIsNotRemoved(self) -> None:
        expires = self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        at = datetime.datetime.fromtimestamp(expires, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self.assertRaises(Conflict) as raised:
            self.store.members.remove_member("host1")
        self.assertEqual(
            str(raised.exception),
            f"cluster member host1 is online (its lease runs until {at}): stop its daemon "
            "first, then remove it",
        )
        self.assertEqual([m.name for m in self.store.members.list_members().members], ["host1"])

    def test_aMemberWithInstancesIsNotRemovedAndTheyAreCounted(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.instances.create_instance("web1", {}, {}, member="host1")
        self.store.instances.create_instance("web2", {}, {}, member="host1")
        self.store.instances.create_instance("db", {}, {}, member="host2")
        self.store.members.give_up_lease("host1", "aa" * 32)
        with self.assertRaises(Conflict) as raised:
            self.store.members.remove_member("host1")
        self.assertEqual(
            str(raised.exception),
            "cluster member host1 still has 2 instances: start it again and delete them "
            "first (vmready cannot move instances to another member)",
        )
        self.store.instances.delete_instance("web2")
        with self.assertRaises(Conflict) as raised:
            self.store.members.remove_member("host1")
        self.assertIn("still has 1 instance:", str(raised.exception))
        self.assertEqual([m.name for m in self.store.members.list_members().members], ["host1"])

    def test_aMemberOutOfItsLeaseWithoutInstancesIsRemoved(self) -> None:
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.members.renew_lease("host2", "10.0.0.2:8443", "bb" * 32, 15.0)
        self.store.members.give_up_lease("host1", "aa" * 32)
        removed = self.store.members.remove_member("host1")
        self.assertEqual((removed.name, removed.fingerprint), ("host1", "aa" * 32))
        self.assertEqual([m.name for m in self.store.members.list_members().members], ["host2"])
        with self.assertRaises(NotFound) as raised:
            self.store.members.remove_member("host1")
        self.assertEqual(
            str(raised.exception), "no cluster member is called 'host1' (members: host2)"
        )


class FencingTests(_MembersTestCase):
    """Each join bumps the member's lease epoch; every write checks it in its transaction."""

    def setUp(self) -> None:
        super().setUp()
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.instances.create_instance("web1", {}, {}, member="host1")
        self.store.instances.finish_task("web1", TaskState.SPAWNING, VMState.ACTIVE)

    def other_daemon(self) -> Store:
        other = Store.open(self.location, clock=self.clock.seconds)
        self.addCleanup(other.close)
        return other

    def test_eachJoinBumpsTheEpoch(self) -> None:
        self.assertEqual(self.store.members.list_members().members[0].epoch, 1)
        self.store.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.store.members.renew_held_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        self.assertEqual(self.store.members.list_members().members[0].epoch, 2)

    def test_aFrozenDaemonsWritesAreRefusedOnceItsNameWasTakenOver(self) -> None:
        """It has not renewed since (it was frozen): its first write is refused, by the store,
        and nothing of it is kept."""
        self.store.members.give_up_lease("host1", "aa" * 32)  # as when its lease ran out
        new = self.other_daemon()
        new.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        (holder,) = new.members.list_members().members
        writes = [
            lambda: self.store.instances.claim_task(
                "web1", "stop", frozenset({VMState.ACTIVE}), TaskState.POWERING_OFF
            ),
            lambda: self.store.instances.set_power_state("web1", PowerState.SHUTDOWN),
            lambda: self.store.actions.start_action("web1", "stop", "request-1"),
            lambda: self.store.instances.delete_instance("web1"),
        ]
        for write in writes:
            with self.assertRaises(Fenced) as refused:
                write()
            self.assertEqual(refused.exception.holder, holder)
            self.assertEqual(refused.exception.http_status, 503)
        self.assertEqual(
            str(refused.exception),
            "the store refused this daemon's write: member name host1 was taken over by "
            f"another daemon at 10.0.0.2:8443 (certificate {'bb' * 8}…) (lease epoch 2; this "
            "daemon joined at epoch 1)",
        )
        record = new.instances.get_instance("web1")
        self.assertEqual((record.task_state, record.power_state), (None, PowerState.NOSTATE))
        self.assertEqual(new.actions.list_actions("web1"), [])
        # The new holder writes.
        new.instances.claim_task(
            "web1", "stop", frozenset({VMState.ACTIVE}), TaskState.POWERING_OFF
        )

    def test_theSameDaemonStartedAgainFencesItsOlderProcess(self) -> None:
        """Same certificate, same name: the older process (frozen, say) is fenced too."""
        self.other_daemon().members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        with self.assertRaises(Fenced):
            self.store.instances.set_power_state("web1", PowerState.SHUTDOWN)
        with self.assertRaises(LeaseLost):
            self.store.members.renew_held_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)

    def test_anActionRowSaysWhichMemberWroteItAndUnderWhichEpoch(self) -> None:
        self.store.actions.start_action("web1", "stop", "request-1")
        row = self.store.database.db.execute(
            "SELECT member, epoch FROM actions WHERE instance = 'web1'"
        ).fetchone()
        self.assertEqual(tuple(row), ("host1", 1))

    def test_aRetiredNameIsNotJoinedAgain(self) -> None:
        self.store.instances.delete_instance("web1")
        self.store.members.give_up_lease("host1", "aa" * 32)
        self.store.members.remove_member("host1")
        (stamp,) = self.store.database.db.execute(
            "SELECT retired_at FROM retired_members WHERE name = 'host1'"
        ).fetchone()
        retired_at = lease_time(float(stamp))
        message = (
            f"member name host1 was retired at {retired_at} ('vmready cluster remove'); a "
            "retired name is not reused: give this daemon another --member-name"
        )
        for fingerprint in ("aa" * 32, "bb" * 32):
            with self.assertRaises(MemberRetired) as refused:
                self.other_daemon().members.check_join("host1", fingerprint)
            self.assertEqual(str(refused.exception), message)
            with self.assertRaises(MemberRetired):
                self.other_daemon().members.renew_lease("host1", "a:1", fingerprint, 15.0)
        self.assertEqual(self.store.members.list_members().members, ())


class FencingTestsOnPostgreSQL(OnPostgreSQL, FencingTests):
    """The same tests on a real PostgreSQL server (the row lock, the server's clock)."""

    def test_aDaemonFrozenInsideAWriteDoesNotKeepItsNameFromBeingTakenOver(self) -> None:
        """Its write's fencing check locked its members row, then it froze before COMMIT:
        the server ends its idle session (and the lock), and the takeover goes through."""
        location = f"{self.location}&options=-c%20idle_in_transaction_session_timeout%3D300ms"
        frozen = Store.open(location, clock=self.clock.seconds)
        self.addCleanup(frozen.close)
        frozen.members.renew_lease("host1", "10.0.0.1:8443", "aa" * 32, 15.0)
        frozen.members.give_up_lease("host1", "aa" * 32)  # as when its lease ran out
        frozen.database.db.execute("BEGIN")
        frozen.database.check_fence()  # and it never goes on
        new = self.other_daemon()
        new.members.renew_lease("host1", "10.0.0.2:8443", "bb" * 32, 15.0)
        (holder,) = new.members.list_members().members
        self.assertEqual((holder.fingerprint, holder.epoch), ("bb" * 32, 3))


class RetireTestsOnPostgreSQL(OnPostgreSQL, RetireTests):
    """The same tests on a real PostgreSQL server."""
