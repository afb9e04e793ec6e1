"""The guest's devlxd socket: every request forwarded to the host, answered as LXD answers.

A guest program talks plain HTTP to the agent's unix socket (``/dev/lxd/sock``);
the agent sends each request over a new mutual-TLS connection to the host and
unwraps the host's LXD envelope into devlxd's unix-socket format:

- success: the metadata as JSON (``application/json``, with a trailing newline
  as LXD's encoder writes it), except string metadata (a config value, the
  meta-data), which is sent raw (``application/octet-stream``, as LXD does);
- error: ``<error>\\n`` as plain text, with the host's HTTP status;
- ``/1.0/events``: the host's stream relayed as it arrives (chunked, or raw to
  an HTTP/1.0 client), until either side ends.

While the link to the host is down, the meta-data, config and devices are
answered from this boot's data on the config drive (``vmready.agent.bootdata``)
as the host would answer them; any other request then, or any request when
the host fails mid-request, is answered 503 ``host not reachable: <reason>``.
Request bodies are capped at 1 MiB (413), held in memory, never spilled to
disk.  Requests that break HTTP's rules get a plain-text 4xx/5xx saying what
was wrong.  One request per connection: every answer says ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import traceback
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from vmready.agent import httpwire
from vmready.agent.answers import JSON, Answer, devlxd_answer, plain
from vmready.agent.host import (
    AnswerTooLarge,
    HostEndpoint,
    HostError,
    HostResponse,
    describe_failure,
)
from vmready.agent.logs import logger

MAX_REQUEST_BODY = 1024 * 1024
# A body past the limit is still read (and dropped) up to this much, so that the
# client, still sending it, sees the 413 rather than a reset connection.
MAX_DRAIN = 4 * MAX_REQUEST_BODY
# How long a guest program may take to send its request.
REQUEST_TIMEOUT = 60.0
# Guest connections served at once; more wait in the kernel's backlog.
MAX_CONNECTIONS = 256
EVENTS_PATH = "/1.0/events"
STATE_PATH = "/1.0"

log = logger(__name__)


class HostUnreachable(Exception):
    """No link to the host now; the message says why, for the 503 answer."""


@dataclass(frozen=True)
class HostRoute:
    """How to reach the host right now: its guest API, and its name for messages."""

    endpoint: HostEndpoint
    label: str


def _target(target: str) -> tuple[str, str]:
    """The path, and the path with its query, of a request target (origin or absolute form)."""
    if not target.startswith("/"):
        parts = urlsplit(target)
        if not parts.scheme:
            raise httpwire.HTTPError(f"a request target that is not a path: {target[:60]!r}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return target.partition("?")[0], target


def _declared_state(body: bytes) -> str | None:
    """The state a ``PATCH /1.0`` body asks for, if it is a well-formed one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    state = parsed.get("state") if isinstance(parsed, dict) else None
    return state if state in ("Ready", "Started") else None


def _where(error: BaseException) -> str:
    """The innermost frame of a bug, for its one log line."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown place"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


class _Exchange:
    """One guest connection: its streams and the HTTP version to answer in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.version = (1, 1)
        self.started = False

    async def answer(self, answer: Answer) -> None:
        headers = [
            ("Content-Type", answer.content_type),
            ("Content-Length", str(len(answer.body))),
            ("X-Content-Type-Options", "nosniff"),
            ("Connection", "close"),
        ]
        self.started = True
        self.writer.write(httpwire.encode_response_head(answer.code, headers, self.version))
        self.writer.write(answer.body)
        await self.writer.drain()


class GuestAPIProxy:
    """Serves the devlxd socket: every path, every method, forwarded to the host."""

    def __init__(
        self,
        route: Callable[[], HostRoute],
        remember_state: Callable[[str], None],
        timeout: float = 30.0,
        hold_state: Callable[[str], None] | None = None,
        local: Callable[[str, str], Answer | None] | None = None,
    ) -> None:
        """``route`` raises HostUnreachable while the link is down.

        ``remember_state`` is told ``"Ready"`` or ``"Started"`` after the host
        accepted a guest program's ``PATCH /1.0`` to that state; ``hold_state``
        is told the state a ``PATCH /1.0`` asked for while the link was down (it
        is answered 202: the agent delivers it when the link returns).  Without
        ``hold_state`` such a PATCH is answered 503, as any request then.
        ``local(method, path)`` answers, while the link is down, the requests it
        can from this boot's data (``vmready.agent.bootdata``); None: 503 as the rest.
        """
        self.route = route
        self.remember_state = remember_state
        self.hold_state = hold_state
        self.local = local
        self.timeout = timeout
        self._slots: asyncio.Semaphore | None = None  # made in the loop (Python 3.9)
        self._connections: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One guest connection: one request, one answer (``asyncio.start_unix_server``)."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        exchange = _Exchange(reader, writer)
        try:
            # A guest program that went away, or the agent stopping: nobody to answer.
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                async with self._slots:
                    await self._serve(exchange)
        except Exception as e:  # a bug in the agent: one line for the log and for the caller
            log.error(
                "serving a guest program failed: internal error %s: %s (at %s)",
                type(e).__name__,
                e,
                _where(e),
            )
            if not exchange.started:
                with contextlib.suppress(ConnectionError):
                    await exchange.answer(plain(500, f"vmready-agent internal error: {e}"))
        finally:
            self._connections.discard(task)
            writer.close()  # after what was written is flushed

    def close_connections(self) -> None:
        """End every guest connection (the agent stops)."""
        for task in list(self._connections):
            task.cancel()

    async def _serve(self, exchange: _Exchange) -> None:
        try:
            request = await asyncio.wait_for(self._read_request(exchange), REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            await exchange.answer(plain(408, f"no whole request within {REQUEST_TIMEOUT:g}s"))
            return
        except httpwire.BodyTooLarge:
            await exchange.answer(
                plain(413, f"Request body too large (limit {MAX_REQUEST_BODY} bytes)")
            )
            return
        except httpwire.HTTPError as e:
            if not isinstance(e, httpwire.IncompleteMessage):
                await exchange.answer(plain(e.status, f"Bad request: {e}"))
            return
        if request is None:
            return
        await self._forward(exchange, *request)

    async def _read_request(
        self, exchange: _Exchange
    ) -> tuple[httpwire.RequestHead, bytes] | None:
        head = await httpwire.read_request_head(exchange.reader)
        if head is None:
            return None
        exchange.version = min(head.version, (1, 1))
        framing = httpwire.request_framing(head)
        expects = head.headers.get("expect").lower()
        if framing.length is not None and framing.length > MAX_REQUEST_BODY:
            if expects != "100-continue" and framing.length <= MAX_DRAIN:
                await self._drain(exchange.reader, framing)
            raise httpwire.BodyTooLarge(MAX_REQUEST_BODY)
        if expects == "100-continue" and not framing.empty:
            exchange.writer.write(httpwire.encode_response_head(100, [], exchange.version))
        try:
            body = await httpwire.read_body(exchange.reader, framing, MAX_REQUEST_BODY)
        except httpwire.BodyTooLarge:
            # Chunked: what is left of the body is drained, up to a bound, before the 413.
            await self._drain(exchange.reader, framing)
            raise
        return head, body

    async def _drain(self, reader: asyncio.StreamReader, framing: httpwire.Framing) -> None:
        drained = 0
        chunks = httpwire.body_chunks(reader, framing)
        try:
            async for data in chunks:
                drained += len(data)
                if drained > MAX_DRAIN:
                    return
        except httpwire.HTTPError:
            return
        finally:
            await chunks.aclose()

    async def _forward(self, exchange: _Exchange, head: httpwire.RequestHead, body: bytes) -> None:
        try:
            path, full_path = _target(head.target)
        except httpwire.HTTPError as e:
            await exchange.answer(plain(400, f"Bad request: {e}"))
            return
        try:
            route = self.route()
        except HostUnreachable as e:
            known = self.local(head.method, path) if self.local is not None else None
            if known is not None:
                await exchange.answer(known)
                return
            state = (
                _declared_state(body) if head.method == "PATCH" and path == STATE_PATH else None
            )
            if state is not None and self.hold_state is not None and self._hold(state):
                await exchange.answer(
                    plain(
                        202,
                        f"host not reachable: {e}; the agent will tell it {state} "
                        "when the link returns",
                    )
                )
                return
            await exchange.answer(plain(503, f"host not reachable: {e}"))
            return
        try:
            answer = await self._exchange(exchange, route, head, path, full_path, body)
        except asyncio.TimeoutError:
            answer = plain(
                503, f"host not reachable: no answer from {route.label} within {self.timeout:g}s"
            )
        except AnswerTooLarge as e:
            answer = plain(502, f"host sent an answer too large to relay ({e})")
        except HostError as e:
            answer = plain(503, f"host not reachable: {route.label}: {describe_failure(e)}")
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug in the agent: one line for the log and for the caller
            log.error(
                "forwarding %s %s failed: internal error %s: %s (at %s)",
                head.method,
                head.target,
                type(e).__name__,
                e,
                _where(e),
            )
            answer = plain(500, f"vmready-agent internal error: {e}")
        if answer is None or exchange.started:
            return  # a relayed stream: nothing more can be said
        await exchange.answer(answer)

    async def _exchange(
        self,
        exchange: _Exchange,
        route: HostRoute,
        head: httpwire.RequestHead,
        path: str,
        full_path: str,
        body: bytes,
    ) -> Answer | None:
        """Send the request on; the answer for the guest (None: a stream was relayed)."""
        content_type = head.headers.get("content-type")
        # A body only when there is one: a GET stays bodiless.
        response = await asyncio.wait_for(
            route.endpoint.send(head.method, full_path, body or None, content_type), self.timeout
        )
        try:
            if path == EVENTS_PATH and response.status == 200:
                await self._relay(exchange, response)
                return None
            raw = await asyncio.wait_for(response.read(), self.timeout)
        finally:
            response.close()
        answer = devlxd_answer(response.status, raw)
        if head.method == "PATCH" and path == STATE_PATH and 200 <= answer.code < 300:
            state = _declared_state(body)
            if state is not None:
                self._remember(state)
        return answer

    def _hold(self, state: str) -> bool:
        """Keep ``state`` for the host; False if it cannot be kept (then the caller gets 503)."""
        assert self.hold_state is not None
        try:
            self.hold_state(state)
        except OSError as e:
            log.error("cannot keep the workload's state %s: %s", state, e.strerror or e)
            return False
        return True

    def _remember(self, state: str) -> None:
        try:
            self.remember_state(state)
        except OSError as e:
            # The host has the state; only a later reconnect's reassertion is at risk.
            log.error("cannot remember the workload's state %s: %s", state, e.strerror or e)

    async def _relay(self, exchange: _Exchange, response: HostResponse) -> None:
        """Copy the host's event stream to the guest until either side ends."""
        chunked = exchange.version >= (1, 1)
        headers = [("Content-Type", response.content_type or JSON), ("Connection", "close")]
        if chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        exchange.started = True
        writer = exchange.writer
        # The headers now: an event may be long in coming.
        writer.write(httpwire.encode_response_head(200, headers, exchange.version))
        await writer.drain()
        guest_left = asyncio.ensure_future(_until_eof(exchange.reader))
        relay = asyncio.ensure_future(self._copy(response, writer, chunked))
        try:
            await asyncio.wait([guest_left, relay], return_when=asyncio.FIRST_COMPLETED)
        finally:
            guest_left.cancel()
            relay.cancel()
            outcome = await asyncio.gather(guest_left, relay, return_exceptions=True)
        if outcome[1] is None:  # the host ended its stream: end the guest's properly
            if chunked:
                writer.write(httpwire.LAST_CHUNK)
            await writer.drain()

    async def _copy(
        self, response: HostResponse, writer: asyncio.StreamWriter, chunked: bool
    ) -> None:
        events = response.chunks()
        try:
            async for data in events:
                writer.write(httpwire.encode_chunk(data) if chunked else data)
                await writer.drain()
        except HostError as e:
            log.info("the host's event stream for a guest program ended: %s", e)
            raise
        finally:
            await events.aclose()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Returns when the guest program closes its end (anything it sends meanwhile is dropped)."""
    while await reader.read(httpwire.READ_SIZE):
        continue
