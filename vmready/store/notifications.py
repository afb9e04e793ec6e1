"""PostgreSQL's LISTEN/NOTIFY, heard on a thread of its own and delivered on the reactor.

Members sharing one PostgreSQL store tell each other what changed through it:
triggers (``store.pgschema``) notify a changed instance row, member or trusted
certificate, and ``Members.publish_event`` a lifecycle event; PostgreSQL sends
a notification only when its transaction commits.  ``NotificationListener``
LISTENs on its own autocommit connection (with ``connection_string``'s
keepalives: an idle listener would never learn of a dead server) and hands
each notification to ``deliver`` on the reactor thread.  A lost connection
loses what was sent meanwhile: the listener reconnects, LISTENs again and only
then calls ``resync()``, for its owner to read again what it missed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorFromThreads

from vmready.domain import StoreError
from vmready.store.postgres import connection_string, one_line

INSTANCES_CHANNEL = "vmready_instances"
EVENTS_CHANNEL = "vmready_events"
# A member joined, came back, moved, or gave its lease up (not each plain renewal).
MEMBERS_CHANNEL = "vmready_members"
# A client certificate was trusted (a token redeemed) or removed: {"op", "fingerprint"}.
TRUST_CHANNEL = "vmready_trust"
# PostgreSQL refuses a NOTIFY payload of 8000 bytes or more; keep clear of it.
MAX_PAYLOAD_BYTES = 7900

# How often the waiting thread looks up to see whether it should stop.
_POLL = 0.2
# The pauses between reconnection tries: from the first, doubling, up to the last.
_FIRST_PAUSE = 0.1
_LONGEST_PAUSE = 5.0


class NotificationListener:
    """LISTEN on ``channels``; each notification to ``deliver(channel, payload)``, on the reactor.

    ``location`` is the store's ``postgresql://`` URL.  ``resync()`` is called
    (on the reactor) after a lost connection is back, LISTEN in effect again.
    """

    def __init__(
        self,
        reactor: IReactorFromThreads,
        location: str,
        channels: Sequence[str],
        deliver: Callable[[str, str], None],
        resync: Callable[[], None],
    ) -> None:
        self._reactor = reactor
        # The store's URL with vmready's defaults (keepalives: a dead peer is noticed).
        self._conninfo = connection_string(location, application_name="vmready-listener")
        self._channels = tuple(channels)
        self._deliver = deliver
        self._resync = resync
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._started: Deferred[None] | None = None
        self._stopped: list[Deferred[None]] = []
        self._done = False
        # How many times the connection was lost and made again (for tests, figures).
        self.reconnects = 0

    def start(self) -> Deferred[None]:
        """Connect and LISTEN; fires once LISTEN is in effect (StoreError if it cannot be)."""
        if self._thread is not None:
            raise RuntimeError("the listener was started already")
        self._started = Deferred()
        self._thread = threading.Thread(
            target=self._run, name="vmready-store-listener", daemon=True
        )
        self._thread.start()
        return self._started

    def stop(self) -> Deferred[None]:
        """Stop listening; fires once the thread has ended and its connection is closed."""
        if self._thread is None or self._done:
            return succeed(None)
        self._stopping.set()
        stopped: Deferred[None] = Deferred()
        self._stopped.append(stopped)
        return stopped

    # On the listener's thread:

    def _run(self) -> None:
        try:
            connection = self._connect()
        except psycopg.Error as e:
            self._reactor.callFromThread(
                self._start_failed, StoreError(f"cannot listen for notifications: {one_line(e)}")
            )
            self._reactor.callFromThread(self._finished)
            return
        self._reactor.callFromThread(self._start_succeeded)
        current: psycopg.Connection[Any] | None = connection
        while current is not None:
            try:
                self._listen(current)
            except psycopg.Error:
                pass  # lost: reconnect below
            finally:
                current.close()
            current = self._reconnect()
            if current is not None:
                self.reconnects += 1
                self._reactor.callFromThread(self._resync)
        self._reactor.callFromThread(self._finished)

    def _connect(self) -> psycopg.Connection[Any]:
        connection = psycopg.connect(self._conninfo, autocommit=True)
        try:
            for channel in self._channels:
                connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            connection.close()
            raise
        return connection

    def _listen(self, connection: psycopg.Connection[Any]) -> None:
        """Hand on notifications until told to stop (returns) or the connection is lost."""
        while not self._stopping.is_set():
            for notify in connection.notifies(timeout=_POLL):
                self._reactor.callFromThread(self._deliver, notify.channel, notify.payload)

    def _reconnect(self) -> psycopg.Connection[Any] | None:
        """A new connection, LISTEN in effect; None once told to stop."""
        pause = _FIRST_PAUSE
        while not self._stopping.is_set():
            try:
                return self._connect()
            except psycopg.Error:
                self._stopping.wait(pause)
                pause = min(pause * 2, _LONGEST_PAUSE)
        return None

    # On the reactor thread:

    def _start_succeeded(self) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started.callback(None)

    def _start_failed(self, error: StoreError) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started.errback(error)

    def _finished(self) -> None:
        self._done = True
        stopped, self._stopped = self._stopped, []
        for waiting in stopped:
            waiting.callback(None)
