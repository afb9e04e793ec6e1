"""``GET /1.0/metrics`` over a real Lifecycle (fakeqemu VMs), and guest requests counted."""

from __future__ import annotations

import json
import re
from typing import Any

from treq.testing import StubTreq
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.iweb import IRequest

from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.agentlink.link import PollIntervals
from vmready.api.guest import GuestAPI
from vmready.api.metrics import CountedGuestResource
from vmready.api.operator import OperatorAPI
from vmready.domain.model import InstanceRecord
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.guestlink import GuestLink
from vmready.trust.certs import generate

_SERVER = generate("vmready-test-server")
_CALLER = b"X-Test-Instance"
# One sample line: a name, optional labels, a value.
_LABEL = r'[a-zA-Z_]\w*="(?:[^"\\\n]|\\.)*"'
_SAMPLE = re.compile(rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{_LABEL}(?:,{_LABEL})*\}})? (\S+)")


def parse(text: str) -> dict[str, float]:
    """``name{labels}`` → value, checking every line and that each family is declared."""
    declared: dict[str, str] = {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            declared[name] = kind
            continue
        match = _SAMPLE.fullmatch(line)
        assert match is not None, f"not a sample line: {line!r}"
        name = match.group(1)
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in declared or family in declared, f"{name} has no # TYPE"
        values[name + (match.group(2) or "")] = float(match.group(3))
    return values


class MetricsAPITests(TestCase):
    """Actions, Ready, guest requests and ring reads, as a scrape shows them."""

    timeout = 60

    def setUp(self) -> None:
        self.lifecycle: Lifecycle = make_lifecycle(self)
        # A guest API "listens": running VMs get an agent link, their ring buffer is read.
        self.lifecycle.reach.listening(
            GuestLink(
                40999,
                _SERVER.cert_pem,
                "hvsock:/nonexistent",
                PollIntervals(follow_up=0.02, follow_up_window=5.0),
            )
        )
        # StubTreq grows treq's functions at run time; mypy cannot see them.
        self.operator: Any = StubTreq(OperatorAPI(self.lifecycle, "fakeqemu").app.resource())
        guest = GuestAPI(self.lifecycle, self.identify)
        self.guest: Any = StubTreq(
            CountedGuestResource(guest.app.resource(), self.lifecycle.metrics)
        )

    def identify(self, request: IRequest) -> InstanceRecord | None:
        """The instance the test header names."""
        name = request.getHeader(_CALLER)
        return self.lifecycle.store.view.find_instance(name.decode()) if name else None

    async def request(self, http: Any, method: str, url: str, **kwargs: Any) -> tuple[Any, bytes]:
        pending = http.request(method, url, **kwargs)
        http.flush()
        response = await pending
        return response, await http.content(response)

    async def guest_call(self, method: str, path: str, body: Any = None) -> int:
        data = json.dumps(body).encode() if body is not None else None
        response, _ = await self.request(
            self.guest, method, "http://guest" + path, data=data, headers={_CALLER: [b"web1"]}
        )
        code: int = response.code
        return code

    async def scrape(self) -> dict[str, float]:
        response, body = await self.request(self.operator, "GET", "http://vmready/1.0/metrics")
        self.assertEqual(response.code, 200)
        self.assertEqual(
            response.headers.getRawHeaders(b"Content-Type"),
            [b"text/plain; version=0.0.4; charset=utf-8"],
        )
        return parse(body.decode("utf-8"))

    async def launch(self) -> None:
        response, body = await self.request(
            self.operator,
            "POST",
            "http://vmready/1.0/instances",
            data=b'{"name": "web1", "start": true}',
        )
        self.assertEqual(response.code, 202, body)
        operation = self.lifecycle.operations.get(json.loads(body)["metadata"]["id"])
        await operation.when_done()
        self.assertEqual(operation.error, "")

    async def until(self, condition: Any) -> None:
        for _ in range(400):
            if condition():
                return
            await deferLater(reactor, 0.025, lambda: None)
        self.fail("condition not reached")

    async def test_aFreshDaemonShowsEveryFamilyAtZero(self) -> None:
        values = await self.scrape()
        self.assertEqual(values['vmready_build_info{version="0.1.0"}'], 1)
        self.assertEqual(values['vmready_instances{status="READY"}'], 0)
        self.assertEqual(values['vmready_agent_links{state="connected"}'], 0)
        self.assertEqual(values['vmready_actions_total{action="create",result="success"}'], 0)
        self.assertEqual(values['vmready_qmp_ring_reads_total{result="ok"}'], 0)
        self.assertEqual(values["vmready_ready_latency_seconds_count"], 0)
        self.assertEqual(values["vmready_start_time_seconds"], self.lifecycle.metrics.started_at)

    async def test_scrapeReflectsWhatHappened(self) -> None:
        await self.launch()
        metrics = self.lifecycle.metrics
        await self.until(lambda: metrics.ring_reads.value("ok") > 0)
        self.assertEqual(await self.guest_call("PATCH", "/1.0", {"state": "Ready"}), 200)
        self.assertEqual(await self.guest_call("PATCH", "/1.0", {"state": "Up"}), 400)
        self.assertEqual(await self.guest_call("GET", "/1.0/nothing"), 404)
        self.assertEqual(await self.guest_call("GET", "/1.0"), 200)

        values = await self.scrape()
        self.assertEqual(values['vmready_actions_total{action="create",result="success"}'], 1)
        self.assertEqual(values['vmready_actions_total{action="create",result="error"}'], 0)
        self.assertEqual(values['vmready_action_duration_seconds_count{action="create"}'], 1)
        self.assertEqual(
            values['vmready_action_duration_seconds_bucket{action="create",le="+Inf"}'], 1
        )
        self.assertEqual(values['vmready_instances{status="READY"}'], 1)
        self.assertEqual(values['vmready_instances{status="STOPPED"}'], 0)
        # No agent runs in a fakeqemu guest without a boot source: its link says nothing yet.
        self.assertEqual(values['vmready_agent_links{state="unknown"}'], 1)
        self.assertGreaterEqual(values['vmready_qmp_ring_reads_total{result="ok"}'], 1)
        self.assertEqual(values['vmready_guest_api_requests_total{method="PATCH",code="200"}'], 1)
        self.assertEqual(values['vmready_guest_api_requests_total{method="PATCH",code="400"}'], 1)
        self.assertEqual(values['vmready_guest_api_requests_total{method="GET",code="404"}'], 1)
        self.assertEqual(values['vmready_guest_api_requests_total{method="GET",code="200"}'], 1)
        self.assertEqual(values["vmready_ready_latency_seconds_count"], 1)
        self.assertEqual(values['vmready_ready_latency_seconds_bucket{le="+Inf"}'], 1)

    async def test_aRefusedActionIsNotCountedAStoppedOneIs(self) -> None:
        await self.launch()
        for action, code in (("unfreeze", 409), ("stop", 202)):
            response, body = await self.request(
                self.operator,
                "PUT",
                "http://vmready/1.0/instances/web1/state",
                data=json.dumps({"action": action, "force": True}).encode(),
            )
            # unfreeze is refused before it starts (an active instance is not frozen).
            self.assertEqual(response.code, code, body)
        for operation in self.lifecycle.operations.list():
            await operation.when_done()
        values = await self.scrape()
        self.assertEqual(values['vmready_actions_total{action="unfreeze",result="error"}'], 0)
        self.assertEqual(values['vmready_actions_total{action="unfreeze",result="success"}'], 0)
        self.assertEqual(values['vmready_actions_total{action="stop",result="success"}'], 1)
        self.assertEqual(values['vmready_instances{status="STOPPED"}'], 1)
        self.assertEqual(values['vmready_agent_links{state="unknown"}'], 0)

    async def test_metricsIsGETOnly(self) -> None:
        response, body = await self.request(self.operator, "POST", "http://vmready/1.0/metrics")
        self.assertEqual(response.code, 405)
        self.assertEqual(json.loads(body)["error"], "method not allowed")
