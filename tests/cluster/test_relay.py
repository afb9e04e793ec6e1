"""The event relay between members (``lifecycle.relay``), without PostgreSQL.

Two members' buses and relays are wired together by ``Wire``, which hands
each published payload to every relay a turn of the clock later, the sender
included (PostgreSQL's NOTIFY reaches every listener, its sender too).  Where
the store's part matters (re-reading a row another member wrote before the
event about it is published) two real ``AsyncStore`` s on their database
threads share one SQLite file; the two-daemon tests on a real PostgreSQL
are ``tests.cluster.test_members_live``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.reactor import reactor
from vmready.domain.model import InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.lifecycle.agenthistory import AgentHistory, LinkChange
from vmready.lifecycle.events import LIFECYCLE, OPERATION, Event, EventBus
from vmready.lifecycle.faults import Fault
from vmready.lifecycle.liveviews import (
    LiveView,
    OwnViews,
    view_from_json,
    view_json,
    views_from_json,
)
from vmready.lifecycle.relay import EventRelay, InboundOrder, relayable
from vmready.lifecycle.relaypayloads import (
    InstanceChange,
    decode_event,
    decode_instance_change,
    encode_event,
    encode_views,
)
from vmready.protocols import AgentStatus
from vmready.store import MAX_PAYLOAD_BYTES
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import InlineExecutor
from vmready.store.sqlite import Store


def _lifecycle(action: str, instance: str, context: dict[str, Any]) -> Event:
    """A lifecycle event about ``instance``, with its ``context``."""
    metadata = {"action": action, "source": f"/1.0/instances/{instance}", "context": context}
    return Event(LIFECYCLE, 5.0, metadata)


class Wire:
    """NOTIFY between members, in memory: each payload reaches every relay, in order."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.relays: list[EventRelay] = []
        self.payloads: list[str] = []

    def publish_event(self, payload: str) -> Deferred[None]:
        if len(payload.encode()) > MAX_PAYLOAD_BYTES:
            raise ValueError("payload too big")  # as AsyncStore.publish_event refuses it
        self.payloads.append(payload)
        for relay in list(self.relays):
            self.clock.callLater(0, relay.on_event, payload)
        return succeed(None)


class BusOnlyStore:
    """A member's store as far as the relay's bus-to-bus part needs one."""

    def __init__(self, member: str, wire: Wire) -> None:
        self.member = member
        self.wire = wire
        self.refreshed: list[str] = []
        self.reads: list[Deferred[Any]] = []
        self.reloads = 0
        # What the relay publishes through, and reads the rows of (it has none).
        self.members = wire
        self.view = self

    def refresh_instance(self, name: str) -> Deferred[Any]:
        self.refreshed.append(name)
        reading: Deferred[Any] = Deferred()
        self.reads.append(reading)
        return reading

    def reload_instances(self) -> Deferred[None]:
        self.reloads += 1
        reading: Deferred[None] = Deferred()
        self.reads.append(reading)
        return reading

    def list_instances(self) -> list[InstanceRecord]:
        return []  # rows are not this fake's concern (ResyncTests reads real ones)

    def owns(self, record: InstanceRecord) -> bool:
        return record.member == self.member


def member(name: str, wire: Wire, clock: Clock) -> tuple[EventBus, BusOnlyStore, EventRelay]:
    bus = EventBus(clock.seconds, location=name)
    store = BusOnlyStore(name, wire)
    relay = EventRelay(bus, store, name)
    relay.start()
    wire.relays.append(relay)
    return bus, store, relay


class EncodingTests(SynchronousTestCase):
    """One event as one NOTIFY payload, and back."""

    def test_aLifecycleEventTravelsWithItsTimeAndMember(self) -> None:
        event = Event(
            LIFECYCLE,
            1_700_000_000.125,
            {"action": "instance-ready", "source": "/1.0/instances/web1", "context": {"a": 1}},
            location="a",
        )
        payload, trimmed = encode_event(event, "a") or ("", True)
        self.assertFalse(trimmed)
        decoded = decode_event(payload)
        assert decoded is not None
        origin, received = decoded
        self.assertEqual(origin, "a")
        self.assertEqual(received, event)
        self.assertFalse(received.relayed)
        self.assertEqual(received.to_json()["location"], "a")
        self.assertEqual(received.to_json()["timestamp"], "2023-11-14T22:13:20.125Z")

    def test_whatIsRelayed(self) -> None:
        def lifecycle(source: str) -> Event:
            return Event(LIFECYCLE, 1.0, {"action": "x", "source": source, "context": {}})

        self.assertTrue(relayable(lifecycle("/1.0/instances/web1")))
        self.assertTrue(relayable(Event(OPERATION, 1.0, {"id": "x"})))
        # The daemon's own events (store-write-failed, member changes) stay on their member.
        self.assertFalse(relayable(lifecycle("/1.0")))
        self.assertFalse(relayable(lifecycle("/1.0/cluster/members/b")))
        relayed = Event(LIFECYCLE, 1.0, {"source": "/1.0/instances/web1"}, "b", relayed=True)
        self.assertFalse(relayable(relayed))

    def trimmed(self, event: Event) -> str:
        """``event``'s payload, which had to be trimmed to fit a NOTIFY."""
        payload, trimmed = encode_event(event, "a") or ("", False)
        self.assertTrue(trimmed)
        self.assertLessEqual(len(payload.encode()), MAX_PAYLOAD_BYTES)
        return payload

    def test_aBigContextIsTrimmedAndSaysSo(self) -> None:
        # cloud-init user data can be far bigger than a NOTIFY payload may be.
        config = {"cloud-init.user-data": "x" * 20_000, "user.a": "b"}
        payload = self.trimmed(_lifecycle("instance-updated", "web1", {"config": config}))
        self.assertTrue(json.loads(payload)["trimmed"])
        decoded = decode_event(payload)
        assert decoded is not None
        metadata = decoded[1].metadata
        self.assertEqual(
            (metadata["action"], metadata["source"]),
            ("instance-updated", "/1.0/instances/web1"),
        )
        context = metadata["context"]
        self.assertTrue(context["trimmed"])
        self.assertEqual(context["config"]["user.a"], "b")
        self.assertEqual(len(context["config"]["cloud-init.user-data"]), 200)

    def test_aContextOfManyKeysIsDroppedAndSaysSo(self) -> None:
        many = {f"user.k{i}": "v" * 100 for i in range(200)}
        payload = self.trimmed(_lifecycle("instance-updated", "w", many))
        decoded = decode_event(payload)
        assert decoded is not None
        self.assertEqual(decoded[1].metadata["context"], {"trimmed": True})

    def test_multibyteTextIsCountedInBytes(self) -> None:
        self.trimmed(_lifecycle("instance-error", "w", {"e": "é" * 5000}))

    def test_aBigOperationKeepsItsIdentity(self) -> None:
        event = Event(
            OPERATION,
            5.0,
            {"id": "op1", "status": "Failure", "err": "e" * 9000, "metadata": {"x": "y" * 9000}},
        )
        payload, trimmed = encode_event(event, "a") or ("", False)
        self.assertTrue(trimmed)
        decoded = decode_event(payload)
        assert decoded is not None
        metadata = decoded[1].metadata
        self.assertEqual((metadata["id"], metadata["status"]), ("op1", "Failure"))
        self.assertTrue(metadata["metadata"]["trimmed"])

    def test_whatIsNotAnEventIsRefused(self) -> None:
        good = {"v": 1, "member": "a", "type": "lifecycle", "timestamp": 1.0, "metadata": {}}
        self.assertIsNotNone(decode_event(json.dumps(good)))
        for bad in (
            "not json",
            "[]",
            json.dumps({**good, "v": 2}),
            json.dumps({**good, "member": ""}),
            json.dumps({**good, "member": 3}),
            json.dumps({**good, "type": "logging"}),
            json.dumps({**good, "timestamp": "now"}),
            json.dumps({**good, "timestamp": True}),
            '{"v":1,"member":"a","type":"lifecycle","timestamp":Infinity,"metadata":{}}',
            json.dumps({**good, "metadata": []}),
        ):
            self.assertIsNone(decode_event(bad), bad)

    def test_instanceChanges(self) -> None:
        change = decode_instance_change(
            '{"op":"UPDATE","name":"new","old_name":"old","member":"a"}'
        )
        self.assertEqual(change, InstanceChange("UPDATE", "new", "old", "a"))
        assert change is not None
        self.assertEqual(change.names(), ["old", "new"])
        plain = decode_instance_change('{"op":"DELETE","name":"w","old_name":null,"member":""}')
        assert plain is not None
        self.assertEqual(plain.names(), ["w"])
        for bad in (
            "{",
            '{"op":"TRUNCATE","name":"w","old_name":null,"member":""}',
            '{"op":"INSERT","name":"","old_name":null,"member":""}',
            '{"op":"INSERT","name":"w","old_name":3,"member":""}',
            '{"op":"INSERT","name":"w","old_name":null}',
        ):
            self.assertIsNone(decode_instance_change(bad), bad)


class InboundOrderTests(SynchronousTestCase):
    """An event waits for every re-read asked for before it, and no longer."""

    def event(self, n: int) -> Event:
        return Event(LIFECYCLE, float(n), {})

    def test_whatAReadFindsIsDueWhereTheReadStood(self) -> None:
        """A resync's findings come before the events that arrived while it read."""
        order = InboundOrder()
        before = order.event(self.event(1))
        token = order.reading()
        self.assertEqual(order.event(self.event(3)), [])  # arrived during the read
        self.assertEqual(order.read_done(token, [self.event(2)]), [self.event(2), self.event(3)])
        self.assertEqual(before, [self.event(1)])
        self.assertEqual(order.waiting, 0)

    def test_eventsWithoutReadsAreDueAtOnce(self) -> None:
        order = InboundOrder()
        self.assertEqual(order.event(self.event(1)), [self.event(1)])

    def test_anEventWaitsForTheReadBeforeIt(self) -> None:
        order = InboundOrder()
        first = order.reading()
        self.assertEqual(order.event(self.event(1)), [])
        second = order.reading()
        self.assertEqual(order.event(self.event(2)), [])
        self.assertEqual(order.waiting, 2)
        # Reads finish in order on the database thread; a later one alone frees nothing.
        self.assertEqual(order.read_done(second), [])
        self.assertEqual(order.read_done(first), [self.event(1), self.event(2)])
        self.assertEqual(order.waiting, 0)
        self.assertEqual(order.event(self.event(3)), [self.event(3)])

    def test_aReadAfterAnEventDoesNotHoldItBack(self) -> None:
        order = InboundOrder()
        first = order.reading()
        order.event(self.event(1))
        later = order.reading()
        self.assertEqual(order.read_done(first), [self.event(1)])
        self.assertEqual(order.event(self.event(2)), [])
        self.assertEqual(order.read_done(later), [self.event(2)])


class BusToBusTests(SynchronousTestCase):
    """Two members' buses, relayed both ways, each event once."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.wire = Wire(self.clock)
        self.bus_a, self.store_a, self.relay_a = member("a", self.wire, self.clock)
        self.bus_b, self.store_b, self.relay_b = member("b", self.wire, self.clock)
        self.seen_a: list[Event] = []
        self.seen_b: list[Event] = []
        self.bus_a.subscribe(self.seen_a.append)
        self.bus_b.subscribe(self.seen_b.append)

    def test_anInstanceEventOfAIsSeenOnBOnceWithItsTimeAndMember(self) -> None:
        published = self.bus_a.lifecycle("instance-started", "web1", {"x": 1})
        self.clock.advance(0.5)  # the NOTIFY takes a while
        self.clock.advance(0)
        self.assertEqual(self.seen_a, [published])  # A's own comes back once: not again
        [received] = self.seen_b
        self.assertEqual(
            (received.type, received.timestamp, received.metadata, received.location),
            (LIFECYCLE, published.timestamp, published.metadata, "a"),
        )
        self.assertTrue(received.relayed)
        # B published it, and did not send it back.
        self.assertEqual(len(self.wire.payloads), 1)
        self.assertEqual((self.relay_a.sent, self.relay_b.sent), (1, 0))
        self.assertEqual((self.relay_a.received, self.relay_b.received), (0, 1))

    def test_eventsAlikeToTheMicrosecondAreDifferentPayloads(self) -> None:
        # PostgreSQL folds identical payloads of one transaction into one notification.
        self.bus_a.lifecycle("instance-state", "web1", {"status": "Running"})
        self.bus_a.lifecycle("instance-state", "web1", {"status": "Running"})
        self.clock.advance(0)
        self.assertEqual(len(set(self.wire.payloads)), 2)
        self.assertEqual(len(self.seen_b), 2)

    def test_operationEventsTravelServerEventsDoNot(self) -> None:
        self.bus_b.publish(OPERATION, {"id": "op", "status": "Running"})
        self.bus_b.server("store-write-failed", {"error": "disk full"})
        self.clock.advance(0)
        self.assertEqual([(e.type, e.location) for e in self.seen_a], [(OPERATION, "b")])
        # A fault of B's store is not a fault of A's (nor of A's instances).
        self.assertEqual(self.bus_a.faults.of("web1"), [])

    def test_faultsOfAnotherMembersInstanceAreKnownHere(self) -> None:
        self.bus_a.lifecycle("instance-error", "web1", {"error": "boom"})
        self.clock.advance(0)
        self.assertEqual([fault.message for fault in self.bus_b.faults.of("web1")], ["boom"])

    def test_anEventWaitsForTheRowItFollows(self) -> None:
        # The row's notification arrives first (commit order), then the event.
        self.relay_b.on_instances('{"op":"UPDATE","name":"web1","old_name":null,"member":"a"}')
        self.bus_a.lifecycle("instance-started", "web1")
        self.clock.advance(0)
        self.assertEqual(self.store_b.refreshed, ["web1"])
        self.assertEqual(self.seen_b, [])
        self.store_b.reads[0].callback(None)
        self.assertEqual([e.metadata["action"] for e in self.seen_b], ["instance-started"])

    def test_aFailedReadStillLetsTheEventGo(self) -> None:
        self.relay_b.on_instances('{"op":"UPDATE","name":"web1","old_name":null,"member":"a"}')
        self.bus_a.lifecycle("instance-started", "web1")
        self.clock.advance(0)
        self.store_b.reads[0].errback(RuntimeError("connection lost"))
        self.assertEqual(len(self.seen_b), 1)
        self.flushLoggedErrors()

    def test_ownRowsAreNotReadAgainOthersAndRenamesAre(self) -> None:
        self.relay_b.on_instances('{"op":"UPDATE","name":"w","old_name":null,"member":"b"}')
        self.relay_b.on_instances('{"op":"UPDATE","name":"new","old_name":"old","member":"a"}')
        self.relay_b.on_instances('{"op":"DELETE","name":"gone","old_name":null,"member":""}')
        self.relay_b.on_instances("garbage")
        self.assertEqual(self.store_b.refreshed, ["old", "new", "gone"])

    def test_resyncReadsEverythingAndHoldsEventsUntilThen(self) -> None:
        self.relay_b.resync()
        self.bus_a.lifecycle("instance-stopped", "web1")
        self.clock.advance(0)
        self.assertEqual((self.store_b.reloads, self.seen_b), (1, []))
        self.store_b.reads[0].callback(None)
        self.assertEqual(len(self.seen_b), 1)

    def test_stoppedRelaySendsNothing(self) -> None:
        self.relay_a.stop()
        self.relay_a.stop()
        self.bus_a.lifecycle("instance-started", "web1")
        self.clock.advance(0)
        self.assertEqual((self.wire.payloads, self.seen_b), ([], []))

    def test_garbageOnTheEventsChannelIsIgnored(self) -> None:
        self.relay_b.on_event("{}")
        self.relay_b.on_event("\x00")
        self.assertEqual(self.seen_b, [])


class WiredStore:
    """A real AsyncStore as the relay uses it, events onto a ``Wire`` (SQLite has no NOTIFY)."""

    def __init__(self, store: AsyncStore, wire: Wire) -> None:
        self.store = store
        self.member = store.member
        self.members = wire
        self.view = store.view

    def refresh_instance(self, name: str) -> Deferred[Any]:
        return self.store.refresh_instance(name)

    def reload_instances(self) -> Deferred[None]:
        return self.store.reload_instances()


class StoreOrderTests(TestCase):
    """With real stores on their database threads: B publishes A's event only once it reads
    the row that event is about."""

    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-relay-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "vmready.sqlite")
        self.wire = Wire(reactor)
        self.stores: dict[str, AsyncStore] = {}
        self.buses: dict[str, EventBus] = {}
        self.relays: dict[str, EventRelay] = {}
        for name in ("a", "b"):
            store = AsyncStore.threaded(reactor, Store.open(path), member=name)
            self.addCleanup(store.close)
            self.stores[name] = store
            bus = self.buses[name] = EventBus(reactor.seconds, location=name)
            relay = self.relays[name] = EventRelay(bus, WiredStore(store, self.wire), name)
            relay.start()
            self.wire.relays.append(relay)

    async def test_bListsAsInstanceWhenItsEventsArrive(self) -> None:
        a, b = self.stores["a"], self.stores["b"]
        seen_on_b: list[tuple[str, Any]] = []

        def looked(event: Event) -> None:
            # What a ``vmready wait`` that subscribed now would read of the instance.
            record = b.view.find_instance("web1")
            seen_on_b.append((event.metadata["action"], record and record.vm_state))

        self.buses["b"].subscribe(looked)
        created = await a.instances.create_instance("web1", {}, {})
        started = await a.instances.finish_task(
            "web1", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )
        # B's database thread is slow: its re-reads of the row wait for the gate.
        gate = threading.Event()
        self.addCleanup(gate.set)
        b.run(lambda _engine: gate.wait(30))
        # The trigger's notifications of the commits (PostgreSQL sends them; here the test),
        # each followed by the event A published once it committed.
        self.relays["b"].on_instances(_change("INSERT", created.name, "a"))
        self.buses["a"].lifecycle("instance-created", "web1")
        self.relays["b"].on_instances(_change("UPDATE", started.name, "a"))
        self.buses["a"].lifecycle("instance-started", "web1")

        await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(seen_on_b, [])  # held back: B has not read the row yet
        gate.set()
        while len(seen_on_b) < 2:
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(
            seen_on_b, [("instance-created", VMState.ACTIVE), ("instance-started", VMState.ACTIVE)]
        )
        self.assertEqual([r.name for r in b.view.list_instances()], ["web1"])
        self.assertEqual(b.view.owned_instances(), [])

    async def test_aDeletedRowLeavesBsList(self) -> None:
        a, b = self.stores["a"], self.stores["b"]
        await a.instances.create_instance("web1", {}, {})
        self.relays["b"].on_instances(_change("INSERT", "web1", "a"))
        await b.run(lambda _engine: None)
        self.assertIsNotNone(b.view.find_instance("web1"))
        await a.instances.delete_instance("web1")
        self.relays["b"].on_instances(_change("DELETE", "web1", "a"))
        await b.run(lambda _engine: None)
        await deferLater(reactor, 0, lambda: None)
        self.assertIsNone(b.view.find_instance("web1"))


def _change(op: str, name: str, member: str) -> str:
    return json.dumps({"op": op, "name": name, "old_name": None, "member": member})


class ResyncTests(TestCase):
    """After lost notifications, what changed meanwhile is announced from the rows read again."""

    def setUp(self) -> None:
        directory = self.mktemp()
        os.makedirs(directory)
        path = os.path.join(directory, "vmready.sqlite")
        self.other = Store.open(path)  # member a's writes, unheard by b
        self.addCleanup(self.other.close)
        for name, member_name in (("db1", "a"), ("old", "a"), ("same", "a"), ("mine", "b")):
            self.other.instances.create_instance(name, {}, {}, member=member_name)
        engine = Store.open(path)
        self.addCleanup(engine.close)
        self.store = AsyncStore(engine, InlineExecutor(), cached=True, member="b")
        self.bus = EventBus(Clock().seconds, location="b")
        self.seen: list[Event] = []
        self.bus.subscribe(self.seen.append)
        self.relay = EventRelay(self.bus, self.store, "b")

    def test_changedAndDeletedInstancesOfOtherMembersAreAnnounced(self) -> None:
        self.other.instances.finish_task(
            "db1", TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )
        self.other.instances.delete_instance("old")
        self.other.instances.create_instance("web1", {}, {}, member="a")
        self.other.instances.finish_task(
            "mine", TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN
        )
        self.relay.resync()
        announced = [
            (e.metadata["source"], e.metadata["action"], e.metadata["context"].get("status"))
            for e in self.seen
        ]
        self.assertEqual(
            announced,
            [
                ("/1.0/instances/db1", "instance-state", "Running"),
                ("/1.0/instances/old", "instance-deleted", None),
                ("/1.0/instances/web1", "instance-state", "Starting"),  # building
            ],
        )
        self.assertEqual({e.location for e in self.seen}, {"a"})
        self.assertTrue(all(e.relayed and e.metadata["context"]["resynced"] for e in self.seen))
        self.assertEqual(self.store.view.get_instance("db1").vm_state, VMState.ACTIVE)


def _row(name: str, member: str) -> InstanceRecord:
    return InstanceRecord(
        name,
        f"uuid-{name}",
        VMState.ACTIVE,
        None,
        PowerState.RUNNING,
        {},
        {},
        1.0,
        1.0,
        None,
        member,
    )


class Rows:
    """An owner's instance rows, as ``OwnViews`` reads them."""

    def __init__(self, member: str, *names: str) -> None:
        self.member = member
        self.records = {name: _row(name, member) for name in names}

    def find_instance(self, name: str) -> InstanceRecord | None:
        return self.records.get(name)

    def owned_instances(self) -> list[InstanceRecord]:
        return [r for r in self.records.values() if r.member == self.member]


class LiveViewRelayTests(SynchronousTestCase):
    """An owner's view of its instance goes with each event; the other member keeps it."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.wire = Wire(self.clock)
        later = lambda send: self.clock.callLater(0, send)  # noqa: E731
        self.bus_a = EventBus(self.clock.seconds, location="a")
        self.relay_a = EventRelay(self.bus_a, BusOnlyStore("a", self.wire), "a", later)
        self.rows = Rows("a", "web1", "web2")
        self.agents: dict[str, AgentStatus] = {}
        self.history = AgentHistory()
        self.relay_a.own = OwnViews(
            "a",
            self.rows,
            lambda name: self.agents.get(name, AgentStatus.UNKNOWN),
            self.bus_a.faults,
            self.history.of,
            lambda record: f"/srv/a/run/{record.uuid}/console.log",
        )
        self.bus_b = EventBus(self.clock.seconds, location="b")
        self.relay_b = EventRelay(self.bus_b, BusOnlyStore("b", self.wire), "b", later)
        for relay in (self.relay_a, self.relay_b):
            relay.start()
            self.wire.relays.append(relay)
        # What b's view of web1 is as each of a's events is published on b's bus.
        self.seen_with: list[tuple[Any, LiveView | None]] = []
        self.bus_b.subscribe(
            lambda event: self.seen_with.append(
                (event.metadata.get("action"), self.relay_b.views.of(_row("web1", "a")))
            )
        )

    def connect(self, name: str = "web1") -> None:
        """As ``Watching`` does: the event, then (in the same turn) the history."""
        self.agents[name] = AgentStatus.CONNECTED
        event = self.bus_a.lifecycle("instance-agent-connected", name, {"status": "connected"})
        self.history.record(name, LinkChange("connected", event.timestamp, "advertised again"))

    def deliver(self) -> None:
        self.clock.advance(0)  # a's events go out at the end of their turn
        self.clock.advance(0)  # and reach b

    def test_theViewAsTheTurnLeftItTravelsWithTheEvent(self) -> None:
        self.bus_a.lifecycle("instance-snapshot-failed", "web1", {"error": "disk full"})
        self.connect()
        self.deliver()
        view = LiveView(
            "a",
            AgentStatus.CONNECTED,
            (Fault("snapshot", "disk full", 1_700_000_000.0),),
            (LinkChange("connected", 1_700_000_000.0, "advertised again"),),
            "/srv/a/run/uuid-web1/console.log",
        )
        # Each event published on b with the view already kept: never behind the event.
        self.assertEqual(
            self.seen_with,
            [("instance-snapshot-failed", view), ("instance-agent-connected", view)],
        )

    def test_aViewIsNotUsedForAnInstanceRunningElsewhere(self) -> None:
        self.connect()
        self.deliver()
        self.assertIsNotNone(self.relay_b.views.of(_row("web1", "a")))
        self.assertIsNone(self.relay_b.views.of(_row("web1", "c")))

    def test_anEventWithoutAViewForgetsTheOneKept(self) -> None:
        self.connect()
        self.deliver()
        # A fault too long for one payload: the event goes, its view does not fit.
        self.bus_a.lifecycle("instance-error", "web1", {"error": "x" * 5000})
        self.bus_a.lifecycle("instance-snapshot-failed", "web1", {"error": "y" * 5000})
        self.deliver()
        self.assertEqual([action for action, _ in self.seen_with][-1], "instance-snapshot-failed")
        self.assertIsNone(self.relay_b.views.of(_row("web1", "a")))

    def test_anInstanceDeletedOrRenamedAwayIsForgotten(self) -> None:
        self.connect("web1")
        self.connect("web2")
        self.deliver()
        del self.rows.records["web1"]
        self.bus_a.lifecycle("instance-deleted", "web1")
        self.rows.records["web3"] = _row("web3", "a")
        del self.rows.records["web2"]
        self.agents["web3"] = self.agents.pop("web2")
        self.bus_a.lifecycle("instance-renamed", "web3", {"old_name": "web2"})
        self.deliver()
        self.assertIsNone(self.relay_b.views.of(_row("web1", "a")))
        self.assertIsNone(self.relay_b.views.of(_row("web2", "a")))
        told = self.relay_b.views.of(_row("web3", "a"))
        assert told is not None
        self.assertEqual(told.agent, AgentStatus.CONNECTED)

    def test_aMemberAskingGetsEveryViewOfTheOthers(self) -> None:
        self.agents["web1"] = AgentStatus.CONNECTED
        console = "/srv/a/run/uuid-{}/console.log".format
        self.relay_b.ask_views()
        self.clock.advance(0)  # the request reaches a
        self.clock.advance(0)  # a's views reach b
        self.assertEqual(
            {name: self.relay_b.views.of(_row(name, "a")) for name in ("web1", "web2")},
            {
                "web1": LiveView("a", AgentStatus.CONNECTED, console_log=console("web1")),
                "web2": LiveView("a", AgentStatus.UNKNOWN, console_log=console("web2")),
            },
        )
        self.assertEqual(self.seen_with, [])  # views are no events

    def test_lostNotificationsForgetEveryViewAndAskAgain(self) -> None:
        self.connect()
        self.deliver()
        self.agents["web1"] = AgentStatus.STOPPED  # its event lost with the connection
        self.relay_b.resync()
        self.assertEqual(len(self.relay_b.views), 0)
        self.clock.advance(0)
        self.clock.advance(0)
        told = self.relay_b.views.of(_row("web1", "a"))
        assert told is not None
        self.assertEqual(told.agent, AgentStatus.STOPPED)

    def test_stoppingSendsWhatWaitsForTheTurnsEnd(self) -> None:
        self.connect()
        self.relay_a.stop()
        self.assertEqual(len(self.wire.payloads), 1)
        self.assertEqual(json.loads(self.wire.payloads[0])["live"]["agent"], "connected")


class ViewPayloadTests(SynchronousTestCase):
    """Views in NOTIFY payloads: as many to one as fit, and back."""

    def view(
        self, reason: str = "lost: the agent said nothing for 15.0s (no heartbeat)"
    ) -> LiveView:
        history = tuple(LinkChange("stopped", 1_700_000_000.0 + i, reason) for i in range(10))
        return LiveView("a", AgentStatus.STOPPED, (Fault("agent", reason, 1.0),), history)

    def test_manyViewsTravelInPayloadsWithinTheLimit(self) -> None:
        views = {f"web{i}": self.view() for i in range(100)}
        payloads = encode_views("a", views, seq=7)
        self.assertGreater(len(payloads), 1)
        told: dict[str, LiveView] = {}
        for number, payload in enumerate(payloads):
            self.assertLessEqual(len(payload.encode()), MAX_PAYLOAD_BYTES)
            document = json.loads(payload)
            self.assertEqual((document["member"], document["seq"]), ("a", 7 + number))
            told.update(views_from_json("a", document["views"]))
        self.assertEqual(told, views)

    def test_aViewTooBigForAPayloadOfItsOwnIsLeftOut(self) -> None:
        views = {"big": self.view("z" * 1000), "small": self.view()}
        [payload] = encode_views("a", views)
        self.assertEqual(list(json.loads(payload)["views"]), ["small"])

    def test_whatIsNotAViewIsNotOne(self) -> None:
        good = view_json(self.view())
        self.assertEqual(view_from_json("a", good), self.view())
        bad: Any
        for bad in (
            None,
            [],
            {**good, "agent": "dancing"},
            {**good, "faults": [["agent", "x"]]},
            {**good, "faults": [["agent", "x", "soon"]]},
            {**good, "history": [["stopped", float("nan"), None]]},
            {**good, "history": [["stopped", 1.0, 5]]},
            {**good, "history": None},
        ):
            self.assertIsNone(view_from_json("a", bad), bad)
