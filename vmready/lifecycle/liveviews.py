"""What only an instance's own member knows of it, told to the other members as it changes.

Every member holds every instance row (``lifecycle.relay``), but three parts
of an instance's view live in the daemon that runs it: its agent's status,
its standing faults (``lifecycle.faults``) and its agent history
(``lifecycle.agenthistory``).  Each is changed by an event that member
publishes, so the relay carries, with each event about one of its
instances, that member's *live view* of the instance as it stands once the
event's turn is over (the agent history is recorded after the event, the
faults as the bus delivers it).  The other members keep the last view told
(``RemoteViews``) and show the instance from its row and that view: a
``GET`` of another member's instance is answered where it lands, as that
member would answer it, instead of being forwarded there.

What a member does not know it does not guess.  An event relayed without a
view (it had to be trimmed to fit a NOTIFY) forgets the instance's view;
after lost notifications every view is forgotten; a view told by a member
that no longer runs the instance is not used.  Without a view, the
instance's member is asked, as before.  A member that joins, or comes back
to its notifications, asks for every view (``resend``); a member that starts
tells all of its own at once (its agents' links start over with it).  Only a
daemon holding its member's lease tells anything: one refused the name, or
whose lease was taken over, knows nothing of those instances worth hearing.

The faults told are the instance's own: the store's faults that
``FaultLog.of`` adds are the answering member's, which is the one whose
store they are about.  The view also says where that member's host logs the
instance's console (another host's path is no use).

Encoding, decoding and the kept views are plain functions and classes
without I/O; the relay sends and receives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs

from vmready.domain import InstanceRecord
from vmready.lifecycle.agenthistory import LinkChange
from vmready.lifecycle.faults import Fault, FaultLog
from vmready.protocols import AgentStatus


@attrs.frozen
class LiveView:
    """Member ``member``'s own view of one of its instances: agent, faults, agent history."""

    member: str
    agent: AgentStatus
    faults: tuple[Fault, ...] = ()
    history: tuple[LinkChange, ...] = ()
    # Where that member's host logs the instance's serial console (None: not told).
    console_log: str | None = None


def view_json(view: LiveView) -> dict[str, Any]:
    """The view as a relay payload carries it (its member is the payload's)."""
    return {
        "agent": view.agent.value,
        "faults": [[fault.kind, fault.message, fault.since] for fault in view.faults],
        "history": [[change.status, change.at, change.reason] for change in view.history],
        "console": view.console_log,
    }


def view_from_json(member: str, value: Any) -> LiveView | None:
    """The view ``view_json`` gave, told by ``member``; None if ``value`` is not one."""
    if not isinstance(value, dict):
        return None
    try:
        agent = AgentStatus(value.get("agent"))
    except ValueError:
        return None
    faults = _rows(value.get("faults"), _fault)
    history = _rows(value.get("history"), _change)
    console_log = value.get("console")
    if faults is None or history is None or not isinstance(console_log, str | None):
        return None
    return LiveView(member, agent, tuple(faults), tuple(history), console_log)


def views_from_json(member: str, value: Mapping[str, Any]) -> dict[str, LiveView]:
    """The views a payload told, by instance name (any that is not one left out)."""
    views = {}
    for name, view_value in value.items():
        view = view_from_json(member, view_value)
        if view is not None:
            views[name] = view
    return views


def _rows(value: Any, decode: Callable[[list[Any]], Any]) -> list[Any] | None:
    if not isinstance(value, list):
        return None
    rows = [decode(row) if isinstance(row, list) and len(row) == 3 else None for row in value]
    return None if any(row is None for row in rows) else rows


def _fault(row: list[Any]) -> Fault | None:
    kind, message, since = row
    if isinstance(kind, str) and isinstance(message, str) and _time(since):
        return Fault(kind, message, float(since))
    return None


def _change(row: list[Any]) -> LinkChange | None:
    status, at, reason = row
    if isinstance(status, str) and _time(at) and (reason is None or isinstance(reason, str)):
        return LinkChange(status, float(at), reason)
    return None


def _time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class OwnedRows(Protocol):
    """The instance rows as this member reads them (the store's ``view``)."""

    def find_instance(self, name: str) -> InstanceRecord | None: ...

    def owned_instances(self) -> list[InstanceRecord]: ...


class OwnViews:
    """This member's live view of each instance it runs, read from the lifecycle's parts."""

    def __init__(
        self,
        member: str,
        rows: OwnedRows,
        agent_status: Callable[[str], AgentStatus],
        faults: FaultLog,
        history: Callable[[str], Iterable[LinkChange]],
        console_log: Callable[[InstanceRecord], str],
    ) -> None:
        self.member = member
        self._rows = rows
        self._agent_status = agent_status
        self._faults = faults
        self._history = history
        self._console_log = console_log

    def of(self, name: str) -> LiveView | None:
        """The view of instance ``name``; None unless this member runs it."""
        record = self._rows.find_instance(name)
        if record is None or record.member != self.member:
            return None
        return self._view(record)

    def every(self) -> dict[str, LiveView]:
        """The view of every instance this member runs, by name."""
        return {record.name: self._view(record) for record in self._rows.owned_instances()}

    def _view(self, record: InstanceRecord) -> LiveView:
        name = record.name
        return LiveView(
            self.member,
            self._agent_status(name),
            tuple(self._faults.own(name)),
            tuple(self._history(name)),
            self._console_log(record),
        )


class RemoteViews:
    """The other members' live views of their instances, as the relay last told them."""

    def __init__(self) -> None:
        self._views: dict[str, LiveView] = {}

    def __len__(self) -> int:
        return len(self._views)

    def of(self, record: InstanceRecord) -> LiveView | None:
        """The view of ``record`` told by the member that runs it now; None: none known."""
        view = self._views.get(record.name)
        if view is None or view.member != record.member:
            return None
        return view

    def told(self, name: str, view: LiveView | None) -> None:
        """Instance ``name``'s member told its view (None: an event came without one)."""
        if view is None:
            self._views.pop(name, None)
        else:
            self._views[name] = view

    def told_all(self, views: Mapping[str, LiveView]) -> None:
        """A member told the views of its instances (at its start, or asked to)."""
        self._views.update(views)

    def forget(self, name: str) -> None:
        """Instance ``name`` is gone (deleted, or renamed away)."""
        self._views.pop(name, None)

    def clear(self) -> None:
        """Notifications were lost: no view told before can be trusted."""
        self._views.clear()
