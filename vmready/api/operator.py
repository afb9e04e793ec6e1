"""The operator API: LXD-shaped REST over the lifecycle, served by Klein.

Every response uses LXD's envelope.  Synchronous answers are
``{"type": "sync", "status": "Success", "status_code": 200, …, "metadata": …}``;
actions answer 202 with ``{"type": "async", "operation": "/1.0/operations/<id>", …}``
and a ``Location`` header; errors are ``{"type": "error", "error": …, "error_code": …}``
with the same HTTP status.  Request bodies are JSON objects of at most
``MAX_BODY_BYTES`` (1 MiB); larger ones get 413 before they are read
(``api.limits``, served by ``operator_site``).  The
JSON views are ``api.views``; an event stream is ``api.eventstream``.

Routes:

- ``GET /``, ``GET /1.0`` — API versions, server information (hypervisor kind, the
  daemon's options as ``config``, read-only).
- ``GET /1.0/instances`` (``?recursion=1`` for objects), ``POST /1.0/instances``.
- ``GET``/``PATCH``/``DELETE /1.0/instances/<name>``; ``POST`` renames (``{"name": NEW}``).
- ``GET``/``PUT /1.0/instances/<name>/state`` — start, stop, restart, freeze, unfreeze.
- ``POST /1.0/instances/<name>/actions/<rebuild|resize|confirm-resize|revert-resize>``.
- ``GET /1.0/instances/<name>/actions`` — the action history.
- ``GET /1.0/instances/<name>/console`` — the guest's serial console log, raw bytes.
- ``GET /1.0/events?type=lifecycle,operation`` — newline-delimited JSON, kept open.
- ``GET /1.0/operations``, ``GET /1.0/operations/<id>``, ``GET /1.0/operations/<id>/wait``.
- ``GET /1.0/metrics`` — Prometheus' text format, not an envelope (``api.metrics``).
- ``GET /1.0/cluster/members`` (``?recursion=1`` for objects), ``GET /1.0/cluster/members/<name>``
  — the cluster's members (404 on a daemon that is no member: ``api.cluster``);
  ``DELETE /1.0/cluster/members/<name>`` retires one (409 while online, running
  instances, or the member answering).

A daemon that is a cluster member (``cluster=ClusterContext(...)``) answers
for every member: requests about an instance another member runs are
relayed to it, except reads of the instance list and of one instance;
``POST /1.0/instances?target=MEMBER`` launches on that member (default: the
least loaded).  See ``api.cluster``.
- ``GET``/``POST /1.0/certificates``, ``GET``/``DELETE /1.0/certificates/<fingerprint>`` —
  the remote API's trust store: issue a trust token, redeem one (the only request an
  untrusted remote client may make), list and remove trusted certificates (``api.trust``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, cast
from urllib.parse import urlencode

from klein import Klein
from twisted.internet.defer import Deferred, race
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

import vmready
from vmready.api.cluster import NOT_A_MEMBER, ClusterContext
from vmready.api.eventstream import EventStream
from vmready.api.forwarding import FORWARDED_BY
from vmready.api.limits import MAX_OPERATOR_CONNECTIONS, LimitedSite
from vmready.api.metrics import metrics_response
from vmready.api.requestbody import (
    DEFAULT_TIMEOUT,
    event_types,
    field,
    query_param,
    read_json_body,
    recursion_level,
    seconds_param,
)
from vmready.api.trust import (
    TrustRegistry,
    certificate_json,
    peer_of,
    refuse_untrusted,
)
from vmready.api.views import instance_json, instance_url, operation_url, snapshot_json, state_json
from vmready.api.web import (
    ErrorStyle,
    handle_error,
    json_response,
    literal_paths,
    local_site,
    sync_response,
)
from vmready.domain.members import MemberRecord
from vmready.domain.model import (
    BadGateway,
    BadRequest,
    InstanceRecord,
    LoopDetected,
    NotFound,
    Unavailable,
)
from vmready.domain.states import StatusCode
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.operations import Operation

__all__ = ["MAX_CONSOLE_BYTES", "OPERATOR_ERRORS", "OperatorAPI", "operator_site"]

# How much of a console log GET /1.0/instances/<name>/console returns at most.
MAX_CONSOLE_BYTES = 4 * 1024 * 1024

STATE_ACTIONS = ("start", "stop", "restart", "freeze", "unfreeze")
INSTANCE_ACTIONS = ("rebuild", "resize", "confirm-resize", "revert-resize")


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


def operator_site(resource: IResource, reactor: IReactorTime | None = None) -> LimitedSite:
    """The HTTP site serving the operator API's ``resource`` (``OperatorAPI(...).app.resource()``).

    Within ``vmready.api.limits``'s limits, at most ``MAX_OPERATOR_CONNECTIONS``
    connections open at once; its refusals use the operator API's envelope.
    """
    return local_site(
        resource,
        OPERATOR_ERRORS,
        label="operator API",
        max_connections=MAX_OPERATOR_CONNECTIONS,
        reactor=reactor,
    )


Handler = Callable[..., Any]


def _forwardable(handler: Handler) -> Handler:
    """A handler of ``/1.0/instances/<name>…``: relayed to the member that runs ``name``.

    On a single host, or for an instance this member runs (or one the
    store does not know: the handler says 404), the handler answers.
    """

    @functools.wraps(handler)
    def route(api: OperatorAPI, request: IRequest, **arguments: Any) -> Any:
        cluster = api.cluster
        if cluster is not None:
            record = api.lifecycle.store.find_instance(arguments["name"])
            member = cluster.remote_owner(record) if record is not None else None
            if member is not None and record is not None:
                return Deferred.fromCoroutine(
                    cluster.forward(request, member, f"instance {record.name}", (record.name,))
                )
        return handler(api, request, **arguments)

    return route


def _forwardable_operation(waits: bool = False) -> Callable[[Handler], Handler]:
    """A handler of ``/1.0/operations/<id>…``: relayed for an operation a relay started.

    ``waits``: the request waits by design (``/wait?timeout=N``): relayed
    as waits with the forwarding deadline on top (``ClusterContext.forward_wait``),
    so it is never cut short of what the client asked for.
    """

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def route(api: OperatorAPI, request: IRequest, **arguments: Any) -> Any:
            cluster = api.cluster
            if cluster is not None:
                operation_id = arguments["operation_id"]
                member = cluster.operation_owner(operation_id)
                if member is not None and waits:
                    timeout = _requested_wait(request)
                    return Deferred.fromCoroutine(
                        cluster.forward_wait(request, member, operation_id, timeout)
                    )
                if member is not None:
                    return Deferred.fromCoroutine(
                        cluster.forward(request, member, f"operation {operation_id}")
                    )
            return handler(api, request, **arguments)

        return route

    return decorate


def _requested_wait(request: IRequest) -> float | None:
    """The seconds ``?timeout=`` asks a wait for; None: no limit (absent, or -1)."""
    return seconds_param(query_param(request, "timeout"), "timeout")


class OperatorAPI:
    """The operator API over one ``Lifecycle``; serve ``OperatorAPI(...).app.resource()``.

    ``cluster``: this daemon is a member of a cluster (``api.cluster``); None,
    a single host. It may be set after construction, before requests come.
    """

    app = literal_paths(Klein())
    log = Logger()

    def __init__(
        self,
        lifecycle: Lifecycle,
        hypervisor: str,
        trust: TrustRegistry | None = None,
        config: Mapping[str, str] | None = None,
        cluster: ClusterContext | None = None,
    ) -> None:
        self.lifecycle = lifecycle
        self.cluster = cluster
        self.hypervisor = hypervisor
        # Without one: a daemon with no remote API (trust tokens are refused, saying why).
        self.trust = trust or TrustRegistry(lifecycle.store, lifecycle.clock.seconds)
        # The daemon's effective options, shown read-only as the server's ``config``.
        self.config = dict(config or {})

    # -- errors: the one place an exception becomes a response ------------

    def _instance_json(self, record: InstanceRecord) -> dict[str, Any]:
        lifecycle = self.lifecycle
        # On a cluster member: where it runs, and whether that member is unreachable.
        placed: dict[str, Any] = (
            {}
            if self.cluster is None
            else {
                "location": self.cluster.location(record),
                "unreachable": self.cluster.unreachable(record),
            }
        )
        return instance_json(
            record,
            lifecycle.running.agent_status(record.name),
            lifecycle.events.faults.of(record.name),
            lifecycle.agent_history.of(record.name),
            lifecycle.specs.console_log_path(record),
            **placed,
        )

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
        """Server information: API version, the hypervisor, the daemon's options (``config``)."""
        return sync_response(
            request,
            {
                "api_version": "1.0",
                "api_status": "stable",
                "api_extensions": [],
                "auth": "trusted",
                "public": False,
                "config": self.config,
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

    @app.route("/1.0/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        """Counters, gauges and histograms in Prometheus' text format (no envelope)."""
        return metrics_response(request, self.lifecycle)

    # -- instances --------------------------------------------------------

    @app.route("/1.0/instances", methods=["GET"])
    def list_instances(self, request: IRequest) -> bytes:
        """Every instance, as URLs or (``recursion=1``) objects."""
        records = sorted(self.lifecycle.store.list_instances(), key=lambda record: record.name)
        if recursion_level(request) >= 1:
            return sync_response(request, [self._instance_json(record) for record in records])
        return sync_response(request, [instance_url(record.name) for record in records])

    @app.route("/1.0/instances", methods=["POST"])
    async def create_instance(self, request: IRequest) -> bytes:
        """Create and boot an instance; answers with its operation.

        In a cluster, on the member ``?target=`` names, else the least loaded
        online one: relayed to it unless that is this member.
        """
        target = query_param(request, "target")
        if self.cluster is None:
            if target is not None:
                raise BadRequest(f"Invalid target {target!r}: {NOT_A_MEMBER}")
        elif request.getHeader(FORWARDED_BY) is not None:
            if target != self.cluster.name:
                raise LoopDetected(
                    f"a launch forwarded to cluster member {self.cluster.name} names "
                    f"target {target!r}: it is not forwarded again"
                )
        else:
            member = self.cluster.membership.choose_target(target)
            if member.name != self.cluster.name:
                return await self.cluster.forward(
                    request,
                    member,
                    "the launch",
                    uri=b"/1.0/instances?" + urlencode({"target": member.name}).encode(),
                )
        body = read_json_body(request)
        name = field(body, "name", str, "a string")
        if name is None:
            raise BadRequest("Invalid field 'name': an instance name is required")
        config = field(body, "config", dict, "an object") or {}
        kind = field(body, "type", str, "a string")
        if kind not in (None, "", "virtual-machine"):
            raise BadRequest(
                f"Invalid field 'type': only 'virtual-machine' is supported, not {kind!r}"
            )
        return _async(request, await self.lifecycle.create(name, config))

    @app.route("/1.0/instances/<name>", methods=["GET"])
    def get_instance(self, request: IRequest, name: str) -> bytes | Deferred[bytes]:
        """One instance.

        In a cluster, an instance another member runs is asked of that member
        while it is online: its agent link, history and faults live there.
        Unreachable, or not answering, the shared store answers here (UNKNOWN
        while its lease has run out).
        """
        cluster = self.cluster
        if cluster is not None and request.getHeader(FORWARDED_BY) is None:
            record = self.lifecycle.store.find_instance(name)
            owner = None if record is None else cluster.reachable_owner(record)
            if owner is not None:
                return Deferred.fromCoroutine(self._instance_from(request, owner, name))
        record = self.lifecycle.store.get_instance(name)
        return sync_response(request, self._instance_json(record))

    async def _instance_from(self, request: IRequest, owner: MemberRecord, name: str) -> bytes:
        """The instance as its member shows it; this member's view if that member fails."""
        assert self.cluster is not None
        try:
            return await self.cluster.forward(request, owner, f"instance {name}")
        except (Unavailable, BadGateway) as e:
            self.log.info(
                "showing instance {name} from the store: its member {member} did not answer"
                " ({error})",
                name=name,
                member=owner.name,
                error=e.message,
            )
            request.setResponseCode(200)
            return sync_response(
                request, self._instance_json(self.lifecycle.store.get_instance(name))
            )

    @app.route("/1.0/instances/<name>", methods=["PATCH"])
    @_forwardable
    async def patch_instance(self, request: IRequest, name: str) -> bytes:
        """Set user-settable config keys (``null`` removes one); answers with the instance."""
        body = read_json_body(request)
        config = field(body, "config", dict, "an object")
        if config is None:
            raise BadRequest("Invalid field 'config': an object of keys to set is required")
        updated = await self.lifecycle.configuring.update_config(name, config)
        return sync_response(request, self._instance_json(updated))

    @app.route("/1.0/instances/<name>", methods=["PUT"])
    @_forwardable
    async def put_instance(self, request: IRequest, name: str) -> bytes:
        """LXD's restore: ``{"restore": SNAP, "stateful": bool, "force": bool}``."""
        body = read_json_body(request)
        unexpected = sorted(set(body) - {"restore", "stateful", "force"})
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: expected restore, stateful, force")
        snapshot = field(body, "restore", str, "a snapshot name")
        if snapshot is None:
            raise BadRequest("Invalid field 'restore': the name of a snapshot is required")
        params = {"snapshot": snapshot}
        for flag in ("stateful", "force"):
            value = field(body, flag, bool, "true or false")
            if value is not None:
                params[flag] = value
        self.lifecycle.store.get_instance(name)
        return _async(request, await self.lifecycle.act(name, "restore", **params))

    @app.route("/1.0/instances/<name>", methods=["POST"])
    @_forwardable
    async def rename_instance(self, request: IRequest, name: str) -> bytes:
        """LXD's rename: ``{"name": NEW}``, of a stopped instance; answers with the operation."""
        body = read_json_body(request)
        unexpected = sorted(set(body) - {"name"})
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: a rename takes only name")
        new_name = field(body, "name", str, "an instance name")
        if new_name is None:
            raise BadRequest("Invalid field 'name': the instance's new name is required")
        return _async(request, await self.lifecycle.renaming.rename(name, new_name))

    @app.route("/1.0/instances/<name>/snapshots", methods=["GET"])
    @_forwardable
    async def list_snapshots(self, request: IRequest, name: str) -> bytes:
        """The instance's snapshots, oldest first."""
        return sync_response(
            request,
            [
                snapshot_json(snapshot)
                for snapshot in await self.lifecycle.store.list_snapshots(name)
            ],
        )

    @app.route("/1.0/instances/<name>/snapshots", methods=["POST"])
    @_forwardable
    async def create_snapshot(self, request: IRequest, name: str) -> bytes:
        """Take a snapshot: ``{"name": SNAP, "stateful": bool}``."""
        body = read_json_body(request)
        unexpected = sorted(set(body) - {"name", "stateful"})
        if unexpected:
            raise BadRequest(f"Invalid field {unexpected[0]!r}: expected name, stateful")
        snapshot = field(body, "name", str, "a snapshot name")
        if snapshot is None:
            raise BadRequest("Invalid field 'name': the snapshot's name is required")
        params: dict[str, Any] = {"snapshot": snapshot}
        stateful = field(body, "stateful", bool, "true or false")
        if stateful is not None:
            params["stateful"] = stateful
        self.lifecycle.store.get_instance(name)
        return _async(request, await self.lifecycle.act(name, "snapshot", **params))

    @app.route("/1.0/instances/<name>/snapshots/<snapshot>", methods=["DELETE"])
    @_forwardable
    async def delete_snapshot(self, request: IRequest, name: str, snapshot: str) -> bytes:
        """Delete a snapshot, answering with what it was; 409 while a restore from it runs."""
        self.lifecycle.store.get_instance(name)
        deleted = await self.lifecycle.snapshotting.delete_snapshot(name, snapshot)
        return sync_response(request, snapshot_json(deleted))

    @app.route("/1.0/instances/<name>", methods=["DELETE"])
    @_forwardable
    async def delete_instance(self, request: IRequest, name: str) -> bytes:
        """Delete an instance (its VM is stopped first); answers with the operation."""
        self.lifecycle.store.get_instance(name)
        return _async(request, await self.lifecycle.act(name, "delete"))

    @app.route("/1.0/instances/<name>/state", methods=["GET"])
    @_forwardable
    def get_state(self, request: IRequest, name: str) -> bytes:
        """The instance's status and the three fields it is derived from."""
        record = self.lifecycle.store.get_instance(name)
        return sync_response(
            request, state_json(record, self.lifecycle.running.agent_status(name))
        )

    @app.route("/1.0/instances/<name>/state", methods=["PUT"])
    @_forwardable
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
        self.lifecycle.store.get_instance(name)
        params: dict[str, Any] = {}
        if action in ("stop", "restart"):
            if force is not None:
                params["force"] = force
            if timeout is not None and timeout != DEFAULT_TIMEOUT:
                params["timeout"] = timeout
        return _async(request, await self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/actions/<action>", methods=["POST"])
    @_forwardable
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
        self.lifecycle.store.get_instance(name)
        return _async(request, await self.lifecycle.act(name, action, **params))

    @app.route("/1.0/instances/<name>/console", methods=["GET"])
    @_forwardable
    def get_console(self, request: IRequest, name: str) -> bytes:
        """The guest's serial console log (the last ``MAX_CONSOLE_BYTES``), as raw bytes."""
        record = self.lifecycle.store.get_instance(name)
        log = self.lifecycle.specs.console_log(record, MAX_CONSOLE_BYTES)
        request.setHeader(b"Content-Type", b"application/octet-stream")
        return log

    @app.route("/1.0/instances/<name>/actions", methods=["GET"])
    @_forwardable
    async def list_actions(self, request: IRequest, name: str) -> bytes:
        """The instance's action history (kept after delete), newest first, with steps."""
        actions = await self.lifecycle.store.list_actions(name)
        if not actions:
            self.lifecycle.store.get_instance(name)
        return sync_response(request, [action.to_json() for action in actions])

    # -- cluster ----------------------------------------------------------

    @app.route("/1.0/cluster/members", methods=["GET"])
    def list_members(self, request: IRequest) -> bytes:
        """The cluster's members, as URLs or (``recursion=1``) objects; 404 if not a member."""
        if self.cluster is None:
            raise NotFound(NOT_A_MEMBER)
        members = self.cluster.members_json()
        if recursion_level(request) >= 1:
            return sync_response(request, members)
        return sync_response(
            request, [f"/1.0/cluster/members/{m['server_name']}" for m in members]
        )

    @app.route("/1.0/cluster/members/<name>", methods=["GET"])
    def get_member(self, request: IRequest, name: str) -> bytes:
        """One member: its address, status, instance count and lease."""
        if self.cluster is None:
            raise NotFound(NOT_A_MEMBER)
        return sync_response(request, self.cluster.member_json(name))

    @app.route("/1.0/cluster/members/<name>", methods=["DELETE"])
    async def remove_member(self, request: IRequest, name: str) -> bytes:
        """Retire a member: offline, running no instance, not this one (409 otherwise)."""
        if self.cluster is None:
            raise NotFound(NOT_A_MEMBER)
        return sync_response(request, await self.cluster.remove_member(name))

    # -- events -----------------------------------------------------------

    @app.route("/1.0/events", methods=["GET"])
    def events(self, request: IRequest) -> Deferred[None]:
        """Newline-delimited JSON events until the client goes away."""
        types = event_types(query_param(request, "type"))
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/x-ndjson")

        # Klein hands us twisted.web's Request, which is also the connection's consumer.
        web_request = cast(http.Request, request)
        stream = EventStream(web_request)
        web_request.registerProducer(stream, True)
        unsubscribe = self.lifecycle.events.subscribe(stream.deliver, types)
        # Headers now: a client that saw them knows it is subscribed.
        request.write(b"")

        # Klein cancels this when the connection is lost; it never fires otherwise.
        return Deferred(lambda _: unsubscribe())

    # -- operations -------------------------------------------------------

    @app.route("/1.0/operations", methods=["GET"])
    def list_operations(self, request: IRequest) -> bytes:
        """Operations grouped by status, as URLs or (``recursion=1``) objects."""
        recursion = recursion_level(request)
        grouped: dict[str, list[Any]] = {}
        for operation in sorted(self.lifecycle.operations.list(), key=lambda op: op.created_at):
            item = operation.to_json()
            key = str(item["status"]).lower()
            grouped.setdefault(key, []).append(
                item if recursion >= 1 else operation_url(operation)
            )
        return sync_response(request, grouped)

    @app.route("/1.0/operations/<operation_id>", methods=["GET"])
    @_forwardable_operation()
    def get_operation(self, request: IRequest, operation_id: str) -> bytes:
        """One operation."""
        return sync_response(request, self.lifecycle.operations.get(operation_id).to_json())

    @app.route("/1.0/operations/<operation_id>/wait", methods=["GET"])
    @_forwardable_operation(waits=True)
    async def wait_operation(self, request: IRequest, operation_id: str) -> bytes:
        """The operation once done, or as it is when ``?timeout=S`` runs out (-1: no limit)."""
        operation = self.lifecycle.operations.get(operation_id)
        timeout = _requested_wait(request)
        if not operation.done:
            done = operation.when_done()
            if timeout is None:
                await done
            else:
                await race([done, deferLater(self.lifecycle.clock, timeout, lambda: operation)])
        return sync_response(request, operation.to_json())

    # -- the remote API's trust store -------------------------------------

    @app.route("/1.0/certificates", methods=["GET"])
    async def list_certificates(self, request: IRequest) -> bytes:
        """The trusted client certificates, as URLs or (``recursion=1``) objects."""
        refuse_untrusted(peer_of(request), "listing certificates")
        entries = await self.trust.certificates()
        if recursion_level(request) >= 1:
            return sync_response(request, [certificate_json(entry) for entry in entries])
        return sync_response(request, [f"/1.0/certificates/{e.fingerprint}" for e in entries])

    @app.route("/1.0/certificates", methods=["POST"])
    async def add_certificate(self, request: IRequest) -> bytes:
        """``{"name": N, "token": true}``: issue a trust token; ``{"trust_token": T}``: redeem it.

        Redeeming trusts the certificate the TLS client presents, so it is done
        over the remote API only; issuing needs the unix socket or a trusted client.
        """
        body = read_json_body(request)
        peer = peer_of(request)
        if "trust_token" in body:
            if peer is None:
                raise BadRequest(
                    "a trust token is redeemed over the remote API (https), by the client "
                    "whose certificate it adds; this request came over the unix socket"
                )
            entry = await self.trust.redeem(body["trust_token"], peer)
            return sync_response(request, certificate_json(entry))
        refuse_untrusted(peer, "issuing trust tokens")
        if body.get("token") is not True:
            raise BadRequest(
                'expected {"name": NAME, "token": true} (issue a trust token) or '
                '{"trust_token": TOKEN} (redeem one)'
            )
        return sync_response(request, await self.trust.issue(body.get("name")))

    @app.route("/1.0/certificates/<fingerprint>", methods=["GET"])
    async def get_certificate(self, request: IRequest, fingerprint: str) -> bytes:
        """One trusted certificate."""
        refuse_untrusted(peer_of(request), "reading certificates")
        return sync_response(request, certificate_json(await self.trust.find(fingerprint)))

    @app.route("/1.0/certificates/<fingerprint>", methods=["DELETE"])
    async def delete_certificate(self, request: IRequest, fingerprint: str) -> bytes:
        """Stop trusting a certificate; its client's open connections close."""
        refuse_untrusted(peer_of(request), "removing certificates")
        return sync_response(
            request, certificate_json(await self.trust.remove(fingerprint, request))
        )
