"""Tests for vmready.domain.listeners: each listener told, in order, whatever another does."""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred, fail
from twisted.logger import ILogObserver, Logger
from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.listeners import Listeners


class ListenersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.logged: list[dict[str, Any]] = []
        self.listeners: Listeners[str] = Listeners(
            Logger(observer=cast(ILogObserver, self.logged.append)),
            "listener failed on {kind} of {name}",
        )
        self.heard: list[tuple[str, str]] = []

    def hear(self, who: str) -> Any:
        return lambda event: self.heard.append((who, event))

    def test_everyListenerHearsEachEventInTheOrderTheySubscribed(self) -> None:
        self.listeners.subscribe(self.hear("a"))
        self.listeners.subscribe(self.hear("b"))
        self.listeners.notify("one")
        self.listeners.notify("two")
        self.assertEqual(self.heard, [("a", "one"), ("b", "one"), ("a", "two"), ("b", "two")])

    def test_aFirstListenerHearsBeforeThoseAlreadyThere(self) -> None:
        self.listeners.subscribe(self.hear("a"))
        self.listeners.subscribe(self.hear("first"), first=True)
        self.listeners.notify("one")
        self.assertEqual(self.heard, [("first", "one"), ("a", "one")])

    def test_anUnsubscribedListenerHearsNothingAndUnsubscribingTwiceIsHarmless(self) -> None:
        unsubscribe = self.listeners.subscribe(self.hear("a"))
        self.listeners.subscribe(self.hear("b"))
        unsubscribe()
        unsubscribe()
        self.listeners.notify("one")
        self.assertEqual(self.heard, [("b", "one")])

    def test_aListenerThatRaisesIsLoggedWithTheFieldsAndTheOthersStillHear(self) -> None:
        def broken(event: str) -> None:
            raise RuntimeError("listener bug")

        self.listeners.subscribe(broken)
        self.listeners.subscribe(self.hear("b"))
        self.listeners.notify("one", kind="start", name="vm1")
        self.assertEqual(self.heard, [("b", "one")])
        [entry] = self.logged
        self.assertEqual(
            (entry["log_format"], entry["kind"], entry["name"]),
            ("listener failed on {kind} of {name}", "start", "vm1"),
        )
        self.assertEqual(entry["log_failure"].getErrorMessage(), "listener bug")

    def test_aListenersFailingDeferredIsLogged(self) -> None:
        self.listeners.subscribe(lambda event: fail(ValueError("later")))
        self.listeners.subscribe(self.hear("b"))
        self.listeners.notify("one", name="vm1")
        self.assertEqual(self.heard, [("b", "one")])
        self.assertEqual([e["log_failure"].getErrorMessage() for e in self.logged], ["later"])

    def test_aListenerWaitingIsNotWaitedFor(self) -> None:
        waiting: Deferred[None] = Deferred()
        self.listeners.subscribe(lambda event: waiting)
        self.listeners.subscribe(self.hear("b"))
        self.listeners.notify("one")
        self.assertEqual((self.heard, self.logged), ([("b", "one")], []))
        waiting.errback(ValueError("at last"))
        self.assertEqual([e["log_failure"].getErrorMessage() for e in self.logged], ["at last"])

    def test_aListenerUnsubscribedDuringAnEventStillHearsThatEventOnly(self) -> None:
        unsubscribe_b: list[Any] = []
        self.listeners.subscribe(lambda event: unsubscribe_b[0]())
        unsubscribe_b.append(self.listeners.subscribe(self.hear("b")))
        self.listeners.notify("one")
        self.listeners.notify("two")
        self.assertEqual(self.heard, [("b", "one")])
