"""The agent end to end: a fake serial peer, a real TLS fake host, a guest program's socket.

The host and the serial peer are the Twisted fakes (``tests.agentfakes``), the
daemon's own TLS code behind them; the agent is the real one, built by
``build_agent`` from an ``AgentConfig``, running on its own asyncio loop in a
thread beside the reactor (``AgentThread``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from typing import Any, cast

import treq
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IAgent, IAgentEndpointFactory
from zope.interface import implementer

from tests.agentfakes import FakeGuestHost, agent_ports
from tests.asynciotesting import AgentThread
from tests.reactor import reactor
from tests.received import Received
from vmready.agent.config import AgentConfig, Transport
from vmready.agent.memory import ReadyMemory
from vmready.agent.service import Agent as GuestAgent
from vmready.agent.service import build_agent
from vmready.protocols.transcriptreader import read_transcript
from vmready.trust.certs import CertificatePair, generate, write_config_drive

CLIENT = generate("demo")
SERVER = generate("vmready")
IMPOSTOR = generate("vmready")
STRANGER = generate("other")


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (polling: some states have no event to wait on)."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await deferLater(reactor, 0.01)
    raise AssertionError("condition not met in time")


@implementer(IAgentEndpointFactory)
class _OneEndpoint:
    def __init__(self, endpoint: UNIXClientEndpoint) -> None:
        self.endpoint = endpoint

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return self.endpoint


class LineCollector(Received):
    """A guest program reading an event stream."""

    def close(self) -> None:
        cast(IPushProducer, self.transport).stopProducing()


class AgentEndToEndTests(TestCase):
    """One agent, one fake host on a hybrid vsock port, one fake serial peer."""

    def setUp(self) -> None:
        self.base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.drive = os.path.join(self.base, "drive")
        write_config_drive(self.drive, CLIENT, SERVER.cert_pem)
        self.host_path = os.path.join(self.base, "g.sock")
        self.socket = os.path.join(self.base, "lxd", "sock")
        self.state_dir = os.path.join(self.base, "run")
        # The host's CONNECT lines arrive on a port of their own, as from a vmready daemon.
        self.peer, self.connect_port = agent_ports(
            reactor, os.path.join(self.base, "vp"), self.addCleanup
        )
        self.hosts: list[FakeGuestHost] = []
        self.addCleanup(self.stop_hosts)
        self.thread = AgentThread()
        self.addCleanup(self.thread.stop)

    async def stop_hosts(self) -> None:
        for host in self.hosts:
            await host.stop()

    async def start_host(
        self, server: CertificatePair = SERVER, client: CertificatePair = CLIENT
    ) -> FakeGuestHost:
        host = FakeGuestHost(
            reactor, server, client.cert_pem, self.host_path, config={"user.foo": "bar"}
        )
        await host.start()
        self.hosts.append(host)
        return host

    def config(self, **changes: Any) -> AgentConfig:
        settings: dict[str, Any] = {
            "client_cert": os.path.join(self.drive, "agent.crt"),
            "client_key": os.path.join(self.drive, "agent.key"),
            "server_cert_pem": SERVER.cert_pem,
            "transport": Transport("hvsock", self.host_path),
            "socket": self.socket,
            "state_dir": self.state_dir,
            "virtio_ports": os.path.join(self.base, "vp"),
            "virtio_sysfs": None,
            "heartbeat": 30.0,
            "retries": 1,
        }
        settings.update(changes)
        return AgentConfig(**settings)

    def start_agent(self, **changes: Any) -> GuestAgent:
        agent = build_agent(self.config(**changes))
        self.thread.submit(agent.start()).result(timeout=10)
        self.addCleanup(self.stop_agent, agent)
        return agent

    async def stop_agent(self, agent: GuestAgent) -> None:
        if agent.serial is not None and agent.serial.running:
            await self.thread.deferred(agent.stop())

    async def connected(self, host: FakeGuestHost) -> None:
        """Advertise ``host`` on the serial line and wait for CONNECTED."""
        seen = self.peer.wait_for(b"CONNECTED")
        self.connect_port.send(host.connect_line)
        await seen

    def guest_agent(self) -> IAgent:
        pool = HTTPConnectionPool(reactor, persistent=False)
        endpoint = UNIXClientEndpoint(reactor, self.socket)
        agent: IAgent = Agent.usingEndpointFactory(reactor, _OneEndpoint(endpoint), pool=pool)
        return agent

    async def guest(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """A guest program's request on the agent's socket: status and body."""
        response = await treq.request(
            method, "http://lxd" + path, data=body, agent=self.guest_agent()
        )
        return response.code, await response.content()

    async def test_agentSaysStartedThenConnectedAfterConnect(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.peer.wait_for(b"STARTED", since=0)
        await self.connected(host)
        self.assertEqual(self.peer.lines[:2], [b"STARTED", b"CONNECTED"])

    async def test_connectedAgentHoldsTheHostsEventStream(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        await eventually(lambda: host.event_streams == 1)

    async def test_socketIsOwnerOnly(self) -> None:
        self.start_agent()
        self.assertEqual(stat.S_IMODE(os.stat(self.socket).st_mode), 0o600)

    async def test_guestRequestBeforeConnectIs503(self) -> None:
        self.start_agent()
        self.assertEqual(
            await self.guest("GET", "/1.0"),
            (503, b"host not reachable: the host has not sent CONNECT yet\n"),
        )

    async def test_guestReadsConfigThroughTheAgent(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        self.assertEqual(await self.guest("GET", "/1.0/config/user.foo"), (200, b"bar"))

    async def test_guestGetsTheHostsErrorAsPlainText(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        self.assertEqual(
            await self.guest("GET", "/1.0/config/ssh.key"), (403, b"not authorized\n")
        )

    async def test_readyPatchedOnTheSocketReachesTheHost(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        self.assertEqual(await self.guest("PATCH", "/1.0", b'{"state":"Ready"}'), (200, b"{}\n"))
        self.assertEqual(host.patches, ["Ready"])
        self.assertTrue(ReadyMemory(self.state_dir).is_ready())

    async def host_stopped(self) -> None:
        """A connected agent's host stops; once the agent says STARTED again."""
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        started = self.peer.wait_for(b"STARTED")
        await host.stop()
        await started

    async def test_hostStoppingMakesTheAgentSayStarted(self) -> None:
        await self.host_stopped()

    async def test_guestRequestAfterTheHostStoppedIs503(self) -> None:
        await self.host_stopped()
        code, body = await self.guest("GET", "/1.0")
        self.assertEqual(code, 503)
        self.assertTrue(
            body.startswith(
                f"host not reachable: lost the link to the host at {self.host_path}_".encode()
            ),
            body,
        )

    async def test_hostRestartThenConnectReassertsReady(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        await self.guest("PATCH", "/1.0", b'{"state":"Ready"}')
        started = self.peer.wait_for(b"STARTED")
        await host.stop()
        await started
        restarted = await self.start_host()
        self.assertEqual(restarted.state, "Started")
        patched = restarted.when_patched("Ready")
        await self.connected(restarted)
        await patched
        self.assertEqual(restarted.state, "Ready")

    async def test_readyIsReassertedByARestartedAgent(self) -> None:
        host = await self.start_host()
        first = self.start_agent()
        await self.connected(host)
        await self.guest("PATCH", "/1.0", b'{"state":"Ready"}')
        await self.thread.deferred(first.stop())
        await eventually(lambda: self.peer.client is None)
        host.state = "Started"  # as a daemon that restarted meanwhile would say
        patched = host.when_patched("Ready")
        restarted = self.peer.wait_for(b"STARTED")
        self.start_agent()
        await restarted
        await self.connected(host)
        await patched
        self.assertEqual(host.patches, ["Ready", "Ready"])

    async def test_eventsAreRelayedAsTheyArrive(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        response = await self.guest_agent().request(b"GET", b"http://lxd/1.0/events")
        self.assertEqual(response.code, 200)
        reader = LineCollector()
        response.deliverBody(reader)
        await eventually(lambda: host.event_streams == 2)  # the link watch and the guest's
        host.send_event({"type": "config", "metadata": {"key": "user.foo"}})
        await eventually(lambda: reader.received.endswith(b"\n"))
        self.assertEqual(reader.received, b'{"type": "config", "metadata": {"key": "user.foo"}}\n')
        reader.close()
        await reader.closed

    async def test_guestLeavingTheEventStreamClosesTheHostStream(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        response = await self.guest_agent().request(b"GET", b"http://lxd/1.0/events")
        reader = LineCollector()
        response.deliverBody(reader)
        await eventually(lambda: host.event_streams == 2)
        reader.close()
        await eventually(lambda: host.event_streams == 1)

    async def never_connected(self, host: FakeGuestHost) -> bytes:
        """An agent told to CONNECT to ``host`` stays STARTED; the 503 body it answers."""
        self.start_agent()
        await self.peer.wait_for(b"STARTED", since=0)
        started = self.peer.wait_for(b"STARTED")
        self.connect_port.send(host.connect_line)
        await started
        self.assertNotIn(b"CONNECTED", self.peer.lines)
        code, body = await self.guest("GET", "/1.0")
        self.assertEqual(code, 503)
        return body

    async def test_unpinnedHostCertificateIsNeverConnected(self) -> None:
        host = await self.start_host(server=IMPOSTOR)
        body = await self.never_connected(host)
        self.assertIn(
            b"TLS handshake failed (certificate verify failed: self-signed certificate)", body
        )

    async def test_hostThatDoesNotKnowTheAgentIsNeverConnected(self) -> None:
        host = await self.start_host(client=STRANGER)
        body = await self.never_connected(host)
        self.assertIn(b"TLS handshake failed (tlsv1 alert unknown ca)", body)

    async def test_serialResetReopensThePortAndSaysConnected(self) -> None:
        host = await self.start_host()
        self.start_agent()
        await self.connected(host)
        # Opened, reopened after STARTED, reopened after CONNECTED: the VM resets that one.
        await eventually(lambda: self.peer.connections == 3 and self.peer.client is not None)
        connections = self.peer.connections
        again = self.peer.wait_for(b"CONNECTED")
        await self.peer.drop_client()
        await again
        # Reopened once, then closed and reopened once more to announce CONNECTED.
        await eventually(lambda: self.peer.connections == connections + 2)

    async def test_stopSaysStoppedAndClosesTheLink(self) -> None:
        host = await self.start_host()
        agent = self.start_agent()
        await self.connected(host)
        stopped = self.peer.wait_for(b"STOPPED")
        await self.thread.deferred(agent.stop())
        await stopped
        await eventually(lambda: host.event_streams == 0)
        self.assertFalse(os.path.exists(self.socket))

    async def test_recordedSessionHasBothSides(self) -> None:
        record = os.path.join(self.base, "agent.jsonl")
        host = await self.start_host()
        agent = self.start_agent(record=record, instance="demo")
        # As a host does: CONNECT answers STARTED (CONNECT arrives on a port of its
        # own, so one sent earlier could be read before STARTED is written).
        await self.peer.wait_for(b"STARTED", since=0)
        await self.connected(host)
        await self.guest("PATCH", "/1.0", b'{"state":"Ready"}')
        await self.thread.deferred(agent.stop())
        transcript = read_transcript(record)
        self.assertEqual((transcript.side, transcript.header["instance"]), ("agent", "demo"))
        kinds = [entry.kind for entry in transcript.entries]
        self.assertEqual(kinds[:2], ["serial-out", "serial-in"])
        self.assertIn("host-request", kinds)
        patches = [
            entry.fields
            for entry in transcript.entries
            if entry.kind == "host-request" and entry.fields["method"] == "PATCH"
        ]
        self.assertEqual(json.loads(patches[0]["body"]), {"state": "Ready"})
        self.assertEqual(transcript.entries[-1].fields, {"text": "STOPPED\n"})
