"""The operator API as LXD's clients drive it, in memory (StubTreq): what LXD's API means.

``If-Match`` on ``PUT``, ``filter=``, LXD's request bodies (snapshot expiry,
a rename's move fields), ``?project=``, ``recursion=2`` and the "not supported
by vmready" answers.  The real clients run in ``tests/lxdclients``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

import vmready
from tests.api.test_api import APITestCase
from vmready.api.filtering import parse_filter
from vmready.domain.model import BadRequest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "docs")
_WEB1 = {
    "name": "web1",
    "status": "Running",
    "config": {"user.role": "web", "limits.cpu": "2"},
    "ephemeral": False,
}


class PutETagTests(APITestCase):
    """``PUT /1.0/instances/NAME`` with LXD's ``If-Match``: 412 when stale."""

    async def fetch(self) -> tuple[dict[str, Any], str]:
        """The instance and the ETag its GET answers."""
        reply = await self.call("GET", "/1.0/instances/web1")
        [etag] = reply.headers["etag"]
        return reply.metadata, etag

    async def put(self, view: dict[str, Any], etag: str) -> Any:
        """A PUT of ``view``'s writable fields with ``If-Match: etag``."""
        body = {key: view[key] for key in ("architecture", "config", "devices", "profiles")}
        pending = self.http.request(
            "PUT",
            "http://vmready/1.0/instances/web1",
            json=body,
            headers={"If-Match": etag},
        )
        self.http.flush()
        response = await pending
        return response.code, await self.http.json_content(response)

    async def test_staleETagIs412AndChangesNothing(self) -> None:
        await self.launch()
        view, stale = await self.fetch()
        await self.call("PATCH", "/1.0/instances/web1", {"config": {"user.role": "db"}})
        view["config"]["user.role"] = "cache"
        code, body = await self.put(view, stale)
        self.assertEqual(code, 412)
        self.assertEqual(
            body,
            {
                "type": "error",
                "error": "ETag doesn't match: instance web1 changed since it was read",
                "error_code": 412,
            },
        )
        shown, _ = await self.fetch()
        self.assertEqual(shown["config"]["user.role"], "db")

    async def test_freshETagReplacesTheConfig(self) -> None:
        await self.launch(config={"user.role": "web", "user.tier": "gold"})
        view, etag = await self.fetch()
        view["config"]["user.role"] = "db"
        del view["config"]["user.tier"]
        code, body = await self.put(view, etag)
        self.assertEqual((code, body["metadata"]["status"]), (202, "Success"))
        shown, newer = await self.fetch()
        self.assertEqual(shown["config"]["user.role"], "db")
        self.assertNotIn("user.tier", shown["config"])
        self.assertNotEqual(newer, etag)


class FilterParsingTests(SynchronousTestCase):
    """``filter=``: LXD's expressions as ``lxc list`` sends them, and one line for a bad one."""

    def matches(self, expression: str) -> bool:
        predicate = parse_filter(expression)
        assert predicate is not None
        return predicate(_WEB1)

    def refusal(self, expression: str) -> str:
        error = self.assertRaises(BadRequest, parse_filter, expression)
        message = str(error.message)
        self.assertNotIn("\n", message)
        return message

    def test_noFilterIsNone(self) -> None:
        self.assertIsNone(parse_filter(None))
        self.assertIsNone(parse_filter("  "))

    def test_eqComparesAsTextCaseInsensitively(self) -> None:
        self.assertTrue(self.matches("status eq running"))
        self.assertFalse(self.matches("status eq stopped"))

    def test_neIsTheOpposite(self) -> None:
        self.assertTrue(self.matches("status ne stopped"))
        self.assertFalse(self.matches("status ne Running"))

    def test_notNegatesAClause(self) -> None:
        self.assertTrue(self.matches("not status eq stopped"))

    def test_andBindsBeforeOr(self) -> None:
        self.assertTrue(self.matches("name eq db1 and status eq x or name eq web1"))
        self.assertFalse(self.matches("name eq web1 and status eq stopped"))

    def test_configKeysWithDotsAndQuotedValues(self) -> None:
        self.assertTrue(self.matches("config.user.role eq 'web'"))
        self.assertTrue(self.matches('config.limits.cpu eq "2"'))
        self.assertTrue(self.matches("ephemeral eq false"))

    def test_unknownOperatorIsOneLine400(self) -> None:
        self.assertEqual(
            self.refusal("status gt 1"),
            "Invalid filter 'status gt 1': unknown operator 'gt' (expected eq or ne)",
        )

    def test_missingValueIsOneLine400(self) -> None:
        self.assertEqual(
            self.refusal("status eq"), "Invalid filter 'status eq': expected FIELD eq|ne VALUE"
        )

    def test_badJoinerIsOneLine400(self) -> None:
        self.assertEqual(
            self.refusal("status eq running xor name eq web1"),
            "Invalid filter 'status eq running xor name eq web1': "
            "expected 'and' or 'or' between clauses",
        )

    def test_unbalancedQuoteIsOneLine400(self) -> None:
        self.assertIn('Invalid filter "name eq \'web1": ', self.refusal("name eq 'web1"))


class FilterRouteTests(APITestCase):
    """``GET /1.0/instances?filter=``: the list filtered, a bad filter a 400 envelope."""

    async def test_listKeepsWhatTheFilterMatches(self) -> None:
        await self.launch("web1")
        await self.settle(await self.call("POST", "/1.0/instances", {"name": "db1"}))
        reply = await self.call("GET", "/1.0/instances?filter=status+eq+stopped")
        self.assertEqual(reply.metadata, ["/1.0/instances/db1"])

    async def test_badFilterIs400(self) -> None:
        reply = await self.call("GET", "/1.0/instances?filter=status+gt+1")
        self.assertError(
            reply, 400, "Invalid filter 'status gt 1': unknown operator 'gt' (expected eq or ne)"
        )


class RecursionTwoTests(APITestCase):
    """``recursion=2`` (``container_full``): each instance with its state and snapshots."""

    async def test_eachInstanceCarriesItsStateSnapshotsAndBackups(self) -> None:
        await self.launch()
        await self.settle(await self.call("POST", "/1.0/instances/web1/snapshots", {"name": "s1"}))
        [full] = (await self.call("GET", "/1.0/instances?recursion=2")).metadata
        self.assertEqual(full["name"], "web1")
        self.assertEqual(full["state"]["status"], "Running")
        self.assertEqual([s["name"] for s in full["snapshots"]], ["s1"])
        self.assertEqual(full["backups"], [])

    async def test_recursionOneHasNoState(self) -> None:
        await self.launch()
        [shown] = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertNotIn("state", shown)


class SnapshotBodyTests(APITestCase):
    """LXD's snapshot body: ``expires_at`` accepted as ``null`` or Go's zero time only."""

    async def test_nullAndZeroExpiryAreAccepted(self) -> None:
        await self.launch()
        for name, expires in (("s1", None), ("s2", "0001-01-01T00:00:00Z")):
            body = {"name": name, "stateful": False, "expires_at": expires}
            await self.settle(await self.call("POST", "/1.0/instances/web1/snapshots", body))
        listed = await self.call("GET", "/1.0/instances/web1/snapshots")
        self.assertEqual(len(listed.metadata), 2)

    async def test_anExpiryIsRefusedSayingWhy(self) -> None:
        await self.launch()
        body = {"name": "s1", "expires_at": "2030-01-01T00:00:00Z"}
        reply = await self.call("POST", "/1.0/instances/web1/snapshots", body)
        self.assertError(
            reply,
            400,
            "Invalid field 'expires_at': snapshot expiry (not supported by vmready), "
            "got '2030-01-01T00:00:00Z'",
        )


class RenameBodyTests(APITestCase):
    """LXD's rename body: its move fields accepted at their defaults, refused otherwise."""

    async def test_moveFieldsAtTheirDefaultsRename(self) -> None:
        await self.settle(await self.call("POST", "/1.0/instances", {"name": "web1"}))
        body = {
            "name": "web2",
            "migration": False,
            "live": False,
            "instance_only": False,
            "container_only": False,
            "target": "",
            "pool": "",
            "project": "",
            "allow_inconsistent": False,
        }
        await self.settle(await self.call("POST", "/1.0/instances/web1", body))
        listed = await self.call("GET", "/1.0/instances")
        self.assertEqual(listed.metadata, ["/1.0/instances/web2"])

    async def test_aMoveIsRefusedSayingWhy(self) -> None:
        await self.settle(await self.call("POST", "/1.0/instances", {"name": "web1"}))
        for field, value, why in (
            ("migration", True, "migrations"),
            ("target", "host2", "moves to another cluster member"),
            ("pool", "fast", "storage pools"),
        ):
            reply = await self.call("POST", "/1.0/instances/web1", {"name": "web2", field: value})
            self.assertError(
                reply,
                400,
                f"Invalid field {field!r}: {why} (not supported by vmready), got {value!r}",
            )
        reply = await self.call("POST", "/1.0/instances/web1", {"name": "web2", "x": 1})
        self.assertError(reply, 400, "Invalid field 'x': a rename takes no such field")


class ProjectTests(APITestCase):
    """``?project=``: ``default`` (or none) everywhere; any other is LXD's 404, saying why."""

    async def test_defaultProjectIsServedEverywhere(self) -> None:
        await self.launch()
        for path in ("/1.0", "/1.0/instances", "/1.0/instances/web1", "/1.0/operations"):
            reply = await self.call("GET", path + "?project=default")
            self.assertEqual(reply.code, 200, path)
        created = await self.call("POST", "/1.0/instances?project=default", {"name": "db1"})
        await self.settle(created)

    async def test_anotherProjectIsNotFoundOnEveryRoute(self) -> None:
        await self.launch()
        message = (
            "Project 'p2' not found: vmready has only 'default' "
            "(other projects are not supported by vmready)"
        )
        for method, path in (
            ("GET", "/1.0/instances"),
            ("GET", "/1.0/instances/web1"),
            ("PUT", "/1.0/instances/web1/state"),
            ("GET", "/1.0/events"),
            ("GET", "/1.0/projects/p2"),
        ):
            reply = await self.call(method, path + "?project=p2", {"action": "stop"})
            self.assertError(reply, 404, message)
        self.assertEqual((await self.state())["status"], "Running")


class NotSupportedTests(APITestCase):
    """What LXD has and vmready does not: 501 in LXD's error envelope, saying so."""

    async def test_instanceFeaturesAre501(self) -> None:
        await self.launch()
        reply = await self.call("POST", "/1.0/instances/web1/exec", {"command": ["true"]})
        self.assertError(
            reply, 501, "Running commands in a guest (lxc exec): not supported by vmready"
        )
        reply = await self.call("GET", "/1.0/instances/web1/files?path=/etc/hosts")
        self.assertError(reply, 501, "Guest files (lxc file): not supported by vmready")

    async def test_aMissingInstancesFeatureIs404NotFound(self) -> None:
        reply = await self.call("POST", "/1.0/instances/nope/exec", {})
        self.assertError(reply, 404, "Instance nope not found")

    async def test_collectionsAre501(self) -> None:
        reply = await self.call("GET", "/1.0/storage-pools/default")
        self.assertError(reply, 501, "Storage pools (lxc storage): not supported by vmready")
        reply = await self.call("GET", "/1.0/networks")
        self.assertError(reply, 501, "Networks (lxc network): not supported by vmready")
        reply = await self.call("POST", "/1.0/images", {"source": {"type": "url"}})
        self.assertError(
            reply,
            501,
            "Images (lxc image, lxc launch IMAGE; vmready boots what config's boot.image "
            "names): not supported by vmready",
        )

    async def test_anotherProjectCannotBeCreated(self) -> None:
        reply = await self.call("POST", "/1.0/projects", {"name": "p2"})
        self.assertError(
            reply,
            501,
            "Profiles and projects other than an empty 'default': not supported by vmready",
        )

    async def test_onlyTheEmptyDefaultProfile(self) -> None:
        profile = (await self.call("GET", "/1.0/profiles/default")).metadata
        self.assertEqual((profile["config"], profile["devices"]), ({}, {}))
        reply = await self.call("POST", "/1.0/profiles", {"name": "p2"})
        self.assertError(
            reply,
            501,
            "Profiles and projects other than an empty 'default': not supported by vmready",
        )


class ServerTests(APITestCase):
    """``GET /1.0`` as LXD's clients read it: the extensions honoured, the server's environment."""

    async def test_theExtensionsAreExactlyTheDocumentedOnes(self) -> None:
        with open(os.path.join(DOCS, "api.md"), encoding="utf-8") as f:
            documented = f.read().split("What works, and the API extensions", 1)[1]
        documented = documented.split("Times are RFC", 1)[0]
        server = (await self.call("GET", "/1.0")).metadata
        self.assertEqual(
            server["api_extensions"],
            [
                "instances",
                "api_filtering",
                "container_full",
                "instance_get_full",
                "console",
                "event_lifecycle",
                "event_project",
                "etag",
            ],
        )
        # docs/api.md names each (lower-case, in backquotes), in the same order, and no other.
        self.assertEqual(re.findall(r"`([a-z_]+)`", documented), server["api_extensions"])

    async def test_theEnvironmentNamesTheServerAsLXDDoes(self) -> None:
        environment = (await self.call("GET", "/1.0")).metadata["environment"]
        self.assertEqual(environment["server"], "vmready")
        self.assertEqual(environment["server_version"], vmready.__version__)
        self.assertEqual(environment["kernel_version"], os.uname().release)
        self.assertEqual(environment["driver"], environment["hypervisor"])
        self.assertEqual(environment["instance_types"], ["virtual-machine"])
        self.assertEqual(environment["project"], "default")
        self.assertIsInstance(environment["server_name"], str)


class InstanceFieldsTests(APITestCase):
    """An instance has LXD's fields beside vmready's own; a create is stopped unless started."""

    async def test_lxdsFieldsAreThere(self) -> None:
        await self.launch(config={"user.role": "web"})
        shown = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(
            {
                key: shown[key]
                for key in (
                    "type",
                    "ephemeral",
                    "stateful",
                    "profiles",
                    "description",
                    "project",
                    "devices",
                    "expanded_devices",
                )
            },
            {
                "type": "virtual-machine",
                "ephemeral": False,
                "stateful": False,
                "profiles": ["default"],
                "description": "",
                "project": "default",
                "devices": {},
                "expanded_devices": {},
            },
        )
        self.assertEqual(shown["expanded_config"]["user.role"], "web")
        self.assertEqual(shown["architecture"], "x86_64")
        self.assertRegex(shown["last_used_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
        # vmready's own fields stay.
        self.assertIn("operator_status", shown)
        self.assertIn("agent", shown)

    async def test_aCreateWithoutStartLeavesItStopped(self) -> None:
        await self.settle(await self.call("POST", "/1.0/instances", {"name": "db1"}))
        self.assertEqual((await self.state("db1"))["status"], "Stopped")
        await self.settle(
            await self.call("POST", "/1.0/instances", {"name": "db2", "start": False})
        )
        self.assertEqual((await self.state("db2"))["status"], "Stopped")
