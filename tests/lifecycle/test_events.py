"""Tests for vmready.lifecycle.events and vmready.lifecycle.operations."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.model import Conflict, NotFound
from vmready.lifecycle.events import LIFECYCLE, OPERATION, Event, EventBus
from vmready.lifecycle.operations import RETAIN_SECONDS, Operations


class EventBusTests(SynchronousTestCase):
    """Events reach subscribers, filtered by type, in LXD's envelope."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000.25)
        self.bus = EventBus(self.clock.seconds)

    def test_lifecycleEventNamesSourceAndContext(self) -> None:
        seen: list[Event] = []
        self.bus.subscribe(seen.append)
        self.bus.lifecycle("instance-ready", "web1", {"status": "Ready"})
        self.assertEqual(
            seen[0].to_json(),
            {
                "type": "lifecycle",
                "timestamp": "2023-11-14T22:13:20.25Z",
                "metadata": {
                    "action": "instance-ready",
                    "source": "/1.0/instances/web1",
                    "context": {"status": "Ready"},
                },
                "project": "default",
            },
        )

    def test_typeFilterDeliversOnlyThoseTypes(self) -> None:
        lifecycle: list[Event] = []
        self.bus.subscribe(lifecycle.append, frozenset({LIFECYCLE}))
        self.bus.publish(OPERATION, {"id": "x"})
        self.bus.lifecycle("instance-started", "a")
        self.assertEqual([e.type for e in lifecycle], [LIFECYCLE])

    def test_unsubscribeStopsDelivery(self) -> None:
        seen: list[Event] = []
        unsubscribe = self.bus.subscribe(seen.append)
        unsubscribe()
        unsubscribe()
        self.bus.lifecycle("instance-started", "a")
        self.assertEqual(seen, [])

    def test_brokenSubscriberDoesNotStopOthers(self) -> None:
        def broken(event: Event) -> None:
            raise RuntimeError("subscriber bug")

        seen: list[Event] = []
        self.bus.subscribe(broken)
        self.bus.subscribe(seen.append)
        self.bus.lifecycle("instance-started", "a")
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class OperationsTests(SynchronousTestCase):
    """Operations run work, report its outcome, and are forgotten after a while."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.events: list[Event] = []
        bus = EventBus(self.clock.seconds)
        bus.subscribe(self.events.append)
        self.operations = Operations(self.clock, bus)

    def test_successfulWorkSucceeds(self) -> None:
        async def work() -> None:
            return None

        operation = self.operations.run("Start instance a", "a", work)
        self.assertEqual(operation.to_json()["status"], "Success")
        self.assertEqual(operation.to_json()["status_code"], 200)
        self.assertEqual(operation.to_json()["resources"], {"instances": ["/1.0/instances/a"]})
        self.assertIs(self.successResultOf(operation.when_done()), operation)

    def test_userErrorBecomesTheOperationError(self) -> None:
        async def work() -> None:
            raise Conflict("Cannot 'stop' instance a while it is in task_state rebuilding")

        operation = self.operations.run("Stop instance a", "a", work)
        self.assertEqual(
            (operation.to_json()["status"], operation.to_json()["err"]),
            ("Failure", "Cannot 'stop' instance a while it is in task_state rebuilding"),
        )

    def test_unexpectedErrorIsLoggedAndReported(self) -> None:
        async def work() -> None:
            raise KeyError("boom")

        operation = self.operations.run("Stop instance a", "a", work)
        self.assertIn("internal error", operation.error)
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_operationEventsAnnounceCreationAndCompletion(self) -> None:
        async def work() -> None:
            return None

        self.operations.run("Start instance a", "a", work)
        self.assertEqual(
            [e.metadata["status"] for e in self.events if e.type == OPERATION],
            ["Running", "Success"],
        )

    def test_finishedOperationsAreForgottenLater(self) -> None:
        async def work() -> None:
            return None

        operation = self.operations.run("Start instance a", "a", work)
        self.assertIs(self.operations.get(operation.id), operation)
        self.clock.advance(RETAIN_SECONDS + 1)
        with self.assertRaises(NotFound):
            self.operations.get(operation.id)
