"""Tests for vmready.api.guest: the guest API in memory (StubTreq) and over real mutual TLS."""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import shutil
import socket
import ssl
import tempfile
from typing import Any

from OpenSSL import SSL
from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator, IStreamClientEndpoint
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.internet.unix import Port as UNIXPort
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.iweb import IAgentEndpointFactory, IRequest
from zope.interface import implementer

from tests.envelopes import error_envelope, sync_envelope
from tests.fixtures import Reply, make_lifecycle
from tests.reactor import reactor
from tests.received import Received
from vmready.api import guest as guest_api
from vmready.api.eventstream import EventStream
from vmready.api.guest import (
    FORBIDDEN_MESSAGE,
    GuestAPI,
    GuestEvent,
    GuestEventFeed,
    certificate_authorizer,
    certificate_identifier,
    guest_site,
    guest_tls_factory,
    instance_for_certificate,
)
from vmready.api.requestbody import MAX_BODY_BYTES
from vmready.domain.model import InstanceRecord
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import LIFECYCLE, Event
from vmready.store.sqlite import Store
from vmready.trust.certs import CertificatePair, generate
from vmready.trust.tls import PinnedServerTLS

_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")
_NO_BODY = object()
_NOW = datetime.datetime.now(datetime.UTC)
# Generating P-384 keys is the slow part: one set for the whole module.
_SERVER = generate("vmready")
_WEB1 = generate("web1")
_WEB2 = generate("web2")
_STRANGER = generate("web1")
# The header through which in-memory tests say who is calling (StubTreq has no TLS).
_CALLER = b"X-Test-Caller"


def _add(store: Store, name: str, config: dict[str, str] | None = None, **devices: Any) -> None:
    """An idle, stopped instance straight in the store (no VM)."""
    store.instances.create_instance(name, config or {}, devices)
    store.instances.finish_task(name, TaskState.SPAWNING, VMState.STOPPED, PowerState.SHUTDOWN)


class GuestAPITestCase(TestCase):
    """A GuestAPI over a real Lifecycle, driven in memory; the caller named by a test header."""

    timeout = 60

    def setUp(self) -> None:
        self.lifecycle: Lifecycle = make_lifecycle(self)
        self.store = self.lifecycle.store.engine
        self.revoked: set[str] = set()
        self.api = GuestAPI(self.lifecycle, self.identify, location="host1")
        # StubTreq grows treq's functions at run time; mypy cannot see them.
        self.http: Any = StubTreq(self.api.app.resource())

    def identify(self, request: IRequest) -> InstanceRecord | None:
        """The instance the test header names, unless the test revoked it."""
        name = request.getHeader(_CALLER)
        if name is None or name.decode() in self.revoked:
            return None
        return self.store.instances.find_instance(name.decode())

    def add(
        self, name: str = "web1", config: dict[str, str] | None = None, **devices: Any
    ) -> None:
        """An idle, stopped instance straight in the store (no VM)."""
        _add(self.store, name, config, **devices)

    async def launch(self, name: str = "web1", config: dict[str, Any] | None = None) -> None:
        """Create an instance with a running fakeqemu VM."""
        operation = await (await self.lifecycle.create(name, config or {})).when_done()
        # Waiters wake before the operation's final event goes out: let that happen too.
        await deferLater(reactor, 0, lambda: None)
        self.assertEqual(operation.error, "")

    async def call(
        self,
        method: str,
        path: str,
        body: Any = _NO_BODY,
        raw: bytes | None = None,
        caller: str | None = "web1",
    ) -> Reply:
        """One request from ``caller``'s guest; the response once complete."""
        data = raw
        if body is not _NO_BODY:
            data = json.dumps(body).encode("utf-8")
        headers = {_CALLER: [caller.encode()]} if caller is not None else {}
        pending = self.http.request(method, "http://guest" + path, data=data, headers=headers)
        self.http.flush()
        response = await pending
        content = await self.http.content(response)
        return Reply(
            response.code,
            json.loads(content),
            {
                name.decode("ascii").lower(): [value.decode("utf-8") for value in values]
                for name, values in response.headers.getAllRawHeaders()
            },
        )

    async def open_events(self, query: str = "", caller: str = "web1") -> tuple[Received, Any]:
        """Open ``caller``'s event stream; its line collector and the response."""
        pending = self.http.get(
            "http://guest/1.0/events" + query, headers={_CALLER: [caller.encode()]}
        )
        self.http.flush()
        response = await pending
        lines = Received()
        response.deliverBody(lines)
        return lines, response

    def update(self, name: str, config: dict[str, Any]) -> None:
        """The operator changes config (what ``PATCH /1.0/instances/<name>`` does)."""
        self.successResultOf(
            Deferred.fromCoroutine(self.lifecycle.configuring.update_config(name, config))
        )
        self.http.flush()

    def assertSync(self, reply: Reply, metadata: Any) -> None:
        """A 200 success envelope around exactly this metadata."""
        self.assertEqual((reply.code, reply.body), (200, sync_envelope(metadata)))

    def assertError(self, reply: Reply, code: int, message: str) -> None:
        """LXD's error envelope with this status and text."""
        self.assertEqual((reply.code, reply.body), (code, error_envelope(code, message)))


class ServerTests(GuestAPITestCase):
    """``GET /``, ``GET /1.0``, and what every route shares."""

    async def test_rootListsAPIVersion(self) -> None:
        self.add()
        self.assertSync(await self.call("GET", "/"), ["/1.0"])

    async def test_answersAreJSON(self) -> None:
        self.add()
        reply = await self.call("GET", "/1.0")
        self.assertEqual(reply.headers["content-type"], ["application/json"])

    async def test_instanceIsStartedUntilReady(self) -> None:
        self.add()
        self.assertSync(
            await self.call("GET", "/1.0"),
            {
                "api_version": "1.0",
                "instance_type": "virtual-machine",
                "location": "host1",
                "state": "Started",
            },
        )

    async def test_instanceIsReadyWhenItsReadyKeyIsTrue(self) -> None:
        self.add(config={READY_KEY: "true"})
        self.assertEqual((await self.call("GET", "/1.0")).metadata["state"], "Ready")

    async def test_readyKeyFalseIsStarted(self) -> None:
        self.add(config={READY_KEY: "false"})
        self.assertEqual((await self.call("GET", "/1.0")).metadata["state"], "Started")

    async def test_locationDefaultsToNone(self) -> None:
        self.add()
        self.http = StubTreq(GuestAPI(self.lifecycle, self.identify).app.resource())
        self.assertEqual((await self.call("GET", "/1.0")).metadata["location"], "none")

    async def test_unknownPathIs404(self) -> None:
        self.add()
        self.assertError(await self.call("GET", "/1.0/nothing"), 404, "not found")

    async def test_wrongMethodIs405NamingTheMethod(self) -> None:
        self.add()
        reply = await self.call("DELETE", "/1.0")
        self.assertError(reply, 405, 'method "DELETE" not allowed')
        self.assertEqual(reply.headers["allow"], ["GET, HEAD, PATCH"])

    async def test_unknownCallerIsRefusedOnEveryRoute(self) -> None:
        self.add()
        routes = [
            ("GET", "/"),
            ("GET", "/1.0"),
            ("PATCH", "/1.0"),
            ("GET", "/1.0/config"),
            ("GET", "/1.0/config/user.a"),
            ("GET", "/1.0/meta-data"),
            ("GET", "/1.0/devices"),
            ("GET", "/1.0/events"),
        ]
        for method, path in routes:
            reply = await self.call(method, path, {"state": "Ready"}, caller="nobody")
            self.assertError(reply, 403, FORBIDDEN_MESSAGE)

    async def test_revokedCallerIsRefused(self) -> None:
        self.add()
        self.revoked.add("web1")
        self.assertError(await self.call("GET", "/1.0"), 403, FORBIDDEN_MESSAGE)

    async def test_defaultIdentifyRefusesARequestWithoutCertificate(self) -> None:
        self.add()
        self.http = StubTreq(GuestAPI(self.lifecycle).app.resource())
        self.assertError(await self.call("GET", "/1.0"), 403, FORBIDDEN_MESSAGE)

    async def test_unexpectedExceptionIsLogged500(self) -> None:
        def broken(request: IRequest) -> InstanceRecord | None:
            raise RuntimeError("database on fire")

        self.api.identify = broken
        self.assertError(await self.call("GET", "/1.0"), 500, "internal server error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class PatchStateTests(GuestAPITestCase):
    """``PATCH /1.0``: the workload says Ready or Started, and nothing else."""

    async def test_readyMarksTheInstanceReady(self) -> None:
        await self.launch()
        self.assertSync(await self.call("PATCH", "/1.0", {"state": "Ready"}), {})
        self.assertEqual((await self.call("GET", "/1.0")).metadata["state"], "Ready")
        self.assertEqual(self.store.instances.get_instance("web1").config[READY_KEY], "true")

    async def test_readyEmitsInstanceReadyEveryTime(self) -> None:
        await self.launch()
        seen: list[Event] = []
        self.lifecycle.events.subscribe(seen.append, frozenset({LIFECYCLE}))
        for _ in range(2):
            await self.call("PATCH", "/1.0", {"state": "Ready"})
        ready = [e for e in seen if e.metadata["action"] == "instance-ready"]
        self.assertEqual([e.metadata["source"] for e in ready], ["/1.0/instances/web1"] * 2)

    async def test_startedWithdrawsReady(self) -> None:
        await self.launch()
        await self.call("PATCH", "/1.0", {"state": "Ready"})
        self.assertSync(await self.call("PATCH", "/1.0", {"state": "Started"}), {})
        self.assertEqual((await self.call("GET", "/1.0")).metadata["state"], "Started")
        self.assertEqual(self.store.instances.get_instance("web1").config[READY_KEY], "false")

    async def test_unknownKeysBesideStateAreIgnored(self) -> None:
        await self.launch()
        reply = await self.call("PATCH", "/1.0", {"state": "Ready", "extra": [1, 2]})
        self.assertSync(reply, {})
        self.assertEqual((await self.call("GET", "/1.0")).metadata["state"], "Ready")

    async def test_instanceWithoutRunningVMIs409(self) -> None:
        self.add()
        reply = await self.call("PATCH", "/1.0", {"state": "Ready"})
        self.assertError(reply, 409, "Instance web1 is not running")
        self.assertNotIn(READY_KEY, self.store.instances.get_instance("web1").config)

    async def test_otherStateNamesAre400(self) -> None:
        self.add()
        for state in ("ready", "READY", "Running", "Stopped", "Ready ", ""):
            reply = await self.call("PATCH", "/1.0", {"state": state})
            self.assertError(reply, 400, f'Invalid state "{state}"')

    async def test_missingOrNonStringStateIsTheEmptyState(self) -> None:
        self.add()
        bodies: list[Any] = [
            {},
            {"state": 1},
            {"state": None},
            {"state": True},
            {"state": ["Ready"]},
            {"State": "Ready"},
            [],
            "Ready",
            None,
        ]
        for body in bodies:
            reply = await self.call("PATCH", "/1.0", body)
            self.assertError(reply, 400, 'Invalid state ""')

    async def test_invalidStateIsQuotedAsGoQuotesIt(self) -> None:
        self.add()
        reply = await self.call("PATCH", "/1.0", {"state": 'a"b\\c\n\u00e9\x07\u200b\ud800'})
        self.assertError(reply, 400, 'Invalid state "a\\"b\\\\c\\né\\a\\u200b\ufffd"')

    async def test_bodyThatIsNotJSONIs400(self) -> None:
        self.add()
        cases = {
            b"{bad": "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
            b"": "Expecting value: line 1 column 1 (char 0)",
            b'{"state": NaN}': "NaN is not valid JSON",
            b'{"state": "Ready"} {}': "Extra data: line 1 column 20 (char 19)",
        }
        for raw, why in cases.items():
            reply = await self.call("PATCH", "/1.0", raw=raw)
            self.assertError(reply, 400, f"Invalid request body: {why}")

    async def test_bodyOverTheCapIs413(self) -> None:
        self.add()
        raw = b'{"state": "Ready", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
        reply = await self.call("PATCH", "/1.0", raw=raw)
        self.assertError(reply, 413, f"Request body too large (limit {MAX_BODY_BYTES} bytes)")


class ConfigTests(GuestAPITestCase):
    """``GET /1.0/config`` and ``GET /1.0/config/<key>``: user.* and cloud-init.* only."""

    async def test_listNamesUserAndCloudInitKeysSorted(self) -> None:
        self.add(
            config={
                "user.b": "2",
                "cloud-init.user-data": "#cloud-config\n",
                "user.a": "1",
                "limits.memory": "512",
                READY_KEY: "true",
            }
        )
        self.assertSync(
            await self.call("GET", "/1.0/config"),
            ["/1.0/config/cloud-init.user-data", "/1.0/config/user.a", "/1.0/config/user.b"],
        )

    async def test_listIsEmptyWithoutGuestKeys(self) -> None:
        self.add(config={"limits.cpu": "2"})
        self.assertSync(await self.call("GET", "/1.0/config"), [])

    async def test_keyGivesItsRawValue(self) -> None:
        self.add(config={"cloud-init.user-data": '#cloud-config\nruncmd: ["true"]\n'})
        self.assertSync(
            await self.call("GET", "/1.0/config/cloud-init.user-data"),
            '#cloud-config\nruncmd: ["true"]\n',
        )

    async def test_percentEncodedKeyIsDecoded(self) -> None:
        self.add(config={"user.a/b c%d?é": "odd"})
        reply = await self.call("GET", "/1.0/config/user.a%2Fb%20c%25d%3F%C3%A9")
        self.assertSync(reply, "odd")

    async def test_otherPrefixesAre403(self) -> None:
        self.add(config={"limits.memory": "512", READY_KEY: "true"})
        for key in ("limits.memory", READY_KEY, "users.a", "user"):
            self.assertError(await self.call("GET", f"/1.0/config/{key}"), 403, "not authorized")

    async def test_unsetKeyIs404(self) -> None:
        self.add()
        self.assertError(await self.call("GET", "/1.0/config/user.missing"), 404, "not found")

    async def test_emptyValueIs404(self) -> None:
        self.add(config={"user.empty": ""})
        self.assertError(await self.call("GET", "/1.0/config/user.empty"), 404, "not found")


class MetaDataAndDevicesTests(GuestAPITestCase):
    """``GET /1.0/meta-data`` and ``GET /1.0/devices``."""

    async def test_metaDataNamesTheUuidAndHostname(self) -> None:
        self.add()
        uuid = self.store.instances.get_instance("web1").uuid
        self.assertSync(
            await self.call("GET", "/1.0/meta-data"),
            f"instance-id: {uuid}\nlocal-hostname: web1\n",
        )

    async def test_metaDataEndsWithUserMetaData(self) -> None:
        self.add(config={"user.meta-data": "public-keys: []\n"})
        reply = await self.call("GET", "/1.0/meta-data")
        self.assertTrue(reply.metadata.endswith("local-hostname: web1\npublic-keys: []\n"))

    async def test_devicesAreTheInstances(self) -> None:
        self.add(root={"type": "disk", "path": "/"}, eth0={"type": "nic", "name": "eth0"})
        self.assertSync(
            await self.call("GET", "/1.0/devices"),
            {"root": {"type": "disk", "path": "/"}, "eth0": {"type": "nic", "name": "eth0"}},
        )

    async def test_noDevicesIsAnEmptyObject(self) -> None:
        self.add()
        self.assertSync(await self.call("GET", "/1.0/devices"), {})


class IsolationTests(GuestAPITestCase):
    """An instance only ever sees and changes itself."""

    async def test_anotherInstancesConfigIsInvisible(self) -> None:
        self.add("web1", {"user.mine": "1"})
        self.add("web2", {"user.secret": "hunter2"})
        self.assertSync(await self.call("GET", "/1.0/config"), ["/1.0/config/user.mine"])
        self.assertError(await self.call("GET", "/1.0/config/user.secret"), 404, "not found")

    async def test_eachCallerGetsItsOwnMetaData(self) -> None:
        self.add("web1")
        self.add("web2")
        web2 = await self.call("GET", "/1.0/meta-data", caller="web2")
        self.assertIn("local-hostname: web2\n", web2.metadata)
        self.assertIn(self.store.instances.get_instance("web2").uuid, web2.metadata)

    async def test_patchChangesOnlyTheCaller(self) -> None:
        await self.launch("web1")
        await self.launch("web2")
        await self.call("PATCH", "/1.0", {"state": "Ready"}, caller="web1")
        self.assertEqual(
            (await self.call("GET", "/1.0", caller="web2")).metadata["state"], "Started"
        )
        self.assertNotIn(READY_KEY, self.store.instances.get_instance("web2").config)

    async def test_eventsOfOtherInstancesNeverArrive(self) -> None:
        self.add("web1")
        self.add("web2")
        lines, _ = await self.open_events(caller="web1")
        self.update("web2", {"user.a": "1"})
        self.update("web1", {"user.b": "2"})
        self.assertEqual([event["metadata"]["key"] for event in lines.events], ["user.b"])


class EventTests(GuestAPITestCase):
    """``GET /1.0/events``: this instance's config changes, as JSON lines, kept open."""

    async def test_configChangesArriveWithTheirOldValues(self) -> None:
        self.add(config={"user.a": "1", "cloud-init.vendor-data": "old"})
        lines, _ = await self.open_events()
        self.update("web1", {"user.a": "2"})
        self.update("web1", {"user.b": "new", "cloud-init.vendor-data": None})
        self.assertEqual(
            [event["metadata"] for event in lines.events],
            [
                {"key": "user.a", "old_value": "1", "value": "2"},
                {"key": "cloud-init.vendor-data", "old_value": "old", "value": ""},
                {"key": "user.b", "old_value": "", "value": "new"},
            ],
        )

    async def test_linesAreTypeTimestampMetadataUnenveloped(self) -> None:
        self.add()
        lines, response = await self.open_events()
        self.update("web1", {"user.a": "1"})
        self.assertEqual(response.code, 200)
        self.assertEqual(
            response.headers.getRawHeaders(b"content-type"), [b"application/x-ndjson"]
        )
        (event,) = lines.events
        self.assertEqual(sorted(event), ["metadata", "timestamp", "type"])
        self.assertEqual(event["type"], "config")
        self.assertRegex(event["timestamp"], _RFC3339)
        self.assertFalse(lines.closed.called)

    async def test_unchangedValuesAndOtherKeysSendNothing(self) -> None:
        self.add(config={"user.a": "1"})
        lines, _ = await self.open_events()
        self.update("web1", {"user.a": "1", "limits.memory": "512"})
        self.assertEqual(lines.received, b"")

    async def test_deviceFilterLeavesConfigEventsOut(self) -> None:
        self.add()
        lines, _ = await self.open_events("?type=device")
        self.update("web1", {"user.a": "1"})
        self.assertEqual(lines.received, b"")

    async def test_typeFilterTakesCommaListsAndRepeats(self) -> None:
        self.add()
        first, _ = await self.open_events("?type=device,config")
        second, _ = await self.open_events("?type=device&type=config")
        self.update("web1", {"user.a": "1"})
        self.assertEqual([len(first.events), len(second.events)], [1, 1])

    async def test_unknownEventTypeIs400(self) -> None:
        self.add()
        self.assertError(
            await self.call("GET", "/1.0/events?type=config,lifecycle"),
            400,
            'Invalid event type "lifecycle"',
        )

    async def test_disconnectUnsubscribes(self) -> None:
        self.add()
        before = len(self.lifecycle.events._subscribers)
        lines, _ = await self.open_events()
        self.assertEqual(len(self.lifecycle.events._subscribers), before + 1)
        assert lines.transport is not None
        lines.transport.stopProducing()  # type: ignore[attr-defined]
        self.http.flush()
        self.assertEqual(len(self.lifecycle.events._subscribers), before)

    async def test_streamEndsWhenTheInstanceIsDeleted(self) -> None:
        self.add()
        before = len(self.lifecycle.events._subscribers)
        lines, _ = await self.open_events()
        operation = await (await self.lifecycle.act("web1", "delete")).when_done()
        self.assertEqual(operation.error, "")
        self.http.flush()
        await lines.closed
        assert lines.reason is not None
        self.assertIsInstance(lines.reason.value, ResponseDone)
        self.assertEqual(lines.received, b"")
        self.assertEqual(len(self.lifecycle.events._subscribers), before)

    async def test_streamEndsWhenTheCallerIsRevoked(self) -> None:
        self.add()
        lines, _ = await self.open_events()
        self.revoked.add("web1")
        self.update("web1", {"user.a": "1"})
        await lines.closed
        assert lines.reason is not None
        self.assertIsInstance(lines.reason.value, ResponseDone)
        self.assertEqual(lines.received, b"")


def _fresh_store(case: SynchronousTestCase, prefix: str) -> Store:
    """A store in a directory of its own, both gone after ``case``."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    case.addCleanup(shutil.rmtree, directory, True)
    store = Store.open(os.path.join(directory, "vmready.sqlite"))
    case.addCleanup(store.close)
    return store


class GuestEventFeedTests(SynchronousTestCase):
    """The lifecycle → guest event translation, without I/O."""

    def setUp(self) -> None:
        self.store = _fresh_store(self, "vmr-feed-")
        _add(self.store, "web1", {"user.a": "1", "limits.cpu": "1"})

    def feed(self, types: frozenset[str] = frozenset({"config", "device"})) -> GuestEventFeed:
        return GuestEventFeed(self.store.instances.get_instance("web1"), types)

    def updated(self, config: dict[str, str | None], instance: str = "web1") -> Event:
        return Event(
            LIFECYCLE,
            12.5,
            {
                "action": "instance-updated",
                "source": f"/1.0/instances/{instance}",
                "context": {"config": config},
            },
        )

    def test_changedKeyBecomesAConfigEvent(self) -> None:
        self.assertEqual(
            self.feed().feed(self.updated({"user.a": "2"})),
            [GuestEvent("config", 12.5, {"key": "user.a", "old_value": "1", "value": "2"})],
        )

    def test_oldValueIsTheOneBeforeTheLastChange(self) -> None:
        feed = self.feed()
        feed.feed(self.updated({"user.a": "2"}))
        (event,) = feed.feed(self.updated({"user.a": "3"}))
        self.assertEqual(event.metadata["old_value"], "2")

    def test_otherInstancesEventsGiveNothing(self) -> None:
        self.assertEqual(self.feed().feed(self.updated({"user.a": "2"}, instance="web10")), [])

    def test_otherActionsGiveNothing(self) -> None:
        event = Event(
            LIFECYCLE, 1.0, {"action": "instance-ready", "source": "/1.0/instances/web1"}
        )
        self.assertEqual(self.feed().feed(event), [])

    def test_nonGuestKeysGiveNothing(self) -> None:
        self.assertEqual(self.feed().feed(self.updated({"limits.cpu": "2"})), [])

    def test_withoutConfigTypeNothingIsProduced(self) -> None:
        self.assertEqual(self.feed(frozenset({"device"})).feed(self.updated({"user.a": "2"})), [])

    def test_guestEventJSONHasNoProject(self) -> None:
        event = GuestEvent("config", 0.0, {"key": "user.a"})
        self.assertEqual(
            event.to_json(),
            {"type": "config", "timestamp": "1970-01-01T00:00:00Z", "metadata": {"key": "user.a"}},
        )


class CertificateIdentityTests(SynchronousTestCase):
    """Certificates → instances: the fingerprint must be known and the date inside validity."""

    def setUp(self) -> None:
        self.store = _fresh_store(self, "vmr-ident-")
        _add(self.store, "web1")
        self.store.certificates.set_agent_certificate("web1", _WEB1.fingerprint)

    def test_knownCertificateIdentifiesItsInstance(self) -> None:
        record = instance_for_certificate(self.store.certificates, _WEB1.cert_pem, _NOW)
        self.assertEqual(record.name if record else None, "web1")

    def test_unknownCertificateIdentifiesNothing(self) -> None:
        self.assertIsNone(
            instance_for_certificate(self.store.certificates, _STRANGER.cert_pem, _NOW)
        )

    def test_certificateOutsideItsValidityIdentifiesNothing(self) -> None:
        later = _NOW + datetime.timedelta(days=20 * 365)
        earlier = _NOW - datetime.timedelta(days=1)
        self.assertIsNone(instance_for_certificate(self.store.certificates, _WEB1.cert_pem, later))
        self.assertIsNone(
            instance_for_certificate(self.store.certificates, _WEB1.cert_pem, earlier)
        )

    def test_garbageIdentifiesNothing(self) -> None:
        self.assertIsNone(
            instance_for_certificate(self.store.certificates, b"not a certificate", _NOW)
        )

    def test_deletedInstanceIdentifiesNothing(self) -> None:
        self.store.instances.delete_instance("web1")
        self.assertIsNone(instance_for_certificate(self.store.certificates, _WEB1.cert_pem, _NOW))

    def test_authorizerAcceptsExactlyIdentifyingCertificates(self) -> None:
        authorize = certificate_authorizer(self.store.certificates, clock=lambda: _NOW)
        self.assertEqual([authorize(_WEB1.cert_pem), authorize(_STRANGER.cert_pem)], [True, False])

    def test_authorizerConsultsItsClock(self) -> None:
        later = _NOW + datetime.timedelta(days=20 * 365)
        self.assertFalse(
            certificate_authorizer(self.store.certificates, clock=lambda: later)(_WEB1.cert_pem)
        )


# -- over real mutual TLS ----------------------------------------------------


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """The agent's way to the daemon: a new TLS connection to the unix socket per request."""

    def __init__(self, creator: IOpenSSLClientConnectionCreator, path: str) -> None:
        self.creator = creator
        self.path = path

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return wrapClientTLS(self.creator, UNIXClientEndpoint(reactor, self.path))


def _connections_on(path: str) -> list[object]:
    """Open connections (either end) on the unix socket at ``path``, not the listener."""
    found: list[object] = []
    wanted = os.fsencode(path)
    for selectable in {*reactor.getReaders(), *reactor.getWriters()}:
        if isinstance(selectable, UNIXPort):
            continue
        for get in ("getHost", "getPeer"):
            address = getattr(selectable, get, lambda: None)()
            name = getattr(address, "name", None)
            if name is not None and os.fsencode(name) == wanted:
                found.append(selectable)
    return found


class GuestTLSTests(TestCase):
    """The guest API behind ``guest_tls_factory``, reached the way the agent reaches it."""

    timeout = 60

    def setUp(self) -> None:
        self.lifecycle = make_lifecycle(self)
        self.store = self.lifecycle.store.engine
        _add(self.store, "web1")
        self.store.certificates.set_agent_certificate("web1", _WEB1.fingerprint)
        _add(self.store, "web2")
        self.store.certificates.set_agent_certificate("web2", _WEB2.fingerprint)
        directory = tempfile.mkdtemp(prefix="vmr-guest-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "devlxd")
        self.pools: list[HTTPConnectionPool] = []
        self.api = GuestAPI(self.lifecycle, location="host1")
        self.listening = False
        self.max_per_guest: int | None = None

    def listen(self) -> None:
        """Serve ``self.api`` on the socket with mutual TLS, as the daemon does (once)."""
        if self.listening:
            return
        self.listening = True
        self.site = guest_site(self.api.app.resource())
        if self.max_per_guest is not None:
            self.site.max_per_peer = self.max_per_guest
        port = reactor.listenUNIX(
            self.path,
            guest_tls_factory(  # type: ignore[arg-type]  # any IProtocolFactory listens
                _SERVER, self.store.certificates, self.site
            ),
        )
        # Cleanups run last-registered first: pools close, connections drain, port stops.
        self.addCleanup(port.stopListening)
        self.addCleanup(self.drained)
        self.addCleanup(self.close_pools)

    async def close_pools(self) -> None:
        for pool in self.pools:
            await pool.closeCachedConnections()

    async def drained(self) -> None:
        """Wait until both ends of every connection to the socket have closed."""
        for _ in range(500):
            if not _connections_on(self.path):
                return
            await deferLater(reactor, 0.01, lambda: None)
        self.fail(f"connections still open: {_connections_on(self.path)}")

    def agent(self, identity: CertificatePair, persistent: bool = False) -> HTTPClient:
        """An HTTP client presenting ``identity`` and pinning the daemon's certificate."""
        self.listen()
        pool = HTTPConnectionPool(reactor, persistent=persistent)
        self.pools.append(pool)
        endpoints = _Endpoints(PinnedServerTLS(identity, _SERVER.cert_pem), self.path)
        return HTTPClient(Agent.usingEndpointFactory(reactor, endpoints, pool=pool))

    async def get(self, client: HTTPClient, path: str) -> Reply:
        response = await client.get("https://guest" + path)
        body = json.loads(await response.content())
        return Reply(response.code, body, {})

    async def assertHandshakeRefused(self, client: HTTPClient) -> None:
        """The request never gets an answer: the TLS handshake failed."""
        with self.assertRaises(ResponseNeverReceived) as caught:
            await client.get("https://guest/1.0")
        self.assertIsInstance(caught.exception.reasons[0].value, SSL.Error)

    async def test_knownInstanceGetsItsOwnState(self) -> None:
        reply = await self.get(self.agent(_WEB1), "/1.0")
        self.assertEqual(reply.code, 200)
        self.assertEqual(
            reply.body,
            sync_envelope(
                {
                    "api_version": "1.0",
                    "instance_type": "virtual-machine",
                    "location": "host1",
                    "state": "Started",
                }
            ),
        )

    async def test_eachCertificateIsItsOwnInstance(self) -> None:
        web1 = await self.get(self.agent(_WEB1), "/1.0/meta-data")
        web2 = await self.get(self.agent(_WEB2), "/1.0/meta-data")
        self.assertIn("local-hostname: web1\n", web1.metadata)
        self.assertIn("local-hostname: web2\n", web2.metadata)

    async def test_unknownCertificateFailsTheHandshake(self) -> None:
        await self.assertHandshakeRefused(self.agent(_STRANGER))

    async def test_deletedInstancesCertificateFailsTheHandshake(self) -> None:
        client = self.agent(_WEB1)
        self.assertEqual((await self.get(client, "/1.0")).code, 200)
        operation = await (await self.lifecycle.act("web1", "delete")).when_done()
        self.assertEqual(operation.error, "")
        await self.assertHandshakeRefused(client)

    async def test_deletionRevokesAConnectionAlreadyOpen(self) -> None:
        client = self.agent(_WEB1, persistent=True)
        self.assertEqual((await self.get(client, "/1.0")).code, 200)
        self.store.instances.delete_instance("web1")
        reply = await self.get(client, "/1.0")
        self.assertEqual((reply.code, reply.body), (403, error_envelope(403, FORBIDDEN_MESSAGE)))

    async def test_certificatePastItsValidityIsRefusedByEveryRequest(self) -> None:
        later = _NOW + datetime.timedelta(days=20 * 365)
        self.api = GuestAPI(
            self.lifecycle, identify=certificate_identifier(self.store.certificates, lambda: later)
        )
        reply = await self.get(self.agent(_WEB1), "/1.0")
        self.assertEqual((reply.code, reply.body), (403, error_envelope(403, FORBIDDEN_MESSAGE)))

    async def test_guestThatStopsReadingItsEventsIsCutOff(self) -> None:
        self.patch(guest_api, "EventStream", functools.partial(EventStream, limit=64 * 1024))
        response = await self.agent(_WEB1).get("https://guest/1.0/events")
        lines = Received()
        response.deliverBody(lines)
        assert lines.transport is not None
        lines.transport.pauseProducing()  # type: ignore[attr-defined]
        published = 40
        for number in range(published):
            await self.lifecycle.configuring.update_config(
                "web1", {"user.blob": f"{number:02} " + "x" * 65536}
            )
            await deferLater(reactor, 0.005, lambda: None)
        lines.transport.resumeProducing()  # type: ignore[attr-defined]
        await lines.closed
        assert lines.reason is not None
        self.assertIsInstance(lines.reason.value, ResponseFailed)
        numbers = [int(event["metadata"]["value"][:2]) for event in lines.events]
        self.assertLess(len(numbers), published)
        self.assertEqual(numbers, list(range(len(numbers))))

    async def test_aGuestHoldsAtMostItsBoundOfConnections(self) -> None:
        self.max_per_guest = 2
        held = []
        for _ in range(2):  # each keeps its connection open after its answer
            client = self.agent(_WEB1, persistent=True)
            self.assertEqual((await self.get(client, "/1.0")).code, 200)
            held.append(self.pools[-1])
        with capturedLogs() as logs:
            refused = await self.get(self.agent(_WEB1), "/1.0")
        message = "Too many connections from this instance (limit 2)"
        self.assertEqual((refused.code, refused.body), (429, error_envelope(429, message)))
        self.assertEqual([log["peer"] for log in logs if "peer" in log], ["instance 'web1'"])
        # Another guest is not held back by this one.
        self.assertEqual((await self.get(self.agent(_WEB2), "/1.0")).code, 200)
        # One of web1's connections closes: its slot is free again.
        await held[0].closeCachedConnections()
        for _ in range(500):
            if self.site.per_peer["instance 'web1'"] < 2:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual((await self.get(self.agent(_WEB1), "/1.0")).code, 200)

    async def test_connectionsThatSayNothingAfterTheirHandshakeCountToo(self) -> None:
        """Two silent TLS connections of web1 fill a bound of 2: a third request gets 429."""
        self.max_per_guest = 2
        self.listen()
        directory = tempfile.mkdtemp(prefix="vmr-silent-")
        self.addCleanup(shutil.rmtree, directory, True)
        cert, key = os.path.join(directory, "web1.crt"), os.path.join(directory, "web1.key")
        with open(cert, "wb") as f:
            f.write(_WEB1.cert_pem)
        with open(key, "wb") as f:
            f.write(_WEB1.key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(cert, key)
        silent: list[ssl.SSLSocket] = []

        def open_silently() -> None:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(10)
            raw.connect(self.path)
            silent.append(context.wrap_socket(raw))  # the handshake, and nothing more

        for _ in range(2):
            await deferToThread(open_silently)

        def close_silent() -> None:
            for connection in silent:
                connection.close()

        self.addCleanup(close_silent)
        for _ in range(500):
            if self.site.per_peer["instance 'web1'"] == 2:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.site.per_peer["instance 'web1'"], 2)
        with capturedLogs():
            refused = await self.get(self.agent(_WEB1), "/1.0")
        message = "Too many connections from this instance (limit 2)"
        self.assertEqual((refused.code, refused.body), (429, error_envelope(429, message)))

    async def test_aConnectionThatNeverStartsItsHandshakeIsClosedWhenIdle(self) -> None:
        self.listen()
        self.site.timeOut = 0.1  # the idle timeout, short for the test

        def silent_client() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(10)
                client.connect(self.path)
                received = b""
                while chunk := client.recv(4096):
                    received += chunk
                return received

        # recv returns b"" (the daemon closed) rather than timing out after 10 s.
        self.assertEqual(await deferToThread(silent_client), b"")
