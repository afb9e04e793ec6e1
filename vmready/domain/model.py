"""Records and errors shared by the store, the lifecycle, the API and the CLI."""

from __future__ import annotations

from typing import Any

import attrs

from vmready.domain.states import (
    READY_KEY,
    OperatorStatus,
    PowerState,
    Status,
    TaskState,
    VMState,
    action_word,
    derive_status,
    describe_state,
    display_status,
    operator_status,
)

DEFAULT_MEMORY_MIB = 256
DEFAULT_CPUS = 1


class VMReadyError(Exception):
    """An error a user sees: an HTTP status and one clear message."""

    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(VMReadyError):
    """The request is malformed or names an invalid value."""

    http_status = 400


class NotFound(VMReadyError):
    """No such instance, action or operation."""

    http_status = 404


class Conflict(VMReadyError):
    """The action cannot run now (another task, or the wrong vm_state)."""

    http_status = 409


class Forbidden(VMReadyError):
    """The caller may not see this (an unknown certificate, or a key outside user.*)."""

    http_status = 403


class PayloadTooLarge(VMReadyError):
    """The request body is over the documented cap."""

    http_status = 413


class Unavailable(VMReadyError):
    """What the request needs cannot be reached now (a cluster member whose lease ran out)."""

    http_status = 503


class BadGateway(VMReadyError):
    """The cluster member a request was forwarded to failed to answer it."""

    http_status = 502


class LoopDetected(VMReadyError):
    """A request already forwarded by a cluster member would have to be forwarded again."""

    http_status = 508


class HypervisorError(VMReadyError):
    """The hypervisor refused or failed; the message carries its own words."""

    http_status = 500


class StoreError(Exception):
    """The store cannot be opened or used (not a user error: the daemon must not start)."""


def task_conflict(
    action: str, name: str, task_state: TaskState | None, vm_state: VMState
) -> Conflict:
    """The 409 for an action that lost the race or is not allowed in the current state.

    In the operator's words, not the stored fields': ``Cannot start instance
    web1: it is running``, ``…: it is stopping (a stop is in progress)``.
    """
    return Conflict(
        f"Cannot {action_word(action)} instance {name}: "
        f"it is {describe_state(vm_state, task_state)}"
    )


@attrs.frozen
class InstanceRecord:
    """One instance row as stored."""

    name: str
    uuid: str
    vm_state: VMState
    task_state: TaskState | None
    power_state: PowerState
    config: dict[str, str]
    devices: dict[str, dict[str, str]]
    created_at: float
    updated_at: float
    error: str | None = None
    # The cluster member whose host runs it ("" on a single host: the store's only daemon).
    member: str = ""

    @property
    def ready(self) -> bool:
        """Whether the workload declared Ready (and the daemon has not cleared it)."""
        return self.config.get(READY_KEY) == "true"

    @property
    def status(self) -> Status:
        """The derived LXD status."""
        return derive_status(self.vm_state, self.task_state, self.power_state, self.ready)

    @property
    def operator_status(self) -> OperatorStatus:
        """The one status an operator reads (the task in progress, else the resting state)."""
        return operator_status(self.vm_state, self.task_state, self.power_state, self.ready)

    @property
    def display_status(self) -> str:
        """The derived Nova-style display status."""
        return display_status(self.vm_state, self.task_state)

    @property
    def memory_mib(self) -> int:
        """limits.memory in MiB."""
        return int(self.config.get("limits.memory", DEFAULT_MEMORY_MIB))

    @property
    def cpus(self) -> int:
        """limits.cpu."""
        return int(self.config.get("limits.cpu", DEFAULT_CPUS))


@attrs.frozen
class ActionStep:
    """One step of an action (Nova's instance action event)."""

    name: str
    started_at: float
    finished_at: float | None
    result: str | None
    error: str | None


@attrs.frozen
class ActionRecord:
    """One action on an instance, with its steps (Nova's instance action)."""

    id: int
    instance: str
    action: str
    request_id: str
    started_at: float
    finished_at: float | None
    result: str | None
    error: str | None
    steps: tuple[ActionStep, ...]

    def to_json(self) -> dict[str, Any]:
        """The API representation."""
        return attrs.asdict(self, recurse=True)
