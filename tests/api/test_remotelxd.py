"""The remote API (TLS on loopback) as LXD's clients meet it.

What ``lxc remote add`` does before it is trusted (a TLS client with no
certificate, then ``GET /1.0`` untrusted), LXD's body redeeming a trust
token, and ``/1.0/events`` as a WebSocket over TLS, closed when its
certificate is removed.  The client side is Python's ``ssl`` on a thread,
as a client program would be; ``tests/lxdclients`` runs ``lxc`` itself.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import tempfile
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.api.test_eventsocket import text_frame, upgrade_request
from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.api.operator import OperatorAPI
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.trust.certs import CertificatePair, generate

TIMEOUT = 30.0


class RemoteAPITestCase(TestCase):
    """An operator API behind the remote API's TLS and trust gate, on 127.0.0.1."""

    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.lifecycle = make_lifecycle(self)
        server = generate("vmready")
        self.trust = TrustRegistry(self.lifecycle.store, reactor.seconds, server.fingerprint)
        await self.trust.load()
        self.api = OperatorAPI(self.lifecycle, "fakeqemu", self.trust)
        resource = self.api.app.resource()
        port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            remote_tls_factory(server, remote_site(resource, self.trust))
        )
        self.addCleanup(port.stopListening)
        self.port = port.getHost().port
        self.trust.addresses = [f"127.0.0.1:{self.port}"]
        self.dir = tempfile.mkdtemp(prefix="vmr-rlxd-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.client = generate("laptop")

    def context(self, pair: CertificatePair | None) -> ssl.SSLContext:
        """A TLS client context presenting ``pair`` (None: no certificate)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if pair is not None:
            cert, key = os.path.join(self.dir, "c.crt"), os.path.join(self.dir, "c.key")
            with open(cert, "wb") as f:
                f.write(pair.cert_pem)
            with open(key, "wb") as f:
                f.write(pair.key_pem)
            context.load_cert_chain(cert, key)
        return context

    def request(
        self, method: str, path: str, body: Any = None, pair: CertificatePair | None = None
    ) -> Deferred[tuple[int, Any]]:
        """One HTTPS request on a thread: its status and JSON body."""
        context = self.context(pair)

        def send() -> tuple[int, Any]:
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, context=context, timeout=TIMEOUT
            )
            try:
                data = None if body is None else json.dumps(body)
                connection.request(method, path, body=data)
                response = connection.getresponse()
                return response.status, json.loads(response.read())
            finally:
                connection.close()

        return deferToThread(send)

    async def trusted(self) -> None:
        """The client's certificate trusted, through a token redeemed as vmready does."""
        token = (await self.trust.issue("laptop"))["token"]
        status, _ = await self.request(
            "POST", "/1.0/certificates", {"trust_token": token}, self.client
        )
        self.assertEqual(status, 200)


class UntrustedTests(RemoteAPITestCase):
    """What ``lxc remote add`` reads before its certificate is trusted."""

    async def test_clientWithoutACertificateReadsTheUntrustedServer(self) -> None:
        status, body = await self.request("GET", "/1.0")
        self.assertEqual(status, 200)
        server = body["metadata"]
        self.assertEqual(server["auth"], "untrusted")
        self.assertIn("instances", server["api_extensions"])
        self.assertNotIn("environment", server)
        self.assertNotIn("config", server)

    async def test_clientWithoutACertificateIsRefusedEverythingElse(self) -> None:
        for method, path in (("GET", "/1.0/instances"), ("POST", "/1.0/certificates")):
            status, body = await self.request(method, path, {"password": "x"})
            self.assertEqual(
                (status, body["error"]),
                (403, "not authorized: a client certificate is required"),
            )

    async def test_untrustedCertificateReadsTheUntrustedServerOnly(self) -> None:
        status, body = await self.request("GET", "/1.0", pair=self.client)
        self.assertEqual((status, body["metadata"]["auth"]), (200, "untrusted"))
        status, body = await self.request("GET", "/1.0/instances", pair=self.client)
        self.assertEqual(status, 403)
        self.assertIn("is not trusted by the daemon", body["error"])


class LXDRedeemTests(RemoteAPITestCase):
    """``POST /1.0/certificates`` as LXD's clients send it: the token as ``password``."""

    async def test_tokenAsPasswordTrustsThePresentedCertificate(self) -> None:
        token = (await self.trust.issue("laptop"))["token"]
        # lxc 5.0's body; its name, type and certificate are the token's business.
        body = {
            "name": "",
            "type": "",
            "restricted": False,
            "projects": None,
            "certificate": "",
            "password": token,
            "token": False,
        }
        status, answer = await self.request("POST", "/1.0/certificates", body, self.client)
        self.assertEqual((status, answer["metadata"]["name"]), (200, "laptop"))
        self.assertEqual(answer["metadata"]["fingerprint"], self.client.fingerprint)
        status, server = await self.request("GET", "/1.0", pair=self.client)
        self.assertEqual(server["metadata"]["auth"], "trusted")
        self.assertEqual(server["metadata"]["environment"]["server"], "vmready")

    async def test_aPasswordThatIsNotATokenIsRefusedSayingSo(self) -> None:
        body = {"type": "client", "password": "hunter2"}
        status, answer = await self.request("POST", "/1.0/certificates", body, self.client)
        self.assertEqual(status, 400)
        self.assertEqual(
            answer["error"],
            "Invalid field 'password': not a trust token: its base64 does not hold JSON (was it "
            "copied whole?); trust passwords are not supported by vmready, give a trust token "
            "('vmready config trust add NAME' on the daemon's host)",
        )
        self.assertEqual(await self.trust.certificates(), [])


class EventWebSocketTests(RemoteAPITestCase):
    """``/1.0/events`` upgraded to a WebSocket over the remote API's TLS."""

    def open_events(self) -> Deferred[tuple[ssl.SSLSocket, bytes]]:
        """The upgrade handshake on a thread: the socket and the response's head."""
        context = self.context(self.client)

        def handshake() -> tuple[ssl.SSLSocket, bytes]:
            raw = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)
            tls = context.wrap_socket(raw)
            tls.sendall(upgrade_request(b"127.0.0.1"))
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    break
                head += chunk
            return tls, head

        return deferToThread(handshake)

    async def subscribed(self) -> ssl.SSLSocket:
        """A trusted client's WebSocket, once the daemon has subscribed it."""
        await self.trusted()
        tls, head = await self.open_events()
        self.addCleanup(tls.close)
        self.assertIn(b" 101 ", head.split(b"\r\n", 1)[0])
        for _ in range(200):
            if self.api.event_feeds:
                break
            await deferLater(reactor, 0.01, lambda: None)
        return tls

    async def test_eventsArriveAsMessages(self) -> None:
        tls = await self.subscribed()
        self.lifecycle.events.lifecycle("instance-ready", "web1")
        frame = await deferToThread(_read_frame, tls)
        event = json.loads(frame)
        self.assertEqual(
            (event["type"], event["metadata"]["action"]), ("lifecycle", "instance-ready")
        )

    async def test_removingTheCertificateClosesItsWebSocket(self) -> None:
        tls = await self.subscribed()
        await self.trust.remove(self.client.fingerprint)
        self.assertEqual(await deferToThread(_read_to_end, tls), b"")


def _read_frame(tls: ssl.SSLSocket) -> bytes:
    """The payload of the first text frame that arrives."""
    data = b""
    while (payload := text_frame(data)) is None:
        data += tls.recv(65536)
    return payload


def _read_to_end(tls: ssl.SSLSocket) -> bytes:
    """What arrives until the daemon ends the connection (b"": nothing, it was cut)."""
    data = b""
    try:
        while chunk := tls.recv(65536):
            data += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return data
