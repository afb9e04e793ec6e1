"""The operator API: LXD-shaped REST over the lifecycle, served by Klein.

Every response uses LXD's envelope.  Synchronous answers are
``{"type": "sync", "status": "Success", "status_code": 200, …, "metadata": …}``;
actions answer 202 with ``{"type": "async", "operation": "/1.0/operations/<id>", …}``
and a ``Location`` header; errors are ``{"type": "error", "error": …, "error_code": …}``
with the same HTTP status.  Request bodies are JSON objects of at most
``MAX_BODY_BYTES`` (1 MiB); larger ones get 413.

Routes:

- ``GET /``, ``GET /1.0`` — API versions, server information (hypervisor kind).
- ``GET /1.0/instances`` (``?recursion=1`` for objects), ``POST /1.0/instances``.
- ``GET``/``PATCH``/``DELETE /1.0/instances/<name>``.
- ``GET``/``PUT /1.0/instances/<name>/state`` — start, stop, restart, freeze, unfreeze.
- ``POST /1.0/instances/<name>/actions/<rebuild|resize|confirm-resize|revert-resize>``.
- ``GET /1.0/instances/<name>/actions`` — the action history.
- ``GET /1.0/instances/<name>/console`` — the guest's serial console log, raw bytes.
- ``GET /1.0/events?type=lifecycle,operation`` — newline-delimited JSON, kept open.
- ``GET /1.0/operations``, ``GET /1.0/operations/<id>``, ``GET /1.0/operations/<id>/wait``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any, cast

from klein import Klein
from twisted.internet.defer import Deferred, race
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from zope.interface import implementer

import vmready
from vmready.agentlink.transport import TRANSPORT_KEY
from vmready.api.web import ErrorStyle, handle_error, json_response, sync_response
from vmready.domain.model import (
    BadRequest,
    InstanceRecord,
    NotFound,
    PayloadTooLarge,
)
from vmready.domain.states import StatusCode, VMState
from vmready.hypervisor.accel import ACCEL_KEY, ACCEL_REASON_KEY, CURRENT_ACCEL_KEY
from vmready.hypervisor.bootsource import BootSource
from vmready.hypervisor.cmdline import SERIAL_LAYOUTS
from vmready.lifecycle.core import LAYOUT_KEY, Lifecycle
from vmready.lifecycle.events import EVENT_TYPES, Event
from vmready.lifecycle.operations import Operation
from vmready.protocols.ringbuffer import AgentStatus

__all__ = ["MAX_BODY_BYTES", "OperatorAPI", "instance_json", "rfc3339", "state_json"]

# The documented cap on request bodies (413 above it).
MAX_BODY_BYTES = 1024 * 1024
# How much of a console log GET /1.0/instances/<name>/console returns at most.
MAX_CONSOLE_BYTES = 4 * 1024 * 1024

STATE_ACTIONS = ("start", "stop", "restart", "freeze", "unfreeze")
INSTANCE_ACTIONS = ("rebuild", "resize", "confirm-resize", "revert-resize")
# LXD's "timeout": -1 means "the daemon's default".
_DEFAULT_TIMEOUT = -1
_ERROR_CODE_DEFAULT = 500
# vm_states with a VM whose size PATCH must not change behind its back.
_LIVE_STATES = frozenset({VMState.ACTIVE, VMState.PAUSED, VMState.RESIZED})


def rfc3339(timestamp: float) -> str:
    """A Unix timestamp as LXD writes times: RFC 3339 in UTC."""
    stamp = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return stamp.isoformat().replace("+00:00", "Z")


def instance_url(name: str) -> str:
    """The API path of an instance."""
    return f"/1.0/instances/{name}"


def operation_url(operation: Operation) -> str:
    """The API path of an operation."""
    return f"/1.0/operations/{operation.id}"


def state_json(record: InstanceRecord, agent: AgentStatus = AgentStatus.UNKNOWN) -> dict[str, Any]:
    """``/1.0/instances/<name>/state``: the derived status beside the three stored fields."""
    status = record.status
    return {
        "status": status.name,
        "status_code": int(status.code),
        "display_status": record.display_status,
        "vm_state": record.vm_state.value,
        "task_state": record.task_state.value if record.task_state is not None else None,
        "power_state": record.power_state.value,
        "ready": record.ready,
        "agent": {"status": agent.value},
        "memory": {"total": record.memory_mib * 1024 * 1024, "total_mib": record.memory_mib},
        "cpu": {"count": record.cpus},
    }


def snapshot_json(snapshot: dict[str, Any]) -> dict[str, Any]:
    """One snapshot as the API shows it."""
    metadata = snapshot["metadata"]
    return {
        "name": snapshot["name"],
        "stateful": snapshot["stateful"],
        "created_at": rfc3339(snapshot["created_at"]),
        "serial_layout": metadata.get("layout"),
        "device_set": metadata.get("device_set"),
        "config": metadata.get("config", {}),
    }


def instance_json(
    record: InstanceRecord, agent: AgentStatus = AgentStatus.UNKNOWN
) -> dict[str, Any]:
    """``/1.0/instances/<name>``: LXD's instance object plus vmready's state fields."""
    status = record.status
    return {
        "name": record.name,
        "uuid": record.uuid,
        "type": "virtual-machine",
        "location": "none",
        "project": "default",
        "status": status.name,
        "status_code": int(status.code),
        "display_status": record.display_status,
        "vm_state": record.vm_state.value,
        "task_state": record.task_state.value if record.task_state is not None else None,
        "power_state": record.power_state.value,
        "error": record.error or "",
        "agent": {"status": agent.value},
        "serial_layout": _layout_json(record),
        "boot": boot_json(record),
        "config": dict(record.config),
        "devices": {name: dict(device) for name, device in record.devices.items()},
        "limits": {"memory_mib": record.memory_mib, "cpus": record.cpus},
        "created_at": rfc3339(record.created_at),
        "last_used_at": rfc3339(record.updated_at),
        "updated_at": rfc3339(record.updated_at),
    }


def boot_json(record: InstanceRecord) -> dict[str, Any]:
    """What the instance boots, under which accelerator, and how its agent reaches the host."""
    source = BootSource.from_config(record.config)
    return {
        "source": source.describe(),
        "image": source.image,
        "kernel": source.kernel,
        "initrd": source.initrd,
        "append": source.append,
        "accel": {
            "requested": record.config.get(ACCEL_KEY, "auto"),
            "current": record.config.get(CURRENT_ACCEL_KEY),
            "reason": record.config.get(ACCEL_REASON_KEY),
        },
        "transport": record.config.get(TRANSPORT_KEY),
    }


def _layout_json(record: InstanceRecord) -> dict[str, str] | None:
    """The serial layout the instance's VM was last started with (None: never started)."""
    name = record.config.get(LAYOUT_KEY)
    if name is None:
        return None
    layout = SERIAL_LAYOUTS.get(name)
    return {"name": name, "description": layout.description if layout else "unknown"}


def _async(request: IRequest, operation: Operation) -> bytes:
    """LXD's asynchronous envelope: 202, the operation, and a Location header."""
    url = operation_url(operation)
    request.setHeader(b"Location", url.encode("utf-8"))
    return json_response(
        request,
        202,
        {
            "type": "async",
            "status": "Operation created",
            "status_code": int(StatusCode.OPERATION_CREATED),
            "operation": url,
            "error_code": 0,
            "error": "",
            "metadata": operation.to_json(),
        },
    )


def _error_envelope(code: int, message: str) -> dict[str, Any]:
    """LXD's error envelope."""
    return {"type": "error", "error": message, "error_code": code}


def _error(request: IRequest, code: int, message: str) -> bytes:
    """An error answered outside the error handler (a stream that cannot start, say)."""
    return json_response(request, code, _error_envelope(code, message))


OPERATOR_ERRORS = ErrorStyle(
    envelope=_error_envelope,
    method_not_allowed=lambda method: "method not allowed",
    internal="internal error",
    label="",
)


def read_json_body(request: IRequest, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, read at most ``limit`` bytes (413 beyond it)."""
    too_large = PayloadTooLarge(f"Request body too large (limit {limit} bytes)")
    declared = request.getHeader(b"Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large
    content = request.content
    if content is None:
        raw = b""
    else:
        content.seek(0)
        raw = content.read(limit + 1)
    if len(raw) > limit:
        raise too_large
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"Invalid request body: {e}") from None
    except RecursionError:
        raise BadRequest("Invalid request body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"Invalid request body: expected a JSON object, got {_kind(body)}")
    return body


def _not_json(constant: str) -> Any:
    """Python's json accepts NaN and Infinity; JSON does not."""
    raise ValueError(f"{constant} is not valid JSON")


def _kind(value: Any) -> str:
    """How a JSON value is called in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``body[name]`` if present and of ``kind``; a 400 naming the field otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise BadRequest(f"Invalid field {name!r}: expected {what}, got {_kind(value)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _query(request: IRequest, name: str) -> str | None:
    """One query parameter as text, or None."""
    values = request.args.get(name.encode("ascii"))
    if not values:
        return None
    value: bytes = values[-1]
    return value.decode("utf-8", errors="replace")


def _recursion(request: IRequest) -> int:
    """``?recursion=N`` (0 when absent)."""
    raw = _query(request, "recursion")
    if raw is None or raw == "":
        return 0
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"Invalid recursion {raw!r}: expected 0 or 1") from None


def _seconds(raw: str | None, name: str) -> float | None:
    """A query parameter in seconds; None when absent or -1 (LXD's "no limit")."""
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds") from None
    if not math.isfinite(seconds):
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds")
    if seconds == _DEFAULT_TIMEOUT:
        return None
    if seconds < 0:
        raise BadRequest(f"Invalid {name} {raw!r}: expected seconds (0 or more, or -1)")
    return seconds


def _event_types(raw: str | None) -> frozenset[str] | None:
    """``?type=lifecycle,operation``: the set asked for, or None for every type."""
    if raw is None or not raw.strip():
        return None
    wanted = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = sorted(wanted - EVENT_TYPES)
    if unknown:
        raise BadRequest(
            f"Invalid event type {unknown[0]!r}: expected {', '.join(sorted(EVENT_TYPES))}"
        )
    return wanted


@implementer(IPushProducer)
class EventStream:
    """Feeds one ``/1.0/events`` client; one that stops reading is cut off, not buffered.

    The transport pauses us when its buffer is full.  Events that arrive while
    paused are still written (so none is silently skipped), but past
    ``MAX_PAUSED_BYTES`` of them the stream is closed: the client reconnects
    and re-reads state, and the daemon's memory stays bounded.
    """

    MAX_PAUSED_BYTES = 4 * 1024 * 1024
    log = Logger()

    def __init__(self, request: http.Request) -> None:
        self.request = request
        self.paused = False
        self.paused_bytes = 0
        self.closed = False

    def pauseProducing(self) -> None:
        """The client's buffer is full."""
        self.paused = True

    def resumeProducing(self) -> None:
        """The client caught up."""
        self.paused = False
        self.paused_bytes = 0

    def stopProducing(self) -> None:
        """The connection is going away."""
        self.closed = True

    def deliver(self, event: Event) -> None:
        """Write one event as a JSON line, or end a stream whose reader fell too far behind."""
        if self.closed:
            return
        line = json.dumps(event.to_json()).encode("utf-8") + b"\n"
        if self.paused:
            self.paused_bytes += len(line)
            if self.paused_bytes > self.MAX_PAUSED_BYTES:
                self.closed = True
                self.log.warn("closing an event stream whose reader stopped reading")
                self.request.loseConnection()
                return
        self.request.write(line)


class OperatorAPI:
    """The operator API over one ``Lifecycle``; serve ``OperatorAPI(...).app.resource()``."""

    app = Klein()
    log = Logger()

    def __init__(self, lifecycle: Lifecycle, hypervisor: str) -> None:
        self.lifecycle = lifecycle
        self.hypervisor = hypervisor

    # -- errors: the one place an exception becomes a response ------------

    def _instance_json(self, record: InstanceRecord) -> dict[str, Any]:
        return instance_json(record, self.lifecycle.agent_status(record.name))

    @app.handle_errors(Exception)
    def _handle_error(self, request: IRequest, failure: Failure) -> bytes:
        """Errors as the operator API words them (``vmready.api.web.handle_error``)."""
        return handle_error(request, failure, OPERATOR_ERRORS, self.log)

    # -- server -----------------------------------------------------------

    @app.route("/", methods=["GET"])
    def root(self, request: IRequest) -> bytes:
        """The API versions this server speaks."""
        return sync_response(request, ["/1.0"])

    @app.route("/1.0", methods=["GET"])
    def server(self, request: IRequest) -> bytes:
        """Server information: API version and the hypervisor in use."""
        return sync_response(
            request,
            {
                "api_version": "1.0",
                "api_status": "stable",
                "api_extensions": [],
                "auth": "trusted",
                "public": False,
                "environment": {
                    "server": "vmready",
                    "server_version": vmready.__version__,
                    "server_pid": os.getpid(),
                    "hypervisor": self.hypervisor,
                    "driver": self.hypervisor,
                    "instance_types": ["virtual-machine"],
                },
            },
        )

    # -- instances --------------------------------------------------------

    @app.route("/1.0/instances", methods=["GET"])
    def list_instances(self, request: IRequest) -> bytes:
        """Every instance, as URLs or (``recursion=1``) objects."""
        records = sorted(self.lifecycle.list(), key=lambda record: record.name)
        if _recursion(request) >= 1:
            return sync_response(request, [self._instance_json(record) for record in records])
        return sync_response(request, [instance_url(record.name) for record in records])

    @app.route("/1.0/instances", methods=["POST"])
    async def create_instance(self, request: IRequest) -> bytes:
        """Create and boot an instance; answers with its operation."""
        body = read_json_body(request)
        name = _field(body, "name", str, "a string")
        if name is None:
            raise BadRequest("Invalid field 'name': an instance name is required")
        config = _field(body, "config", dict, "an object") or {}
        kind = _field(body, "type", str, "a string")
        if kind not in (None, "", "virtual-machine"):
            raise BadRequest(
                f"Invalid field 'type': only 'virtual-machine' is supported, not {kind!r}"
            )
        return _async(request, await self.lifecycle.create(name, config))

    @app.route("/1.0/instances/<name>", methods=["GET"])
    def get_instance(self, request: IRequest, name: str) -> bytes:
        """One instance."""
        return sync_response(request, self._instance_json(self.lifecycle.get(name)))

    @app.route("/1.0/instances/<name>", methods=["PATCH"])
    def patch_instance(self, request: IRequest, name: str) -> bytes:
        """Set user-settable config keys (``null`` removes one); answers with the instance."""
        body = read_json_body(request)
        config = _field(body, "config", dict, "an object")
        if config is None:
            raise BadRequest("Invalid field 'config': an object of keys to set is required")
        return sync_response(
            request, self._instance_json(self.lifecycle.update_config(name, config))
        )

    @app.route("/1.0/instances/<name>", methods=["PUT"])
    def put_instance(self, request: IRequest, name: str) -> bytes:
        """LXD's restore: ``{"restore": SNAP, "stateful": bool, "force": bool}``."""
        body = read_json_body(request)
        unexpected = sorted(set(body) - {"restore", "stateful", "force"})
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: expected restore, stateful, force")
        snapshot = _field(body, "restore", str, "a snapshot name")
        if snapshot is None:
            raise BadRequest("Invalid field 'restore': the name of a snapshot is required")
        params = {"snapshot": snapshot}
        for flag in ("stateful", "force"):
            value = _field(body, flag, bool, "true or false")
            if value is not None:
                params[flag] = value
        self.lifecycle.get(name)
        return _async(request, self.lifecycle.act(name, "restore", **params))

    @app.route("/1.0/instances/<name>/snapshots", methods=["GET"])
    def list_snapshots(self, request: IRequest, name: str) -> bytes:
        """The instance's snapshots, oldest first."""
        return sync_response(
            request,
            [
                snapshot_json(snapshot)
                for snapshot in self.lifecycle.state.store.list_snapshots(name)
            ],
        )

    @app.route("/1.0/instances/<name>/snapshots", methods=["POST"])
    def create_snapshot(self, request: IRequest, name: str) -> bytes:
        """Take a snapshot: ``{"name": SNAP, "stateful": bool}``."""
        body = read_json_body(request)
        unexpected = sorted(set(body) - {"name", "stateful"})
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: expected name, stateful")
        snapshot = _field(body, "name", str, "a snapshot name")
        if snapshot is None:
            raise BadRequest("Invalid field 'name': the snapshot's name is required")
        params: dict[str, Any] = {"snapshot": snapshot}
        stateful = _field(body, "stateful", bool, "true or false")
        if stateful is not None:
            params["stateful"] = stateful
        self.lifecycle.get(name)
        return _async(request, self.lifecycle.act(name, "snapshot", **params))

    @app.route("/1.0/instances/<name>", methods=["DELETE"])
    def delete_instance(self, request: IRequest, name: str) -> bytes:
        """Delete an instance (its VM is stopped first); answers with the operation."""
        self.lifecycle.get(name)
        return _async(request, self.lifecycle.act(name, "delete"))

    @app.route("/1.0/instances/<name>/state", methods=["GET"])
    def get_state(self, request: IRequest, name: str) -> bytes:
        """The instance's status and the three fields it is derived from."""
        return sync_response(
            request, state_json(self.lifecycle.get(name), self.lifecycle.agent_status(name))
        )

    @app.route("/1.0/instances/<name>/state", methods=["PUT"])
    def put_state(self, request: IRequest, name: str) -> bytes:
        """start, stop, restart, freeze or unfreeze, with LXD's force and timeout."""
        body = read_json_body(request)
        action = _field(body, "action", str, "a string")
        if action not in STATE_ACTIONS:
            raise BadRequest(
                f"Invalid field 'action': expected one of {', '.join(STATE_ACTIONS)}, "
                f"got {action!r}"
            )
        force = _field(body, "force", bool, "true or false")
        timeout = _field(body, "timeout", (int, float), "a number of seconds")
        self.lifecycle.get(name)
        params: dict[str, Any] = {}
        if action in ("stop", "restart"):
            if force is not None:
                params["force"] = force
            if timeout is not None and timeout != _DEFAULT_TIMEOUT:
                params["timeout"] = timeout
        return _async(request, self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/actions/<action>", methods=["POST"])
    def run_action(self, request: IRequest, name: str, action: str) -> bytes:
        """rebuild, resize (``{"memory", "cpus"}``), confirm-resize, revert-resize."""
        if action not in INSTANCE_ACTIONS:
            raise NotFound(
                f"Unknown action {action!r}: expected one of {', '.join(INSTANCE_ACTIONS)}"
            )
        body = read_json_body(request)
        allowed = ("memory", "cpus") if action == "resize" else ()
        unexpected = sorted(set(body) - set(allowed))
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: {action} takes no such parameter")
        params: dict[str, Any] = {}
        for key in allowed:
            value = _field(body, key, (str, int), "a number or a string")
            if value is not None:
                params[key] = value
        self.lifecycle.get(name)
        return _async(request, self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/console", methods=["GET"])
    def get_console(self, request: IRequest, name: str) -> bytes:
        """The guest's serial console log (the last ``MAX_CONSOLE_BYTES``), as raw bytes."""
        log = self.lifecycle.console_log(name, MAX_CONSOLE_BYTES)
        request.setHeader(b"Content-Type", b"application/octet-stream")
        return log

    @app.route("/1.0/instances/<name>/actions", methods=["GET"])
    def list_actions(self, request: IRequest, name: str) -> bytes:
        """The instance's action history (kept after delete), newest first, with steps."""
        actions = self.lifecycle.state.store.list_actions(name)
        if not actions:
            self.lifecycle.get(name)
        return sync_response(request, [action.to_json() for action in actions])

    # -- events -----------------------------------------------------------

    @app.route("/1.0/events", methods=["GET"])
    def events(self, request: IRequest) -> Deferred[None]:
        """Newline-delimited JSON events until the client goes away."""
        types = _event_types(_query(request, "type"))
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/x-ndjson")

        # Klein hands us twisted.web's Request, which is also the connection's consumer.
        web_request = cast(http.Request, request)
        stream = EventStream(web_request)
        web_request.registerProducer(stream, True)
        unsubscribe = self.lifecycle.state.events.subscribe(stream.deliver, types)
        # Headers now: a client that saw them knows it is subscribed.
        request.write(b"")

        # Klein cancels this when the connection is lost; it never fires otherwise.
        return Deferred(lambda _: unsubscribe())

    # -- operations -------------------------------------------------------

    @app.route("/1.0/operations", methods=["GET"])
    def list_operations(self, request: IRequest) -> bytes:
        """Operations grouped by status, as URLs or (``recursion=1``) objects."""
        recursion = _recursion(request)
        grouped: dict[str, list[Any]] = {}
        for operation in sorted(
            self.lifecycle.state.operations.list(), key=lambda op: op.created_at
        ):
            item = operation.to_json()
            key = str(item["status"]).lower()
            grouped.setdefault(key, []).append(
                item if recursion >= 1 else operation_url(operation)
            )
        return sync_response(request, grouped)

    @app.route("/1.0/operations/<operation_id>", methods=["GET"])
    def get_operation(self, request: IRequest, operation_id: str) -> bytes:
        """One operation."""
        return sync_response(request, self.lifecycle.state.operations.get(operation_id).to_json())

    @app.route("/1.0/operations/<operation_id>/wait", methods=["GET"])
    async def wait_operation(self, request: IRequest, operation_id: str) -> bytes:
        """The operation once done, or as it is when ``?timeout=S`` runs out (-1: no limit)."""
        operation = self.lifecycle.state.operations.get(operation_id)
        timeout = _seconds(_query(request, "timeout"), "timeout")
        if not operation.done:
            done = operation.when_done()
            if timeout is None:
                await done
            else:
                await race(
                    [done, deferLater(self.lifecycle.state.clock, timeout, lambda: operation)]
                )
        return sync_response(request, operation.to_json())
