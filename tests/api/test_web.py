"""vmready.api.web: HTTP servers on unix sockets answer requests without a Host header."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

from klein import Klein
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.iweb import IRequest

from tests.reactor import reactor
from vmready.api.web import local_site

app = Klein()


@app.route("/where")
def where(request: IRequest) -> bytes:
    hostname: bytes = request.getRequestHostname()
    return hostname


def raw_request(path: str, request: bytes) -> bytes:
    """Send ``request`` on the unix socket ``path``; everything the server answered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(path)
        client.sendall(request)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


class LocalSiteTests(TestCase):
    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-web-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "s")
        site: Any = local_site(app.resource())  # a Site is a Factory of its own channel
        port = IReactorUNIX(reactor).listenUNIX(self.path, site)
        self.addCleanup(port.stopListening)

    async def test_requestWithoutHostHeaderIsAnsweredAsLocalhost(self) -> None:
        answer = await deferToThread(raw_request, self.path, b"GET /where HTTP/1.0\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.0 200 "), answer)
        self.assertTrue(answer.endswith(b"\r\n\r\nlocalhost"), answer)

    async def test_hostHeaderIsStillHonoured(self) -> None:
        answer = await deferToThread(
            raw_request, self.path, b"GET /where HTTP/1.0\r\nHost: vmready:80\r\n\r\n"
        )
        self.assertTrue(answer.endswith(b"\r\n\r\nvmready"), answer)
