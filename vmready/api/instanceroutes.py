"""The operator API's instance routes: list, create, read, update, rename, delete.

As LXD serves them: ``POST /1.0/instances`` creates a stopped instance unless
the body asks ``"start": true``; ``GET`` answers an ``ETag`` that ``PUT``'s
``If-Match`` must match (412 otherwise); ``PUT`` replaces the writable fields
(``api.lxdbodies``) or, with ``{"restore": SNAP}``, restores a snapshot;
lists take ``filter=`` (``api.filtering``) and ``recursion=2`` (each instance
with its state and snapshots).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from twisted.internet.defer import Deferred
from twisted.web.iweb import IRequest

from vmready.api.cluster import NOT_A_MEMBER
from vmready.api.filtering import parse_filter
from vmready.api.forwarding import FORWARDED_BY
from vmready.api.lxdbodies import create_request, instance_etag, put_changes, rename_request
from vmready.api.operatorbase import OperatorBase, async_response, forwardable, operator_app
from vmready.api.rendered import Rendered, in_slices
from vmready.api.requestbody import field, query_param, read_json_body, recursion_level
from vmready.api.views import instance_url, snapshot_json, state_json
from vmready.api.web import sync_response, sync_response_array, sync_response_encoded
from vmready.domain import (
    BadGateway,
    BadRequest,
    InstanceRecord,
    LoopDetected,
    MemberRecord,
    Unavailable,
    VMReadyError,
)


class PreconditionFailed(VMReadyError):
    """412: the request's ``If-Match`` names a version the instance no longer has."""

    http_status = 412


class InstanceRoutes(OperatorBase):
    """``/1.0/instances`` and ``/1.0/instances/<name>``."""

    app = operator_app

    async def full_view(self, record: InstanceRecord) -> dict[str, Any]:
        """The instance with its state, snapshots and backups (LXD's ``InstanceFull``)."""
        view = dict(self.rendered_instance(record).view)
        snapshots = await self.lifecycle.store.snapshots.list_snapshots(record.name)
        view["state"] = state_json(record, self.agent_status(record))
        view["snapshots"] = [snapshot_json(snapshot) for snapshot in snapshots]
        view["backups"] = []
        return view

    def _answer_instance(self, request: IRequest, view: dict[str, Any]) -> bytes:
        """One instance, with its ETag."""
        request.setHeader(b"ETag", instance_etag(view).encode("ascii"))
        return sync_response(request, view)

    def _answer_rendered(self, request: IRequest, record: InstanceRecord) -> bytes:
        """One instance as ``_answer_instance`` answers it, from its kept rendering."""
        rendered = self.rendered_instance(record)
        request.setHeader(b"ETag", rendered.etag.encode("ascii"))
        return sync_response_encoded(request, rendered.json)

    @app.route("/1.0/instances", methods=["GET"])
    async def list_instances(self, request: IRequest) -> bytes:
        """Every instance (``filter=``), as URLs, objects (1) or with state and snapshots (2)."""
        records = sorted(
            self.lifecycle.store.view.list_instances(), key=lambda record: record.name
        )
        recursion = recursion_level(request)
        wanted = parse_filter(query_param(request, "filter"))
        if recursion >= 2:
            views = [await self.full_view(record) for record in records]
            if wanted is not None:
                views = [view for view in views if wanted(view)]
            return sync_response(request, views)
        rendered = await in_slices(
            records, self.rendered_in_list(), self.lifecycle.clock, self.list_slice
        )
        if wanted is not None:
            rendered = [each for each in rendered if wanted(each.view)]
        if recursion == 1:
            return sync_response_array(request, [each.json for each in rendered])
        return sync_response(request, [instance_url(each.view["name"]) for each in rendered])

    @app.route("/1.0/instances", methods=["POST"])
    async def create_instance(self, request: IRequest) -> bytes:
        """Create an instance, stopped unless ``"start": true``; answers with its operation.

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
        wanted = create_request(read_json_body(request))
        operation = await self.lifecycle.create(wanted.name, wanted.config, start=wanted.start)
        return async_response(request, operation)

    @app.route("/1.0/instances/<name>", methods=["GET"])
    def get_instance(self, request: IRequest, name: str) -> Deferred[bytes]:
        """One instance (``recursion=1``: with its state and snapshots), with its ETag.

        In a cluster, an instance another member runs is answered here from its
        row and what its member told of its agent link, history and faults
        with its last event (``lifecycle.liveviews``); while that member is
        online and told nothing this member holds, it is asked.  Unreachable,
        or not answering, the shared store answers here (UNKNOWN while its lease
        has run out).
        """
        cluster = self.cluster
        if cluster is not None and request.getHeader(FORWARDED_BY) is None:
            record = self.lifecycle.store.view.find_instance(name)
            owner = None if record is None else cluster.reachable_owner(record)
            if owner is not None and record is not None and cluster.views.of(record) is None:
                return Deferred.fromCoroutine(self._instance_from(request, owner, name))
        return Deferred.fromCoroutine(self._local_instance(request, name))

    async def _local_instance(self, request: IRequest, name: str) -> bytes:
        record = self.lifecycle.store.view.get_instance(name)
        if recursion_level(request) >= 1:
            return self._answer_instance(request, await self.full_view(record))
        return self._answer_rendered(request, record)

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
            return await self._local_instance(request, name)

    @app.route("/1.0/instances/<name>", methods=["PATCH"])
    @forwardable
    async def patch_instance(self, request: IRequest, name: str) -> bytes:
        """Set user-settable config keys (``null`` removes one); answers with the instance."""
        body = read_json_body(request)
        config = field(body, "config", dict, "an object")
        if config is None:
            raise BadRequest("Invalid field 'config': an object of keys to set is required")
        record = await self.lifecycle.configuring.update_config(name, config)
        return self._answer_rendered(request, record)

    @app.route("/1.0/instances/<name>", methods=["PUT"])
    @forwardable
    async def put_instance(self, request: IRequest, name: str) -> bytes:
        """LXD's update (the writable fields, replaced) or restore (``{"restore": SNAP}``).

        Either answers with its operation; an update is done by then.
        """
        body = read_json_body(request)
        if body.get("restore") is not None:
            return await self._restore(request, name, body)
        record = self.lifecycle.store.view.get_instance(name)
        rendered = self.rendered_instance(record)
        self._check_etag(request, rendered)
        changes = put_changes(record, body, {*rendered.view, "state", "snapshots", "backups"})
        if changes:
            await self.lifecycle.configuring.update_config(name, changes)
        return async_response(request, self.done_operation(f"Updating instance {name}", name))

    def _check_etag(self, request: IRequest, rendered: Rendered) -> None:
        """A 412 unless ``If-Match`` (if any) names the instance as it is now."""
        raw = request.getHeader(b"If-Match")
        if raw is None:
            return
        given = raw.decode("latin-1").strip().strip('"')
        if given not in ("", "*") and given != rendered.etag:
            raise PreconditionFailed(
                f"ETag doesn't match: instance {rendered.view['name']} changed since it was read"
            )

    async def _restore(self, request: IRequest, name: str, body: dict[str, Any]) -> bytes:
        """``{"restore": SNAP, "stateful": bool, "force": bool}``; other fields as they are."""
        snapshot = field(body, "restore", str, "a snapshot name")
        # LXD's clients name it as INSTANCE/SNAPSHOT.
        owner, slash, short = snapshot.rpartition("/")
        if slash and owner == name:
            snapshot = short
        params: dict[str, Any] = {"snapshot": snapshot}
        for flag in ("stateful", "force"):
            value = field(body, flag, bool, "true or false")
            if value is not None:
                params[flag] = value
        self.lifecycle.store.view.get_instance(name)
        return async_response(request, await self.lifecycle.act(name, "restore", **params))

    @app.route("/1.0/instances/<name>", methods=["POST"])
    @forwardable
    async def rename_instance(self, request: IRequest, name: str) -> bytes:
        """LXD's rename (``{"name": NEW}`` and a move's fields), of a stopped instance."""
        new_name = rename_request(read_json_body(request))
        return async_response(request, await self.lifecycle.renaming.rename(name, new_name))

    @app.route("/1.0/instances/<name>", methods=["DELETE"])
    @forwardable
    async def delete_instance(self, request: IRequest, name: str) -> bytes:
        """Delete an instance (its VM is stopped first); answers with the operation."""
        self.lifecycle.store.view.get_instance(name)
        return async_response(request, await self.lifecycle.act(name, "delete"))
