"""Long-running actions as LXD operations: ``/1.0/operations/<id>`` and ``/wait``."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from vmready.domain import NotFound, StatusCode, VMReadyError
from vmready.lifecycle.events import OPERATION, EventBus, rfc3339

# Finished operations stay queryable this long (LXD keeps them for a while too).
RETAIN_SECONDS = 300.0


class Operation:
    """One background task the API handed back to its caller."""

    def __init__(self, description: str, instance: str, created_at: float) -> None:
        self.id = str(uuid.uuid4())
        self.description = description
        self.instance = instance
        self.created_at = created_at
        self.updated_at = created_at
        self.status = StatusCode.RUNNING
        self.error = ""
        # What the running task reports about itself (LXD's operation ``metadata``), or None.
        self.metadata: dict[str, Any] | None = None
        self._waiters: list[Deferred[Operation]] = []

    @property
    def done(self) -> bool:
        """Whether the operation finished (either way)."""
        return self.status is not StatusCode.RUNNING

    def when_done(self) -> Deferred[Operation]:
        """Fires with the operation once it finished."""
        if self.done:
            return succeed(self)
        waiter: Deferred[Operation] = Deferred()
        self._waiters.append(waiter)
        return waiter

    def finish(self, when: float, error: str | None) -> None:
        """Record the outcome and wake every waiter."""
        self.status = StatusCode.FAILURE if error else StatusCode.SUCCESS
        self.error = error or ""
        self.updated_at = when
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(self)

    def to_json(self) -> dict[str, Any]:
        """LXD's operation object (its times in RFC 3339, as LXD's clients parse them)."""
        return {
            "id": self.id,
            "class": "task",
            "description": self.description,
            "created_at": rfc3339(self.created_at),
            "updated_at": rfc3339(self.updated_at),
            "status": {
                StatusCode.RUNNING: "Running",
                StatusCode.SUCCESS: "Success",
                StatusCode.FAILURE: "Failure",
            }[self.status],
            "status_code": int(self.status),
            "resources": {"instances": [f"/1.0/instances/{self.instance}"]},
            "metadata": self.metadata,
            "may_cancel": False,
            "err": self.error,
            "location": "none",
        }


class Operations:
    """Creates, runs, finds and forgets operations."""

    log = Logger()

    def __init__(self, clock: IReactorTime, events: EventBus) -> None:
        self._clock = clock
        self._events = events
        self._operations: dict[str, Operation] = {}
        self._expiries: dict[str, IDelayedCall] = {}
        # Set once the daemon stops (``settle``).
        self.stopping = False

    def run(
        self,
        description: str,
        instance: str,
        work: Callable[[], Coroutine[Any, Any, None]],
    ) -> Operation:
        """Start ``work`` as an operation; its exception (if any) becomes the operation's error."""
        operation = Operation(description, instance, self._clock.seconds())
        self._operations[operation.id] = operation
        self._publish(operation)

        def finished(error: str | None) -> None:
            # Arm the expiry before waking waiters: they may shut everything down at once.
            self._expiries[operation.id] = self._clock.callLater(
                RETAIN_SECONDS, self._forget, operation.id
            )
            operation.finish(self._clock.seconds(), error)
            self._publish(operation)

        def failed(failure: Any) -> None:
            value = failure.value
            if isinstance(value, VMReadyError):
                finished(value.message)
            elif self.stopping:
                # Cut off by the daemon's stop (its store closed under it): not a bug.
                self.log.warn(
                    "operation {description} ended as the daemon stopped: {error}",
                    description=description,
                    error=value,
                )
                finished(f"the daemon stopped: {value}")
            else:
                self.log.failure(
                    "operation {description} failed", failure, description=description
                )
                finished(f"internal error: {value}")

        Deferred.fromCoroutine(work()).addCallbacks(lambda _: finished(None), failed)
        return operation

    def report(self, operation: Operation, metadata: dict[str, Any]) -> None:
        """The running task says where it is (a stop's grace period): stored, and an event."""
        if operation.done:
            return
        operation.metadata = metadata
        operation.updated_at = self._clock.seconds()
        self._publish(operation)

    def _forget(self, operation_id: str) -> None:
        self._operations.pop(operation_id, None)
        self._expiries.pop(operation_id, None)

    async def settle(self, bound: float) -> list[Operation]:
        """Daemon stopping: wait up to ``bound`` seconds for the running operations to end,
        before the store closes; the ones still running (they end as the stop cuts them off)."""
        self.stopping = True
        running = [operation for operation in self._operations.values() if not operation.done]
        if running:
            # Cancelled at ``bound``: each waiter ends cancelled, the list fires all the same.
            ending = DeferredList([op.when_done() for op in running], consumeErrors=True)
            await ending.addTimeout(bound, self._clock)
        cut = [operation for operation in running if not operation.done]
        for operation in cut:
            self.log.warn(
                "operation {description} still runs {bound:g}s after the daemon began to "
                "stop; stopping without it",
                description=operation.description,
                bound=bound,
            )
        return cut

    def stop(self) -> None:
        """Cancel the retention timers (daemon shutdown)."""
        for expiry in self._expiries.values():
            if expiry.active():
                expiry.cancel()
        self._expiries.clear()

    def get(self, operation_id: str) -> Operation:
        """The operation, or NotFound."""
        operation = self._operations.get(operation_id)
        if operation is None:
            raise NotFound(f"Operation {operation_id} not found")
        return operation

    def list(self) -> list[Operation]:
        """Every operation still remembered."""
        return list(self._operations.values())

    def _publish(self, operation: Operation) -> None:
        self._events.publish(OPERATION, operation.to_json())
