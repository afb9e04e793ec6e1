"""Two cluster members on one store: members' API, placement, forwarding over real mutual TLS.

Members "a" and "b" are two real OperatorAPI sites over two Lifecycles
(fakeqemu VMs), each with its own connection to one SQLite store file, its
own server certificate and its remote API on 127.0.0.1; requests come in on
each one's unix socket as the CLI sends them.  Each remote API counts the
connections it accepts (``Accepting``), so the tests see which connections the
members' forwarding makes, keeps and closes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import attrs
from treq.client import HTTPClient
from twisted.internet import tcp
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.endpoints import UNIXClientEndpoint, serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import URI, Agent
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from tests.fixtures import Reply, make_lifecycle
from tests.reactor import reactor
from vmready.api.cluster import WAIT_STEP, ClusterContext
from vmready.api.forwarding import (
    CACHED_CONNECTION_TIMEOUT,
    DEADLINE,
    FORWARDED_BY,
    UNKNOWN_OUTCOME,
    Forwarder,
    Relayed,
)
from vmready.api.limits import IDLE_TIMEOUT
from vmready.api.operator import OperatorAPI
from vmready.api.operatorbase import operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.domain import lease_time
from vmready.domain.members import MemberRecord
from vmready.lifecycle import Fault, LinkChange, LiveView, rfc3339
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.members import Membership
from vmready.protocols import AgentStatus
from vmready.store.executor import StoreWriteFailed
from vmready.trust.certs import CertificatePair, generate


@implementer(IAgentEndpointFactory)
class _Unix:
    def __init__(self, path: str) -> None:
        self.path = path

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(reactor, self.path)


class _Counted(ProtocolWrapper):
    """One connection the remote API accepted; ``drop_on_data``: it dies at its next bytes."""

    factory: Accepting
    drop_on_data = False

    def __init__(self, factory: Any, wrapped: Any) -> None:
        super().__init__(factory, wrapped)
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        if self.drop_on_data:
            # As a member killed with a request in: nothing read, nothing answered.
            transport: Any = self.transport
            transport.abortConnection()
            return
        super().dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self.lost.callback(None)

    @property
    def port(self) -> int:
        """The port it was accepted on."""
        transport: Any = self.transport
        return int(transport.getHost().port)


class Accepting(WrappingFactory):
    """A remote API's TLS factory, counting the connections it accepts and those open."""

    protocol = _Counted

    def __init__(self, wrapped: IProtocolFactory) -> None:
        super().__init__(wrapped)
        self.accepted = 0
        self._idle: list[Deferred[None]] = []

    @property
    def open(self) -> list[_Counted]:
        return list(self.protocols)

    def registerProtocol(self, p: ProtocolWrapper) -> None:
        self.accepted += 1
        super().registerProtocol(p)

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiting, self._idle = self._idle, []
            for d in waiting:
                d.callback(None)

    def all_closed(self) -> Deferred[None]:
        """Fires once no accepted connection is open."""
        if not self.protocols:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._idle.append(d)
        return d

    def kill_all(self) -> None:
        """Every open connection dies at once (as when the daemon's process does)."""
        for p in self.open:
            transport: Any = p.transport
            transport.abortConnection()


@attrs.define
class Member:
    """One member: its lifecycle, API, membership, sockets."""

    name: str
    lifecycle: Lifecycle
    api: OperatorAPI
    membership: Membership
    server: CertificatePair
    socket: str
    tls_port: IListeningPort
    http: HTTPClient
    remote: Accepting

    @property
    def address(self) -> str:
        return self.membership.address

    @property
    def forwarder(self) -> Forwarder:
        assert self.api.cluster is not None
        return self.api.cluster.forwarder


class ClusterTestCase(TestCase):
    """Members a and b, both online, each knowing the other."""

    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.dir = tempfile.mkdtemp(prefix="vmr-cluster-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.store_path = os.path.join(self.dir, "vmready.sqlite")
        self.a = await self.start_member("a")
        self.b = await self.start_member("b")
        for member in (self.a, self.b):
            await member.membership.refresh()
        # First of the cleanups: the kept connections close, on both sides.
        self.addCleanup(self._close_connections)

    async def _close_connections(self) -> None:
        for member in (self.a, self.b):
            assert member.api.cluster is not None
            await member.api.cluster.close()
        for member in (self.a, self.b):
            await member.remote.all_closed()

    async def start_member(self, name: str) -> Member:
        lifecycle = make_lifecycle(self, store_path=self.store_path, member=name)
        store = lifecycle.store
        server = generate(f"vmready-{name}")
        trust = TrustRegistry(store, reactor.seconds, server.fingerprint)
        await trust.load()
        api = OperatorAPI(lifecycle, "fakeqemu", trust)
        resource = api.app.resource()
        membership = Membership(name, "", server.fingerprint, store, lifecycle.events, reactor)
        remote = Accepting(remote_tls_factory(server, remote_site(resource, trust, membership)))
        tls_port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(remote)
        self.addCleanup(self._stop_listening, tls_port)
        socket = os.path.join(self.dir, f"{name}.sock")
        unix: Any = operator_site(resource)
        unix_port = reactor.listenUNIX(socket, unix)
        self.addCleanup(self._stop_listening, unix_port)
        membership.address = f"127.0.0.1:{_port(tls_port)}"
        await membership.start()
        self.addCleanup(self._leave, membership)
        api.cluster = ClusterContext.over_tls(membership, reactor, server)
        http = HTTPClient(Agent.usingEndpointFactory(reactor, _Unix(socket)))
        return Member(name, lifecycle, api, membership, server, socket, tls_port, http, remote)

    async def restart_remote(self, member: Member) -> None:
        """``member``'s remote API stops, its connections die, and it listens again, as a
        restarted daemon does on the same address."""
        port = _port(member.tls_port)
        await self._stop_listening(member.tls_port)
        member.remote.kill_all()
        await member.remote.all_closed()
        member.tls_port = await serverFromString(
            reactor, f"tcp:{port}:interface=127.0.0.1"
        ).listen(member.remote)
        self.addCleanup(self._stop_listening, member.tls_port)

    async def unreachable(self, gone: Member, seen_by: Member) -> MemberRecord:
        """``gone`` stops renewing its lease; ``seen_by``'s view of it once it has read so."""
        await gone.membership.stop()
        await seen_by.membership.refresh()
        record = seen_by.membership.view.find(gone.name)
        assert record is not None
        return record

    def forwarder(self, identity: CertificatePair, name: str) -> Forwarder:
        """A forwarder of its own, closed at the test's end."""
        forwarder = Forwarder(reactor, identity, name)
        self.addCleanup(forwarder.close)
        return forwarder

    async def _stop_listening(self, port: IListeningPort) -> None:
        stopped = port.stopListening()
        if stopped is not None:
            await stopped

    async def _leave(self, membership: Membership) -> None:
        if membership._loop is not None:
            await membership.stop()
        await deferLater(reactor, 0, lambda: None)

    async def call(
        self,
        member: Member,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[bytes, list[bytes]] | None = None,
    ) -> Reply:
        """One request on ``member``'s unix socket; the reply, its body as JSON if it is."""
        options: dict[str, Any] = {} if body is None else {"json": body}
        response = await member.http.request(
            method, "http://vmready" + path, headers=Headers(headers or {}), **options
        )
        raw = await response.content()
        try:
            decoded: Any = json.loads(raw)
        except ValueError:
            decoded = raw
        shown = {
            key.decode().lower(): [value.decode() for value in values]
            for key, values in response.headers.getAllRawHeaders()
        }
        return Reply(response.code, decoded, shown)

    async def launch(self, via: Member, name: str, target: str | None = None) -> dict[str, Any]:
        """Launch through ``via`` and wait for the operation through it; the operation."""
        query = f"?target={target}" if target else ""
        reply = await self.call(
            via, "POST", f"/1.0/instances{query}", {"name": name, "start": True}
        )
        self.assertEqual(reply.code, 202, reply.body)
        return await self.wait(via, reply)

    async def wait(self, via: Member, reply: Reply) -> dict[str, Any]:
        """The operation a 202 started, once done (waited for through ``via``)."""
        self.assertEqual(reply.code, 202, reply.body)
        waited = await self.call(via, "GET", f"{reply.body['operation']}/wait?timeout=-1")
        self.assertEqual(waited.code, 200, waited.body)
        operation: dict[str, Any] = waited.metadata
        self.assertEqual((operation["status"], operation["err"]), ("Success", ""))
        return operation

    def assertRefusedCertificateOfA(self, failure: Any) -> None:
        """A 502: member a's server answered with a certificate the members table does not pin."""
        self.assertEqual(failure.http_status, 502)
        self.assertTrue(
            failure.message.startswith(
                f"refused the certificate of cluster member a at {self.a.address}: the "
                "server's certificate has fingerprint "
            ),
            failure.message,
        )

    def assertError(self, reply: Reply, code: int, message: str) -> None:
        self.assertEqual(
            (reply.code, reply.body),
            (code, {"type": "error", "error": message, "error_code": code}),
        )


class MembersAPITests(ClusterTestCase):
    """``GET /1.0/cluster/members`` and ``…/<name>``."""

    async def test_membersAsURLsAndObjects(self) -> None:
        await self.launch(self.a, "web1", target="a")
        # As the daemon does when the store tells it another member wrote a row.
        await self.b.lifecycle.store.refresh_instance("web1")
        reply = await self.call(self.b, "GET", "/1.0/cluster/members")
        self.assertEqual(reply.metadata, ["/1.0/cluster/members/a", "/1.0/cluster/members/b"])
        reply = await self.call(self.b, "GET", "/1.0/cluster/members?recursion=1")
        shown = [
            (m["server_name"], m["address"], m["status"], m["instances"]) for m in reply.metadata
        ]
        self.assertEqual(
            shown, [("a", self.a.address, "Online", 1), ("b", self.b.address, "Online", 0)]
        )
        one = (await self.call(self.a, "GET", "/1.0/cluster/members/b")).metadata
        view = self.a.membership.view.find("b")
        assert view is not None
        self.assertEqual(
            one,
            {
                "server_name": "b",
                "url": f"https://{self.b.address}",
                "address": self.b.address,
                "fingerprint": self.b.server.fingerprint,
                "status": "Online",
                "message": "Fully operational",
                "instances": 0,
                "joined_at": lease_time(view.joined_at),
                "lease_expires_at": lease_time(view.lease_expires),
            },
        )
        self.assertError(
            await self.call(self.a, "GET", "/1.0/cluster/members/c"),
            404,
            "no cluster member is called 'c' (members: a, b)",
        )

    async def test_anUnreachableMember(self) -> None:
        view = await self.unreachable(self.b, self.a)
        member = (await self.call(self.a, "GET", "/1.0/cluster/members/b")).metadata
        self.assertEqual(
            (member["status"], member["message"]),
            ("Unreachable", f"lease ran out at {lease_time(view.lease_expires)}"),
        )

    async def test_notAMember(self) -> None:
        lifecycle = make_lifecycle(self)
        single = OperatorAPI(lifecycle, "fakeqemu")
        from treq.testing import StubTreq

        http: Any = StubTreq(single.app.resource())
        for path in ("/1.0/cluster/members", "/1.0/cluster/members/a"):
            response = await http.get("http://vmready" + path)
            self.assertEqual(response.code, 404)
            self.assertEqual(
                json.loads(await http.content(response))["error"],
                "this daemon is not a cluster member: it runs alone on its store",
            )
        response = await http.post("http://vmready/1.0/instances?target=a", json={"name": "x"})
        self.assertEqual(
            json.loads(await http.content(response)),
            {
                "type": "error",
                "error": "Invalid target 'a': this daemon is not a cluster member: it runs "
                "alone on its store",
                "error_code": 400,
            },
        )


class PlacementAndForwardingTests(ClusterTestCase):
    """Launches placed on a member; actions relayed to the owner and its answers relayed back."""

    async def test_launchOnTheTargetThroughAnyMember(self) -> None:
        operation = await self.launch(self.b, "web1", target="a")
        # b relayed the launch to a: a runs it, b sees it in the shared store.
        self.assertEqual(self.a.lifecycle.store.view.get_instance("web1").member, "a")
        self.assertTrue(self.a.lifecycle.running.has_vm("web1"))
        self.assertFalse(self.b.lifecycle.running.has_vm("web1"))
        self.assertEqual(operation["resources"]["instances"], ["/1.0/instances/web1"])
        for via in (self.a, self.b):
            shown = (await self.call(via, "GET", "/1.0/instances/web1")).metadata
            self.assertEqual((shown["location"], shown["status"]), ("a", "Running"))
        listed = (await self.call(self.b, "GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual([(i["name"], i["location"]) for i in listed], [("web1", "a")])

    async def test_aMemberThatJustJoinedIsTrustedAtItsFirstRelayedRequest(self) -> None:
        """c joins and at once relays a launch to a, which has not read c's row yet: a reads
        the members again before refusing c's certificate, and serves the request."""
        c = await self.start_member("c")
        assert c.api.cluster is not None
        self.addCleanup(c.api.cluster.close)
        self.assertIsNone(self.a.membership.find("c"))
        reply = await self.call(
            c, "POST", "/1.0/instances?target=a", {"name": "web1", "start": False}
        )
        self.assertEqual(reply.code, 202, reply.body)
        await self.wait(c, reply)
        self.assertEqual(self.a.lifecycle.store.view.get_instance("web1").member, "a")

    async def test_anUnknownCertificateIsStillRefusedAfterTheMembersAreReadAgain(self) -> None:
        stranger = self.forwarder(generate("stranger"), "stranger")
        record = self.b.membership.view.find("a")
        assert record is not None
        answer = await stranger.forward(record, b"GET", b"/1.0/instances", b"", None)
        self.assertEqual(answer.code, 403)
        self.assertIn(b"is not trusted by the daemon", answer.body)

    async def test_launchGoesToTheLeastLoadedMember(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.launch(self.a, "web2")
        self.assertEqual(self.b.lifecycle.store.view.get_instance("web2").member, "b")
        await self.launch(self.b, "web3")
        self.assertEqual(self.a.lifecycle.store.view.get_instance("web3").member, "a")

    async def test_launchTargets(self) -> None:
        reply = await self.call(
            self.a, "POST", "/1.0/instances?target=c", {"name": "web1", "start": True}
        )
        self.assertError(reply, 404, "no cluster member is called 'c' (members: a, b)")
        expires = await self.unreachable(self.b, self.a)
        reply = await self.call(
            self.a, "POST", "/1.0/instances?target=b", {"name": "web1", "start": True}
        )
        self.assertError(
            reply,
            503,
            "cluster member b is unreachable: its lease ran out at "
            f"{lease_time(expires.lease_expires)}",
        )

    async def test_actionsThroughTheNonOwner(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertEqual(stopping.headers["location"], [stopping.body["operation"]])
        await self.wait(self.b, stopping)
        self.assertEqual(
            self.a.lifecycle.store.view.get_instance("web1").vm_state.value, "stopped"
        )
        # b read it again once the relayed operation finished.
        self.assertEqual(
            self.b.lifecycle.store.view.get_instance("web1").vm_state.value, "stopped"
        )
        shown = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(shown.metadata["status"], "Stopped")
        # A refusal comes back as the owner said it, byte for byte: a 409 stays a 409.
        direct = await self.call(
            self.a, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        relayed = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertEqual(direct.code, 409)
        self.assertEqual((relayed.code, relayed.body), (direct.code, direct.body))
        # Snapshots, history and config, relayed.
        snapshot = await self.call(self.b, "POST", "/1.0/instances/web1/snapshots", {"name": "s1"})
        await self.wait(self.b, snapshot)
        listed = await self.call(self.b, "GET", "/1.0/instances/web1/snapshots?recursion=1")
        self.assertEqual([s["name"] for s in listed.metadata], ["s1"])
        history = await self.call(self.b, "GET", "/1.0/instances/web1/actions")
        self.assertEqual([a["action"] for a in history.metadata], ["snapshot", "stop", "create"])
        patched = await self.call(
            self.b, "PATCH", "/1.0/instances/web1", {"config": {"user.role": "web"}}
        )
        self.assertEqual(patched.metadata["config"]["user.role"], "web")
        self.assertEqual(
            self.b.lifecycle.store.view.get_instance("web1").config["user.role"], "web"
        )
        deleting = await self.call(self.b, "DELETE", "/1.0/instances/web1")
        await self.wait(self.b, deleting)
        self.assertIsNone(self.a.lifecycle.store.view.find_instance("web1"))
        self.assertIsNone(self.b.lifecycle.store.view.find_instance("web1"))

    async def test_theConflictOfARaceIsA409ThroughTheNonOwner(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        # a's restart claims the task; b's stop, relayed to a meanwhile, loses the CAS.
        restarting = await self.call(
            self.a, "PUT", "/1.0/instances/web1/state", {"action": "restart", "force": True}
        )
        racing = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertEqual(racing.code, 409, racing.body)
        self.assertEqual(
            racing.body["error"],
            "Cannot stop instance web1: it is restarting (a restart is in progress)",
        )
        await self.wait(self.a, restarting)

    async def test_operationsOfRelayedRequestsAreWaitedThroughTheNonOwner(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        reply = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        operation_id = reply.metadata["id"]
        # An operation of a, not of b: b relays the reads of it.
        self.assertIn(operation_id, [op.id for op in self.a.lifecycle.operations.list()])
        self.assertNotIn(operation_id, [op.id for op in self.b.lifecycle.operations.list()])
        await self.wait(self.b, reply)
        shown = await self.call(self.b, "GET", f"/1.0/operations/{operation_id}")
        self.assertEqual(shown.metadata["status"], "Success")
        # One b never relayed is b's own business: unknown there.
        self.assertEqual((await self.call(self.b, "GET", "/1.0/operations/nope")).code, 404)

    async def test_aForwardedRequestIsNotForwardedAgain(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        reply = await self.call(
            self.b,
            "PUT",
            "/1.0/instances/web1/state",
            {"action": "stop"},
            headers={FORWARDED_BY: [b"c"]},
        )
        self.assertError(
            reply,
            508,
            "instance web1 is run by cluster member a, not b, and the request was already "
            "forwarded once (by c): it is not forwarded again",
        )
        launch = await self.call(
            self.b,
            "POST",
            "/1.0/instances?target=a",
            {"name": "w2", "start": True},
            {FORWARDED_BY: [b"c"]},
        )
        self.assertError(
            launch,
            508,
            "a launch forwarded to cluster member b names target 'a': it is not forwarded again",
        )


class UnreachableOwnerTests(ClusterTestCase):
    """An owner whose lease ran out, or that cannot be reached, and untrusted clients."""

    async def test_instancesOfAnUnreachableMemberAreUnknownUntilItReturns(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        member = await self.unreachable(self.a, self.b)
        at = lease_time(member.lease_expires)
        reason = f"host unreachable: member a's lease ran out at {at}"
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(
            (shown["status"], shown["operator_status"], shown["display_status"]),
            ("Unknown", "UNKNOWN", "UNKNOWN"),
        )
        self.assertEqual(shown["status_code"], 112)
        self.assertEqual(
            shown["faults"][0],
            {"kind": "host", "message": reason, "since": rfc3339(member.lease_expires)},
        )
        # Stored as it was: nothing was written.
        self.assertEqual(
            self.b.lifecycle.store.view.get_instance("web1").operator_status.value, "RUNNING"
        )
        reply = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertError(reply, 503, f"instance web1's {reason}")
        await self.a.membership.start()
        await self.b.membership.refresh()
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual((shown["status"], shown["faults"]), ("Running", []))

    async def test_anOwnerThatCannotBeReached(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        await self._stop_listening(self.a.tls_port)
        reply = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertEqual(reply.code, 503)
        self.assertTrue(
            reply.body["error"].startswith(f"cannot reach cluster member a at {self.a.address}: "),
            reply.body,
        )
        self.assertNotIn("\n", reply.body["error"])

    async def test_anInstanceIsShownAsItsMemberShowsIt(self) -> None:
        """Its faults, agent link and console log live on its member: b asks a."""
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        self.a.lifecycle.events.lifecycle(
            "instance-snapshot-failed", "web1", {"error": "the disk is full"}
        )
        on_a = (await self.call(self.a, "GET", "/1.0/instances/web1")).metadata
        on_b = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(on_b, on_a)
        self.assertEqual([fault["kind"] for fault in on_b["faults"]], ["snapshot"])
        # b's own view knows nothing of it.
        self.assertEqual(self.b.lifecycle.events.faults.of("web1"), [])

    async def test_anOwnerNotAnsweringLeavesTheInstanceShownFromTheStore(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        await self._stop_listening(self.a.tls_port)
        reply = await self.call(self.b, "GET", "/1.0/instances/web1")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertEqual(
            (reply.metadata["name"], reply.metadata["status"], reply.metadata["location"]),
            ("web1", "Running", "a"),
        )

    async def test_aMemberWithAnotherCertificateIsRefused(self) -> None:
        await self.launch(self.a, "web1", target="a")
        forged = MemberRecord("a", self.a.address, "00" * 32, 0.0, 2e9)
        forwarder = self.forwarder(self.b.server, "b")
        failure = await _failure(
            Deferred.fromCoroutine(forwarder.forward(forged, b"GET", b"/1.0/instances", b"", None))
        )
        self.assertRefusedCertificateOfA(failure)

    async def test_onlyMembersAreTrusted(self) -> None:
        record = self.b.membership.view.find("a")
        assert record is not None
        # b's certificate (a member's) is trusted by a; a stranger's is not.
        member = await self.forwarder(self.b.server, "b").forward(
            record, b"GET", b"/1.0/instances", b"", None
        )
        self.assertEqual(member.code, 200)
        stranger = await self.forwarder(generate("stranger"), "x").forward(
            record, b"GET", b"/1.0/instances", b"", None
        )
        self.assertEqual(stranger.code, 403)
        self.assertIn(b"is not trusted by the daemon", stranger.body)


class ListTests(ClusterTestCase):
    """Any member lists every instance, each with where it runs and whether that is reachable."""

    async def on_a(self, *names: str) -> None:
        for name in names:
            await self.launch(self.a, name, target="a")
            await self.b.lifecycle.store.refresh_instance(name)

    async def test_aListShowsEachInstanceOfAnUnreachableMemberAsUnknown(self) -> None:
        await self.on_a("web1", "web2")
        await self.launch(self.b, "db1", target="b")
        member = await self.unreachable(self.a, self.b)
        fault = {
            "kind": "host",
            "message": f"host unreachable: member a's lease ran out at "
            f"{lease_time(member.lease_expires)}",
            "since": rfc3339(member.lease_expires),
        }
        listed = (await self.call(self.b, "GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(
            [(i["name"], i["location"], i["status"], i["faults"]) for i in listed],
            [
                ("db1", "b", "Running", []),
                ("web1", "a", "Unknown", [fault]),
                ("web2", "a", "Unknown", [fault]),
            ],
        )

    async def test_aListLooksAtEachMemberOnceNotAtEachOfItsInstances(self) -> None:
        await self.on_a("web1", "web2", "web3")
        asked: list[str] = []
        reason = self.b.membership.unreachable_reason

        def counted(record: Any) -> str | None:
            asked.append(record.name)
            return reason(record)

        self.patch(self.b.membership, "unreachable_reason", counted)
        listed = (await self.call(self.b, "GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(
            [(i["name"], i["location"]) for i in listed],
            [("web1", "a"), ("web2", "a"), ("web3", "a")],
        )
        self.assertEqual(asked, ["web1"])


class ToldViewTests(ClusterTestCase):
    """A member's instance shown by another from its row and the view its member told.

    The relay carries that view with each event (``lifecycle.liveviews``,
    tested with the relay in ``tests.cluster.test_relay``); here b holds one as
    the relay would have kept it.
    """

    async def told_by_a(self) -> LiveView:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        view = LiveView(
            "a",
            AgentStatus.CONNECTED,
            (Fault("snapshot", "the disk is full", 1_700_000_000.0),),
            (LinkChange("started", 1_699_999_990.0), LinkChange("connected", 1_699_999_991.5)),
            "/srv/a/run/web1/console.log",
        )
        assert self.b.api.cluster is not None
        self.b.api.cluster.views.told("web1", view)
        return view

    async def test_aGetIsAnsweredWithTheToldViewWithoutAskingTheMember(self) -> None:
        await self.told_by_a()
        accepted = self.a.remote.accepted
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(self.a.remote.accepted, accepted)
        self.assertEqual(
            (shown["location"], shown["status"], shown["agent"]),
            (
                "a",
                "Running",
                {
                    "status": "connected",
                    "history": [
                        {"status": "started", "at": rfc3339(1_699_999_990.0)},
                        {"status": "connected", "at": rfc3339(1_699_999_991.5)},
                    ],
                },
            ),
        )
        self.assertEqual(
            shown["faults"],
            [{"kind": "snapshot", "message": "the disk is full", "since": rfc3339(1.7e9)}],
        )
        self.assertEqual(shown["console"], {"log": "/srv/a/run/web1/console.log"})
        full = (await self.call(self.b, "GET", "/1.0/instances/web1?recursion=1")).metadata
        self.assertEqual(full["state"]["agent"], {"status": "connected"})

    async def test_aListShowsTheToldView(self) -> None:
        await self.told_by_a()
        listed = (await self.call(self.b, "GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(
            [(i["name"], i["agent"]["status"], len(i["faults"])) for i in listed],
            [("web1", "connected", 1)],
        )

    async def test_theAnsweringMembersStoreFaultsAreAdded(self) -> None:
        await self.told_by_a()
        self.b.lifecycle.events.server("store-write-failed", {"error": "disk I/O"})
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual([f["kind"] for f in shown["faults"]], ["snapshot", "store"])

    async def test_aViewToldByAnotherMemberIsNotUsed(self) -> None:
        """Once the instance runs elsewhere, what its former member told is not its view."""
        await self.told_by_a()
        assert self.b.api.cluster is not None
        self.b.api.cluster.views.told(
            "web1", LiveView("c", AgentStatus.STOPPED, (), (LinkChange("stopped", 1.0),))
        )
        accepted = self.a.remote.accepted
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(self.a.remote.accepted, accepted + 1)
        self.assertEqual(shown["agent"]["status"], "unknown")

    async def test_anUnreachableMembersViewIsNotShown(self) -> None:
        await self.told_by_a()
        await self.unreachable(self.a, self.b)
        shown = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(
            (shown["status"], shown["agent"]["status"], [f["kind"] for f in shown["faults"]]),
            ("Unknown", "unknown", ["host"]),
        )


class RetireTests(ClusterTestCase):
    """``DELETE /1.0/cluster/members/<name>``: a retired member's certificate is refused."""

    async def as_b(self) -> Relayed:
        """A request to a's remote API presenting b's certificate, as b forwards."""
        record = self.b.membership.view.find("a")
        assert record is not None
        return await self.forwarder(self.b.server, "b").forward(
            record, b"GET", b"/1.0/instances", b"", None
        )

    async def test_anOnlineMemberIsNotRemoved(self) -> None:
        reply = await self.call(self.a, "DELETE", "/1.0/cluster/members/b")
        # The lease written when b renewed last; the store judges it, on its clock.
        await self.a.membership.refresh()
        view = self.a.membership.view.find("b")
        assert view is not None
        self.assertError(
            reply,
            409,
            f"cluster member b is online (its lease runs until {lease_time(view.lease_expires)})"
            ": stop its daemon first, then remove it",
        )

    async def assertRemovalRefused(self, name: str, code: int, message: str) -> None:
        """Removing member ``name`` through a is refused with ``code`` and ``message``."""
        self.assertError(
            await self.call(self.a, "DELETE", f"/1.0/cluster/members/{name}"), code, message
        )

    async def test_theMemberAnsweringDoesNotRemoveItself(self) -> None:
        await self.a.membership.stop()
        await self.assertRemovalRefused(
            "a",
            409,
            "cluster member a is the one answering this request and cannot remove itself: "
            "stop its daemon, then remove it through another member",
        )
        self.assertIsNotNone(self.b.membership.view.find("a"))

    async def test_aMemberWithInstancesIsNotRemoved(self) -> None:
        await self.launch(self.b, "web1", target="b")
        await self.launch(self.b, "web2", target="b")
        await self.b.membership.stop()
        await self.assertRemovalRefused(
            "b",
            409,
            "cluster member b still has 2 instances: start it again and delete them first "
            "(vmready cannot move instances to another member)",
        )

    async def test_unknownMember(self) -> None:
        await self.assertRemovalRefused(
            "c",
            404,
            "no cluster member is called 'c' (members: a, b)",
        )

    async def test_anUnreachableMemberStaysTrustedUntilItIsRemoved(self) -> None:
        await self.unreachable(self.b, self.a)
        # Unreachable, b is still a member: when it comes back it forwards at once.
        self.assertEqual((await self.as_b()).code, 200)
        reply = await self.call(self.a, "DELETE", "/1.0/cluster/members/b")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertEqual(
            (reply.metadata["server_name"], reply.metadata["fingerprint"]),
            ("b", self.b.server.fingerprint),
        )
        members = await self.call(self.a, "GET", "/1.0/cluster/members")
        self.assertEqual(members.metadata, ["/1.0/cluster/members/a"])
        # At once, no renewal in between: b's certificate is nobody's any more.
        refused = await self.as_b()
        self.assertEqual(refused.code, 403)
        self.assertIn(
            f"this client's certificate ({self.b.server.fingerprint}) is not trusted".encode(),
            refused.body,
        )

    async def test_aRemovalIsAnsweredEvenIfTheMembersCannotBeReadAgain(self) -> None:
        await self.unreachable(self.b, self.a)
        membership = self.a.membership

        async def store_down() -> Any:
            raise StoreWriteFailed("the store could not write: disk I/O error")

        membership.refresh = store_down  # type: ignore[method-assign]
        reply = await self.call(self.a, "DELETE", "/1.0/cluster/members/b")
        self.assertEqual((reply.code, reply.metadata["server_name"]), (200, "b"))
        del membership.refresh  # the class's again
        self.assertIsNone((await membership.refresh()).find("b"))


async def _failure(pending: Deferred[Any]) -> Any:
    try:
        await pending
    except Exception as e:
        return e
    raise AssertionError("it did not fail")


# Requests forwarded to one member at once, as a member busy with 200 clients forwards them.
BURST = 12


class ConnectionReuseTests(ClusterTestCase):
    """Forwarded requests go over kept connections, made for the member as it is now."""

    async def owned_by_a(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")

    async def set_role(self, value: str) -> None:
        reply = await self.call(
            self.b, "PATCH", "/1.0/instances/web1", {"config": {"user.role": value}}
        )
        self.assertEqual(reply.code, 200, reply.body)

    def record_of_a(self) -> MemberRecord:
        record = self.b.membership.view.find("a")
        assert record is not None
        return record

    async def get(self, member: MemberRecord) -> Relayed:
        return await self.b.forwarder.forward(member, b"GET", b"/1.0/instances", b"", None)

    def test_keptConnectionsCloseBeforeTheOwnerClosesThem(self) -> None:
        self.assertLessEqual(CACHED_CONNECTION_TIMEOUT, IDLE_TIMEOUT / 2)

    async def test_requestsToAMemberShareOneConnection(self) -> None:
        await self.owned_by_a()
        before = self.a.remote.accepted
        await self.set_role("web")
        await self.set_role("db")
        state = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(state.code, 200, state.body)
        self.assertEqual(
            self.a.lifecycle.store.view.get_instance("web1").config["user.role"], "db"
        )
        self.assertEqual(self.a.remote.accepted, before + 1)
        self.assertEqual(len(self.a.remote.open), 1)

    async def test_theConnectionsOfABurstAreKeptForTheNextBurst(self) -> None:
        record = self.record_of_a()
        accepted = self.a.remote.accepted
        for _ in range(2):
            burst = [Deferred.fromCoroutine(self.get(record)) for _ in range(BURST)]
            answers = await gatherResults(burst)
            self.assertEqual([answer.code for answer in answers], [200] * BURST)
            await deferLater(reactor, 0, lambda: None)
        self.assertEqual(self.a.remote.accepted, accepted + BURST)
        self.assertEqual(len(self.a.remote.open), BURST)

    async def test_aMemberWithAnotherIdentityGetsNewConnections(self) -> None:
        record = self.record_of_a()
        self.assertEqual((await self.get(record)).code, 200)
        [first] = self.a.remote.open
        accepted = self.a.remote.accepted
        # A new certificate in the members table: the connection made for the old one is
        # not used (it would answer 200), a new one is made and refuses a's certificate.
        renewed = attrs.evolve(record, fingerprint="00" * 32)
        failure = await _failure(Deferred.fromCoroutine(self.get(renewed)))
        self.assertRefusedCertificateOfA(failure)
        self.assertEqual(self.a.remote.accepted, accepted + 1)
        await first.lost  # the old identity's connection was closed
        # a moved (another port, same certificate): a connection to the new address only.
        moved_port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            self.a.remote
        )
        self.addCleanup(self._stop_listening, moved_port)
        self.assertEqual((await self.get(record)).code, 200)
        [second] = self.a.remote.open
        moved = attrs.evolve(record, address=f"127.0.0.1:{_port(moved_port)}")
        self.assertEqual((await self.get(moved)).code, 200)
        self.assertEqual((await self.get(moved)).code, 200)
        await second.lost
        self.assertEqual([c.port for c in self.a.remote.open], [_port(moved_port)])
        self.assertEqual(self.a.remote.accepted, accepted + 3)

    async def test_theOwnerRestartingBetweenTwoRequests(self) -> None:
        await self.owned_by_a()
        first = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(first.code, 200, first.body)
        await self.restart_remote(self.a)
        second = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(second.code, 200, second.body)
        await self.restart_remote(self.a)
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        if stopping.code == 202:
            await self.wait(self.b, stopping)
        else:
            self.assertError(
                stopping,
                502,
                f"lost the connection to cluster member a at {self.a.address} before it answered",
            )

    async def test_aRequestTheOwnerDiedWithIsRetriedOnlyIfItIsARead(self) -> None:
        await self.owned_by_a()
        await self.set_role("web")
        [kept] = self.a.remote.open
        accepted = self.a.remote.accepted
        # A read: Twisted's pool sends it again, over a new connection.
        kept.drop_on_data = True
        state = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual((state.code, state.metadata["status"]), (200, "Running"))
        self.assertEqual(self.a.remote.accepted, accepted + 1)
        await kept.lost
        # An action: it may have reached the owner, so it is not sent again.
        running = self.a.lifecycle.store.view.get_instance("web1").vm_state
        [kept] = self.a.remote.open
        kept.drop_on_data = True
        reply = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertError(
            reply,
            502,
            f"lost the connection to cluster member a at {self.a.address} before it answered",
        )
        self.assertEqual(self.a.remote.accepted, accepted + 1)
        self.assertEqual(self.a.lifecycle.store.view.get_instance("web1").vm_state, running)

    async def test_closeLeavesNoConnectionOpen(self) -> None:
        record = self.record_of_a()
        port = _port(self.a.tls_port)
        for _ in range(2):
            self.assertEqual((await self.get(record)).code, 200)
        self.assertEqual(len(self.a.remote.open), 1)
        await self.b.forwarder.close()
        self.assertEqual(_connections_to(port), [])
        await self.a.remote.all_closed()
        # Forwarding still works after it, over a connection closed once answered (close()
        # again waits for that).
        self.assertEqual((await self.get(record)).code, 200)
        await self.b.forwarder.close()
        self.assertEqual(_connections_to(port), [])
        await self.a.remote.all_closed()


def _connections_to(port: int) -> list[tcp.Client]:
    """This process's TCP client connections to ``port`` the reactor still watches."""
    watched = [*reactor.getReaders(), *reactor.getWriters()]
    return [c for c in watched if isinstance(c, tcp.Client) and _peer_port(c) == port]


def _port(port: IListeningPort) -> int:
    address: Any = port.getHost()
    return int(address.port)


def _peer_port(connection: tcp.Client) -> int:
    address: Any = connection.getPeer()
    return int(address.port)


class DeadlineTests(ClusterTestCase):
    """A member that does not answer: its request is given up, never left pending.

    The forwarders' deadline is cut to ``DEADLINE`` seconds here (30 in a daemon).
    """

    DEADLINE = 0.5

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        for member in (self.a, self.b):
            member.forwarder.deadline = self.DEADLINE
            member.forwarder.watch_interval = 0.05

    async def silent_member(self) -> tuple[MemberRecord, Accepting]:
        """A's record, its address a listening socket that accepts and never says a word."""
        silent = Accepting(Factory.forProtocol(Protocol))
        port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(silent)
        self.addCleanup(self._stop_listening, port)
        record = self.b.membership.view.find("a")
        assert record is not None
        return attrs.evolve(record, address=f"127.0.0.1:{_port(port)}"), silent

    async def frozen_connection(self) -> _Counted:
        """web1 runs on a; b's kept connection to a, which a then stops reading (frozen)."""
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        reply = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(reply.code, 200, reply.body)
        [kept] = self.a.remote.open
        transport: Any = kept.transport
        transport.pauseProducing()
        return kept

    async def thaw(self, kept: _Counted) -> None:
        """``kept`` reads again: it sees the connection b aborted, and closes."""
        transport: Any = kept.transport
        transport.resumeProducing()
        await kept.lost

    async def done_operation(self) -> tuple[_Counted, str]:
        """A stop of web1 on a, done, relayed by b; b's kept connection to a, frozen."""
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        await self.wait(self.b, stopping)
        [kept] = self.a.remote.open
        transport: Any = kept.transport
        transport.pauseProducing()
        return kept, str(stopping.body["operation"])

    def context(self, member: Member) -> ClusterContext:
        assert member.api.cluster is not None
        return member.api.cluster

    def did_not_answer(
        self, address: str, changes: bool = False, within: float | None = None
    ) -> str:
        seconds = self.DEADLINE if within is None else within
        line = f"cluster member a at {address} did not answer within {seconds:g} s"
        return f"{line}; {UNKNOWN_OUTCOME}" if changes else line

    def test_theDeadline(self) -> None:
        self.assertEqual(DEADLINE, 30.0)
        self.assertEqual(
            UNKNOWN_OUTCOME, "the request may have been carried out: check with vmready info"
        )

    async def test_aMemberThatNeverCompletesTheTLSHandshake(self) -> None:
        record, silent = await self.silent_member()
        port = int(record.address.rsplit(":", 1)[1])
        forwarder = self.b.forwarder
        for method, changes in ((b"GET", False), (b"PUT", True)):
            failure = await _failure(
                Deferred.fromCoroutine(
                    forwarder.forward(record, method, b"/1.0/instances/web1/state", b"{}", None)
                )
            )
            self.assertEqual(
                (failure.http_status, failure.message),
                (503, self.did_not_answer(record.address, changes)),
            )
            # Aborted, on this side at once; the member sees it go.
            self.assertEqual(_connections_to(port), [])
            await silent.all_closed()
        # Each request had a connection of its own, and was sent once.
        self.assertEqual(silent.accepted, 2)

    async def test_aMemberThatStopsReadingAnAction(self) -> None:
        kept = await self.frozen_connection()
        accepted = self.a.remote.accepted
        reply = await self.call(
            self.b, "PATCH", "/1.0/instances/web1", {"config": {"user.role": "web"}}
        )
        self.assertError(reply, 503, self.did_not_answer(self.a.address, changes=True))
        self.assertEqual(_connections_to(_port(self.a.tls_port)), [])
        # Not sent again, on another connection.
        self.assertEqual(self.a.remote.accepted, accepted)
        # a, reading again, may still find the request (the bytes that reached its host
        # before the reset) and carry it out: why the 503 says the outcome is unknown.
        await self.thaw(kept)
        # The next request gets a new connection and its answer.
        reply = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertEqual(self.a.remote.accepted, accepted + 1)

    async def test_closeAbortsTheConnectionsOfAMemberThatDoesNotAnswerIt(self) -> None:
        kept = await self.frozen_connection()
        self.b.forwarder.close_grace = self.DEADLINE
        started = reactor.seconds()
        await self.b.forwarder.close()
        self.assertGreaterEqual(reactor.seconds() - started, self.DEADLINE)
        self.assertEqual(_connections_to(_port(self.a.tls_port)), [])
        await self.thaw(kept)

    async def test_aMemberThatStopsReadingARead(self) -> None:
        kept = await self.frozen_connection()
        reply = await self.call(self.b, "GET", "/1.0/instances/web1/state")
        self.assertError(reply, 503, self.did_not_answer(self.a.address))
        await self.thaw(kept)

    async def test_anInstanceIsShownFromTheStoreWhenItsMemberDoesNotAnswer(self) -> None:
        kept = await self.frozen_connection()
        reply = await self.call(self.b, "GET", "/1.0/instances/web1")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertEqual(
            (reply.metadata["name"], reply.metadata["status"], reply.metadata["location"]),
            ("web1", "Running", "a"),
        )
        self.assertEqual(_connections_to(_port(self.a.tls_port)), [])
        await self.thaw(kept)

    async def test_aWaitLongerThanTheDeadlineIsNotCutShort(self) -> None:
        cluster = self.context(self.b)
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        # fakeqemu's guest ignores the ACPI button: the stop takes its whole timeout.
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "timeout": 6}
        )
        self.assertEqual(stopping.code, 202, stopping.body)
        wait = self.DEADLINE * 2
        for step in (WAIT_STEP, self.DEADLINE / 2):
            # In one relayed wait, or in several one after the other: the whole wait.
            cluster.wait_step = step
            started = reactor.seconds()
            waited = await self.call(
                self.b, "GET", f"{stopping.body['operation']}/wait?timeout={wait}"
            )
            self.assertEqual(
                (waited.code, waited.metadata["status"]), (200, "Running"), waited.body
            )
            self.assertGreaterEqual(reactor.seconds() - started, wait)
        await self.wait(self.b, stopping)

    async def test_aRelayedWaitFollowsItsMemberToANewAddress(self) -> None:
        """a comes back on another address while b relays a wait to it: each step of the wait
        reads a's record again, so the steps after the move dial the new address."""
        cluster = self.context(self.b)
        cluster.wait_step = 0.3
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.store.refresh_instance("web1")
        # fakeqemu's guest ignores the ACPI button: the stop takes its whole timeout.
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "timeout": 3}
        )
        operation = stopping.body["operation"]
        waiting = Deferred.fromCoroutine(self.call(self.b, "GET", f"{operation}/wait?timeout=-1"))
        await deferLater(reactor, 0.5, lambda: None)
        self.assertFalse(waiting.called)
        # a listens on another port too now, and its row says so.
        moved = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(self.a.remote)
        self.addCleanup(self._stop_listening, moved)
        self.a.membership.address = f"127.0.0.1:{_port(moved)}"
        await self.a.membership.renew()
        await self.b.membership.refresh()
        reply = await waiting
        self.assertEqual((reply.code, reply.metadata["status"]), (200, "Success"), reply.body)
        # The steps after the move went to the new address (the old one's kept connection
        # was not reused for them).
        self.assertNotEqual(_connections_to(_port(moved)), [])

    async def test_aWaitWithNoLimitOnAMemberThatStopsAnswering(self) -> None:
        """It holds its lease (only the way between the two is cut): the wait still ends."""
        kept, operation = await self.done_operation()
        step = self.DEADLINE / 2
        self.context(self.b).wait_step = step
        reply = await self.call(self.b, "GET", f"{operation}/wait?timeout=-1")
        self.assertError(
            reply, 503, self.did_not_answer(self.a.address, within=step + self.DEADLINE)
        )
        await self.thaw(kept)

    async def test_aWaitWithNoLimitEndsWhenTheMembersLeaseRunsOut(self) -> None:
        kept, operation = await self.done_operation()
        waiting = Deferred.fromCoroutine(self.call(self.b, "GET", f"{operation}/wait?timeout=-1"))
        # Well past the deadline, it still waits (as asked); then a's lease runs out.
        await deferLater(reactor, self.DEADLINE * 2, lambda: None)
        self.assertFalse(waiting.called)
        record = await self.unreachable(self.a, self.b)
        reply = await waiting
        self.assertError(
            reply,
            503,
            f"cluster member a at {self.a.address} became unreachable before it answered: "
            f"its lease ran out at {lease_time(record.lease_expires)}",
        )
        await self.thaw(kept)
