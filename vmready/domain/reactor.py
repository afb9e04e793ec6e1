"""The reactor as vmready uses it, typed by Twisted's own interfaces.

vmready's code takes its reactor as a parameter: tests hand it a ``Clock``,
a memory reactor or the real one. A part that needs only time asks for
``IReactorTime``; a part that also spawns processes and speaks unix sockets
asks for ``IVMReadyReactor``, all of those at once, as Twisted's default
reactor is. ``default_reactor()`` is that reactor, typed so.
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFDSet,
    IReactorProcess,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
    IReactorUNIX,
)


class IVMReadyReactor(
    IReactorCore,
    IReactorTime,
    IReactorFDSet,
    IReactorTCP,
    IReactorProcess,
    IReactorUNIX,
    IReactorThreads,
):
    """A reactor that runs, keeps time, watches fds, speaks TCP and unix, spawns, has threads."""


def default_reactor() -> IVMReadyReactor:
    """Twisted's global reactor (installing the default one if none is yet)."""
    from twisted.internet import reactor

    return cast(IVMReadyReactor, reactor)
