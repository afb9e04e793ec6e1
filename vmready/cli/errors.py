"""How a ``vmready`` command ends: its exit statuses, and the errors that carry them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_GONE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM ends with 128 + 15


class CommandError(Exception):
    """Ends a command with a message on stderr and an exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class UsageError(Exception):
    """The command line is wrong; ``usage`` is the usage line of the (sub)command, if known."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage
