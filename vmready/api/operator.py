"""The operator API: LXD-shaped REST over the lifecycle, served by Klein.

Every response uses LXD's envelope.  Synchronous answers are
``{"type": "sync", "status": "Success", "status_code": 200, …, "metadata": …}``;
actions answer 202 with ``{"type": "async", "operation": "/1.0/operations/<id>", …}``
and a ``Location`` header; errors are ``{"type": "error", "error": …, "error_code": …}``
with the same HTTP status.  Request bodies are JSON objects of at most
``MAX_BODY_BYTES`` (1 MiB); larger ones get 413 before they are read
(``api.limits``, served by ``operator_site``).

``OperatorAPI`` is composed of route groups, one module each:

- ``api.serverroutes`` — ``GET /``, ``GET /1.0`` (API extensions, the server's
  environment, the daemon's options as ``config``), ``GET /1.0/metrics``,
  ``/1.0/cluster/members``.
- ``api.instanceroutes`` — ``/1.0/instances`` (``filter=``, ``recursion=1|2``;
  ``POST`` creates stopped unless ``"start": true``), ``/1.0/instances/<name>``
  (``GET`` with its ETag; ``PUT`` replaces the writable fields, or restores;
  ``PATCH`` sets config keys; ``POST`` renames; ``DELETE``).
- ``api.actionroutes`` — ``…/state``, ``…/actions/<action>``, the action
  history, ``…/console`` and ``…/logs``.
- ``api.snapshotroutes`` — ``…/snapshots``, ``…/snapshots/<snapshot>``.
- ``api.operationroutes`` — ``/1.0/operations…`` and ``/1.0/events`` (a
  WebSocket as LXD serves it, or newline-delimited JSON).
- ``api.trustroutes`` — ``/1.0/certificates…``, the remote API's trust store.
- ``api.unsupported`` — what LXD has and vmready does not (501, "not
  supported by vmready"); the empty ``default`` profile and the ``default`` project.

A daemon that is a cluster member (``cluster=ClusterContext(...)``) answers
for every member: requests about an instance another member runs are
relayed to it, except reads of the instance list and of one instance;
``POST /1.0/instances?target=MEMBER`` launches on that member (default: the
least loaded).  See ``api.cluster``.
"""

from __future__ import annotations

from vmready.api.actionroutes import MAX_CONSOLE_BYTES, ActionRoutes
from vmready.api.instanceroutes import InstanceRoutes
from vmready.api.operationroutes import OperationRoutes
from vmready.api.operatorbase import OPERATOR_ERRORS, operator_site
from vmready.api.serverroutes import ServerRoutes
from vmready.api.snapshotroutes import SnapshotRoutes
from vmready.api.trustroutes import TrustRoutes
from vmready.api.unsupported import UnsupportedRoutes

__all__ = ["MAX_CONSOLE_BYTES", "OPERATOR_ERRORS", "OperatorAPI", "operator_site"]


class OperatorAPI(
    ServerRoutes,
    InstanceRoutes,
    ActionRoutes,
    SnapshotRoutes,
    OperationRoutes,
    TrustRoutes,
    UnsupportedRoutes,
):
    """The operator API over one ``Lifecycle``; serve ``OperatorAPI(...).app.resource()``.

    ``cluster``: this daemon is a member of a cluster (``api.cluster``); None,
    a single host. It may be set after construction, before requests come.
    """
