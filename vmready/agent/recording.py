"""``vmready-agent --record FILE``: the agent's side of a session, in the transcript format.

What the agent read from and wrote to its serial port (``serial-in``,
``serial-out``) and every request it sent to the host's guest API with its
answer (``host-request``, ``host-response``), redacted as the daemon's
transcripts are.  ``vmready replay`` plays it against a host: the agent's
writes become the guest's input, its requests the guest API requests.
"""

from __future__ import annotations

import ssl
import time
from typing import Callable

from vmready.agent.config import Transport
from vmready.agent.core import HostAddress
from vmready.agent.host import (
    HostConnector,
    HostEndpoint,
    HostResponse,
    describe_failure,
)
from vmready.agent.network import NetworkPlan
from vmready.protocols import (
    DEFAULT_KEEP,
    DEFAULT_MAX_BYTES,
    PemRedactor,
    TranscriptWriter,
    body_fields,
    data_fields,
    looks_secret,
)

EVENTS_PATH = "/1.0/events"


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


class RecordingEndpoint(HostEndpoint):
    """The host's guest API at one address, each request and its answer recorded."""

    def __init__(
        self, connector: HostConnector, address: HostAddress, recorder: AgentRecorder
    ) -> None:
        super().__init__(connector, address)
        self.recorder = recorder

    async def send(
        self, method: str, target: str, body: bytes | None = None, content_type: str = ""
    ) -> HostResponse:
        request_id = self.recorder.host_request(method, target, body or b"")
        try:
            response = await super().send(method, target, body, content_type)
        except Exception as e:
            self.recorder.host_failed(request_id, describe_failure(e))
            raise
        if method == "GET" and target.split("?")[0] == EVENTS_PATH:
            self.recorder.host_response(request_id, response.status, None)
            return response
        secret = target.startswith("/1.0/config/") and looks_secret(target)
        status = response.status

        def answered(raw: bytes) -> None:
            self.recorder.host_response(request_id, status, raw, secret)

        response.on_body = answered
        return response


class RecordingConnector(HostConnector):
    """A HostConnector whose endpoints record to ``recorder``."""

    def __init__(
        self,
        recorder: AgentRecorder,
        transport: Transport,
        context: ssl.SSLContext,
        pinned_der: bytes,
        tcp_sockets: str | None = None,
        network: NetworkPlan | None = None,
    ) -> None:
        super().__init__(transport, context, pinned_der, tcp_sockets, network)
        self.recorder = recorder

    def at(self, address: HostAddress) -> HostEndpoint:
        return RecordingEndpoint(self, address, self.recorder)
