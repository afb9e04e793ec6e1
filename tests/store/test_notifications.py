"""NotificationListener against a real PostgreSQL server: what is delivered, when, and after loss.

No test waits a fixed time: each waits for the Deferred a delivery (or a
resync) fires, and a rolled-back write is shown never delivered by a
committed write after it arriving first.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from tests.postgres import postgres_location, postgres_server
from tests.reactor import reactor
from vmready.domain.model import Conflict, StoreError
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.store.asyncstore import AsyncStore
from vmready.store.notifications import (
    EVENTS_CHANNEL,
    INSTANCES_CHANNEL,
    MEMBERS_CHANNEL,
    TRUST_CHANNEL,
    NotificationListener,
)
from vmready.store.sqlite import Store


class Heard:
    """What a listener delivered, and Deferreds for what is still to come (on the reactor)."""

    def __init__(self) -> None:
        self.notifications: list[tuple[str, dict[str, Any] | str]] = []
        self.resyncs = 0
        self._waiting: list[tuple[int, Deferred[None]]] = []
        self._resync_waiting: list[Deferred[None]] = []

    def deliver(self, channel: str, payload: str) -> None:
        decoded = json.loads(payload) if channel != EVENTS_CHANNEL else payload
        self.notifications.append((channel, decoded))
        for count, waiting in list(self._waiting):
            if len(self.notifications) >= count:
                self._waiting.remove((count, waiting))
                waiting.callback(None)

    def resync(self) -> None:
        self.resyncs += 1
        waiting, self._resync_waiting = self._resync_waiting, []
        for each in waiting:
            each.callback(None)

    def until(self, count: int) -> Deferred[None]:
        """Fires once ``count`` notifications have arrived."""
        done: Deferred[None] = Deferred()
        if len(self.notifications) >= count:
            done.callback(None)
        else:
            self._waiting.append((count, done))
        return done

    def next_resync(self) -> Deferred[None]:
        done: Deferred[None] = Deferred()
        self._resync_waiting.append(done)
        return done


class ListenerTests(TestCase):
    def setUp(self) -> None:
        self.location = postgres_location(self)
        self.store = Store.open(self.location)
        self.addCleanup(self.store.close)
        self.heard = Heard()
        self.listener = NotificationListener(
            reactor,
            self.location,
            [INSTANCES_CHANNEL, EVENTS_CHANNEL],
            self.heard.deliver,
            self.heard.resync,
        )
        self.addCleanup(self.listener.stop)

    async def test_eachCommittedInstanceWriteIsDeliveredWithItsNameAndMember(self) -> None:
        await self.listener.start()
        self.store.instances.create_instance("web", {}, {}, member="host1")
        self.store.instances.finish_task(
            "web", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        self.store.instances.rename_instance("web", "api", frozenset({VMState.STOPPED}), "r1")
        self.store.instances.delete_instance("api")
        await self.heard.until(4)
        self.assertEqual(
            self.heard.notifications,
            [
                (
                    INSTANCES_CHANNEL,
                    {"op": "INSERT", "name": "web", "old_name": None, "member": "host1"},
                ),
                (
                    INSTANCES_CHANNEL,
                    {"op": "UPDATE", "name": "web", "old_name": None, "member": "host1"},
                ),
                (
                    INSTANCES_CHANNEL,
                    {"op": "UPDATE", "name": "api", "old_name": "web", "member": "host1"},
                ),
                (
                    INSTANCES_CHANNEL,
                    {"op": "DELETE", "name": "api", "old_name": None, "member": "host1"},
                ),
            ],
        )

    async def test_aRolledBackWriteIsNeverDelivered(self) -> None:
        await self.listener.start()

        def then_fail() -> None:
            self.store.instances.create_instance("ghost", {}, {})
            raise Conflict("changed its mind")

        with self.assertRaises(Conflict), self.store.database.batch():
            then_fail()
        self.store.instances.create_instance("real", {}, {})
        await self.heard.until(1)
        # Notifications arrive in commit order: had the ghost's been sent, it came first.
        self.assertEqual(
            [payload for _, payload in self.heard.notifications],
            [{"op": "INSERT", "name": "real", "old_name": None, "member": ""}],
        )

    async def test_aPublishedEventIsDeliveredOnceCommitted(self) -> None:
        await self.listener.start()
        store = AsyncStore.threaded(reactor, Store.open(self.location))
        self.addCleanup(store.close)
        await store.members.publish_event('{"type": "instance-ready", "name": "web"}')
        await self.heard.until(1)
        event = '{"type": "instance-ready", "name": "web"}'
        self.assertEqual(self.heard.notifications, [(EVENTS_CHANNEL, event)])

    async def test_afterItsConnectionIsCutItReconnectsAndResyncsThenHearsAgain(self) -> None:
        await self.listener.start()
        resynced = self.heard.next_resync()
        database = urllib.parse.urlsplit(self.location).path.lstrip("/")
        self.store.close()  # only the listener is left connected to the database
        self.assertGreaterEqual(postgres_server().terminate_backends(database), 1)
        await resynced
        self.assertEqual((self.heard.resyncs, self.listener.reconnects), (1, 1))
        store = Store.open(self.location)
        self.addCleanup(store.close)
        store.instances.create_instance("after", {}, {})
        await self.heard.until(1)
        self.assertEqual(self.heard.notifications[0][1]["name"], "after")  # type: ignore[index]

    async def test_membersJoiningComingBackOrLeavingAreDeliveredButNotPlainRenewals(
        self,
    ) -> None:
        listener = NotificationListener(
            reactor,
            self.location,
            [MEMBERS_CHANNEL, INSTANCES_CHANNEL],
            self.heard.deliver,
            self.heard.resync,
        )
        self.addCleanup(listener.stop)
        await listener.start()
        self.store.members.renew_lease("m1", "10.0.0.1:8443", "aa" * 32, 30.0)  # joins
        self.store.members.renew_lease("m1", "10.0.0.1:8443", "aa" * 32, 30.0)  # renews: nothing
        # A committed write after the renewal: had the renewal notified, it came first.
        self.store.instances.create_instance("web", {}, {}, member="m1")
        self.store.members.give_up_lease("m1", "aa" * 32)  # leaves
        self.store.members.renew_lease("m1", "10.0.0.1:8443", "aa" * 32, 30.0)  # comes back
        self.store.members.renew_lease("m1", "10.0.0.2:8443", "aa" * 32, 30.0)  # moves
        await self.heard.until(5)
        heard = [
            (channel, payload["op"], payload["name"])
            for channel, payload in self.heard.notifications
            if isinstance(payload, dict)
        ]
        self.assertEqual(
            heard,
            [
                (MEMBERS_CHANNEL, "INSERT", "m1"),
                (INSTANCES_CHANNEL, "INSERT", "web"),
                (MEMBERS_CHANNEL, "UPDATE", "m1"),
                (MEMBERS_CHANNEL, "UPDATE", "m1"),
                (MEMBERS_CHANNEL, "UPDATE", "m1"),
            ],
        )

    async def test_aCertificateTrustedOrRemovedIsDelivered(self) -> None:
        listener = NotificationListener(
            reactor, self.location, [TRUST_CHANNEL], self.heard.deliver, self.heard.resync
        )
        self.addCleanup(listener.stop)
        await listener.start()
        self.store.trust.add_token("laptop", "ab" * 32, 1000.0, 2000.0)  # a token: nothing
        self.store.trust.redeem_token("ab" * 32, "cd" * 32, 1001.0)
        self.store.trust.remove_certificate("cd" * 32)
        await self.heard.until(2)
        self.assertEqual(
            self.heard.notifications,
            [
                (TRUST_CHANNEL, {"op": "INSERT", "fingerprint": "cd" * 32}),
                (TRUST_CHANNEL, {"op": "DELETE", "fingerprint": "cd" * 32}),
            ],
        )

    async def test_stopEndsTheThread(self) -> None:
        await self.listener.start()
        await self.listener.stop()
        thread = self.listener._thread
        assert thread is not None
        thread.join(10)  # it told the reactor it is done as its last act
        self.assertFalse(thread.is_alive())

    async def test_aServerThatIsNotThereFailsTheStart(self) -> None:
        listener = NotificationListener(
            reactor,
            postgres_server().url("nowhere"),
            [EVENTS_CHANNEL],
            self.heard.deliver,
            self.heard.resync,
        )
        error: Any = await self.assertFailure(listener.start(), StoreError)
        self.assertIn('database "nowhere" does not exist', str(error))
        self.assertEqual(len(str(error).splitlines()), 1)
        await listener.stop()
