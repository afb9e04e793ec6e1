"""The two HTTP servers.

The operator API (``operator``) and the guest API (``guest``), on one request
class and one error handler (``web``).
"""

from vmready.api.cluster import ClusterContext
from vmready.api.guest import GuestAPI, guest_site, guest_tls_factory
from vmready.api.limits import OPERATOR_LISTEN_BACKLOG
from vmready.api.metrics import CountedGuestResource
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.api.web import BytesProducer, LocalRequest

__all__ = [
    "OPERATOR_LISTEN_BACKLOG",
    "BytesProducer",
    "ClusterContext",
    "CountedGuestResource",
    "GuestAPI",
    "LocalRequest",
    "OperatorAPI",
    "TrustRegistry",
    "guest_site",
    "guest_tls_factory",
    "operator_site",
    "remote_site",
    "remote_tls_factory",
]
