"""``vmready-agent notify ready|started``: a guest program declares its state in one command.

It sends ``PATCH /1.0 {"state": …}`` through the agent's guest API socket, as
any devlxd client would.  Exit status 0 when the host accepted it, 1 with the
reason on one line when not (for example ``host not reachable: …`` while the
agent has no link), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, NoReturn

import attrs
from twisted.internet.defer import TimeoutError
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError
from twisted.web.client import Agent, ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IAgent

from vmready.agent.config import DEFAULT_SOCKET, ConfigError, parse_seconds
from vmready.agent.host import OneEndpoint, read_body, send_request

__all__ = ["STATES", "NotifyFailed", "NotifyRequest", "UsageError", "notify", "parse_notify"]

STATES = {"ready": "Ready", "started": "Started"}
_MAX_ANSWER = 64 * 1024


class NotifyFailed(Exception):
    """The state was not accepted; the message is the one line to show."""


class UsageError(Exception):
    """The command line is wrong; the message says how."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@attrs.frozen
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


async def notify(reactor: Any, socket_path: str, state: str, timeout: float = 60.0) -> None:
    """Ask the agent at ``socket_path`` to set ``state``; NotifyFailed saying why not."""
    endpoint = UNIXClientEndpoint(reactor, socket_path, timeout=timeout)
    agent: IAgent = Agent.usingEndpointFactory(reactor, OneEndpoint(endpoint))
    body = json.dumps({"state": state}).encode("utf-8")
    where = f"the agent at {socket_path}"
    try:
        sending = send_request(agent, b"PATCH", "/1.0", body, b"application/json")
        response = await sending.addTimeout(timeout, reactor)
        answer = await read_body(response, _MAX_ANSWER).addTimeout(timeout, reactor)
    except ConnectError as e:
        reason = e.args[0] if e.args and e.args[0] else type(e).__name__
        raise NotifyFailed(f"cannot reach {where}: {reason}") from None
    except TimeoutError:
        raise NotifyFailed(f"no answer from {where} within {timeout:g}s") from None
    except (ResponseFailed, ResponseNeverReceived):
        raise NotifyFailed(f"{where} closed the connection without answering") from None
    if not 200 <= response.code < 300:
        text = answer.decode("utf-8", "replace").strip()
        raise NotifyFailed(text.splitlines()[0] if text else f"HTTP {response.code}")
