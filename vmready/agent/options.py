"""Option values the agent and ``vmready-agent notify`` share, importing nothing of the agent.

``notify`` runs as a second interpreter while the guest boots (the workload's
``vmready-agent notify ready``): what it imports is paid for at every boot, so
it needs these without the agent's configuration, TLS and serial modules.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_SOCKET = "/dev/lxd/sock"


class ConfigError(Exception):
    """The configuration cannot work; the message is one line for the operator."""


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
