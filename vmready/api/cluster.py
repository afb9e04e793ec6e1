"""The operator API as one member of a cluster: members' JSON, forwarding, placement.

``ClusterContext`` is what ``OperatorAPI(..., cluster=...)`` needs to answer as
any member: the ``Membership`` (who runs what, who is reachable) and a
``Forwarder`` (requests to the member that runs an instance).  Without one
(``cluster=None``) the API is a single host's, unchanged.

Which requests go where (docs/operator-guide.md, "Clusters"): reads of the
instance list and of one instance are answered here, from the shared store;
every other request about an instance another member runs (its actions,
state, snapshots, console, history, config, rename, delete) is relayed to that
member and its answer relayed back.  The operations a relayed request
started are remembered (by id, up to ``MAX_REMEMBERED_OPERATIONS``), so
``GET /1.0/operations/<id>`` and ``…/wait`` reach them through this member too.

A relayed request never waits for ever on its member: it has the
forwarder's deadline (``api.forwarding.DEADLINE``) plus the wait it asks for,
and it is given up as soon as the member's lease runs out
(``Membership.state_of``, looked at every ``WATCH_INTERVAL``).  An
operation's ``/wait`` is relayed as waits of at most ``WAIT_STEP`` seconds,
one after the other up to the wait the client asked for (``forward_wait``):
never cut short, and never left pending on a member that stopped answering,
even with no limit.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from vmready.api.forwarding import DEADLINE, FORWARDED_BY, Forwarder, Relayed
from vmready.api.views import unreachable_fault
from vmready.domain import (
    Conflict,
    InstanceRecord,
    IVMReadyReactor,
    LoopDetected,
    MemberRecord,
    MemberState,
    NotFound,
    Unavailable,
    VMReadyError,
    lease_time,
)
from vmready.lifecycle import Fault, LiveView, Membership, RemoteViews
from vmready.trust import CertificatePair

# What an instance's view shows of the cluster: its location, and the fault of an unreachable
# member (None: reachable, or this member's own).
Placement = tuple[str, Fault | None]

MAX_REMEMBERED_OPERATIONS = 4096
# The longest wait one relayed ``/wait`` asks for: a longer one is relayed as several.
WAIT_STEP = 60.0
NOT_A_MEMBER = "this daemon is not a cluster member: it runs alone on its store"
_STATUS_WORDS = {MemberState.ONLINE: "Online", MemberState.UNREACHABLE: "Unreachable"}


def member_json(member: MemberRecord, state: MemberState, instances: int) -> dict[str, Any]:
    """One member as ``/1.0/cluster/members/<name>`` shows it (LXD's member object, in part)."""
    online = state is MemberState.ONLINE
    return {
        "server_name": member.name,
        "url": f"https://{member.address}",
        "address": member.address,
        "fingerprint": member.fingerprint,
        "status": _STATUS_WORDS[state],
        "message": (
            "Fully operational"
            if online
            else f"lease ran out at {lease_time(member.lease_expires)}"
        ),
        "instances": instances,
        "joined_at": lease_time(member.joined_at),
        "lease_expires_at": lease_time(member.lease_expires),
    }


class ClusterContext:
    """This daemon as member ``membership.name``: who runs what, and the way to the others."""

    log = Logger()

    def __init__(
        self, membership: Membership, forwarder: Forwarder, views: RemoteViews | None = None
    ) -> None:
        self.membership = membership
        self.forwarder = forwarder
        # What the other members told of their instances (``lifecycle.liveviews``).
        self.views = views if views is not None else RemoteViews()
        # Operations started through a forwarded request: their id → the member running them.
        self._operations: OrderedDict[str, str] = OrderedDict()
        # The longest wait one relayed ``/wait`` asks for (``forward_wait``).
        self.wait_step = WAIT_STEP

    @classmethod
    def over_tls(
        cls,
        membership: Membership,
        reactor: IVMReadyReactor,
        identity: CertificatePair,
        deadline: float = DEADLINE,
        views: RemoteViews | None = None,
    ) -> ClusterContext:
        """Forwarding over mutual TLS, presenting ``identity`` (the daemon's server pair);
        ``deadline``: seconds a relayed request may take beyond the wait it asks for;
        ``views``: what the other members told of their instances (the relay's)."""
        return cls(membership, Forwarder(reactor, identity, membership.name, deadline), views)

    @property
    def name(self) -> str:
        """This member's name."""
        return self.membership.name

    def close(self) -> Deferred[None]:
        """Close the connections kept to the other members (the daemon is stopping)."""
        return self.forwarder.close()

    # -- members ------------------------------------------------------------

    def members_json(self) -> list[dict[str, Any]]:
        """Every member, by name."""
        view = self.membership.current()
        return [
            member_json(
                member,
                self.membership.state_of(member),
                view.instance_counts.get(member.name, 0),
            )
            for member in view.members
        ]

    def member_json(self, name: str) -> dict[str, Any]:
        """Member ``name``; NotFound for one the cluster does not have."""
        for shown in self.members_json():
            if shown["server_name"] == name:
                return shown
        known = ", ".join(m.name for m in self.membership.view.members) or "none"
        raise NotFound(f"no cluster member is called {name!r} (members: {known})")

    async def remove_member(self, name: str) -> dict[str, Any]:
        """Retire member ``name``: its row goes, and its certificate is no member's any more.

        409 for the member answering (it would remove itself while it serves),
        for one online, or for one still running instances (the store judges
        the last two, on its clock, as it deletes); 404 for no such member.
        This member reads the members again at once; the others hear of it
        (PostgreSQL: ``vmready_members``) or read it at their next renewal.
        """
        if name == self.name:
            raise Conflict(
                f"cluster member {name} is the one answering this request and cannot remove "
                "itself: stop its daemon, then remove it through another member"
            )
        removed = await self.membership.store.members.remove_member(name)
        try:
            await self.membership.refresh()
        except Exception as e:
            # Removed all the same: the members are read again at the next renewal.
            self.log.warn(
                "removed cluster member {member}, but cannot read the members again: {error}",
                member=removed.name,
                error=e.message if isinstance(e, VMReadyError) else str(e),
            )
        self.log.info(
            "removed cluster member {member} ({address})",
            member=removed.name,
            address=removed.address,
        )
        return member_json(removed, MemberState.UNREACHABLE, 0)

    # -- instances ----------------------------------------------------------

    def location(self, record: InstanceRecord) -> str:
        """Where ``record`` runs, as LXD's ``location``: its member, ``none`` if no member's."""
        return record.member or "none"

    def placement(self, record: InstanceRecord) -> Placement:
        """Where ``record`` runs (``location``) and whether its member is unreachable now
        (``unreachable``): what its view shows of the cluster."""
        return self.location(record), self.unreachable(record)

    def placements(self) -> Callable[[InstanceRecord], Placement]:
        """``placement`` for the instances of one list, asked once per member.

        Both parts depend on the instance's member alone: a list of 1,000
        instances on three members asks the membership three times, not 1,000,
        each member as the list first came to one of its instances.
        """
        known: dict[str, Placement] = {}

        def placement(record: InstanceRecord) -> Placement:
            shown = known.get(record.member)
            if shown is None:
                shown = known[record.member] = self.placement(record)
            return shown

        return placement

    def unreachable(self, record: InstanceRecord) -> Fault | None:
        """The ``host`` fault of ``record`` when its member is unreachable now, else None."""
        reason = self.membership.unreachable_reason(record)
        if reason is None:
            return None
        member = self.membership.owner(record)
        since = member.lease_expires if member is not None else self.membership.store_now()
        return unreachable_fault(reason, since)

    def told_view(self, record: InstanceRecord, unreachable: Fault | None) -> LiveView | None:
        """What another member told of its instance ``record``, while that member is online.

        None for this member's instance, one whose member is unreachable
        (``unreachable``, as ``unreachable`` gave it: its view may be stale), or
        one whose member told nothing this member still holds.
        """
        if unreachable is not None or record.member == self.name:
            return None
        return self.views.of(record)

    def remote_owner(self, record: InstanceRecord) -> MemberRecord | None:
        """The member a request about ``record`` goes to; None: this one answers it.

        503 when that member is unreachable (its lease ran out, or it is unknown).
        """
        if self.membership.is_local(record):
            return None
        reason = self.membership.unreachable_reason(record)
        if reason is not None:
            raise Unavailable(f"instance {record.name}'s {reason}")
        return self.membership.owner(record)

    def reachable_owner(self, record: InstanceRecord) -> MemberRecord | None:
        """The other member running ``record`` while it is online; None: this one, or nobody."""
        if self.membership.is_local(record) or self.membership.is_unreachable(record):
            return None
        return self.membership.owner(record)

    def operation_owner(self, operation_id: str) -> MemberRecord | None:
        """The member running an operation a forwarded request started here; None: not one."""
        name = self._operations.get(operation_id)
        if name is None:
            return None
        member = self.membership.find(name)
        if member is None or self.membership.state_of(member) is not MemberState.ONLINE:
            at = f" at {lease_time(member.lease_expires)}" if member is not None else ""
            raise Unavailable(
                f"operation {operation_id} runs on cluster member {name}, which is "
                f"unreachable: its lease ran out{at}"
            )
        return member

    # -- forwarding ---------------------------------------------------------

    async def forward(
        self,
        request: IRequest,
        member: MemberRecord,
        what: str,
        instances: tuple[str, ...] = (),
        uri: bytes | None = None,
    ) -> bytes:
        """Relay ``request`` (about ``what``) to ``member``; its answer, as the response.

        ``instances``: read again from the store once the member answered, so
        this member's next read shows what the request changed.  ``uri``:
        path and query to send instead of the request's.  Not answered within
        the deadline, or its member unreachable meanwhile: ``Unavailable``.
        """
        relayed = await self._relay(request, member, what, uri)
        return await self._respond(request, member, relayed, instances)

    async def forward_wait(
        self, request: IRequest, member: MemberRecord, operation_id: str, timeout: float | None
    ) -> bytes:
        """Relay ``GET /1.0/operations/<id>/wait`` for ``timeout`` seconds (None: no limit).

        Relayed as waits of at most ``wait_step`` seconds, one after the
        other until the operation is done or ``timeout`` ran out: each one is
        an ordinary relayed request with its wait plus the deadline, so a
        member that stops answering (frozen, or cut off from this one while
        it still holds its lease) ends even a wait with no limit.
        """
        clock = self.membership.clock
        ends = None if timeout is None else clock.seconds() + timeout
        while True:
            # The member as it is now: it may have come back on another address or certificate.
            member = self.membership.find(member.name) or member
            left = None if ends is None else max(0.0, ends - clock.seconds())
            step = self.wait_step if left is None else min(left, self.wait_step)
            uri = request.path + f"?timeout={step:g}".encode()
            relayed = await self._relay(request, member, f"operation {operation_id}", uri, step)
            if (left is not None and left <= step) or relayed.code != 200 or _finished(relayed):
                return await self._respond(request, member, relayed, ())

    async def _relay(
        self,
        request: IRequest,
        member: MemberRecord,
        what: str,
        uri: bytes | None,
        wait: float = 0.0,
    ) -> Relayed:
        """``request`` sent to ``member`` (``uri`` instead of its own; ``wait``: the seconds
        it asks the member to wait, on top of the deadline); the member's answer."""
        forwarded_by = request.getHeader(FORWARDED_BY)
        if forwarded_by is not None:
            by = forwarded_by.decode("utf-8", "replace")
            raise LoopDetected(
                f"{what} is run by cluster member {member.name}, not {self.name}, and the "
                f"request was already forwarded once (by {by}): it is not forwarded again"
            )
        content = request.content
        body = b""
        if content is not None:
            content.seek(0)
            body = content.read()
        return await self.forwarder.forward(
            member,
            request.method,
            uri if uri is not None else request.uri,
            body,
            request.getHeader(b"Content-Type"),
            wait,
            lambda: self._lost(member.name),
        )

    async def _respond(
        self,
        request: IRequest,
        member: MemberRecord,
        relayed: Relayed,
        instances: tuple[str, ...],
    ) -> bytes:
        """``relayed`` as the response to ``request``, once what it changed is read again."""
        self._remember(relayed, member)
        for name in dict.fromkeys((*instances, *_operation_instances(relayed))):
            await self._refresh(name)
        request.setResponseCode(relayed.code)
        for header, value in relayed.headers.items():
            request.setHeader(header, value)
        request.setHeader(b"Content-Length", b"%d" % len(relayed.body))
        return relayed.body

    def _lost(self, name: str) -> str | None:
        """Why member ``name`` is unreachable now (its lease ran out), or None: it is online."""
        member = self.membership.find(name)
        if member is None:
            return "it is no longer a cluster member"
        if self.membership.state_of(member) is MemberState.ONLINE:
            return None
        return f"its lease ran out at {lease_time(member.lease_expires)}"

    def _remember(self, relayed: Relayed, member: MemberRecord) -> None:
        if relayed.code != 202:
            return
        envelope = _json(relayed.body)
        metadata = envelope.get("metadata") if envelope else None
        operation_id = metadata.get("id") if isinstance(metadata, dict) else None
        if isinstance(operation_id, str):
            self._operations[operation_id] = member.name
            while len(self._operations) > MAX_REMEMBERED_OPERATIONS:
                self._operations.popitem(last=False)

    async def _refresh(self, name: str) -> None:
        try:
            await self.membership.store.refresh_instance(name)
        except Exception as e:
            self.log.warn(
                "could not read instance {name} again after a forwarded request: {error}",
                name=name,
                error=e,
            )


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _finished(relayed: Relayed) -> bool:
    """Whether the operation an answer shows is done (its status code 200 or more)."""
    envelope = _json(relayed.body)
    metadata = envelope.get("metadata") if envelope else None
    if not isinstance(metadata, dict):
        return True  # not an operation: nothing to wait for
    code = metadata.get("status_code")
    return not isinstance(code, int) or code >= 200


def _operation_instances(relayed: Relayed) -> tuple[str, ...]:
    """The instances of an operation the answer shows started (202) or finished (``/wait``)."""
    if relayed.code not in (200, 202):
        return ()
    envelope = _json(relayed.body)
    metadata = envelope.get("metadata") if envelope else None
    if not isinstance(metadata, dict) or "may_cancel" not in metadata:
        return ()
    if relayed.code == 200 and int(metadata.get("status_code") or 0) < 200:
        return ()
    resources = metadata.get("resources") or {}
    urls = resources.get("instances") if isinstance(resources, dict) else None
    if not isinstance(urls, list):
        return ()
    return tuple(str(url).rsplit("/", 1)[-1] for url in urls)
