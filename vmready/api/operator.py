"""The operator API: LXD-shaped REST over the lifecycle, served by Klein.

Every response uses LXD's envelope (sync, async with an operation, or error);
request bodies are JSON objects of at most 1 MiB (``api.requestbody``).
``OperatorAPI`` is its route groups, one module each (``api.serverroutes``,
``api.instanceroutes`` …, each naming its routes); in a cluster, requests about
another member's instance are relayed to it (``api.cluster``).  The routes are
in docs/api.md.
"""

from __future__ import annotations

from vmready.api.actionroutes import ActionRoutes
from vmready.api.instanceroutes import InstanceRoutes
from vmready.api.operationroutes import OperationRoutes
from vmready.api.serverroutes import ServerRoutes
from vmready.api.snapshotroutes import SnapshotRoutes
from vmready.api.trustroutes import TrustRoutes
from vmready.api.unsupported import UnsupportedRoutes


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
