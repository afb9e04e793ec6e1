"""Two cluster members on one store: members' API, placement, forwarding over real mutual TLS.

Members "a" and "b" are two real OperatorAPI sites over two Lifecycles
(fakeqemu VMs), each with its own connection to one SQLite store file, its
own server certificate and its remote API on 127.0.0.1; requests come in on
each one's unix socket as the CLI sends them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import attrs
from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, serverFromString
from twisted.internet.interfaces import IListeningPort, IStreamClientEndpoint
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import URI, Agent
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from tests.fixtures import Reply, make_lifecycle
from tests.reactor import reactor
from vmready.api.cluster import ClusterContext
from vmready.api.forwarding import FORWARDED_BY, Forwarder
from vmready.api.operator import OperatorAPI, operator_site
from vmready.api.remote import remote_site, remote_tls_factory
from vmready.api.trust import TrustRegistry
from vmready.api.views import rfc3339
from vmready.domain.members import MemberRecord
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.members import Membership, lease_time
from vmready.trust.certs import CertificatePair, generate


@implementer(IAgentEndpointFactory)
class _Unix:
    def __init__(self, path: str) -> None:
        self.path = path

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(reactor, self.path)


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

    @property
    def address(self) -> str:
        return self.membership.address


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

    async def start_member(self, name: str) -> Member:
        lifecycle = make_lifecycle(self, store_path=self.store_path, member=name)
        store = lifecycle.state.store
        server = generate(f"vmready-{name}")
        trust = TrustRegistry(store, reactor.seconds, server.fingerprint)
        await trust.load()
        api = OperatorAPI(lifecycle, "fakeqemu", trust)
        resource = api.app.resource()
        membership = Membership(
            name, "", server.fingerprint, store, lifecycle.state.events, reactor
        )
        tls_port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            remote_tls_factory(server, remote_site(resource, trust, membership))
        )
        self.addCleanup(self._stop_listening, tls_port)
        socket = os.path.join(self.dir, f"{name}.sock")
        unix: Any = operator_site(resource)
        unix_port = reactor.listenUNIX(socket, unix)
        self.addCleanup(self._stop_listening, unix_port)
        membership.address = f"127.0.0.1:{tls_port.getHost().port}"
        await membership.start()
        self.addCleanup(self._leave, membership)
        api.cluster = ClusterContext.over_tls(membership, reactor, server)
        http = HTTPClient(Agent.usingEndpointFactory(reactor, _Unix(socket)))
        return Member(name, lifecycle, api, membership, server, socket, tls_port, http)

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
        reply = await self.call(via, "POST", f"/1.0/instances{query}", {"name": name})
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
        await self.b.lifecycle.state.store.refresh_instance("web1")
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
        await self.b.membership.stop()
        await self.a.membership.refresh()
        member = (await self.call(self.a, "GET", "/1.0/cluster/members/b")).metadata
        view = self.a.membership.view.find("b")
        assert view is not None
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
        self.assertEqual(self.a.lifecycle.get("web1").member, "a")
        self.assertTrue(self.a.lifecycle.state.has_vm("web1"))
        self.assertFalse(self.b.lifecycle.state.has_vm("web1"))
        self.assertEqual(operation["resources"]["instances"], ["/1.0/instances/web1"])
        for via in (self.a, self.b):
            shown = (await self.call(via, "GET", "/1.0/instances/web1")).metadata
            self.assertEqual((shown["location"], shown["status"]), ("a", "Running"))
        listed = (await self.call(self.b, "GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual([(i["name"], i["location"]) for i in listed], [("web1", "a")])

    async def test_launchGoesToTheLeastLoadedMember(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.launch(self.a, "web2")
        self.assertEqual(self.b.lifecycle.get("web2").member, "b")
        await self.launch(self.b, "web3")
        self.assertEqual(self.a.lifecycle.get("web3").member, "a")

    async def test_launchTargets(self) -> None:
        reply = await self.call(self.a, "POST", "/1.0/instances?target=c", {"name": "web1"})
        self.assertError(reply, 404, "no cluster member is called 'c' (members: a, b)")
        await self.b.membership.stop()
        await self.a.membership.refresh()
        expires = self.a.membership.view.find("b")
        assert expires is not None
        reply = await self.call(self.a, "POST", "/1.0/instances?target=b", {"name": "web1"})
        self.assertError(
            reply,
            503,
            "cluster member b is unreachable: its lease ran out at "
            f"{lease_time(expires.lease_expires)}",
        )

    async def test_actionsThroughTheNonOwner(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.state.store.refresh_instance("web1")
        stopping = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        self.assertEqual(stopping.headers["location"], [stopping.body["operation"]])
        await self.wait(self.b, stopping)
        self.assertEqual(self.a.lifecycle.get("web1").vm_state.value, "stopped")
        # b read it again once the relayed operation finished.
        self.assertEqual(self.b.lifecycle.get("web1").vm_state.value, "stopped")
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
        listed = await self.call(self.b, "GET", "/1.0/instances/web1/snapshots")
        self.assertEqual([s["name"] for s in listed.metadata], ["s1"])
        history = await self.call(self.b, "GET", "/1.0/instances/web1/actions")
        self.assertEqual([a["action"] for a in history.metadata], ["snapshot", "stop", "create"])
        patched = await self.call(
            self.b, "PATCH", "/1.0/instances/web1", {"config": {"user.role": "web"}}
        )
        self.assertEqual(patched.metadata["config"]["user.role"], "web")
        self.assertEqual(self.b.lifecycle.get("web1").config["user.role"], "web")
        deleting = await self.call(self.b, "DELETE", "/1.0/instances/web1")
        await self.wait(self.b, deleting)
        self.assertIsNone(self.a.lifecycle.state.store.find_instance("web1"))
        self.assertIsNone(self.b.lifecycle.state.store.find_instance("web1"))

    async def test_theConflictOfARaceIsA409ThroughTheNonOwner(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.state.store.refresh_instance("web1")
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
        await self.b.lifecycle.state.store.refresh_instance("web1")
        reply = await self.call(
            self.b, "PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True}
        )
        operation_id = reply.metadata["id"]
        # An operation of a, not of b: b relays the reads of it.
        self.assertIn(operation_id, [op.id for op in self.a.lifecycle.state.operations.list()])
        self.assertNotIn(operation_id, [op.id for op in self.b.lifecycle.state.operations.list()])
        await self.wait(self.b, reply)
        shown = await self.call(self.b, "GET", f"/1.0/operations/{operation_id}")
        self.assertEqual(shown.metadata["status"], "Success")
        # One b never relayed is b's own business: unknown there.
        self.assertEqual((await self.call(self.b, "GET", "/1.0/operations/nope")).code, 404)

    async def test_aForwardedRequestIsNotForwardedAgain(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.state.store.refresh_instance("web1")
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
            self.b, "POST", "/1.0/instances?target=a", {"name": "w2"}, {FORWARDED_BY: [b"c"]}
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
        await self.b.lifecycle.state.store.refresh_instance("web1")
        await self.a.membership.stop()
        await self.b.membership.refresh()
        member = self.b.membership.view.find("a")
        assert member is not None
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
        self.assertEqual(self.b.lifecycle.get("web1").operator_status.value, "RUNNING")
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
        await self.b.lifecycle.state.store.refresh_instance("web1")
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
        await self.b.lifecycle.state.store.refresh_instance("web1")
        self.a.lifecycle.state.events.lifecycle(
            "instance-snapshot-failed", "web1", {"error": "the disk is full"}
        )
        on_a = (await self.call(self.a, "GET", "/1.0/instances/web1")).metadata
        on_b = (await self.call(self.b, "GET", "/1.0/instances/web1")).metadata
        self.assertEqual(on_b, on_a)
        self.assertEqual([fault["kind"] for fault in on_b["faults"]], ["snapshot"])
        # b's own view knows nothing of it.
        self.assertEqual(self.b.lifecycle.state.events.faults.of("web1"), [])

    async def test_anOwnerNotAnsweringLeavesTheInstanceShownFromTheStore(self) -> None:
        await self.launch(self.a, "web1", target="a")
        await self.b.lifecycle.state.store.refresh_instance("web1")
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
        forwarder = Forwarder(reactor, self.b.server, "b")
        failure = await _failure(
            Deferred.fromCoroutine(forwarder.forward(forged, b"GET", b"/1.0/instances", b"", None))
        )
        self.assertEqual(failure.http_status, 502)
        self.assertTrue(
            failure.message.startswith(
                f"refused the certificate of cluster member a at {self.a.address}: the "
                "server's certificate has fingerprint "
            ),
            failure.message,
        )

    async def test_onlyMembersAreTrusted(self) -> None:
        record = self.b.membership.view.find("a")
        assert record is not None
        # b's certificate (a member's) is trusted by a; a stranger's is not.
        member = await Forwarder(reactor, self.b.server, "b").forward(
            record, b"GET", b"/1.0/instances", b"", None
        )
        self.assertEqual(member.code, 200)
        stranger = await Forwarder(reactor, generate("stranger"), "x").forward(
            record, b"GET", b"/1.0/instances", b"", None
        )
        self.assertEqual(stranger.code, 403)
        self.assertIn(b"is not trusted by the daemon", stranger.body)


async def _failure(pending: Deferred[Any]) -> Any:
    try:
        await pending
    except Exception as e:
        return e
    raise AssertionError("it did not fail")
