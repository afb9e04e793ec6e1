"""Tests for vmready.api.rendered: each instance's view, rendered again only when it changed."""

from __future__ import annotations

import json
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from vmready.api.lxdbodies import instance_etag
from vmready.api.rendered import RenderedInstances, ViewInputs, in_slices
from vmready.api.views import instance_json
from vmready.domain import InstanceRecord
from vmready.domain.states import PowerState, VMState
from vmready.lifecycle import Fault, LinkChange
from vmready.protocols import AgentStatus


def record(name: str = "web1", **changes: Any) -> InstanceRecord:
    """A running instance's row."""
    row = InstanceRecord(
        name,
        f"uuid-{name}",
        VMState.ACTIVE,
        None,
        PowerState.RUNNING,
        {"limits.memory": "512", "user.team": "blue"},
        {"root": {"type": "disk", "path": "/"}},
        1_800_000_000.0,
        1_800_000_001.5,
    )
    return attrs.evolve(row, **changes)


def inputs(row: InstanceRecord | None = None, **changes: Any) -> ViewInputs:
    """The inputs of a running instance whose agent is connected, with no fault."""
    return ViewInputs(record() if row is None else row, AgentStatus.CONNECTED, (), ())._replace(
        **changes
    )


class RenderedInstancesTests(SynchronousTestCase):
    """A view is rendered once per change of its inputs; every change is seen at once."""

    def setUp(self) -> None:
        self.existing = {"web1", "web2"}
        self.rendered = RenderedInstances(self.render, self.existing.__contains__)

    def render(self, given: ViewInputs) -> dict[str, Any]:
        return instance_json(
            given.record,
            given.agent,
            given.faults,
            given.agent_history,
            "/run/console.log",
            given.location,
            given.unreachable,
        )

    def test_theViewIsTheInstanceJSONOfItsInputs(self) -> None:
        shown = self.rendered.get(inputs())
        self.assertEqual(shown.view, self.render(inputs()))

    def test_theJSONAndETagAreThoseOfTheView(self) -> None:
        shown = self.rendered.get(inputs())
        self.assertEqual(shown.json, json.dumps(shown.view).encode("utf-8"))
        self.assertEqual(shown.etag, instance_etag(shown.view))

    def test_equalInputsAreAnsweredWithoutRenderingAgain(self) -> None:
        first = self.rendered.get(inputs())
        # Equal inputs, not the same objects: a row read again from the store.
        again = self.rendered.get(inputs(record()))
        self.assertIs(again, first)
        self.assertEqual(self.rendered.renders, 1)

    def test_aChangedRowIsShownAtOnce(self) -> None:
        self.rendered.get(inputs())
        changed = record(config={"limits.memory": "1024", "user.team": "red"})
        shown = self.rendered.get(inputs(changed))
        self.assertEqual(shown.view["config"], {"limits.memory": "1024", "user.team": "red"})
        self.assertEqual(shown.view["limits"]["memory_mib"], 1024)

    def test_aChangedRowChangesTheETag(self) -> None:
        before = self.rendered.get(inputs()).etag
        after = self.rendered.get(inputs(record(config={"user.team": "red"}))).etag
        self.assertNotEqual(after, before)

    def test_aChangedAgentStatusIsShownAtOnce(self) -> None:
        self.rendered.get(inputs())
        shown = self.rendered.get(inputs(agent=AgentStatus.STOPPED))
        self.assertEqual(shown.view["agent"]["status"], "stopped")

    def test_aNewFaultIsShownAtOnce(self) -> None:
        self.rendered.get(inputs())
        fault = Fault("monitor", "the VM's monitor was lost", 1_800_000_002.0)
        shown = self.rendered.get(inputs(faults=(fault,)))
        self.assertEqual(
            shown.view["faults"],
            [
                {
                    "kind": "monitor",
                    "message": "the VM's monitor was lost",
                    "since": "2027-01-15T08:00:02Z",
                }
            ],
        )

    def test_aNewAgentLinkChangeIsShownAtOnce(self) -> None:
        self.rendered.get(inputs())
        change = LinkChange("connected", 1_800_000_003.0)
        shown = self.rendered.get(inputs(agent_history=(change,)))
        self.assertEqual(
            shown.view["agent"]["history"], [{"status": "connected", "at": "2027-01-15T08:00:03Z"}]
        )

    def test_anUnreachableMemberIsShownAtOnce(self) -> None:
        self.rendered.get(inputs(location="m2"))
        lost = Fault("host", "member m2 is unreachable", 1_800_000_004.0)
        shown = self.rendered.get(inputs(location="m2", unreachable=lost))
        self.assertEqual(shown.view["display_status"], "UNKNOWN")

    def test_eachInstanceKeepsItsOwnView(self) -> None:
        self.rendered.get(inputs(record("web1")))
        self.rendered.get(inputs(record("web2")))
        self.assertEqual(self.rendered.get(inputs(record("web1"))).view["name"], "web1")
        self.assertEqual(self.rendered.renders, 2)

    def test_theViewsOfInstancesGoneAreDroppedAsOthersAreAdded(self) -> None:
        # Instances come and go, read once each: what is kept stays near what exists.
        for index in range(1000):
            name = f"vm{index}"
            self.existing.add(name)
            self.rendered.get(inputs(record(name)))
            self.existing.discard(name)
        self.assertLessEqual(len(self.rendered), 64)

    def test_theViewsOfInstancesThatExistAreKept(self) -> None:
        names = [f"vm{index}" for index in range(200)]
        self.existing.update(names)
        for name in names:
            self.rendered.get(inputs(record(name)))
        for name in names:
            self.rendered.get(inputs(record(name)))
        self.assertEqual((len(self.rendered), self.rendered.renders), (200, 200))


class Turns(Clock):
    """A clock whose ``turn`` runs the calls due now, as one turn of the reactor does.

    (``Clock.advance`` also runs the calls those calls schedule for now.)
    """

    def turn(self) -> None:
        due = [call for call in self.calls if call.getTime() <= self.seconds()]
        for call in due:
            self.calls.remove(call)
            call.func(*call.args, **call.kw)


class InSlicesTests(SynchronousTestCase):
    """A long list is read a slice per turn of the reactor, in order."""

    def setUp(self) -> None:
        self.clock = Turns()
        self.seen: list[int] = []

    def each(self, item: int) -> int:
        self.seen.append(item)
        return item * 10

    def test_aSliceIsReadPerTurnOfTheReactor(self) -> None:
        done = Deferred.fromCoroutine(in_slices(range(250), self.each, self.clock, 100))
        self.assertEqual((len(self.seen), done.called), (100, False))
        self.clock.turn()
        self.assertEqual((len(self.seen), done.called), (200, False))
        self.clock.turn()
        self.assertEqual(self.successResultOf(done), [item * 10 for item in range(250)])

    def test_aListWithinOneSliceIsReadAtOnce(self) -> None:
        done = Deferred.fromCoroutine(in_slices(range(100), self.each, self.clock, 100))
        self.assertEqual(self.successResultOf(done), [item * 10 for item in range(100)])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_anEmptyListIsReadAtOnce(self) -> None:
        done = Deferred.fromCoroutine(in_slices([], self.each, self.clock, 100))
        self.assertEqual(self.successResultOf(done), [])
