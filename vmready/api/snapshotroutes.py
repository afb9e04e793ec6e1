"""The operator API's snapshot routes, as LXD serves them.

- ``GET /1.0/instances/<name>/snapshots`` — URLs, or (``recursion=1``) objects, oldest first.
- ``POST /1.0/instances/<name>/snapshots`` — ``{"name", "stateful", "expires_at": null}``.
- ``GET``/``DELETE /1.0/instances/<name>/snapshots/<snapshot>`` — one snapshot;
  a delete answers with its (finished) operation, as LXD's does.

Restoring is ``PUT /1.0/instances/<name> {"restore": SNAP}`` (``api.instanceroutes``).
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from vmready.api.lxdbodies import snapshot_request
from vmready.api.operatorbase import OperatorBase, async_response, forwardable, operator_app
from vmready.api.requestbody import read_json_body, recursion_level
from vmready.api.views import snapshot_json, snapshot_url
from vmready.api.web import sync_response
from vmready.domain import NotFound


class SnapshotRoutes(OperatorBase):
    """``/1.0/instances/<name>/snapshots`` and ``…/snapshots/<snapshot>``."""

    app = operator_app

    async def _snapshots(self, name: str) -> list[dict[str, Any]]:
        """The instance's snapshots as the API shows them, oldest first (404: no instance)."""
        snapshots = await self.lifecycle.store.snapshots.list_snapshots(name)
        if not snapshots:
            self.lifecycle.store.view.get_instance(name)
        return [snapshot_json(snapshot) for snapshot in snapshots]

    @app.route("/1.0/instances/<name>/snapshots", methods=["GET"])
    @forwardable
    async def list_snapshots(self, request: IRequest, name: str) -> bytes:
        """The instance's snapshots, oldest first: URLs, or (``recursion=1``) objects."""
        snapshots = await self._snapshots(name)
        if recursion_level(request) >= 1:
            return sync_response(request, snapshots)
        return sync_response(request, [snapshot_url(name, s["name"]) for s in snapshots])

    @app.route("/1.0/instances/<name>/snapshots", methods=["POST"])
    @forwardable
    async def create_snapshot(self, request: IRequest, name: str) -> bytes:
        """Take a snapshot: ``{"name": SNAP, "stateful": bool}``."""
        params = snapshot_request(read_json_body(request))
        self.lifecycle.store.view.get_instance(name)
        return async_response(request, await self.lifecycle.act(name, "snapshot", **params))

    @app.route("/1.0/instances/<name>/snapshots/<snapshot>", methods=["GET"])
    @forwardable
    async def get_snapshot(self, request: IRequest, name: str, snapshot: str) -> bytes:
        """One snapshot."""
        for shown in await self._snapshots(name):
            if shown["name"] == snapshot:
                return sync_response(request, shown)
        raise NotFound(f"Snapshot {snapshot} of instance {name} not found")

    @app.route("/1.0/instances/<name>/snapshots/<snapshot>", methods=["DELETE"])
    @forwardable
    async def delete_snapshot(self, request: IRequest, name: str, snapshot: str) -> bytes:
        """Delete a snapshot (409 while a restore from it runs); answers with its operation.

        The snapshot is gone by then: the operation is finished, and its
        metadata is the snapshot as it was.
        """
        self.lifecycle.store.view.get_instance(name)
        deleted = snapshot_json(await self.lifecycle.snapshotting.delete_snapshot(name, snapshot))
        operation = self.done_operation(f"Deleting snapshot {name}/{snapshot}", name, deleted)
        return async_response(request, operation)
