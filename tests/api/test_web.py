"""vmready.api.web: HTTP servers on unix sockets answer requests without a Host header."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from typing import Any

from klein import Klein
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from tests.envelopes import sync_envelope
from tests.reactor import reactor
from vmready.api.limits import body_overflowed
from vmready.api.operatorbase import OPERATOR_ERRORS
from vmready.api.requestbody import MAX_BODY_BYTES, read_json_body
from vmready.api.web import (
    LocalRequest,
    local_site,
    sync_response,
    sync_response_array,
    sync_response_encoded,
)
from vmready.domain.model import PayloadTooLarge

app = Klein()


@app.route("/where")
def where(request: IRequest) -> bytes:
    hostname: bytes = request.getRequestHostname()
    return hostname


@app.route("/json")
def answer_json(request: IRequest) -> bytes:
    return sync_response(request, {"state": "Started"})


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
        site: Any = local_site(app.resource(), OPERATOR_ERRORS, label="test")
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

    async def test_jsonAnswerHasItsLengthAndIsNotChunked(self) -> None:
        # HTTP/1.1: without a length twisted.web would send the body in chunks.
        answer = await deferToThread(
            raw_request, self.path, b"GET /json HTTP/1.1\r\nHost: v\r\nConnection: close\r\n\r\n"
        )
        head, _, body = answer.partition(b"\r\n\r\n")
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        self.assertNotIn(b"Transfer-Encoding", headers)
        self.assertEqual(int(headers[b"Content-Length"]), len(body))
        self.assertTrue(body.endswith(b'"metadata": {"state": "Started"}}\n'), body)


class BodyCapTests(SynchronousTestCase):
    """A body over the cap is dropped as it arrives, never buffered; the handler says 413."""

    def request(self) -> LocalRequest:
        return LocalRequest(DummyChannel())

    def test_aDeclaredLengthOverTheCapKeepsNothing(self) -> None:
        request = self.request()
        request.gotLength(2**31)
        request.handleContentChunk(b"x" * 65536)
        assert request.content is not None
        self.assertEqual((body_overflowed(request), request.content.tell()), (True, 0))
        self.assertRaises(PayloadTooLarge, read_json_body, request)

    def test_aChunkedBodyIsDroppedOnceItPassesTheCap(self) -> None:
        request = self.request()
        request.gotLength(None)  # chunked: no length declared
        chunk = b"x" * (MAX_BODY_BYTES // 2 + 1)
        request.handleContentChunk(chunk)
        self.assertFalse(body_overflowed(request))
        request.handleContentChunk(chunk)
        request.handleContentChunk(chunk)
        assert request.content is not None
        self.assertEqual((body_overflowed(request), request.content.tell()), (True, 0))
        self.assertRaises(PayloadTooLarge, read_json_body, request)

    def test_aBodyWithinTheCapIsKept(self) -> None:
        request = self.request()
        body = b'{"a": 1}'
        request.gotLength(len(body))
        request.handleContentChunk(body)
        self.assertFalse(body_overflowed(request))
        self.assertEqual(read_json_body(request), {"a": 1})


class SyncEnvelopeTests(SynchronousTestCase):
    """LXD's sync envelope is written as ``json.dumps`` writes it, from metadata or its JSON."""

    METADATA: Any = {"name": "web1", "config": {"user.x": "é"}, "list": [1, None, True]}

    def envelope(self, metadata: Any) -> bytes:
        return json.dumps(sync_envelope(metadata)).encode("utf-8") + b"\n"

    def test_metadataIsWrittenAsJsonDumpsWritesTheEnvelope(self) -> None:
        request: Any = DummyRequest([b""])
        self.assertEqual(sync_response(request, self.METADATA), self.envelope(self.METADATA))

    def test_encodedMetadataMakesTheSameBytesAndLength(self) -> None:
        request: Any = DummyRequest([b""])
        encoded = json.dumps(self.METADATA).encode("utf-8")
        answer = sync_response_encoded(request, encoded)
        self.assertEqual(answer, self.envelope(self.METADATA))
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"Content-Length"), [b"%d" % len(answer)]
        )

    def test_encodedItemsMakeTheListJsonDumpsWrites(self) -> None:
        items = [self.METADATA, {"name": "web2", "n": [1, 2]}, {}]
        for count in (0, 1, 3):
            request: Any = DummyRequest([b""])
            encoded = [json.dumps(item).encode("utf-8") for item in items[:count]]
            answer = sync_response_array(request, encoded)
            self.assertEqual(answer, self.envelope(items[:count]))
            self.assertEqual(
                request.responseHeaders.getRawHeaders(b"Content-Length"), [b"%d" % len(answer)]
            )
