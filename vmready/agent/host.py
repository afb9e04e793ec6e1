"""The host's guest API as the agent reaches it: mutual TLS to the advertised address.

Every request gets a new connection, as LXD's agent does; the one long-lived
connection is the link watch, a held ``GET /1.0/events`` whose end tells the
agent the host went away.  An address comes from a ``CONNECT`` line:

- ``<cid>:<port>`` on the ``vsock`` transport: kernel ``AF_VSOCK``;
- ``<cid>:<port>`` on ``hvsock:<path>`` (fakeqemu guests): the unix socket
  ``<path>_<port>``, the cid ignored;
- ``tcp:<ipv4>:<port>`` (the fallback transport): TCP, after the NIC named in
  ``agent.json`` is brought up with its address; for a fakeqemu guest (with
  ``tcp_sockets``) the unix socket ``<tcp_sockets>/<ipv4>:<port>`` instead.

Each connection is connected first, then wrapped in TLS (``vmready.agent.tls``),
so every failure says which step failed.  Requests and answers use the codec
in ``vmready.agent.httpwire``; an answer is held in memory, so it is capped.
Every failure is a ``HostError`` whose message is one line for logs and for
the guest's 503 answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Callable

from vmready.agent import httpwire
from vmready.agent.config import Transport
from vmready.agent.core import HostAddress, TcpAddress, VsockAddress
from vmready.agent.network import NetworkPlan, NetworkSetupError, bring_up
from vmready.agent.tls import describe_ssl_error

API_VERSION = "1.0"
EVENTS_PATH = "/1.0/events"
# The host is trusted, but an answer is held in memory: bound it anyway.
MAX_ANSWER_BYTES = 16 * 1024 * 1024
# Connect and TLS handshake, together.
CONNECT_TIMEOUT = 10.0
# The name sent in Host and SNI: the certificate is pinned, never checked against it.
HOST_NAME = "vmready-host"
AF_VSOCK: int = getattr(socket, "AF_VSOCK", 40)
_READ_LIMIT = 2 * httpwire.MAX_LINE_BYTES  # the stream reader's line limit


class HostError(Exception):
    """Talking to the host failed; the message says why, in one line."""


class HostRefused(HostError):
    """The host answered, but not as a vmready guest API should; the message says how."""


class AnswerTooLarge(HostError):
    """The host's answer passed the size limit."""


@dataclass(frozen=True)
class HostAnswer:
    """A whole answer from the host."""

    status: int
    content_type: str
    body: bytes


def _lost(error: BaseException) -> HostError:
    """The exception a broken exchange with the host becomes."""
    if isinstance(error, ssl.SSLError):
        return HostError(f"TLS handshake failed ({describe_ssl_error(error)})")
    if isinstance(error, httpwire.IncompleteMessage):
        return HostError("the host closed the connection")
    if isinstance(error, httpwire.HTTPError):
        return HostError(f"the host sent malformed HTTP: {error}")
    return HostError("the connection to the host was lost")


class HostResponse:
    """An answer whose head has arrived; its body is read whole or streamed."""

    def __init__(
        self,
        head: httpwire.ResponseHead,
        framing: httpwire.Framing,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.status = head.status
        self.content_type = head.headers.get("content-type")
        self._framing = framing
        self._reader = reader
        self._writer = writer
        # Told the whole body when ``read`` has it (the recorder listens here).
        self.on_body: Callable[[bytes], None] | None = None

    async def read(self, limit: int = MAX_ANSWER_BYTES) -> bytes:
        """The whole body, then the connection is closed; AnswerTooLarge past ``limit``."""
        try:
            body = await httpwire.read_body(self._reader, self._framing, limit)
        except httpwire.BodyTooLarge:
            raise AnswerTooLarge(f"answer larger than {limit} bytes") from None
        except (httpwire.HTTPError, OSError) as e:
            raise _lost(e) from None
        finally:
            self.close()
        if self.on_body is not None:
            self.on_body(body)
        return body

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive, until it ends (HostError if it breaks off)."""
        chunks = httpwire.body_chunks(self._reader, self._framing)
        try:
            async for data in chunks:
                yield data
        except (httpwire.HTTPError, OSError) as e:
            raise _lost(e) from None
        finally:
            await chunks.aclose()
            self.close()

    def close(self) -> None:
        """Drop the connection (at once: nothing more is wanted from it)."""
        transport = self._writer.transport
        if not transport.is_closing():
            transport.abort()


class HostEndpoint:
    """The host's guest API at one address: every request a new mutual-TLS connection."""

    def __init__(self, connector: HostConnector, address: HostAddress) -> None:
        self.connector = connector
        self.address = address
        self.label = connector.describe(address)

    async def send(
        self, method: str, target: str, body: bytes | None = None, content_type: str = ""
    ) -> HostResponse:
        """Connect, send one request and read the answer's head."""
        reader, writer = await self.connector.connect(self.address)
        headers = [("Host", HOST_NAME), ("User-Agent", "vmready-agent"), ("Connection", "close")]
        if content_type:
            headers.append(("Content-Type", content_type))
        try:
            writer.write(httpwire.encode_request(method, target, headers, body))
            head = await httpwire.read_response_head(reader)
            framing = httpwire.response_framing(head, method)
        except (httpwire.HTTPError, OSError) as e:
            writer.transport.abort()
            raise _lost(e) from None
        except BaseException:
            writer.transport.abort()
            raise
        return HostResponse(head, framing, reader, writer)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes | None = None,
        content_type: str = "",
        limit: int = MAX_ANSWER_BYTES,
    ) -> HostAnswer:
        """One whole request and answer."""
        response = await self.send(method, target, body, content_type)
        try:
            raw = await response.read(limit)
        finally:
            response.close()
        return HostAnswer(response.status, response.content_type, raw)


Bring_up = Callable[[NetworkPlan], str]


class HostConnector:
    """Connections to the host's guest API at an advertised address, with pinned mutual TLS."""

    def __init__(
        self,
        transport: Transport,
        context: ssl.SSLContext,
        pinned_der: bytes,
        tcp_sockets: str | None = None,
        network: NetworkPlan | None = None,
        bring_up_network: Bring_up = bring_up,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.transport = transport
        self.context = context
        self.pinned_der = pinned_der
        self.tcp_sockets = tcp_sockets
        self.network = network
        self.bring_up_network = bring_up_network
        self.connect_timeout = connect_timeout

    def describe(self, address: HostAddress) -> str:
        """How an operator would name the address: ``vsock 2:1234``, a socket path, ``tcp …``."""
        if isinstance(address, TcpAddress):
            if self.tcp_sockets is not None:
                return self._tcp_socket(address)
            return f"tcp {address.host}:{address.port}"
        if self.transport.kind == "vsock":
            return f"vsock {address}"
        return f"{self.transport.path}_{address.port}"

    def at(self, address: HostAddress) -> HostEndpoint:
        """The host's guest API at ``address``."""
        return HostEndpoint(self, address)

    def _tcp_socket(self, address: TcpAddress) -> str:
        assert self.tcp_sockets is not None
        return os.path.join(self.tcp_sockets, f"{address.host}:{address.port}")

    async def connect(
        self, address: HostAddress
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TLS stream to the host at ``address``, its certificate checked; HostError."""
        try:
            return await asyncio.wait_for(self._connect(address), self.connect_timeout)
        except asyncio.TimeoutError:
            raise HostError("timed out") from None

    async def _connect(
        self, address: HostAddress
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = await self._connected_socket(address)
        try:
            reader, writer = await asyncio.open_connection(
                sock=sock,
                ssl=self.context,
                server_hostname=HOST_NAME,
                ssl_handshake_timeout=self.connect_timeout,
                limit=_READ_LIMIT,
            )
        except ssl.SSLError as e:
            sock.close()
            raise HostError(f"TLS handshake failed ({describe_ssl_error(e)})") from None
        except (ConnectionError, OSError):
            sock.close()
            raise HostError("TLS handshake failed (the host closed the connection)") from None
        except BaseException:
            sock.close()
            raise
        peer = writer.get_extra_info("ssl_object")
        if peer is None or peer.getpeercert(binary_form=True) != self.pinned_der:
            writer.transport.abort()
            raise HostError("TLS handshake failed (the host's certificate is not server.crt)")
        return reader, writer

    async def _connected_socket(self, address: HostAddress) -> socket.socket:
        """The plain connection, before TLS."""
        target: Any
        if isinstance(address, VsockAddress):
            if self.transport.kind == "vsock":
                family, target = AF_VSOCK, (address.cid, address.port)
            else:
                family, target = socket.AF_UNIX, f"{self.transport.path}_{address.port}"
        elif self.tcp_sockets is not None:
            family, target = socket.AF_UNIX, self._tcp_socket(address)
        elif self.transport.kind == "hvsock":
            # A fakeqemu guest is a host process: it must never dial the guest network for real.
            raise HostError("cannot dial TCP: a fakeqemu guest (hvsock) needs tcp_sockets")
        else:
            if self.network is not None:
                try:
                    self.bring_up_network(self.network)
                except NetworkSetupError as e:
                    raise HostError(str(e)) from None
            family, target = socket.AF_INET, (address.host, address.port)
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            kind = "AF_VSOCK" if family == AF_VSOCK else "a"
            raise HostError(f"cannot connect: cannot create {kind} socket: {e.strerror}") from None
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, target)
        except OSError as e:
            sock.close()
            # asyncio rewrites the OS's words ("Connect call failed …"): use the errno's.
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise HostError(f"cannot connect: {reason}") from None
        except BaseException:
            sock.close()
            raise
        return sock


def envelope_metadata(code: int, raw: bytes) -> Any:
    """The metadata of a success envelope; HostRefused for anything else."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        envelope = None
    if not isinstance(envelope, dict):
        raise HostRefused(f"HTTP {code} without a JSON envelope")
    if envelope.get("type") == "error" or code >= 400:
        raise HostRefused(f"HTTP {code}: {envelope.get('error') or 'error'}")
    return envelope.get("metadata")


class LinkWatch:
    """The held event stream: the link is up while it lasts; ``lost`` gets why it ended."""

    def __init__(self, response: HostResponse) -> None:
        self.response = response
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._closing = False
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        events = self.response.chunks()
        try:
            async for _event in events:
                continue  # events are not the agent's business; the stream shows the host is there
            reason = "the host ended the event stream"
        except asyncio.CancelledError:
            reason = "closed by the agent"
        except HostError as e:
            reason = str(e)
        finally:
            await events.aclose()
        if self._closing:
            reason = "closed by the agent"
        if not self.lost.done():
            self.lost.set_result(reason)

    def close(self) -> None:
        """Drop the stream (the agent dials elsewhere or stops)."""
        self._closing = True
        self.response.close()
        self._task.cancel()
        if not self.lost.done():  # the watch may not even have started
            self.lost.set_result("closed by the agent")

    async def closed(self) -> None:
        """Once the stream's connection is gone."""
        await asyncio.shield(self.lost)


async def open_link(endpoint: HostEndpoint) -> LinkWatch:
    """Validate the host (``GET /1.0`` answers api_version 1.0) and hold its event stream."""
    answer = await endpoint.request("GET", "/1.0")
    metadata = envelope_metadata(answer.status, answer.body)
    version = metadata.get("api_version") if isinstance(metadata, dict) else None
    if answer.status != 200 or version != API_VERSION:
        raise HostRefused(f"GET /1.0 answered api_version {version!r}, not {API_VERSION!r}")
    response = await endpoint.send("GET", EVENTS_PATH)
    if response.status != 200:
        raw = await response.read()
        try:
            envelope_metadata(response.status, raw)
        except HostRefused as e:
            raise HostRefused(f"GET /1.0/events: {e}") from None
        raise HostRefused(f"GET /1.0/events answered HTTP {response.status}")
    return LinkWatch(response)


async def patch_state(endpoint: HostEndpoint, state: str) -> None:
    """``PATCH /1.0 {"state": state}``; HostRefused if the host does not accept it."""
    body = json.dumps({"state": state}).encode("utf-8")
    answer = await endpoint.request("PATCH", "/1.0", body, "application/json")
    envelope_metadata(answer.status, answer.body)


def describe_failure(error: BaseException) -> str:
    """One line saying why talking to the host failed, for logs and 503 answers."""
    if isinstance(error, HostError):
        return str(error)
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, (ssl.SSLError, httpwire.HTTPError, OSError)):
        return str(_lost(error))
    return str(error) or type(error).__name__
