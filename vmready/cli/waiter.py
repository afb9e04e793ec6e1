"""``vmready wait``: subscribe to lifecycle events, check the instance once, wake on the event."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from vmready.cli.client import APIError, Client, LineStream, get_instance, instance_path
from vmready.cli.errors import (
    EXIT_FAILED,
    EXIT_GONE,
    EXIT_OK,
    CommandError,
    UsageError,
)

# Statuses ``wait`` understands; "running" is also met by Ready (Ready counts as running).
WAIT_STATUSES = (
    "running",
    "ready",
    "stopped",
    "frozen",
    "error",
    "starting",
    "stopping",
    "freezing",
)
AGENT_CONDITION = "agent"
# How the timer settles a wait internally (exit status 1, with its own message).
_TIMED_OUT = -1
_SATISFIES = {
    "running": frozenset({"running", "ready"}),
    AGENT_CONDITION: frozenset({"connected"}),
}


def parse_condition(condition: str) -> str:
    """``wait``'s CONDITION: the status to wait for, or AGENT_CONDITION; UsageError if unknown."""
    if condition.strip().lower() == "agent":
        return AGENT_CONDITION
    key, sep, value = condition.partition("=")
    if not sep or key.strip().lower() != "status":
        raise UsageError(f"unknown condition {condition!r}: expected status=<status> or agent")
    status = value.strip().lower()
    if status not in WAIT_STATUSES:
        raise UsageError(
            f"unknown status {value.strip()!r} in {condition!r}: "
            f"expected one of {', '.join(WAIT_STATUSES)}"
        )
    return status


class Waiter:
    """``wait``: subscribe to lifecycle events, check the instance once, wake on the event."""

    def __init__(self, client: Client, name: str, status: str) -> None:
        self.client = client
        self.name = name
        self.status = status
        self.wanted = _SATISFIES.get(status, frozenset({status}))
        self.last_status: str | None = None
        self.saw_event = False
        self.outcome: Deferred[tuple[int, str | None]] = Deferred()
        self._stream: LineStream | None = None
        self._source = instance_path(name)

    async def subscribe(self) -> None:
        """Open the event stream; when this returns, the daemon has subscribed us."""
        self._stream = await self.client.events(["lifecycle"], self._event)
        self._stream.ended.addCallback(self._stream_ended)

    def close(self) -> None:
        """Stop listening."""
        if self._stream is not None:
            self._stream.close()

    async def wait(self, timeout: float | None) -> str:
        """Check the current status, then wait for the event; the line saying it was met.

        CommandError when it is not (timed out, deleted, gone to Error, …).
        """
        try:
            instance = await get_instance(self.client, self.name)
        except APIError as e:
            # Unknown instance or a daemon error; unless an event already decided.
            if not self.outcome.called:
                raise CommandError(f"Error: {e.error}", EXIT_FAILED) from None
        else:
            if self.status == AGENT_CONDITION:
                status = str((instance.get("agent") or {}).get("status", "unknown")).lower()
                if instance.get("status") == "Error":
                    status = "error"
            else:
                status = str(instance["status"]).lower()
            # A match is a match; anything else only counts when no event overtook the
            # answer (then it may be older than what the events said).
            if status in self.wanted or not self.saw_event:
                self._observe(status, str(instance.get("error") or "") or None)
        timer: IDelayedCall | None = None
        if timeout is not None and not self.outcome.called:
            timer = self.client.reactor.callLater(timeout, self._settle, _TIMED_OUT, None)
        try:
            code, message = await self.outcome
        finally:
            if timer is not None and timer.active():
                timer.cancel()
        if code == _TIMED_OUT:
            now = (self.last_status or "unknown").upper()
            if self.status == AGENT_CONDITION:
                raise CommandError(
                    f"timed out after {timeout:g}s waiting for the agent of {self.name} "
                    f"to connect (agent: {now})",
                    EXIT_FAILED,
                )
            raise CommandError(
                f"timed out after {timeout:g}s waiting for {self.name} status={self.status} "
                f"(status: {now})",
                EXIT_FAILED,
            )
        if code != EXIT_OK:
            raise CommandError(message or "wait failed", code)
        if self.status == AGENT_CONDITION:
            return f"{self.name}: agent {self.met.upper()}"
        return f"{self.name}: {self.met.upper()}"

    @property
    def met(self) -> str:
        """The status (or agent status) that met the condition."""
        if self.status == AGENT_CONDITION:
            return self.last_status or "connected"
        return self.last_status or self.status

    def result(self, condition: str) -> dict[str, str]:
        """What ``wait`` prints in the json, yaml and csv formats once the condition is met."""
        return {"name": self.name, "condition": condition, "met": self.met}

    def _event(self, event: dict[str, Any]) -> None:
        metadata = event.get("metadata") or {}
        if metadata.get("source") != self._source:
            return
        context = metadata.get("context") or {}
        action = metadata.get("action")
        self.saw_event = True
        if self.status == AGENT_CONDITION and action not in ("instance-deleted", "instance-error"):
            if str(action).startswith("instance-agent-") and context.get("status"):
                self._observe(str(context["status"]).lower(), None)
            return
        if action == "instance-deleted":
            self._observe("deleted", None)
        elif action == "instance-error":
            self._observe("error", str(context.get("error") or "") or None)
        elif action == "instance-ready":
            # The workload said Ready; while a task runs (a restart, say) that is about to be
            # undone, and the instance's status says so (Restarting, not Ready): ask for it.
            Deferred.fromCoroutine(self._current_status()).addCallback(self._observe_status)
        elif action == "instance-state" and context.get("status"):
            status = str(context["status"]).lower()
            if status == "error" and "error" not in self.wanted:
                # The state event does not carry the reason: ask for it, once.
                self.last_status = status
                Deferred.fromCoroutine(self._error_reason()).addCallback(
                    lambda reason: self._observe("error", reason)
                )
            else:
                self._observe(status, None)

    async def _current_status(self) -> tuple[str, str | None] | None:
        """The instance's status and error now (None: it cannot be read; events decide)."""
        try:
            instance = await get_instance(self.client, self.name)
        except CommandError:  # an APIError too
            return None
        return str(instance["status"]).lower(), str(instance.get("error") or "") or None

    def _observe_status(self, found: tuple[str, str | None] | None) -> None:
        if found is not None:
            self._observe(*found)

    async def _error_reason(self) -> str | None:
        try:
            instance = await get_instance(self.client, self.name)
        except CommandError:
            return None
        return str(instance.get("error") or "") or None

    def _observe(self, status: str, error: str | None) -> None:
        self.last_status = status
        if status in self.wanted:
            self._settle(EXIT_OK, None)
        elif status == "deleted":
            self._settle(EXIT_GONE, f"instance {self.name} was deleted while waiting")
        elif status == "error":
            reason = f": {error}" if error else ""
            self._settle(EXIT_GONE, f"instance {self.name} went to ERROR while waiting{reason}")

    def _stream_ended(self, why: str | None) -> None:
        if why is not None:
            self._settle(EXIT_FAILED, why)

    def _settle(self, code: int, message: str | None) -> None:
        if not self.outcome.called:
            self.outcome.callback((code, message))
