"""What every part of the operator API shares: its Klein app, envelopes, errors, relaying.

The operator API (``api.operator.OperatorAPI``) is one class composed of route
groups, one module each (server, instances, instance actions, snapshots,
operations and events, the trust store, what vmready does not implement).
Each group is an ``OperatorBase`` whose handlers are routes of the one shared
Klein app, ``operator_app``: Klein binds them to the ``OperatorAPI`` instance
that serves a request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from vmready.api.cluster import ClusterContext, Placement
from vmready.api.eventstream import MAX_PENDING_BYTES, BoundedFeed
from vmready.api.limits import MAX_OPERATOR_CONNECTIONS, LimitedSite
from vmready.api.rendered import SLICE, Rendered, RenderedInstances, ViewInputs
from vmready.api.requestbody import query_param, seconds_param
from vmready.api.trust import TrustRegistry
from vmready.api.views import instance_json, operation_url
from vmready.api.web import ErrorStyle, handle_error, json_response, literal_paths, local_site
from vmready.domain import InstanceRecord, NotFound, StatusCode
from vmready.lifecycle import Fault, Lifecycle, LinkChange, Operation
from vmready.protocols import AgentStatus

# The one project vmready has: LXD's ``?project=`` may name it, or be left out.
DEFAULT_PROJECT = "default"

Handler = Callable[..., Any]
RouteHandler = TypeVar("RouteHandler", bound=Handler)


def require_default_project(request: IRequest) -> None:
    """NotFound, as LXD answers for a project it does not have, unless ``?project=`` is default."""
    project = query_param(request, "project")
    if project not in (None, "", DEFAULT_PROJECT):
        raise NotFound(project_not_found(project))


def project_not_found(name: str) -> str:
    """The words for a project other than ``default``."""
    return (
        f"Project {name!r} not found: vmready has only {DEFAULT_PROJECT!r} "
        "(other projects are not supported by vmready)"
    )


class _DefaultProjectKlein(Klein):
    """Klein whose every route serves LXD's ``default`` project only.

    LXD's clients may add ``?project=NAME`` to any request (``lxc --project``,
    a remote's project): absent or ``default`` is served, any other is 404
    (``require_default_project``), before the handler runs.
    """

    def route(
        self, url: str, *args: Any, branch: bool = False, **kwargs: Any
    ) -> Callable[[RouteHandler], RouteHandler]:
        """Klein's ``route``, the handler behind the project check."""
        register = super().route(url, *args, branch=branch, **kwargs)

        def decorate(handler: RouteHandler) -> RouteHandler:
            @functools.wraps(handler)
            def in_default_project(api: Any, request: IRequest, *a: Any, **kw: Any) -> Any:
                require_default_project(request)
                return handler(api, request, *a, **kw)

            register(in_default_project)
            # Klein's own contract: the handler itself, so routes stack on it.
            return handler

        return decorate


# The one Klein app every route group of the operator API adds its routes to.
operator_app = literal_paths(_DefaultProjectKlein())


def async_response(request: IRequest, operation: Operation) -> bytes:
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


def error_response(request: IRequest, code: int, message: str) -> bytes:
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
    connections open at once; its refusals use the operator API's envelope;
    its access log has a line for every change and every refused or failed
    request, none for a successful read.
    """
    return local_site(
        resource,
        OPERATOR_ERRORS,
        label="operator API",
        max_connections=MAX_OPERATOR_CONNECTIONS,
        log_reads=False,
        reactor=reactor,
    )


def forwardable(handler: Handler) -> Handler:
    """A handler of ``/1.0/instances/<name>…``: relayed to the member that runs ``name``.

    On a single host, or for an instance this member runs (or one the
    store does not know: the handler says 404), the handler answers.
    """

    @functools.wraps(handler)
    def route(api: OperatorBase, request: IRequest, **arguments: Any) -> Any:
        cluster = api.cluster
        if cluster is not None:
            record = api.lifecycle.store.view.find_instance(arguments["name"])
            member = cluster.remote_owner(record) if record is not None else None
            if member is not None and record is not None:
                return Deferred.fromCoroutine(
                    cluster.forward(request, member, f"instance {record.name}", (record.name,))
                )
        return handler(api, request, **arguments)

    return route


def forwardable_operation(waits: bool = False) -> Callable[[Handler], Handler]:
    """A handler of ``/1.0/operations/<id>…``: relayed for an operation a relay started.

    ``waits``: the request waits by design (``/wait?timeout=N``): relayed
    as waits with the forwarding deadline on top (``ClusterContext.forward_wait``),
    so it is never cut short of what the client asked for.
    """

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def route(api: OperatorBase, request: IRequest, **arguments: Any) -> Any:
            cluster = api.cluster
            if cluster is not None:
                operation_id = arguments["operation_id"]
                member = cluster.operation_owner(operation_id)
                if member is not None and waits:
                    timeout = requested_wait(request)
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


def requested_wait(request: IRequest) -> float | None:
    """The seconds ``?timeout=`` asks a wait for; None: no limit (absent, or -1)."""
    return seconds_param(query_param(request, "timeout"), "timeout")


class OperatorBase:
    """What every route group of the operator API holds: the lifecycle and its context.

    ``cluster``: this daemon is a member of a cluster (``api.cluster``); None,
    a single host. It may be set after construction, before requests come.
    """

    app = operator_app
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
        # The event consumers connected now, either form, and what each may have held.
        self.event_feeds: set[BoundedFeed] = set()
        self.event_buffer_limit = MAX_PENDING_BYTES
        # Each instance's view, kept until what it shows changes.
        self.rendered = RenderedInstances(
            self._render_instance,
            lambda name: lifecycle.store.view.find_instance(name) is not None,
        )
        # The instances a list reads per turn of the reactor (``api.rendered.in_slices``).
        self.list_slice = SLICE

    def rendered_instance(
        self,
        record: InstanceRecord,
        placement: Callable[[InstanceRecord], Placement] | None = None,
        server_faults: tuple[Fault, ...] | None = None,
    ) -> Rendered:
        """The instance object as this daemon shows it now, rendered only if it changed.

        ``placement``: where instances run, for a cluster member
        (``ClusterContext.placement`` unless given: a list gives its ``placements``);
        ``server_faults``: the daemon's standing faults (read now unless given:
        a list reads them once).
        """
        if server_faults is None:
            server_faults = tuple(self.lifecycle.events.faults.server())
        cluster = self.cluster
        if cluster is None:
            return self.rendered.get(
                ViewInputs(record, *self._own_link(record.name, server_faults))
            )
        # On a cluster member: where it runs, and whether that member is unreachable.
        location, unreachable = (placement or cluster.placement)(record)
        told = cluster.told_view(record, unreachable)
        if told is None:
            own = self._own_link(record.name, server_faults)
            return self.rendered.get(ViewInputs(record, *own, location, unreachable))
        inputs = ViewInputs(
            record,
            told.agent,
            told.faults + server_faults,
            told.history,
            location,
            unreachable,
            told.console_log,
        )
        return self.rendered.get(inputs)

    def agent_status(self, record: InstanceRecord) -> AgentStatus:
        """The instance's agent status as shown: its member's (``rendered_instance``)."""
        cluster = self.cluster
        if cluster is not None:
            told = cluster.told_view(record, cluster.unreachable(record))
            if told is not None:
                return told.agent
        return self.lifecycle.running.agent_status(record.name)

    def _own_link(
        self, name: str, server_faults: tuple[Fault, ...]
    ) -> tuple[AgentStatus, tuple[Fault, ...], tuple[LinkChange, ...]]:
        """What this daemon knows of the agent link and the faults of instance ``name``
        (its own faults, then the daemon's ``server_faults``)."""
        lifecycle = self.lifecycle
        return (
            lifecycle.running.agent_status(name),
            tuple(lifecycle.events.faults.of(name, server_faults)),
            tuple(lifecycle.agent_history.of(name)),
        )

    def rendered_in_list(self) -> Callable[[InstanceRecord], Rendered]:
        """``rendered_instance`` for the instances of one list: what they all share
        (the daemon's faults; on a member, each member's placement) is read once."""
        server_faults = tuple(self.lifecycle.events.faults.server())
        placement = None if self.cluster is None else self.cluster.placements()
        return lambda record: self.rendered_instance(record, placement, server_faults)

    def _render_instance(self, inputs: ViewInputs) -> dict[str, Any]:
        """The instance object of these inputs (``api.views.instance_json``)."""
        record = inputs.record
        return instance_json(
            record,
            inputs.agent,
            inputs.faults,
            inputs.agent_history,
            inputs.console_log or self.lifecycle.specs.console_log_path(record),
            inputs.location,
            inputs.unreachable,
        )

    def done_operation(
        self, description: str, instance: str, metadata: dict[str, Any] | None = None
    ) -> Operation:
        """An operation for work already done (LXD answers this request with one)."""

        async def done() -> None:
            """The work was done before the operation was made."""

        operation = self.lifecycle.operations.run(description, instance, done)
        operation.metadata = metadata
        return operation

    @app.handle_errors(Exception)
    def _handle_error(self, request: IRequest, failure: Failure) -> bytes:
        """Errors as the operator API words them (``vmready.api.web.handle_error``)."""
        return handle_error(request, failure, OPERATOR_ERRORS, self.log)
