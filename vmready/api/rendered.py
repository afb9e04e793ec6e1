"""Each instance's view as last rendered, kept until anything it shows changes.

An instance's JSON (``api.views.instance_json``) is a function of its inputs
only: its stored row, what its agent last said, its standing faults, its
agent link's recent history and, in a cluster, where it runs and whether its
member is unreachable.  ``RenderedInstances`` keeps, per instance, the inputs
it last rendered and what they gave: the view, its JSON text, its ETag.  A
read whose inputs equal the kept ones is answered from them; any other is
rendered again, and that is kept.  So whatever changes an input, the next
read shows it; a read that finds nothing changed costs comparing the inputs.

Under load (one daemon, 1,000 instances, ``benchmarks/api_load.py``) the
list ``recursion=1`` rendered every instance and encoded it for every
request: most of the daemon's time.  Now it joins the kept JSON texts, and
reads a long list's instances a slice at a time (``in_slices``), letting the
reactor serve other requests between slices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from vmready.api.lxdbodies import instance_etag
from vmready.domain import InstanceRecord
from vmready.lifecycle import Fault, LinkChange
from vmready.protocols import AgentStatus

T = TypeVar("T")
R = TypeVar("R")

# The instances a list reads in one turn of the reactor.
SLICE = 100
# Entries kept before those of instances gone are first dropped (then twice what remains).
_FIRST_SWEEP = 64


class ViewInputs(NamedTuple):
    """Everything an instance's view is made of (``api.views.instance_json``'s arguments).

    A tuple: comparing it compares each part, an unchanged part (the very
    same row) at once by identity.
    """

    record: InstanceRecord
    agent: AgentStatus
    faults: tuple[Fault, ...]
    agent_history: tuple[LinkChange, ...]
    location: str = "none"
    unreachable: Fault | None = None
    # Where its console is logged, as its member told it (None: on this daemon's host).
    console_log: str | None = None


@attrs.frozen
class Rendered:
    """One instance's view, its JSON text (as ``json.dumps`` writes it) and its ETag.

    ``view`` is shared by every read of the same inputs: read it, never change it.
    """

    view: dict[str, Any]
    json: bytes
    etag: str


class RenderedInstances:
    """The instances' views, each rendered again only when its inputs changed.

    ``render`` makes an instance's view from its inputs; ``exists`` says
    whether an instance of that name still exists (entries of the others are
    dropped, now and then, as entries are added).
    """

    def __init__(
        self,
        render: Callable[[ViewInputs], dict[str, Any]],
        exists: Callable[[str], bool],
    ) -> None:
        self._render = render
        self._exists = exists
        self._kept: dict[str, tuple[ViewInputs, Rendered]] = {}
        self._sweep_at = _FIRST_SWEEP
        # How many reads rendered (the others were answered from what was kept).
        self.renders = 0

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, inputs: ViewInputs) -> Rendered:
        """The instance's view for these inputs: kept if they are the last ones, else rendered."""
        name = inputs.record.name
        kept = self._kept.get(name)
        if kept is not None and kept[0] == inputs:
            return kept[1]
        view = self._render(inputs)
        rendered = Rendered(view, json.dumps(view).encode("utf-8"), instance_etag(view))
        self.renders += 1
        if kept is None and len(self._kept) >= self._sweep_at:
            self._sweep()
        self._kept[name] = (inputs, rendered)
        return rendered

    def _sweep(self) -> None:
        """Drop the entries of instances that no longer exist."""
        self._kept = {name: kept for name, kept in self._kept.items() if self._exists(name)}
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._kept))


async def in_slices(
    items: Sequence[T], each: Callable[[T], R], clock: IReactorTime, size: int = SLICE
) -> list[R]:
    """``each`` of every item, in order, ``size`` items per turn of the reactor.

    So a list of 1,000 instances does not hold up, until it is done, every
    request that came after it: they are served between its slices.
    """
    done = [each(item) for item in items[:size]]
    for start in range(size, len(items), size):
        await deferLater(clock, 0, lambda: None)
        done.extend(each(item) for item in items[start : start + size])
    return done
