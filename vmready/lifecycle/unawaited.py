"""Writes nobody waits for: how their failure is logged.

A store that refused a write (``StoreWriteFailed``: PostgreSQL restarting,
a full disk) or fenced it (``Fenced``: this daemon's lease was taken over)
is an expected fault, announced elsewhere: one line of warning; so is a
store closed under a write (``StoreClosed``: the daemon stops).  Anything
else is a bug, logged with its traceback.
"""

from __future__ import annotations

from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import Fenced
from vmready.store import StoreClosed, StoreWriteFailed


def log_failed_write(failure: Failure, log: Logger, what: str) -> None:
    """Log the failure of an unawaited write of ``what``: one line if the store refused it."""
    if failure.check(StoreWriteFailed, Fenced, StoreClosed):
        log.warn("writing {what} failed: {error}", what=what, error=failure.getErrorMessage())
    else:
        log.failure("writing {what}", failure, what=what)
