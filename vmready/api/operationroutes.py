"""The operator API's operations and events.

- ``GET /1.0/operations`` (``?recursion=1`` for objects), ``GET /1.0/operations/<id>``,
  ``GET /1.0/operations/<id>/wait?timeout=S``.
- ``GET /1.0/events?type=lifecycle,operation`` — a WebSocket when the client
  asks to upgrade (``api.eventsocket``: LXD's form), else newline-delimited
  JSON kept open (``api.eventstream``); either way bounded per consumer.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred, FailureGroup, race
from twisted.internet.task import deferLater
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from vmready.api.eventstream import EventStream, wants_websocket
from vmready.api.operatorbase import (
    OperatorBase,
    forwardable_operation,
    operator_app,
    requested_wait,
)
from vmready.api.requestbody import event_types, query_param, recursion_level
from vmready.api.views import operation_url
from vmready.api.web import sync_response


class OperationRoutes(OperatorBase):
    """``/1.0/operations…`` and ``/1.0/events``."""

    app = operator_app

    @app.route("/1.0/events", methods=["GET"])
    def events(self, request: IRequest) -> Deferred[None] | IResource:
        """Events until the client goes away: a WebSocket if asked for, else JSON lines."""
        types = event_types(query_param(request, "type"))
        bus = self.lifecycle.events
        if wants_websocket(request):
            # autobahn (0.4 s of imports) is loaded by the first WebSocket client, not at start.
            from vmready.api.eventsocket import event_socket

            return event_socket(request, bus, types, self.event_feeds, self.event_buffer_limit)
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", b"application/x-ndjson")
        # Klein hands us twisted.web's Request, which is also the connection's consumer.
        web_request = cast(http.Request, request)
        stream = EventStream(web_request, "a JSON-lines client", self.event_buffer_limit)
        web_request.registerProducer(stream, True)
        self.event_feeds.add(stream)
        unsubscribe = bus.subscribe(stream.deliver, types)
        # Headers now: a client that saw them knows it is subscribed.
        request.write(b"")

        def gone(_: object) -> None:
            unsubscribe()
            self.event_feeds.discard(stream)

        # Klein cancels this when the connection is lost; it never fires otherwise.
        return Deferred(gone)

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
    @forwardable_operation()
    def get_operation(self, request: IRequest, operation_id: str) -> bytes:
        """One operation."""
        return sync_response(request, self.lifecycle.operations.get(operation_id).to_json())

    @app.route("/1.0/operations/<operation_id>/wait", methods=["GET"])
    @forwardable_operation(waits=True)
    async def wait_operation(self, request: IRequest, operation_id: str) -> bytes:
        """The operation once done, or as it is when ``?timeout=S`` runs out (-1: no limit)."""
        operation = self.lifecycle.operations.get(operation_id)
        timeout = requested_wait(request)
        if not operation.done:
            done = operation.when_done()
            if timeout is None:
                await done
            else:
                timer = deferLater(self.lifecycle.clock, timeout, lambda: operation)
                try:
                    await race([done, timer])
                except FailureGroup as e:
                    # The wait was cancelled (its client went away): both were cancelled too.
                    raise CancelledError() from e
        return sync_response(request, operation.to_json())
