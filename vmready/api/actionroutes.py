"""The operator API's routes that act on an instance or read what it did.

- ``GET``/``PUT /1.0/instances/<name>/state`` — start, stop, restart, freeze,
  unfreeze, with LXD's ``force`` and ``timeout`` (``stateful`` only as false).
- ``POST /1.0/instances/<name>/actions/<rebuild|resize|confirm-resize|revert-resize>``.
- ``GET /1.0/instances/<name>/actions`` — the action history.
- ``GET /1.0/instances/<name>/console`` — the serial console log, raw bytes, as
  LXD answers it; ``GET …/logs`` and ``…/logs/console.log`` the same log as
  LXD's log files (what ``lxc info --show-log`` reads).
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from vmready.api.operatorbase import OperatorBase, async_response, forwardable, operator_app
from vmready.api.requestbody import DEFAULT_TIMEOUT, field, read_json_body
from vmready.api.views import instance_url, state_json
from vmready.api.web import sync_response
from vmready.domain import BadRequest, NotFound

# How much of a console log GET /1.0/instances/<name>/console returns at most.
MAX_CONSOLE_BYTES = 4 * 1024 * 1024
# The one log file ``/1.0/instances/<name>/logs`` lists: the serial console's.
CONSOLE_LOG_FILE = "console.log"
# The log LXD's ``lxc info --show-log`` asks a VM for: vmready answers the console's.
QEMU_LOG_FILE = "qemu.log"

STATE_ACTIONS = ("start", "stop", "restart", "freeze", "unfreeze")
INSTANCE_ACTIONS = ("rebuild", "resize", "confirm-resize", "revert-resize")


class ActionRoutes(OperatorBase):
    """``/1.0/instances/<name>/state``, ``…/actions``, ``…/console`` and ``…/logs``."""

    app = operator_app

    @app.route("/1.0/instances/<name>/state", methods=["GET"])
    @forwardable
    def get_state(self, request: IRequest, name: str) -> bytes:
        """The instance's status and the three fields it is derived from."""
        return sync_response(
            request,
            state_json(
                self.lifecycle.store.view.get_instance(name),
                self.lifecycle.running.agent_status(name),
            ),
        )

    @app.route("/1.0/instances/<name>/state", methods=["PUT"])
    @forwardable
    async def put_state(self, request: IRequest, name: str) -> bytes:
        """start, stop, restart, freeze or unfreeze, with LXD's force and timeout."""
        body = read_json_body(request)
        action = field(body, "action", str, "a string")
        if action not in STATE_ACTIONS:
            raise BadRequest(
                f"Invalid field 'action': expected one of {', '.join(STATE_ACTIONS)}, "
                f"got {action!r}"
            )
        force = field(body, "force", bool, "true or false")
        timeout = field(body, "timeout", (int, float), "a number of seconds")
        if field(body, "stateful", bool, "true or false"):
            raise BadRequest(
                "Invalid field 'stateful': stateful stops and starts are not supported by "
                "vmready (take a stateful snapshot instead)"
            )
        self.lifecycle.store.view.get_instance(name)
        params: dict[str, Any] = {}
        if action in ("stop", "restart"):
            if force is not None:
                params["force"] = force
            if timeout is not None and timeout != DEFAULT_TIMEOUT:
                params["timeout"] = timeout
        return async_response(request, await self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/actions/<action>", methods=["POST"])
    @forwardable
    async def run_action(self, request: IRequest, name: str, action: str) -> bytes:
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
            value = field(body, key, (str, int), "a number or a string")
            if value is not None:
                params[key] = value
        self.lifecycle.store.view.get_instance(name)
        return async_response(request, await self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/actions", methods=["GET"])
    @forwardable
    async def list_actions(self, request: IRequest, name: str) -> bytes:
        """The instance's action history (kept after delete), newest first, with steps."""
        actions = await self.lifecycle.store.actions.list_actions(name)
        if not actions:
            self.lifecycle.store.view.get_instance(name)
        return sync_response(request, [action.to_json() for action in actions])

    @app.route("/1.0/instances/<name>/console", methods=["GET"])
    @forwardable
    def get_console(self, request: IRequest, name: str) -> bytes:
        """The guest's serial console log (the last ``MAX_CONSOLE_BYTES``), as raw bytes."""
        return self._console_log(request, name)

    @app.route("/1.0/instances/<name>/logs", methods=["GET"])
    @forwardable
    def list_logs(self, request: IRequest, name: str) -> bytes:
        """The instance's log files, as LXD lists them: the console log only."""
        self.lifecycle.store.view.get_instance(name)
        return sync_response(request, [f"{instance_url(name)}/logs/{CONSOLE_LOG_FILE}"])

    @app.route("/1.0/instances/<name>/logs/<filename>", methods=["GET"])
    @forwardable
    def get_log(self, request: IRequest, name: str, filename: str) -> bytes:
        """A log file: ``console.log`` (and ``qemu.log``, which LXD's clients ask a VM for)."""
        if filename not in (CONSOLE_LOG_FILE, QEMU_LOG_FILE):
            self.lifecycle.store.view.get_instance(name)
            raise NotFound(
                f"Log file {filename!r} not found: instance {name} has {CONSOLE_LOG_FILE} only"
            )
        return self._console_log(request, name)

    def _console_log(self, request: IRequest, name: str) -> bytes:
        log = self.lifecycle.specs.console_log(
            self.lifecycle.store.view.get_instance(name), MAX_CONSOLE_BYTES
        )
        request.setHeader(b"Content-Type", b"application/octet-stream")
        return log
