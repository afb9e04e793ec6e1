"""``GET /1.0/metrics`` and the counting of guest API requests.

The operator API answers ``GET /1.0/metrics`` with ``metrics_response``: the
lifecycle's metrics (``vmready.lifecycle.metrics``) and ``vmready_build_info``
in Prometheus' text format.  ``CountedGuestResource`` wraps the guest API's
resource (outermost, so it sees every answer, whoever wrote it) and counts
each request by method and the status code it was answered with, once the
answer is complete; a request whose guest went away before its answer is
counted with the status it had been given (an event stream the guest closes
was answered 200).
"""

from __future__ import annotations

from typing import Any, cast

from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request
from zope.interface import implementer

import vmready
from vmready.lifecycle import Lifecycle, LifecycleMetrics
from vmready.protocols.prometheus import CONTENT_TYPE, GAUGE, MetricFamily, Sample, exposition


def build_info() -> MetricFamily:
    """``vmready_build_info{version="…"} 1``: which vmready answers."""
    return MetricFamily(
        "vmready_build_info",
        GAUGE,
        "Always 1; its version label says which vmready runs.",
        (Sample("", (("version", vmready.__version__),), 1),),
    )


def metrics_response(request: IRequest, lifecycle: Lifecycle) -> bytes:
    """Every metric, as Prometheus scrapes them."""
    body = exposition([build_info(), *lifecycle.metric_families()])
    request.setResponseCode(200)
    request.setHeader(b"Content-Type", CONTENT_TYPE.encode("ascii"))
    request.setHeader(b"Content-Length", b"%d" % len(body))
    return body


@implementer(IResource)
class CountedGuestResource:
    """The guest API's resource, each request counted by method and status code."""

    isLeaf = True

    def __init__(self, inner: IResource, metrics: LifecycleMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise TypeError("the counted guest API has fixed routes: add routes to GuestAPI")

    def render(self, irequest: IRequest) -> Any:
        request = cast(Request, irequest)
        method = request.method.decode("ascii", "replace")

        def answered(_: object) -> None:
            self.metrics.guest_request(method, request.code)

        request.notifyFinish().addBoth(answered)
        return self.inner.render(request)
