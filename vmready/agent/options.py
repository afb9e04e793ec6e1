"""Option values the agent and ``vmready-agent notify`` share, importing nothing of the agent.

``notify`` runs as a second interpreter while the guest boots (the workload's
``vmready-agent notify ready``), and the agent parses its command line before
it says its first ``STARTED``: what this imports is paid for at every boot, so
it needs nothing of the agent's configuration, TLS and serial modules (and not
``typing``, whose names only mypy reads here).
"""

from __future__ import annotations

import math

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEFAULT_SOCKET = "/dev/lxd/sock"
DEFAULT_CONFIG_DRIVE = "/var/lib/vmready-agent/config"
DEFAULT_HEARTBEAT = 5.0
DEFAULT_RETRIES = 3


class ConfigError(Exception):
    """The configuration cannot work; the message is one line for the operator."""


class UsageError(Exception):
    """The command line is wrong; the message says how."""


def split_transport(text: str) -> tuple[str, str]:
    """``vsock`` or ``hvsock:<path>`` as (kind, path); ConfigError otherwise."""
    if text == "vsock":
        return "vsock", ""
    kind, colon, path = text.partition(":")
    if kind == "hvsock" and colon and path:
        return kind, path
    raise ConfigError(f"transport {text!r} is neither 'vsock' nor 'hvsock:<path>'")


def parse_seconds(value: Any, name: str) -> float:
    """A positive, finite number of seconds for option ``--name``; ConfigError otherwise."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a number of seconds, not {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"--{name} must be a positive number of seconds, not {value!r}")
    return seconds


def parse_count(value: Any, name: str) -> int:
    """A whole number, zero or more, for option ``--name``; ConfigError otherwise."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a whole number, not {value!r}") from None
    if count < 0:
        raise ConfigError(f"--{name} must be zero or more, not {value!r}")
    return count
