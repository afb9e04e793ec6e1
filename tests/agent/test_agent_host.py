"""Tests for vmready.agent.host: reaching the host's guest API over real sockets and real TLS.

Each test runs a small host in the test's own loop (the standard library's
``ssl`` server side, demanding the agent's client certificate) and dials it as
the agent does: hybrid vsock, TCP on the loopback, or a fakeqemu guest's
``tcp_sockets`` socket.  Every way the host can misbehave ends in a ``HostError``
whose message says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import shutil
import socket
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.asynciotesting import run_in_loop
from vmready.agent import httpwire
from vmready.agent.config import Transport
from vmready.agent.core import TcpAddress, VsockAddress
from vmready.agent.host import (
    HostConnector,
    HostError,
    open_link,
    patch_state,
)
from vmready.agent.network import NetworkPlan, NetworkSetupError, parse_network
from vmready.agent.recording import AgentRecorder, RecordingConnector
from vmready.agent.tls import client_context, pinned_der
from vmready.protocols.transcriptreader import read_transcript
from vmready.trust.certs import CertificatePair, generate

CLIENT = generate("vmready-agent-demo")
SERVER = generate("vmready")
IMPOSTOR = generate("vmready")
STRANGER = generate("vmready-agent-other")
EXPIRED = generate(
    "vmready",
    days=1,
    now=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3),
)

VSOCK = Transport("vsock")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def envelope(metadata: Any) -> bytes:
    return json.dumps({"type": "sync", "status": "Success", "metadata": metadata}).encode()


def write_pair(directory: str, name: str, pair: CertificatePair) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    with open(cert, "wb") as f:
        f.write(pair.cert_pem)
    with open(key, "wb") as f:
        f.write(pair.key_pem)
    return cert, key


def reply(status: int, body: bytes, extra: list[tuple[str, str]] | None = None) -> bytes:
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    return httpwire.encode_response_head(status, headers + (extra or [])) + body


class FakeHost:
    """The host's guest API in the test's loop: mutual TLS, then whatever ``answer`` says."""

    def __init__(
        self,
        base: str,
        server: CertificatePair = SERVER,
        trusts: CertificatePair = CLIENT,
        tls12: bool = False,
    ) -> None:
        self.base = base
        self.requests: list[tuple[httpwire.RequestHead, bytes]] = []
        self.answer: Callable[[httpwire.RequestHead], bytes] = lambda head: reply(
            200, envelope({"api_version": "1.0"})
        )
        self.stream: asyncio.StreamWriter | None = None
        cert, key = write_pair(base, "host", server)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.load_verify_locations(cadata=trusts.cert_pem.decode())
        if tls12:
            self.context.maximum_version = ssl.TLSVersion.TLSv1_2
        self.servers: list[asyncio.AbstractServer] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await httpwire.read_request_head(reader)
            if head is None:
                return
            body = await httpwire.read_body(reader, httpwire.request_framing(head), 1 << 20)
        except (ssl.SSLError, ConnectionError, httpwire.HTTPError):
            writer.close()
            return
        self.requests.append((head, body))
        if head.target.startswith("/1.0/events") and self.answer(head) == b"stream":
            writer.write(
                httpwire.encode_response_head(
                    200,
                    [("Content-Type", "application/x-ndjson"), ("Transfer-Encoding", "chunked")],
                )
            )
            self.stream = writer
            return
        writer.write(self.answer(head))
        await writer.drain()
        writer.close()

    async def on_unix(self, path: str) -> None:
        self.servers.append(await asyncio.start_unix_server(self._serve, path, ssl=self.context))

    async def on_tcp(self) -> int:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            await server.wait_closed()


class ConnectorHarness:
    """A host and the agent's connector to it, in one temp dir."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.test = test
        self.base = tempfile.mkdtemp(prefix="vra-")
        test.addCleanup(shutil.rmtree, self.base, True)
        self.hvsock = os.path.join(self.base, "g.sock")
        self.cert, self.key = write_pair(self.base, "agent", CLIENT)
        self.network_calls: list[NetworkPlan] = []
        self.network_error: str | None = None

    def connector(
        self,
        pinned: CertificatePair = SERVER,
        transport: Transport = VSOCK,
        tcp_sockets: str | None = None,
        network: NetworkPlan | None = None,
    ) -> HostConnector:
        return HostConnector(
            transport,
            client_context(self.cert, self.key, pinned.cert_pem),
            pinned_der(pinned.cert_pem),
            tcp_sockets,
            network,
            self.bring_up,
            connect_timeout=10,
        )

    def hvsock_connector(self, pinned: CertificatePair = SERVER) -> HostConnector:
        return self.connector(pinned, Transport("hvsock", self.hvsock))

    def bring_up(self, plan: NetworkPlan) -> str:
        self.network_calls.append(plan)
        if self.network_error is not None:
            raise NetworkSetupError(self.network_error)
        return "eth0"

    def run(
        self, scenario: Callable[[FakeHost], Awaitable[Any]], host: FakeHost | None = None
    ) -> Any:
        async def hosted() -> Any:
            serving = host or FakeHost(self.base)
            try:
                return await scenario(serving)
            finally:
                await serving.close()

        return run_in_loop(self.test, hosted)

    def failure(
        self, scenario: Callable[[FakeHost], Awaitable[Any]], host: FakeHost | None = None
    ) -> str:
        async def failing(serving: FakeHost) -> str:
            try:
                await scenario(serving)
            except HostError as e:
                return f"{type(e).__name__}: {e}"
            return "no failure"

        result: str = self.run(failing, host)
        return result


class DialTests(SynchronousTestCase):
    """Reaching the host on each transport, with the pinned certificate."""

    def setUp(self) -> None:
        self.harness = ConnectorHarness(self)

    def test_hybridVsockReachesTheUnixSocketOfThePort(self) -> None:
        async def scenario(host: FakeHost) -> tuple[int, bytes, str]:
            await host.on_unix(f"{self.harness.hvsock}_49152")
            answer = (
                await self.harness.hvsock_connector()
                .at(VsockAddress(2, 49152))
                .request("GET", "/1.0")
            )
            return answer.status, answer.body, host.requests[0][0].headers.get("user-agent")

        self.assertEqual(
            self.harness.run(scenario), (200, envelope({"api_version": "1.0"}), "vmready-agent")
        )

    def test_tcpOnTheLoopback(self) -> None:
        async def scenario(host: FakeHost) -> int:
            port = await host.on_tcp()
            endpoint = self.harness.connector().at(TcpAddress("127.0.0.1", port))
            return (await endpoint.request("GET", "/1.0")).status

        self.assertEqual(self.harness.run(scenario), 200)
        self.assertEqual(self.harness.network_calls, [])

    def test_tcpBringsTheNetworkUpFirst(self) -> None:
        plan = parse_network("52:54:00:76:6d:01", "10.0.2.15/24")

        async def scenario(host: FakeHost) -> int:
            port = await host.on_tcp()
            endpoint = self.harness.connector(network=plan).at(TcpAddress("127.0.0.1", port))
            return (await endpoint.request("GET", "/1.0")).status

        self.assertEqual(self.harness.run(scenario), 200)
        self.assertEqual(self.harness.network_calls, [plan])

    def test_networkThatCannotComeUpIsTheDialsReason(self) -> None:
        plan = parse_network("52:54:00:76:6d:01", "10.0.2.15/24")
        self.harness.network_error = "no network interface has MAC 52:54:00:76:6d:01"

        async def scenario(host: FakeHost) -> None:
            await (
                self.harness.connector(network=plan)
                .at(TcpAddress("127.0.0.1", 9))
                .request("GET", "/1.0")
            )

        self.assertEqual(
            self.harness.failure(scenario),
            "HostError: no network interface has MAC 52:54:00:76:6d:01",
        )

    def test_tcpSocketsStandForTheGuestsTCPAddresses(self) -> None:
        sockets = os.path.join(self.harness.base, "tcp")
        os.makedirs(sockets)
        address = TcpAddress("10.0.2.100", 8443)
        connector = self.harness.connector(tcp_sockets=sockets)

        async def scenario(host: FakeHost) -> int:
            await host.on_unix(os.path.join(sockets, "10.0.2.100:8443"))
            return (await connector.at(address).request("GET", "/1.0")).status

        self.assertEqual(self.harness.run(scenario), 200)
        self.assertEqual(connector.describe(address), os.path.join(sockets, "10.0.2.100:8443"))
        self.assertEqual(self.harness.network_calls, [])

    def test_aFakeqemuGuestNeverDialsTCPForReal(self) -> None:
        async def scenario(host: FakeHost) -> None:
            await (
                self.harness.hvsock_connector()
                .at(TcpAddress("10.0.2.100", 8443))
                .request("GET", "/1.0")
            )

        self.assertEqual(
            self.harness.failure(scenario),
            "HostError: cannot dial TCP: a fakeqemu guest (hvsock) needs tcp_sockets",
        )

    def test_nobodyListeningOnHybridVsock(self) -> None:
        async def scenario(host: FakeHost) -> None:
            await self.harness.hvsock_connector().at(VsockAddress(2, 1)).request("GET", "/1.0")

        self.assertEqual(
            self.harness.failure(scenario), "HostError: cannot connect: No such file or directory"
        )

    def test_nobodyListeningOnTCP(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]  # bound, not listening: refused

            async def scenario(host: FakeHost) -> None:
                await (
                    self.harness.connector()
                    .at(TcpAddress("127.0.0.1", port))
                    .request("GET", "/1.0")
                )

            self.assertEqual(
                self.harness.failure(scenario), "HostError: cannot connect: Connection refused"
            )

    def test_addressesAreNamedAsAnOperatorWould(self) -> None:
        self.assertEqual(self.harness.connector().describe(VsockAddress(2, 5)), "vsock 2:5")
        self.assertEqual(
            self.harness.hvsock_connector().describe(VsockAddress(2, 5)),
            f"{self.harness.hvsock}_5",
        )
        self.assertEqual(
            self.harness.connector().describe(TcpAddress("10.0.2.100", 8443)),
            "tcp 10.0.2.100:8443",
        )


class TLSTests(SynchronousTestCase):
    """Only the pinned host is accepted, and only with the agent's own certificate."""

    def setUp(self) -> None:
        self.harness = ConnectorHarness(self)

    def dial(self, host: FakeHost, pinned: CertificatePair = SERVER) -> str:
        async def scenario(serving: FakeHost) -> None:
            await serving.on_unix(f"{self.harness.hvsock}_1")
            await (
                self.harness.hvsock_connector(pinned).at(VsockAddress(2, 1)).request("GET", "/1.0")
            )

        return self.harness.failure(scenario, host)

    def test_anImpostorHostIsRefused(self) -> None:
        self.assertEqual(
            self.dial(FakeHost(self.harness.base, server=IMPOSTOR)),
            "HostError: TLS handshake failed (certificate verify failed: self-signed certificate)",
        )

    def test_anExpiredPinnedCertificateIsRefused(self) -> None:
        self.assertEqual(
            self.dial(FakeHost(self.harness.base, server=EXPIRED), pinned=EXPIRED),
            "HostError: TLS handshake failed (certificate verify failed: certificate has expired)",
        )

    def test_aHostThatDoesNotKnowTheAgentRefusesIt(self) -> None:
        # An asyncio host drops the connection without sending its alert, so that is all
        # the agent can say; the daemon's TLS stack sends the alert, and the agent names
        # it ("tlsv1 alert unknown ca": test_agent_e2e).  TLS 1.2 keeps the refusal inside
        # the handshake here (under TLS 1.3 it would come after, on the first read).
        self.assertEqual(
            self.dial(FakeHost(self.harness.base, trusts=STRANGER, tls12=True)),
            "HostError: TLS handshake failed (the host closed the connection)",
        )

    def test_thePinnedHostIsAccepted(self) -> None:
        self.assertEqual(self.dial(FakeHost(self.harness.base)), "no failure")


class MisbehavingHostTests(SynchronousTestCase):
    """A host that answers wrongly, or not at all."""

    def setUp(self) -> None:
        self.harness = ConnectorHarness(self)

    def ask(self, answer: bytes, limit: int = 1 << 20) -> str:
        async def scenario(host: FakeHost) -> None:
            host.answer = lambda head: answer
            await host.on_unix(f"{self.harness.hvsock}_1")
            await (
                self.harness.hvsock_connector()
                .at(VsockAddress(2, 1))
                .request("GET", "/1.0", limit=limit)
            )

        return self.harness.failure(scenario)

    def test_aHostThatClosesWithoutAnswering(self) -> None:
        self.assertEqual(self.ask(b""), "HostError: the host closed the connection")

    def test_aHostThatStopsMidBody(self) -> None:
        self.assertEqual(
            self.ask(httpwire.encode_response_head(200, [("Content-Length", "10")]) + b"abc"),
            "HostError: the host closed the connection",
        )

    def test_aHostThatSpeaksGarbage(self) -> None:
        self.assertEqual(
            self.ask(b"SSH-2.0-OpenSSH\r\n\r\n"),
            "HostError: the host sent malformed HTTP: "
            "a status line without a status code: 'SSH-2.0-OpenSSH'",
        )

    def test_anAnswerPastTheLimit(self) -> None:
        self.assertEqual(
            self.ask(reply(200, b"x" * 2000), limit=1000),
            "AnswerTooLarge: answer larger than 1000 bytes",
        )

    def test_aChunkedAnswerIsRead(self) -> None:
        chunked = httpwire.encode_response_head(200, [("Transfer-Encoding", "chunked")])
        self.assertEqual(self.ask(chunked + b"2\r\n{}\r\n0\r\n\r\n"), "no failure")


class LinkTests(SynchronousTestCase):
    """``open_link``: the host validated, then its event stream held."""

    def setUp(self) -> None:
        self.harness = ConnectorHarness(self)

    def link(self, answer: Callable[[httpwire.RequestHead], bytes]) -> str:
        async def scenario(host: FakeHost) -> None:
            host.answer = answer
            await host.on_unix(f"{self.harness.hvsock}_1")
            await open_link(self.harness.hvsock_connector().at(VsockAddress(2, 1)))

        return self.harness.failure(scenario)

    def test_wrongApiVersionIsRefused(self) -> None:
        self.assertEqual(
            self.link(lambda head: reply(200, envelope({"api_version": "2.0"}))),
            "HostRefused: GET /1.0 answered api_version '2.0', not '1.0'",
        )

    def test_anErrorEnvelopeIsRefused(self) -> None:
        error = json.dumps({"type": "error", "error": "Forbidden", "error_code": 403}).encode()
        self.assertEqual(
            self.link(lambda head: reply(403, error)), "HostRefused: HTTP 403: Forbidden"
        )

    def test_eventsThatAreNotAStreamAreRefused(self) -> None:
        def answer(head: httpwire.RequestHead) -> bytes:
            if head.target == "/1.0/events":
                return reply(404, json.dumps({"type": "error", "error": "not found"}).encode())
            return reply(200, envelope({"api_version": "1.0"}))

        self.assertEqual(self.link(answer), "HostRefused: GET /1.0/events: HTTP 404: not found")

    def test_theLinkLastsUntilTheHostEndsItsStream(self) -> None:
        def answer(head: httpwire.RequestHead) -> bytes:
            if head.target == "/1.0/events":
                return b"stream"
            return reply(200, envelope({"api_version": "1.0"}))

        async def scenario(host: FakeHost) -> tuple[bool, str]:
            host.answer = answer
            await host.on_unix(f"{self.harness.hvsock}_1")
            watch = await open_link(self.harness.hvsock_connector().at(VsockAddress(2, 1)))
            assert host.stream is not None
            host.stream.write(httpwire.encode_chunk(b'{"type": "config"}\n'))
            await asyncio.sleep(0)
            held = not watch.lost.done()
            host.stream.write(httpwire.LAST_CHUNK)
            host.stream.close()
            return held, await watch.lost

        self.assertEqual(self.harness.run(scenario), (True, "the host ended the event stream"))

    def test_closingTheLinkSaysSo(self) -> None:
        async def scenario(host: FakeHost) -> str:
            host.answer = lambda head: (
                b"stream"
                if head.target == "/1.0/events"
                else reply(200, envelope({"api_version": "1.0"}))
            )
            await host.on_unix(f"{self.harness.hvsock}_1")
            watch = await open_link(self.harness.hvsock_connector().at(VsockAddress(2, 1)))
            watch.close()
            await watch.closed()
            return watch.lost.result()

        self.assertEqual(self.harness.run(scenario), "closed by the agent")

    def test_refusedPatchSaysWhy(self) -> None:
        async def scenario(host: FakeHost) -> None:
            error = json.dumps({"type": "error", "error": "Instance demo is not running"})
            host.answer = lambda head: reply(409, error.encode())
            await host.on_unix(f"{self.harness.hvsock}_1")
            await patch_state(self.harness.hvsock_connector().at(VsockAddress(2, 1)), "Ready")

        self.assertEqual(
            self.harness.failure(scenario),
            "HostRefused: HTTP 409: Instance demo is not running",
        )


class RecordingTests(SynchronousTestCase):
    """``--record``: each request to the host and its answer, in the transcript."""

    def test_requestsAndAnswersAreRecorded(self) -> None:
        harness = ConnectorHarness(self)
        path = os.path.join(harness.base, "agent.jsonl")
        recorder = AgentRecorder(path, "demo")

        async def scenario(host: FakeHost) -> None:
            await host.on_unix(f"{harness.hvsock}_1")
            connector = RecordingConnector(
                recorder,
                Transport("hvsock", harness.hvsock),
                client_context(harness.cert, harness.key, SERVER.cert_pem),
                pinned_der(SERVER.cert_pem),
            )
            await connector.at(VsockAddress(2, 1)).request("GET", "/1.0")
            with contextlib.suppress(HostError):
                await connector.at(VsockAddress(2, 2)).request("GET", "/1.0")

        harness.run(scenario)
        recorder.close()
        entries = read_transcript(path).entries
        self.assertEqual(
            [(entry.kind, entry.fields.get("status")) for entry in entries],
            [("host-request", None), ("host-response", 200), ("host-request", None),
             ("host-response", 0)],
        )  # fmt: skip
        self.assertEqual(entries[1].fields["body"], envelope({"api_version": "1.0"}).decode())
        self.assertEqual(entries[3].fields["error"], "cannot connect: No such file or directory")
