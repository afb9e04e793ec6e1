"""Listeners: each told of every event in order; one that fails is logged, the rest still told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from twisted.internet.defer import maybeDeferred
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

T = TypeVar("T")
# A listener may answer with a Deferred: its failure is logged too.
Listener = Callable[[T], object]


class Listeners(Generic[T]):
    """The listeners of one source of ``T`` events.

    ``failed`` is the twisted.logger format logged (on ``log``, with the
    fields ``notify`` is given) when a listener raises or its Deferred fails.
    """

    def __init__(self, log: Logger, failed: str) -> None:
        self._log = log
        self._failed = failed
        self._listeners: list[Listener[T]] = []

    def subscribe(self, listener: Listener[T], first: bool = False) -> Callable[[], None]:
        """Tell ``listener`` of every later event (``first``: before those already here);
        returns the unsubscriber, harmless to call twice."""
        if first:
            self._listeners.insert(0, listener)
        else:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def notify(self, event: T, /, **fields: object) -> None:
        """Call each listener subscribed now with ``event``; ``fields`` go into a failure's log."""
        for listener in list(self._listeners):
            maybeDeferred(listener, event).addErrback(self._log_failure, fields)

    def _log_failure(self, failure: Failure, fields: dict[str, object]) -> None:
        self._log.failure(self._failed, failure, LogLevel.critical, **fields)
