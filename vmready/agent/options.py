"""Option values the agent and ``vmready-agent notify`` share, importing nothing of the agent.

``notify`` runs as a second interpreter while the guest boots (the workload's
``vmready-agent notify ready``), and the agent parses its command line before
it says its first ``STARTED``: what this imports is paid for at every boot, so
it needs nothing of the agent's configuration, TLS and serial modules (and not
``typing``, whose names only mypy reads here).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

DEFAULT_SOCKET = "/dev/lxd/sock"
DEFAULT_CONFIG_DRIVE = "/var/lib/vmready-agent/config"
DEFAULT_HEARTBEAT = 5.0
DEFAULT_RETRIES = 3


class ConfigError(Exception):
    """The configuration cannot work; the message is one line for the operator."""


class UsageError(Exception):
    """The command line is wrong; the message says how."""


class OptionParser(argparse.ArgumentParser):
    """argparse's parser, raising UsageError; its help sized without ``shutil``.

    argparse's own help formatter, made for every ``add_argument``, imports
    ``shutil`` for the terminal's width, and ``shutil`` loads ``zlib``, ``bz2``
    and ``lzma`` (shared libraries, under emulation slow to load) into every
    start of the agent and of ``notify``.
    """

    def __init__(self, prog: str, description: str, usage: str | None = None) -> None:
        super().__init__(prog=prog, usage=usage, description=description, formatter_class=_help)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _help(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=_columns() - 2)  # as argparse sizes it


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it: $COLUMNS, stdout, 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.__stdout__
    try:
        return (os.get_terminal_size(stdout.fileno()).columns if stdout else 0) or 80
    except (ValueError, OSError):
        return 80


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
