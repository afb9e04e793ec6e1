"""The agent's logging: quiet as a library, one line per message as a program.

Every agent module takes its logger from ``logger``, which gives the
``vmready.agent`` loggers a ``NullHandler`` first: nothing is printed unless
the program (``vmready-agent``, a benchmark's worker) calls
``configure_logging``.  This lives here, not in the package's ``__init__``,
because the agent says its first ``STARTED`` and ``vmready-agent notify``
does its whole work without ``logging``, which costs under emulation.
"""

from __future__ import annotations

import logging
import sys

PROGRAM = "vmready-agent"
PACKAGE = "vmready.agent"

logging.getLogger(PACKAGE).addHandler(logging.NullHandler())


def logger(name: str) -> logging.Logger:
    """The logger of the agent module ``name`` (its ``__name__``)."""
    return logging.getLogger(name)


class OneLineFormatter(logging.Formatter):
    """``vmready-agent: [warning: ]<message>``: one line, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message += f" ({type(error).__name__}: {error})"
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"{PROGRAM}: {level}{message}".replace("\n", " ")


def configure_logging(level: int = logging.INFO) -> None:
    """Every log message to stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
