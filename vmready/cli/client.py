"""The daemon's operator API: requests, LXD's envelopes, the event stream.

HTTP is treq's, on Twisted's ``Agent`` with an endpoint factory that sends
every request to the daemon: its unix socket (the ``local`` remote), or a
remote's TLS endpoint (``cli.remotetls.PinnedRemote``), so every command
works the same against either.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import quote, urlencode

from treq import content
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError, ConnectionDone
from twisted.internet.interfaces import IPushProducer, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from vmready.cli.errors import EXIT_FAILED, CommandError
from vmready.cli.remotetls import PinnedRemote, tls_failure
from vmready.domain import IVMReadyReactor

_START_HINT = "is it running? start it with: twistd -n vmready"
_HOST = "http://vmready"


class DaemonUnreachable(CommandError):
    """The daemon's socket cannot be connected to."""

    def __init__(self, socket_path: str, reason: str, hint: str = _START_HINT) -> None:
        super().__init__(
            f"cannot reach the vmready daemon at {socket_path}: {reason} ({hint})", EXIT_FAILED
        )


class DaemonBusy(DaemonUnreachable):
    """The daemon runs, but its socket's queue of connections not yet accepted is full."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(
            socket_path,
            "its queue of connections waiting to be accepted is full",
            "it is too busy to accept more now; try again",
        )


class APIError(CommandError):
    """The daemon answered with LXD's error envelope."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(f"Error: {error}", EXIT_FAILED)
        self.code = code
        self.error = error


@implementer(IAgentEndpointFactory)
class _UnixSocket:
    """Every request goes to the daemon's unix socket, whatever the URL's host."""

    def __init__(self, reactor: IVMReadyReactor, path: str) -> None:
        self._reactor = reactor
        self._path = path

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        """The unix socket endpoint."""
        return UNIXClientEndpoint(self._reactor, self._path)


class LineStream(Protocol):
    """Receives a streamed response body and hands over each complete line."""

    MAX_LINE = 4 * 1024 * 1024

    def __init__(self, on_line: Callable[[bytes], None], daemon: str) -> None:
        self._on_line = on_line
        self._daemon = daemon
        self._buffer = b""
        self.closing = False
        self.ended: Deferred[str | None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        """Split into lines; a line longer than MAX_LINE ends the stream."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip() and not self.closing:
                self._on_line(line)
        if len(self._buffer) > self.MAX_LINE:
            self.close()

    def close(self) -> None:
        """Stop reading (closes the connection)."""
        if not self.closing and self.transport is not None:
            self.closing = True
            cast(IPushProducer, self.transport).stopProducing()  # a body's transport pushes

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        """Fires ``ended`` with None when we closed it, else with why it ended (for the user)."""
        if self.closing:
            self.ended.callback(None)
        elif reason.check(ResponseDone):
            self.ended.callback(f"{self._daemon} closed the event stream")
        else:
            # ResponseFailed's message is a list of Failure reprs: say what happened instead.
            self.ended.callback(f"lost the connection to {self._daemon}")


class Client:
    """The operator API of one daemon, with LXD's envelopes unwrapped.

    ``Client(reactor, socket_path)`` reaches it on its unix socket;
    ``Client.remote`` over a remote's mutual TLS.
    """

    def __init__(self, reactor: IVMReadyReactor, socket_path: str) -> None:
        self._setup(
            reactor,
            _UnixSocket(reactor, socket_path),
            f"the vmready daemon at {socket_path}",
            lambda reason: DaemonUnreachable(socket_path, reason),
            lambda: DaemonBusy(socket_path),
        )
        self.socket_path = socket_path

    @classmethod
    def remote(cls, reactor: IVMReadyReactor, name: str, url: str, tls: PinnedRemote) -> Client:
        """The daemon of remote ``name`` at ``url``, over ``tls``."""
        self = cls.__new__(cls)
        daemon = f"remote {name} ({url})"
        self._setup(
            reactor,
            tls,
            daemon,
            lambda reason: CommandError(f"cannot reach {daemon}: {reason}", EXIT_FAILED),
            lambda: CommandError(
                f"cannot reach {daemon}: it hung up on the connection", EXIT_FAILED
            ),
        )
        self.socket_path = url
        return self

    def _setup(
        self,
        reactor: IVMReadyReactor,
        endpoints: IAgentEndpointFactory,
        daemon: str,
        unreachable: Callable[[str], CommandError],
        busy: Callable[[], CommandError],
    ) -> None:
        self.reactor = reactor
        self.daemon = daemon
        self._unreachable = unreachable
        self._busy = busy
        self._pinned = endpoints.tls if isinstance(endpoints, PinnedRemote) else None
        self._http = HTTPClient(Agent.usingEndpointFactory(reactor, endpoints))

    def _failed(self, error: ResponseFailed | RequestTransmissionFailed) -> Exception:
        """What to raise for a request or response that broke off."""
        if any(reason.check(CancelledError) for reason in error.reasons):
            # We cancelled it (a signal ends the command): not the daemon's doing.
            return CancelledError()
        why = tls_failure(error.reasons, self._pinned)
        if why is not None:
            return self._unreachable(why)
        return CommandError(f"lost the connection to {self.daemon}", EXIT_FAILED)

    async def _read_body(self, response: IResponse) -> bytes:
        """The whole body of ``response``."""
        try:
            body: bytes = await content(response)
        except ResponseFailed as e:
            raise self._failed(e) from None
        return body

    async def _send(
        self, method: str, path: str, body: Any = None, stream: bool = False
    ) -> IResponse:
        """One request; ``stream``: the body is read as it comes (the event stream)."""
        options: dict[str, Any] = {} if body is None else {"json": body}
        try:
            response: IResponse = await self._http.request(
                method,
                _HOST + path,
                headers=Headers({b"User-Agent": [b"vmready-cli"]}),
                unbuffered=stream,
                **options,
            )
            return response
        except ConnectError as e:
            if _closed_while_connecting(e):
                raise self._busy() from None
            raise self._unreachable(_connect_reason(e)) from None
        except (ResponseFailed, RequestTransmissionFailed) as e:
            raise self._failed(e) from None

    async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One request; the whole envelope, or APIError for an error envelope."""
        response = await self._send(method, path, body)
        raw = await self._read_body(response)
        try:
            envelope = json.loads(raw)
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict):
            raise CommandError(
                f"unexpected answer from the daemon (HTTP {response.code}): {raw[:200]!r}",
                EXIT_FAILED,
            )
        if envelope.get("type") == "error" or response.code >= 400:
            raise APIError(
                int(envelope.get("error_code") or response.code),
                str(envelope.get("error") or f"HTTP {response.code}"),
            )
        return envelope

    async def get(self, path: str) -> Any:
        """GET and return the metadata."""
        return (await self.request("GET", path))["metadata"]

    async def get_raw(self, path: str) -> bytes:
        """GET a body that is not an envelope (a console log); APIError for an error envelope."""
        response = await self._send("GET", path)
        raw = await self._read_body(response)
        if response.code >= 400:
            try:
                envelope = json.loads(raw)
                error = str(envelope.get("error") or f"HTTP {response.code}")
            except (ValueError, AttributeError):
                error = f"HTTP {response.code}"
            raise APIError(response.code, error)
        return raw

    async def operation(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """Start an action; returns its operation object."""
        envelope = await self.request(method, path, body)
        operation: dict[str, Any] = envelope["metadata"]
        return operation

    async def wait_operation(self, operation: dict[str, Any]) -> dict[str, Any]:
        """The operation once it finished (``/wait`` without a limit)."""
        done: dict[str, Any] = await self.get(
            f"/1.0/operations/{quote(str(operation['id']), safe='')}/wait?timeout=-1"
        )
        return done

    async def events(
        self, types: Sequence[str], on_event: Callable[[dict[str, Any]], None]
    ) -> LineStream:
        """Subscribe to ``/1.0/events``; returns once the daemon has subscribed us."""
        arguments = {"type": ",".join(types)}
        query = f"?{urlencode(arguments, errors='surrogateescape')}" if types else ""
        response = await self._send("GET", f"/1.0/events{query}", stream=True)
        if response.code != 200:
            raw = await self._read_body(response)
            try:
                error = str(json.loads(raw).get("error"))
            except (ValueError, AttributeError):
                error = f"HTTP {response.code}"
            raise APIError(response.code, error)

        def line(raw: bytes) -> None:
            try:
                event = json.loads(raw)
            except ValueError:
                return
            if isinstance(event, dict):
                on_event(event)

        stream = LineStream(line, self.daemon)
        response.deliverBody(stream)
        return stream


def _connect_reason(error: ConnectError) -> str:
    """Why a connect failed, as the OS says it ("No such file or directory")."""
    if isinstance(error.osError, int):
        return os.strerror(error.osError)
    return str(error.args[0]) if error.args else str(error)


def _closed_while_connecting(error: ConnectError) -> bool:
    """Whether the socket was closed before it connected, with no error of the OS's.

    A unix socket's connect whose listening queue is full is told "try again"
    (EAGAIN) and then hung up on: Twisted ends such an attempt as a plain
    ``ConnectError`` naming no OS error; every error the OS names has its own.
    """
    return type(error) is ConnectError and error.osError is None


def instance_path(name: str, *rest: str) -> str:
    """The API path of instance ``name``, with ``rest`` appended."""
    # argv may hold undecodable bytes (as surrogates): send them as they were.
    return "/".join(["/1.0/instances", quote(name, safe="", errors="surrogateescape"), *rest])


async def get_instance(client: Client, name: str) -> dict[str, Any]:
    """The instance object of ``name``; APIError (404) for an unknown one."""
    instance: dict[str, Any] = await client.get(instance_path(name))
    return instance
