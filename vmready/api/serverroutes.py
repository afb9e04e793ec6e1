"""The operator API's server routes: API versions, server information, metrics, members.

``GET /1.0`` is what LXD's clients read first: ``api_extensions`` decides
which requests they make (``lxc`` refuses to list without ``api_filtering``,
and without ``instances`` falls back to ``/1.0/containers``), and
``environment`` is what ``lxc version`` and ``lxc info`` show of the server.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from twisted.web.iweb import IRequest

import vmready
from vmready.api.cluster import NOT_A_MEMBER
from vmready.api.metrics import metrics_response
from vmready.api.operatorbase import OperatorBase, operator_app
from vmready.api.requestbody import recursion_level
from vmready.api.trust import peer_of
from vmready.api.web import sync_response
from vmready.domain import NotFound

# The LXD API extensions vmready honours, each as LXD defines it (docs/api.md says how).
API_EXTENSIONS = (
    # /1.0/instances (LXD's clients use /1.0/containers without it).
    "instances",
    # filter= on GET /1.0/instances.
    "api_filtering",
    # recursion=2 on GET /1.0/instances: each instance with its state and snapshots.
    "container_full",
    # recursion=1 on GET /1.0/instances/<name>: the same for one instance.
    "instance_get_full",
    # GET /1.0/instances/<name>/console: the console log.
    "console",
    # Lifecycle events on /1.0/events (type=lifecycle).
    "event_lifecycle",
    # Event envelopes carry their project.
    "event_project",
    # The instance's ETag on GET, If-Match honoured on PUT.
    "etag",
)


def server_environment(hypervisor: str, server_name: str, clustered: bool) -> dict[str, Any]:
    """``GET /1.0``'s ``environment``: what the server is, in LXD's fields."""
    system = os.uname()
    return {
        "server": "vmready",
        "server_version": vmready.__version__,
        "server_name": server_name,
        "server_pid": os.getpid(),
        "server_clustered": clustered,
        "server_event_mode": "full-mesh" if clustered else "",
        "kernel": system.sysname,
        "kernel_version": system.release,
        "kernel_architecture": system.machine,
        "architectures": ["x86_64"],
        "hypervisor": hypervisor,
        "driver": hypervisor,
        "driver_version": vmready.__version__,
        "instance_types": ["virtual-machine"],
        "project": "default",
        "storage": "",
        "storage_version": "",
        "firewall": "",
    }


class ServerRoutes(OperatorBase):
    """``/``, ``/1.0``, ``/1.0/metrics`` and ``/1.0/cluster/members``."""

    app = operator_app

    @app.route("/", methods=["GET"])
    def root(self, request: IRequest) -> bytes:
        """The API versions this server speaks."""
        return sync_response(request, ["/1.0"])

    @app.route("/1.0", methods=["GET"])
    def server(self, request: IRequest) -> bytes:
        """Server information: API version and extensions, the server, the daemon's options.

        An untrusted remote client gets what LXD shows one (``ServerUntrusted``):
        the API, ``"auth": "untrusted"``, and nothing of the server.
        """
        public = {
            "api_version": "1.0",
            "api_status": "stable",
            "api_extensions": list(API_EXTENSIONS),
            "auth": "trusted",
            "auth_methods": ["tls"],
            "public": False,
        }
        peer = peer_of(request)
        if peer is not None and not peer.trusted:
            return sync_response(request, {**public, "auth": "untrusted"})
        name = self.cluster.name if self.cluster is not None else socket.gethostname()
        return sync_response(
            request,
            {
                **public,
                "config": self.config,
                "environment": server_environment(self.hypervisor, name, self.cluster is not None),
            },
        )

    @app.route("/1.0/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        """Counters, gauges and histograms in Prometheus' text format (no envelope)."""
        return metrics_response(request, self.lifecycle)

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
