"""``vmready-agent --record FILE``: the agent's side of a session, in the transcript format.

What the agent read from and wrote to its serial port (``serial-in``,
``serial-out``) and every request it sent to the host's guest API with its
answer (``host-request``, ``host-response``), redacted as the daemon's
transcripts are.  ``vmready replay`` plays it against a host: the agent's
writes become the guest's input, its requests the guest API requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from zope.interface import implementer

from vmready.agent.serial import SerialKeeper
from vmready.recording import EVENTS_PATH
from vmready.transcript import (
    DEFAULT_KEEP,
    DEFAULT_MAX_BYTES,
    PemRedactor,
    TranscriptWriter,
    body_fields,
    data_fields,
    looks_secret,
)

__all__ = ["AgentRecorder", "RecordingAgent", "RecordingSerialKeeper"]


class AgentRecorder:
    """Writes the agent's side of the session to one transcript."""

    def __init__(
        self,
        path: str,
        instance: str | None,
        monotonic: Callable[[], float] = time.monotonic,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        self.writer = TranscriptWriter(
            path,
            {"side": "agent", "instance": instance or "unknown"},
            monotonic=monotonic,
            max_bytes=max_bytes,
            keep=keep,
        )
        # Ids go on from the continued file's (a second --record to the same file).
        self._next_id = self.writer.last_id
        # One per stream: a PEM block split across chunks is redacted whole.
        self._in = PemRedactor()
        self._out = PemRedactor()

    def serial_in(self, data: bytes) -> None:
        """Bytes the agent read from its port (the host's CONNECT lines)."""
        self.writer.write("serial-in", **data_fields(data, self._in))

    def serial_out(self, data: bytes) -> None:
        """Bytes the agent wrote to its port (STARTED, CONNECTED, STOPPED)."""
        self.writer.write("serial-out", **data_fields(data, self._out))

    def host_request(self, method: str, path: str, body: bytes) -> int:
        """A request to the host's guest API; returns its id."""
        self._next_id += 1
        self.writer.write(
            "host-request", id=self._next_id, method=method, path=path, **body_fields(body)
        )
        return self._next_id

    def host_response(
        self, request_id: int, status: int, body: bytes | None, secret: bool = False
    ) -> None:
        """The host's answer (``body`` None: an event stream, status only)."""
        if body is None:
            self.writer.write("host-response", id=request_id, status=status, stream=True)
            return
        self.writer.write(
            "host-response", id=request_id, status=status, **body_fields(body, secret)
        )

    def host_failed(self, request_id: int, why: str) -> None:
        """The request never got an answer (status 0: the replay does not send it)."""
        self.writer.write("host-response", id=request_id, status=0, error=why)

    def close(self) -> None:
        """Stop recording."""
        self.writer.close()


class RecordingSerialKeeper(SerialKeeper):
    """A ``SerialKeeper`` that records what the agent writes."""

    recorder: AgentRecorder

    def write(self, data: bytes) -> bool:
        written = super().write(data)
        if written:
            self.recorder.serial_out(data)
        return written


class _Tee(Protocol):
    """Passes a response body on and keeps a copy for the transcript."""

    def __init__(self, inner: IProtocol, done: Callable[[bytes], None]) -> None:
        self.inner = inner
        self.done = done
        self.chunks: list[bytes] = []

    def makeConnection(self, transport: Any) -> None:
        self.inner.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)
        self.inner.dataReceived(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        self.done(b"".join(self.chunks))
        self.inner.connectionLost(reason)


@implementer(IResponse)
class _RecordedResponse:
    """An IResponse whose body is recorded as it is delivered."""

    def __init__(self, inner: IResponse, done: Callable[[bytes], None]) -> None:
        self._inner = inner
        self._done = done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def deliverBody(self, protocol: IProtocol) -> None:
        self._inner.deliverBody(_Tee(protocol, self._done))


@implementer(IAgent)
class RecordingAgent:
    """An IAgent to the host that records each request and its answer."""

    def __init__(self, inner: IAgent, recorder: AgentRecorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        path = uri.split(b"://", 1)[-1]
        path = path[path.find(b"/") :] if b"/" in path else b"/"
        body = getattr(bodyProducer, "body", b"") if bodyProducer is not None else b""
        text_path = path.decode("utf-8", "replace")
        request_id = self.recorder.host_request(method.decode("ascii"), text_path, body)
        stream = method == b"GET" and text_path.split("?")[0] == EVENTS_PATH
        secret = text_path.startswith("/1.0/config/") and looks_secret(text_path)

        def answered(response: IResponse) -> IResponse:
            if stream:
                self.recorder.host_response(request_id, response.code, None)
                return response
            return _RecordedResponse(
                response,
                lambda raw: self.recorder.host_response(request_id, response.code, raw, secret),
            )

        def failed(failure: Failure) -> Failure:
            self.recorder.host_failed(request_id, failure.getErrorMessage())
            return failure

        sent: Deferred[IResponse] = self.inner.request(method, uri, headers, bodyProducer)
        return sent.addCallbacks(answered, failed)
