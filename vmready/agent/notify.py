"""``vmready-agent notify ready|started``: a guest program declares its state in one command.

It sends ``PATCH /1.0 {"state": …}`` through the agent's guest API socket, as
any devlxd client would.  Exit status 0 when the host accepted it, 1 with the
reason on one line when not (for example ``host not reachable: …`` while the
agent has no link), 2 for a usage error.

It is a second interpreter started while the guest boots (the workload's
``vmready-agent notify ready``), so it does its one exchange on a plain
blocking socket, without asyncio (whose import, ssl among it, costs seconds
under emulation), and imports nothing of the agent but ``httpcodec`` and
``options``.  It speaks HTTP/1.0, so that the answer comes with a
``Content-Length`` or ends with the connection, never chunked.
"""

from __future__ import annotations

import socket
import time

from vmready.agent.httpcodec import (
    MAX_LINE_BYTES,
    READ_SIZE,
    BodyTooLarge,
    HeadLines,
    HTTPError,
    IncompleteMessage,
    encode_request,
    parse_status_line,
    response_framing,
)
from vmready.agent.options import (
    DEFAULT_SOCKET,
    ConfigError,
    OptionParser,
    UsageError,
    parse_seconds,
)
from vmready.agent.records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is for mypy only: notify runs at every boot
    from collections.abc import Sequence

STATES = {"ready": "Ready", "started": "Started"}
MAX_ANSWER = 64 * 1024


class NotifyFailed(Exception):
    """The state was not accepted; the message is the one line to show."""


class NotifyRequest(Record):
    """What ``vmready-agent notify`` was asked to do."""

    __slots__ = ("socket", "state", "timeout")

    def __init__(self, state: str, socket: str, timeout: float) -> None:
        self.state = state
        self.socket = socket
        self.timeout = timeout


SYNOPSIS = "ready|started [--socket PATH] [--timeout SECONDS]"


def parse_notify(args: Sequence[str]) -> NotifyRequest:
    """``ready|started [--socket PATH] [--timeout SECONDS]``, options anywhere; UsageError."""
    parser = OptionParser(
        "vmready-agent notify",
        "Declare the workload Ready (or back to Started) through the agent.",
    )
    parser.add_argument("state", help="ready or started")
    parser.add_argument("--socket", "-s", default=DEFAULT_SOCKET, help="the agent's socket")
    parser.add_argument("--timeout", default="60", help="seconds to wait for the answer")
    parsed = parser.parse_args(list(args))
    if parsed.state not in STATES:
        raise UsageError(f"the state is 'ready' or 'started', not {parsed.state!r}")
    try:
        timeout = parse_seconds(parsed.timeout, "timeout")
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return NotifyRequest(STATES[parsed.state], parsed.socket, timeout)


class _Answer:
    """One answer, read from a blocking socket before a deadline (``socket.timeout`` after)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buffer = bytearray()
        self.ended = False

    def _more(self) -> bool:
        """Read what arrives next into the buffer; False once the agent closed."""
        if not self.ended:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            self.sock.settimeout(left)
            data = self.sock.recv(READ_SIZE)
            self.buffer += data
            self.ended = not data
        return not self.ended

    def _take(self, size: int) -> bytes:
        taken = bytes(self.buffer[:size])
        del self.buffer[:size]
        return taken

    def line(self) -> bytes | None:
        """The next line with its LF; None when the answer ended before a byte of it."""
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                return self._take(end + 1)
            if len(self.buffer) > MAX_LINE_BYTES:
                raise HTTPError(f"a head line longer than {MAX_LINE_BYTES} bytes", 431)
            if not self._more():
                if self.buffer:
                    raise IncompleteMessage("the connection ended in the middle of the head")
                return None

    def body(self, length: int | None) -> bytes:
        """``length`` bytes, or all up to the end when None; BodyTooLarge past ``MAX_ANSWER``."""
        if length is None:
            while len(self.buffer) <= MAX_ANSWER and self._more():
                continue
        elif length <= MAX_ANSWER:
            while len(self.buffer) < length:
                if not self._more():
                    raise IncompleteMessage("the connection ended in the middle of the body")
        if max(len(self.buffer), length or 0) > MAX_ANSWER:
            raise BodyTooLarge(MAX_ANSWER)
        return self._take(len(self.buffer) if length is None else length)

    def head(self) -> tuple[int, int | None]:
        """The final answer's status and body length (None: up to the end); 1xx skipped."""
        while True:
            lines = HeadLines()
            raw = self.line()
            if raw is None:
                raise IncompleteMessage("the connection ended before an answer")
            head = parse_status_line(lines.take(raw))
            while True:
                raw = self.line()
                if raw is None:
                    raise IncompleteMessage("the connection ended in the middle of the head")
                if not lines.field(lines.take(raw)):
                    break
            head.headers = lines.headers
            if not 100 <= head.status < 200:
                break
        framing = response_framing(head, "PATCH")
        if framing.chunked:
            raise HTTPError("a chunked answer to an HTTP/1.0 request")
        return head.status, None if framing.until_close else framing.length or 0


def _exchange(sock: socket.socket, state: str, deadline: float) -> tuple[int, bytes]:
    body = ('{"state": "' + state + '"}').encode("utf-8")  # one of STATES' values: no escapes
    headers = [
        ("Host", "lxd"),
        ("User-Agent", "vmready-agent"),
        ("Content-Type", "application/json"),
    ]
    sock.sendall(encode_request("PATCH", "/1.0", headers, body, version=(1, 0)))
    answer = _Answer(sock, deadline)
    status, length = answer.head()
    return status, answer.body(length)


def notify(socket_path: str, state: str, timeout: float = 60.0) -> str | None:
    """Ask the agent at ``socket_path`` to set ``state``; NotifyFailed saying why not.

    None once the host has the state; the agent's words when it kept the state
    to deliver later (202: the host is unreachable now).
    """
    where = f"the agent at {socket_path}"
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout)
            sock.connect(socket_path)
        except socket.timeout:
            raise NotifyFailed(f"no answer from {where} within {timeout:g}s") from None
        except OSError as e:
            raise NotifyFailed(f"cannot reach {where}: {e.strerror or e}") from None
        try:
            status, answer = _exchange(sock, state, deadline)
        except socket.timeout:
            raise NotifyFailed(f"no answer from {where} within {timeout:g}s") from None
        except (IncompleteMessage, ConnectionError):
            raise NotifyFailed(f"{where} closed the connection without answering") from None
        except HTTPError as e:
            raise NotifyFailed(f"{where} sent a malformed answer: {e}") from None
        except OSError as e:
            raise NotifyFailed(f"lost {where}: {e.strerror or e}") from None
    finally:
        sock.close()
    text = answer.decode("utf-8", "replace").strip()
    if not 200 <= status < 300:
        raise NotifyFailed(text.splitlines()[0] if text else f"HTTP {status}")
    if status == 202:
        return text.splitlines()[0] if text else "kept for the host"
    return None
