"""``twistd fakeqemu-host``: Options and makeService for the multi-VM host."""

from __future__ import annotations

import resource

from twisted.application import strports
from twisted.application.service import IService
from twisted.python import usage

from fakeqemu._host import HostControlFactory, VMHost


class Options(usage.Options):
    """Options for ``twistd fakeqemu-host``."""

    optParameters = [
        ["control", "c", None, "Path of the control socket (required)."],
    ]

    def postOptions(self) -> None:
        if not self["control"]:
            raise usage.UsageError("--control PATH is required")


def raise_file_limit() -> None:
    """Each VM holds a few sockets; let a thousand VMs fit under the descriptor limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def makeService(options: Options) -> IService:
    """The control socket listener; VMs live inside this process's reactor."""
    from twisted.internet import reactor

    raise_file_limit()
    host = VMHost(reactor)
    endpoint = "unix:" + options["control"].replace(":", "\\:")
    return strports.service(endpoint, HostControlFactory(host))
