"""``vmready-agent notify ready|started``: a guest program declares its state in one command.

It sends ``PATCH /1.0 {"state": …}`` through the agent's guest API socket, as
any devlxd client would.  Exit status 0 when the host accepted it, 1 with the
reason on one line when not (for example ``host not reachable: …`` while the
agent has no link), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from vmready.agent import httpwire
from vmready.agent.options import DEFAULT_SOCKET, ConfigError, UsageError, parse_seconds

STATES = {"ready": "Ready", "started": "Started"}
MAX_ANSWER = 64 * 1024


class NotifyFailed(Exception):
    """The state was not accepted; the message is the one line to show."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class NotifyRequest:
    """What ``vmready-agent notify`` was asked to do."""

    state: str
    socket: str
    timeout: float


SYNOPSIS = "ready|started [--socket PATH] [--timeout SECONDS]"


def parse_notify(args: Sequence[str]) -> NotifyRequest:
    """``ready|started [--socket PATH] [--timeout SECONDS]``, options anywhere; UsageError."""
    parser = _Parser(
        prog="vmready-agent notify",
        description="Declare the workload Ready (or back to Started) through the agent.",
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


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: str
) -> tuple[int, bytes]:
    body = json.dumps({"state": state}).encode("utf-8")
    headers = [
        ("Host", "lxd"),
        ("User-Agent", "vmready-agent"),
        ("Content-Type", "application/json"),
    ]
    writer.write(httpwire.encode_request("PATCH", "/1.0", headers, body))
    head = await httpwire.read_response_head(reader)
    framing = httpwire.response_framing(head, "PATCH")
    return head.status, await httpwire.read_body(reader, framing, MAX_ANSWER)


async def notify(socket_path: str, state: str, timeout: float = 60.0) -> str | None:
    """Ask the agent at ``socket_path`` to set ``state``; NotifyFailed saying why not.

    None once the host has the state; the agent's words when it kept the state
    to deliver later (202: the host is unreachable now).
    """
    where = f"the agent at {socket_path}"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), timeout)
    except asyncio.TimeoutError:
        raise NotifyFailed(f"no answer from {where} within {timeout:g}s") from None
    except OSError as e:
        raise NotifyFailed(f"cannot reach {where}: {e.strerror or e}") from None
    try:
        status, answer = await asyncio.wait_for(_exchange(reader, writer, state), timeout)
    except asyncio.TimeoutError:
        raise NotifyFailed(f"no answer from {where} within {timeout:g}s") from None
    except (httpwire.IncompleteMessage, ConnectionError):
        raise NotifyFailed(f"{where} closed the connection without answering") from None
    except httpwire.HTTPError as e:
        raise NotifyFailed(f"{where} sent a malformed answer: {e}") from None
    finally:
        writer.close()
    text = answer.decode("utf-8", "replace").strip()
    if not 200 <= status < 300:
        raise NotifyFailed(text.splitlines()[0] if text else f"HTTP {status}")
    if status == 202:
        return text.splitlines()[0] if text else "kept for the host"
    return None
