"""The ``vmready`` command."""

from vmready.cli.client import APIError, Client, DaemonUnreachable, LineStream, instance_path
from vmready.cli.errors import CommandError
from vmready.cli.waiter import Waiter

__all__ = [
    "APIError",
    "Client",
    "CommandError",
    "DaemonUnreachable",
    "LineStream",
    "Waiter",
    "instance_path",
]
