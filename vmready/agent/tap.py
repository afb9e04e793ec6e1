"""``twistd vmready-agent``: the agent's Options and makeService, and nothing else."""

from __future__ import annotations

import os
from typing import Any

from twisted.python import usage

from vmready.agent.config import (
    DEFAULT_CONFIG_DRIVE,
    DEFAULT_HEARTBEAT,
    DEFAULT_RETRIES,
    ConfigError,
    load_config,
    parse_count,
    parse_seconds,
    parse_transport,
)
from vmready.agent.service import AgentService, build_agent


class Options(usage.Options):
    """Options for ``vmready-agent`` and ``twistd vmready-agent``."""

    # twistd prints "Usage: twistd [options] vmready-agent" before this.
    synopsis = "[options]"
    longdesc = (
        "The in-guest vmready agent: reports STARTED/CONNECTED/STOPPED on the virtio "
        "serial port, dials the host when it writes CONNECT, and serves the guest API "
        "(devlxd) on a unix socket.  Settings come from the config drive's agent.json; "
        "an option given here wins.  'vmready-agent notify ready' declares the workload Ready."
    )
    optParameters = [
        [
            "config-drive",
            "c",
            DEFAULT_CONFIG_DRIVE,
            "Directory with agent.crt, agent.key, server.crt and optional agent.json.",
        ],
        ["serial", None, None, "The serial port to use (device or unix socket); default: found."],
        [
            "virtio-ports",
            None,
            None,
            "Where to find com.canonical.lxd or org.linuxcontainers.lxd "
            "(default /dev/virtio-ports).",
        ],
        ["transport", None, None, "How to reach the host: vsock (default) or hvsock:PATH."],
        ["socket", "s", None, "The guest API socket to serve (default /dev/lxd/sock)."],
        [
            "state-dir",
            None,
            None,
            "Where to remember Ready for this boot; a tmpfs (default /run/vmready-agent).",
        ],
        ["heartbeat", None, str(DEFAULT_HEARTBEAT), "Seconds between status lines."],
        ["retries", None, str(DEFAULT_RETRIES), "Retries of a failing dial before waiting."],
        [
            "record",
            None,
            None,
            "Record the agent's side of the session (serial lines, requests to the host) to "
            "this transcript file, for vmready replay.",
        ],
    ]

    def postOptions(self) -> None:
        try:
            self["heartbeat"] = parse_seconds(self["heartbeat"], "heartbeat")
            self["retries"] = parse_count(self["retries"], "retries")
            if self["transport"] is not None:
                parse_transport(self["transport"])
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None


def _exit_nonzero(reactor: Any) -> None:
    """twistd has no exit status of its own: leave with 1 once shutdown ran."""
    reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
    reactor.stop()


def makeService(options: Options) -> AgentService:
    """Read the config drive (a bad one stops twistd with one line), then build the agent."""
    from twisted.internet import reactor

    try:
        service = build_agent(reactor, load_config(options))
    except ConfigError as e:
        raise SystemExit(f"vmready-agent: {e}") from None
    service.on_fatal = lambda reason: _exit_nonzero(reactor)
    return service
