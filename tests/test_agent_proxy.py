"""Tests for vmready.agent.proxy: the devlxd socket's answers, as a guest program sees them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import treq
from treq.testing import RequestTraversalAgent, StubTreq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseNeverReceived
from twisted.web.iweb import IAgent, IResponse
from zope.interface import implementer

from vmready.agent.host import OneEndpoint
from vmready.agent.proxy import (
    MAX_REQUEST_BODY,
    Answer,
    GuestAPIProxy,
    HostRoute,
    HostUnreachable,
    devlxd_answer,
    proxy_site,
)
from vmready.agent.testing import FakeGuestHost

LABEL = "vsock 2:49152"


def envelope(metadata: Any) -> bytes:
    return json.dumps({"type": "sync", "status": "Success", "metadata": metadata}).encode()


class DevlxdAnswerTests(SynchronousTestCase):
    """The host's envelope, unwrapped into what LXD's devlxd socket sends."""

    def test_objectMetadataIsJsonWithANewline(self) -> None:
        self.assertEqual(
            devlxd_answer(200, envelope({"state": "Ready"})),
            Answer(200, b"application/json", b'{"state": "Ready"}\n'),
        )

    def test_stringMetadataIsRaw(self) -> None:
        self.assertEqual(
            devlxd_answer(200, envelope("instance-id: x\n")),
            Answer(200, b"application/octet-stream", b"instance-id: x\n"),
        )

    def test_errorIsPlainTextWithTheStatus(self) -> None:
        raw = json.dumps({"type": "error", "error": "not found", "error_code": 404}).encode()
        self.assertEqual(
            devlxd_answer(404, raw), Answer(404, b"text/plain; charset=utf-8", b"not found\n")
        )

    def test_answerWithoutEnvelopeIs502(self) -> None:
        answer = devlxd_answer(200, b"<html>")
        self.assertEqual(
            (answer.code, answer.body),
            (502, b"host sent an invalid answer (HTTP 200, not an LXD envelope)\n"),
        )


@implementer(IAgent)
class ScriptedAgent:
    """An HTTP client to the host that answers every request with ``result``."""

    def __init__(self, result: Deferred[IResponse]) -> None:
        self.result = result
        self.uris: list[bytes] = []

    def request(
        self, method: bytes, uri: bytes, headers: Any = None, bodyProducer: Any = None
    ) -> Deferred[IResponse]:
        self.uris.append(uri)
        return self.result


class ProxyHarness:
    """The proxy in memory, in front of a fake host in memory."""

    def __init__(self, connected: bool = True, host_agent: IAgent | None = None) -> None:
        self.clock = Clock()
        self.host = FakeGuestHost(self.clock, config={"user.foo": "bar"})
        self.host_agent = host_agent or RequestTraversalAgent(self.host.app.resource())
        self.connected = connected
        self.remembered: list[str] = []
        self.proxy = GuestAPIProxy(self.route, self.remembered.append, self.clock, timeout=30)
        # StubTreq grows treq's functions at run time; mypy cannot see them.
        self.client: Any = StubTreq(self.proxy)

    def route(self) -> HostRoute:
        if not self.connected:
            raise HostUnreachable("the host has not sent CONNECT yet")
        return HostRoute(self.host_agent, LABEL)

    def flush(self) -> None:
        for _ in range(5):
            if isinstance(self.host_agent, RequestTraversalAgent):
                self.host_agent.flush()
            self.client.flush()

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, bytes]:
        """Status, content type and body of one request."""
        requesting = self.client.request(method, "http://lxd" + path, data=body)
        self.flush()
        response = requesting.result if requesting.called else None
        assert response is not None, "no answer"
        reading = response.content()
        self.flush()
        content_type = response.headers.getRawHeaders(b"content-type", [b""])[0]
        return response.code, content_type, reading.result


class ProxyTests(SynchronousTestCase):
    def test_stateIsTheHostsMetadataAsJson(self) -> None:
        code, content_type, body = ProxyHarness().call("GET", "/1.0")
        self.assertEqual((code, content_type), (200, b"application/json"))
        self.assertEqual(json.loads(body)["state"], "Started")

    def test_configValueIsRaw(self) -> None:
        self.assertEqual(
            ProxyHarness().call("GET", "/1.0/config/user.foo"),
            (200, b"application/octet-stream", b"bar"),
        )

    def test_hostErrorIsPlainTextWithItsStatus(self) -> None:
        self.assertEqual(
            ProxyHarness().call("GET", "/1.0/config/user.missing"),
            (404, b"text/plain; charset=utf-8", b"not found\n"),
        )

    def test_readyPatchReachesTheHostAndIsRemembered(self) -> None:
        harness = ProxyHarness()
        code, _, body = harness.call("PATCH", "/1.0", b'{"state": "Ready"}')
        self.assertEqual((code, body), (200, b"{}\n"))
        self.assertEqual((harness.host.patches, harness.remembered), (["Ready"], ["Ready"]))

    def test_startedPatchIsRemembered(self) -> None:
        harness = ProxyHarness()
        harness.call("PATCH", "/1.0", b'{"state": "Started"}')
        self.assertEqual(harness.remembered, ["Started"])

    def test_refusedPatchIsNotRemembered(self) -> None:
        harness = ProxyHarness()
        code, _, body = harness.call("PATCH", "/1.0", b'{"state": "Running"}')
        self.assertEqual((code, body), (400, b'Invalid state "Running"\n'))
        self.assertEqual(harness.remembered, [])

    def test_pathAndQueryAreForwarded(self) -> None:
        agent = ScriptedAgent(Deferred())
        harness = ProxyHarness(host_agent=agent)
        harness.client.request("GET", "http://lxd/1.0/events?type=config")
        self.assertEqual(agent.uris, [b"http://vmready-host/1.0/events?type=config"])

    def test_linkDownIs503WithTheReason(self) -> None:
        self.assertEqual(
            ProxyHarness(connected=False).call("GET", "/1.0"),
            (
                503,
                b"text/plain; charset=utf-8",
                b"host not reachable: the host has not sent CONNECT yet\n",
            ),
        )

    def test_hostDroppingTheRequestIs503(self) -> None:
        dropped = fail(ResponseNeverReceived([Failure(ConnectionLost())]))
        code, _, body = ProxyHarness(host_agent=ScriptedAgent(dropped)).call("GET", "/1.0")
        self.assertEqual(
            (code, body),
            (503, b"host not reachable: vsock 2:49152: the connection to the host was lost\n"),
        )

    def test_agentBugIs500WithOneLine(self) -> None:
        broken = ProxyHarness(
            host_agent=ScriptedAgent(fail(ZeroDivisionError("division by zero")))
        )
        code, _, body = broken.call("GET", "/1.0")
        self.assertEqual((code, body), (500, b"vmready-agent internal error: division by zero\n"))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    def test_silentHostIs503AfterTheTimeout(self) -> None:
        harness = ProxyHarness(host_agent=ScriptedAgent(Deferred()))
        requesting = harness.client.request("GET", "http://lxd/1.0")
        harness.flush()
        harness.clock.advance(30)
        harness.flush()
        response = self.successResultOf(requesting)
        reading = response.content()
        harness.flush()
        self.assertEqual(
            (response.code, self.successResultOf(reading)),
            (503, b"host not reachable: no answer from vsock 2:49152 within 30s\n"),
        )


class CappedBodyTests(TestCase):
    """Request bodies over 1 MiB, over the real socket and HTTP parser."""

    def setUp(self) -> None:
        base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, base, True)
        self.socket = os.path.join(base, "sock")
        proxy = GuestAPIProxy(self.unreachable, lambda state: None, reactor)
        self.port: IListeningPort = reactor.listenUNIX(self.socket, proxy_site(proxy))  # type: ignore[attr-defined]
        self.addCleanup(self.port.stopListening)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)
        self.agent = Agent.usingEndpointFactory(
            reactor, OneEndpoint(UNIXClientEndpoint(reactor, self.socket)), pool=self.pool
        )

    def unreachable(self) -> HostRoute:
        raise HostUnreachable("no link in this test")

    async def patch_body(self, size: int) -> tuple[int, bytes]:
        response = await treq.request(
            "PATCH", "http://lxd/1.0", data=b" " * size, agent=self.agent
        )
        return response.code, await response.content()

    async def test_bodyOverTheLimitIs413(self) -> None:
        self.assertEqual(
            await self.patch_body(MAX_REQUEST_BODY + 1),
            (413, b"Request body too large (limit 1048576 bytes)\n"),
        )

    async def test_bodyAtTheLimitGoesOnToTheHost(self) -> None:
        self.assertEqual(
            await self.patch_body(MAX_REQUEST_BODY),
            (503, b"host not reachable: no link in this test\n"),
        )
