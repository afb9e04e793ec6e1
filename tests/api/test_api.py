"""Tests for vmready.api.operator: the operator API in memory (StubTreq) over a real Lifecycle."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from io import BytesIO
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from tests.envelopes import sync_envelope
from tests.fixtures import STARTED_UNDER_TCG, STOP_TIMEOUT, Reply, make_lifecycle
from tests.reactor import reactor
from tests.received import Received
from vmready.api.eventstream import MAX_PENDING_BYTES, EventStream
from vmready.api.operator import OperatorAPI
from vmready.api.requestbody import MAX_BODY_BYTES, read_json_body
from vmready.domain.model import BadRequest, PayloadTooLarge
from vmready.domain.states import READY_KEY
from vmready.hypervisor.cmdline import LEGACY_LAYOUT
from vmready.lifecycle.agenthistory import LinkChange
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import Event
from vmready.lifecycle.operations import Operation
from vmready.protocols.ringbuffer import AgentStatus

_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")
_NO_BODY = object()


class APITestCase(TestCase):
    """An OperatorAPI over a real Lifecycle (SQLite store, fakeqemu VMs), driven in memory."""

    timeout = 60

    def setUp(self) -> None:
        self.lifecycle: Lifecycle = make_lifecycle(self)
        self.api = OperatorAPI(self.lifecycle, "fakeqemu")
        # StubTreq grows treq's functions at run time; mypy cannot see them.
        self.http: Any = StubTreq(self.api.app.resource())

    async def call(
        self, method: str, path: str, body: Any = _NO_BODY, raw: bytes | None = None
    ) -> Reply:
        """One request; the response once complete."""
        data = raw
        if body is not _NO_BODY:
            data = json.dumps(body).encode("utf-8")
        pending = self.http.request(method, "http://vmready" + path, data=data)
        self.http.flush()
        response = await pending
        content = await self.http.content(response)
        headers = {
            name.decode("ascii").lower(): [value.decode("utf-8") for value in values]
            for name, values in response.headers.getAllRawHeaders()
        }
        return Reply(response.code, json.loads(content), headers)

    def operation(self, reply: Reply) -> Operation:
        """The operation an async reply names."""
        self.assertEqual(reply.code, 202, reply.body)
        operation: Operation = self.lifecycle.operations.get(reply.metadata["id"])
        return operation

    async def settle(self, reply: Reply) -> Operation:
        """Wait for the reply's operation; it must succeed."""
        operation = await self.operation(reply).when_done()
        # Waiters wake before the operation's final event goes out: let that happen too.
        await deferLater(reactor, 0, lambda: None)
        self.assertEqual(operation.error, "")
        return operation

    async def launch(self, name: str = "web1", config: dict[str, Any] | None = None) -> None:
        """Create an instance through the API and wait until it runs."""
        await self.settle(
            await self.call(
                "POST",
                "/1.0/instances",
                {"name": name, "start": True, **({"config": config} if config else {})},
            )
        )

    async def state(self, name: str = "web1") -> dict[str, Any]:
        """The instance's state object."""
        reply = await self.call("GET", f"/1.0/instances/{name}/state")
        self.assertEqual(reply.code, 200)
        state: dict[str, Any] = reply.metadata
        return state

    def assertError(self, reply: Reply, code: int, message: str) -> None:
        """LXD's error envelope with this status and text."""
        self.assertEqual(reply.code, code)
        self.assertEqual(reply.body, {"type": "error", "error": message, "error_code": code})


class ServerTests(APITestCase):
    """``GET /`` and ``GET /1.0``, and the envelopes of routes that do not exist."""

    async def test_rootListsAPIVersion(self) -> None:
        reply = await self.call("GET", "/")
        self.assertEqual(reply.metadata, ["/1.0"])

    async def test_serverInfoNamesVersionAndHypervisor(self) -> None:
        reply = await self.call("GET", "/1.0")
        self.assertEqual(reply.code, 200)
        self.assertEqual(
            {key: reply.body[key] for key in ("type", "status", "status_code", "error_code")},
            {"type": "sync", "status": "Success", "status_code": 200, "error_code": 0},
        )
        self.assertEqual(reply.body["operation"], "")
        self.assertEqual(reply.metadata["api_version"], "1.0")
        self.assertEqual(reply.metadata["environment"]["hypervisor"], "fakeqemu")
        self.assertEqual(reply.headers["content-type"], ["application/json"])

    async def test_unknownRouteIs404Envelope(self) -> None:
        self.assertError(await self.call("GET", "/1.0/nothing"), 404, "not found")

    async def test_wrongMethodIs405Envelope(self) -> None:
        self.assertError(await self.call("DELETE", "/1.0"), 405, "method not allowed")

    async def test_unexpectedExceptionIsLogged500(self) -> None:
        def broken() -> list[Any]:
            raise RuntimeError("database on fire")

        self.patch(self.lifecycle.store.view, "list_instances", broken)
        self.assertError(await self.call("GET", "/1.0/instances"), 500, "internal error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class CreateTests(APITestCase):
    """``POST /1.0/instances`` and the instance object."""

    async def test_createAnswersWithOperationAndLocation(self) -> None:
        reply = await self.call("POST", "/1.0/instances", {"name": "web1", "config": {}})
        operation = self.operation(reply)
        self.assertEqual(reply.body["type"], "async")
        self.assertEqual(reply.body["status"], "Operation created")
        self.assertEqual(reply.body["status_code"], 100)
        self.assertEqual(reply.body["operation"], f"/1.0/operations/{operation.id}")
        self.assertEqual(reply.headers["location"], [f"/1.0/operations/{operation.id}"])
        self.assertEqual(reply.metadata["resources"], {"instances": ["/1.0/instances/web1"]})
        await self.settle(reply)

    async def test_createdInstanceRunsWithItsConfig(self) -> None:
        await self.launch("web1", {"limits.memory": "512", "limits.cpu": 2, "user.role": "db"})
        reply = await self.call("GET", "/1.0/instances/web1")
        instance = reply.metadata
        self.assertEqual(
            {
                key: instance[key]
                for key in ("name", "operator_status", "status", "status_code", "display_status")
            },
            {
                "name": "web1",
                "operator_status": "RUNNING",
                "status": "Running",
                "status_code": 103,
                "display_status": "ACTIVE",
            },
        )
        self.assertEqual(
            (instance["vm_state"], instance["task_state"], instance["power_state"]),
            ("active", None, "running"),
        )
        self.assertEqual(
            instance["config"],
            {
                "limits.memory": "512",
                "limits.cpu": "2",
                "user.role": "db",
                "volatile.serial.layout": "current",
                **STARTED_UNDER_TCG,
            },
        )
        self.assertEqual(instance["limits"], {"memory_mib": 512, "cpus": 2})
        self.assertEqual(
            (instance["type"], instance["location"], instance["error"], instance["devices"]),
            ("virtual-machine", "none", "", {}),
        )
        self.assertEqual(len(instance["uuid"]), 36)
        for key in ("created_at", "last_used_at", "updated_at"):
            self.assertRegex(instance[key], _RFC3339)

    async def test_listGivesURLsOrObjectsWithRecursion(self) -> None:
        self.assertEqual((await self.call("GET", "/1.0/instances")).metadata, [])
        await self.launch("web2")
        await self.launch("web1")
        urls = await self.call("GET", "/1.0/instances")
        self.assertEqual(urls.metadata, ["/1.0/instances/web1", "/1.0/instances/web2"])
        objects = await self.call("GET", "/1.0/instances?recursion=1")
        self.assertEqual([item["name"] for item in objects.metadata], ["web1", "web2"])
        self.assertEqual(objects.metadata[0]["status"], "Running")

    async def test_badRecursionIs400(self) -> None:
        self.assertError(
            await self.call("GET", "/1.0/instances?recursion=all"),
            400,
            "Invalid recursion 'all': expected 0, 1 or 2",
        )

    async def test_duplicateNameIs409(self) -> None:
        await self.launch("web1")
        reply = await self.call("POST", "/1.0/instances", {"name": "web1"})
        self.assertError(reply, 409, "Instance web1 already exists")

    async def test_invalidJSONIs400(self) -> None:
        reply = await self.call("POST", "/1.0/instances", raw=b'{"name": "web1",')
        self.assertEqual(reply.code, 400)
        self.assertTrue(reply.body["error"].startswith("Invalid request body: "), reply.body)
        self.assertEqual(reply.body["error_code"], 400)

    async def test_nonStandardJSONConstantsAre400(self) -> None:
        reply = await self.call("POST", "/1.0/instances", raw=b'{"name": "web1", "x": NaN}')
        self.assertError(reply, 400, "Invalid request body: NaN is not valid JSON")

    async def test_deeplyNestedBodyIs400(self) -> None:
        reply = await self.call("POST", "/1.0/instances", raw=b"[" * 100_000 + b"]" * 100_000)
        self.assertError(reply, 400, "Invalid request body: nested too deeply")

    async def test_nonObjectBodyIs400(self) -> None:
        self.assertError(
            await self.call("POST", "/1.0/instances", ["web1"]),
            400,
            "Invalid request body: expected a JSON object, got an array",
        )

    async def test_missingNameIs400(self) -> None:
        self.assertError(
            await self.call("POST", "/1.0/instances", {"config": {}}),
            400,
            "Invalid field 'name': an instance name is required",
        )

    async def test_wrongFieldTypesAre400NamingTheField(self) -> None:
        self.assertError(
            await self.call("POST", "/1.0/instances", {"name": 7}),
            400,
            "Invalid field 'name': expected a string, got a number",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances", {"name": "web1", "config": "big"}),
            400,
            "Invalid field 'config': expected an object, got a string",
        )

    async def test_invalidNameAndConfigAre400WithLifecycleText(self) -> None:
        reply = await self.call("POST", "/1.0/instances", {"name": "1bad"})
        self.assertEqual(reply.code, 400)
        self.assertIn("Invalid instance name '1bad'", reply.body["error"])
        reply = await self.call(
            "POST", "/1.0/instances", {"name": "web1", "config": {"volatile.x": "1"}}
        )
        self.assertEqual(reply.code, 400)
        self.assertIn("Invalid config key 'volatile.x'", reply.body["error"])
        self.assertEqual((await self.call("GET", "/1.0/instances")).metadata, [])

    async def test_bodyOverTheCapIs413(self) -> None:
        raw = b'{"name": "' + b"x" * MAX_BODY_BYTES + b'"}'
        self.assertError(
            await self.call("POST", "/1.0/instances", raw=raw),
            413,
            "Request body too large (limit 1048576 bytes)",
        )

    async def test_unknownInstanceIs404(self) -> None:
        self.assertError(
            await self.call("GET", "/1.0/instances/nope"), 404, "Instance nope not found"
        )
        self.assertError(
            await self.call("GET", "/1.0/instances/nope/state"), 404, "Instance nope not found"
        )
        self.assertError(
            await self.call("PUT", "/1.0/instances/nope/state", {"action": "start"}),
            404,
            "Instance nope not found",
        )
        self.assertError(
            await self.call("DELETE", "/1.0/instances/nope"), 404, "Instance nope not found"
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/nope/actions/rebuild"),
            404,
            "Instance nope not found",
        )
        self.assertError(
            await self.call("GET", "/1.0/instances/nope/actions"), 404, "Instance nope not found"
        )
        self.assertError(
            await self.call("PATCH", "/1.0/instances/nope", {"config": {}}),
            404,
            "Instance nope not found",
        )


class BodyReaderTests(SynchronousTestCase):
    """The size-capped body reader, without a Content-Length to trust."""

    def request(self, body: bytes | BytesIO) -> Request:
        request = Request(DummyChannel())
        request.content = body if isinstance(body, BytesIO) else BytesIO(body)
        return request

    def test_readsAnObject(self) -> None:
        self.assertEqual(read_json_body(self.request(b'{"a": 1}')), {"a": 1})

    def test_emptyBodyIsAnEmptyObject(self) -> None:
        self.assertEqual(read_json_body(self.request(b"")), {})

    def test_readsNoMoreThanTheCapPlusOne(self) -> None:
        body = BytesIO(b"{" + b" " * 100 + b"}")
        error = self.assertRaises(PayloadTooLarge, read_json_body, self.request(body), 10)
        self.assertEqual(error.message, "Request body too large (limit 10 bytes)")
        self.assertEqual(body.tell(), 11)

    def test_invalidUTF8IsBadRequest(self) -> None:
        error = self.assertRaises(BadRequest, read_json_body, self.request(b'{"a": "\xff"}'))
        self.assertTrue(error.message.startswith("Invalid request body: "))


class PatchTests(APITestCase):
    """``PATCH /1.0/instances/<name>``: user-settable keys, null deletes."""

    async def test_setsAndDeletesUserKeys(self) -> None:
        await self.launch("web1", {"user.a": "1"})
        seen: list[Event] = []
        self.lifecycle.events.subscribe(seen.append)
        reply = await self.call(
            "PATCH", "/1.0/instances/web1", {"config": {"user.a": None, "user.b": "2"}}
        )
        self.assertEqual(reply.code, 200)
        expected = {"user.b": "2", "volatile.serial.layout": "current", **STARTED_UNDER_TCG}
        self.assertEqual(reply.metadata["config"], expected)
        self.assertEqual(self.lifecycle.store.view.get_instance("web1").config, expected)
        self.assertEqual([event.metadata["action"] for event in seen], ["instance-updated"])

    async def test_volatileKeysAreNotSettable(self) -> None:
        await self.launch("web1")
        for value in ("true", None):
            reply = await self.call("PATCH", "/1.0/instances/web1", {"config": {READY_KEY: value}})
            self.assertEqual(reply.code, 400)
            self.assertIn(f"Invalid config key '{READY_KEY}'", reply.body["error"])

    async def test_configMustBeAnObject(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.call("PATCH", "/1.0/instances/web1", {"config": ["user.a"]}),
            400,
            "Invalid field 'config': expected an object, got an array",
        )
        self.assertError(
            await self.call("PATCH", "/1.0/instances/web1", {}),
            400,
            "Invalid field 'config': an object of keys to set is required",
        )

    async def test_limitsOfARunningInstanceAre409(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.call("PATCH", "/1.0/instances/web1", {"config": {"limits.memory": "1GiB"}}),
            409,
            "Cannot change limits.memory of instance web1 while it is running: "
            "use the resize action",
        )

    async def test_limitsOfAStoppedInstanceChange(self) -> None:
        await self.launch("web1")
        await self.settle(
            await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop", "force": True})
        )
        reply = await self.call(
            "PATCH", "/1.0/instances/web1", {"config": {"limits.memory": "1GiB"}}
        )
        self.assertEqual(reply.metadata["limits"]["memory_mib"], 1024)
        reply = await self.call(
            "PATCH", "/1.0/instances/web1", {"config": {"limits.memory": None}}
        )
        self.assertEqual(reply.metadata["limits"]["memory_mib"], 256)

    async def test_patchDuringATaskIs409(self) -> None:
        await self.launch("web1")
        stopping = await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"})
        self.assertError(
            await self.call("PATCH", "/1.0/instances/web1", {"config": {"user.a": "1"}}),
            409,
            "Cannot update instance web1: it is stopping (a stop is in progress)",
        )
        await self.settle(stopping)


class StateTests(APITestCase):
    """``GET``/``PUT /1.0/instances/<name>/state``."""

    async def test_stateShowsStatusAndStoredFields(self) -> None:
        await self.launch("web1", {"limits.memory": "512", "limits.cpu": "2"})
        self.assertEqual(
            await self.state(),
            {
                "operator_status": "RUNNING",
                "status": "Running",
                "status_code": 103,
                "display_status": "ACTIVE",
                "vm_state": "active",
                "task_state": None,
                "power_state": "running",
                "ready": False,
                "agent": {"status": "unknown"},
                "memory": {
                    "total": 512 * 1024 * 1024,
                    "total_mib": 512,
                    "usage": 0,
                    "usage_peak": 0,
                    "swap_usage": 0,
                    "swap_usage_peak": 0,
                },
                "cpu": {"count": 2, "usage": 0},
                "disk": {},
                "network": {},
                "pid": 0,
                "processes": -1,
            },
        )

    async def test_agentStatusIsInTheInstanceAndItsState(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.running, "agent_status", lambda name: AgentStatus.CONNECTED)
        await self.lifecycle.guestside.set_ready("web1", True)
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["agent"], {"status": "connected", "history": []})
        self.assertEqual((instance["status"], instance["status_code"]), ("Ready", 113))
        listed = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(listed[0]["agent"], {"status": "connected", "history": []})
        state = await self.state()
        self.assertEqual((state["agent"], state["ready"]), ({"status": "connected"}, True))

    async def test_agentHistoryIsInTheInstanceOldestFirstWithReasons(self) -> None:
        await self.launch("web1")
        history = self.lifecycle.agent_history
        history.record("web1", LinkChange("started", 1_800_000_000.0))
        history.record("web1", LinkChange("connected", 1_800_000_001.5))
        lost = "lost: the agent said nothing for 15.0s (no heartbeat)"
        history.record("web1", LinkChange("stopped", 1_800_000_030.0, lost))
        history = (await self.call("GET", "/1.0/instances/web1")).metadata["agent"]["history"]
        self.assertEqual(
            [(change["status"], change.get("reason")) for change in history],
            [("started", None), ("connected", None), ("stopped", lost)],
        )
        self.assertEqual(
            history[1:],
            [
                {"status": "connected", "at": "2027-01-15T08:00:01.5Z"},
                {"status": "stopped", "at": "2027-01-15T08:00:30Z", "reason": lost},
            ],
        )
        listed = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(listed[0]["agent"]["history"], history)

    async def test_consoleLogPathIsInTheInstance(self) -> None:
        await self.launch("web1")
        path = (await self.call("GET", "/1.0/instances/web1")).metadata["console"]["log"]
        self.assertTrue(os.path.isabs(path), path)
        spec = self.lifecycle.specs.spec_for(self.lifecycle.store.view.get_instance("web1"))
        self.assertEqual(path, os.path.abspath(spec.console_log))
        # The file the console endpoint serves (the guest may have written more since).
        console = self.http.get("http://vmready/1.0/instances/web1/console")
        self.http.flush()
        served = await self.http.content(await console)
        self.assertIn(b"--- vmready: ", served)
        with open(path, "rb") as f:
            self.assertTrue(f.read().startswith(served))

    async def test_stopStartRestartFreezeUnfreeze(self) -> None:
        await self.launch("web1")
        expected = [
            ({"action": "stop", "force": True}, "Stopped", "SHUTOFF", "STOPPED"),
            ({"action": "start"}, "Running", "ACTIVE", "RUNNING"),
            ({"action": "restart", "force": True}, "Running", "ACTIVE", "RUNNING"),
            ({"action": "freeze"}, "Frozen", "PAUSED", "FROZEN"),
            ({"action": "unfreeze"}, "Running", "ACTIVE", "RUNNING"),
        ]
        for body, status, display, operator in expected:
            await self.settle(await self.call("PUT", "/1.0/instances/web1/state", body))
            state = await self.state()
            self.assertEqual(
                (state["status"], state["display_status"], state["operator_status"]),
                (status, display, operator),
                body,
            )

    async def test_stopTimeoutMinusOneMeansTheDefault(self) -> None:
        await self.launch("web1")
        await self.settle(
            await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop", "timeout": -1})
        )
        history = (await self.call("GET", "/1.0/instances/web1/actions")).metadata
        steps = [step["name"] for step in history[0]["steps"]]
        self.assertIn(f"forced stop after {STOP_TIMEOUT:g}s timeout", steps)

    async def test_secondActionWhileTheFirstRunsIs409(self) -> None:
        await self.launch("web1")
        first = await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"})
        second = await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"})
        self.assertError(
            second,
            409,
            "Cannot stop instance web1: it is stopping (a stop is in progress)",
        )
        await self.settle(first)
        self.assertEqual((await self.state())["status"], "Stopped")

    async def test_actionNotAllowedInVMStateIs409(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.call("PUT", "/1.0/instances/web1/state", {"action": "start"}),
            409,
            "Cannot start instance web1: it is running",
        )

    async def test_badStateBodiesAre400NamingTheField(self) -> None:
        await self.launch("web1")
        cases = [
            (
                {"action": "explode"},
                "Invalid field 'action': expected one of start, stop, restart, freeze, "
                "unfreeze, got 'explode'",
            ),
            (
                {},
                "Invalid field 'action': expected one of start, stop, restart, freeze, "
                "unfreeze, got None",
            ),
            (
                {"action": "stop", "force": "yes"},
                "Invalid field 'force': expected true or false, got a string",
            ),
            (
                {"action": "stop", "timeout": "10"},
                "Invalid field 'timeout': expected a number of seconds, got a string",
            ),
            (
                {"action": "stop", "timeout": True},
                "Invalid field 'timeout': expected a number of seconds, got a boolean",
            ),
            (
                {"action": "stop", "timeout": -5},
                "Invalid timeout -5: expected seconds from 0 to 3600",
            ),
        ]
        for body, message in cases:
            self.assertError(
                await self.call("PUT", "/1.0/instances/web1/state", body), 400, message
            )
        self.assertEqual((await self.state())["status"], "Running")


class RenderedViewTests(APITestCase):
    """Each instance's view is rendered once per change, and every change is seen at once."""

    async def raw(self, path: str) -> bytes:
        """The body of a GET, as sent."""
        pending = self.http.get("http://vmready" + path)
        self.http.flush()
        body: bytes = await self.http.content(await pending)
        return body

    async def test_readingAnUnchangedInstanceAgainDoesNotRenderItAgain(self) -> None:
        await self.launch("web1")
        await self.call("GET", "/1.0/instances/web1")
        renders = self.api.rendered.renders
        await self.call("GET", "/1.0/instances/web1")
        await self.call("GET", "/1.0/instances?recursion=1")
        await self.call("GET", "/1.0/instances")
        self.assertEqual(self.api.rendered.renders, renders)

    async def test_aConfigChangeIsSeenByTheNextReadWithItsETag(self) -> None:
        await self.launch("web1")
        before = await self.call("GET", "/1.0/instances/web1")
        await self.call("GET", "/1.0/instances?recursion=1")
        await self.lifecycle.configuring.update_config("web1", {"user.team": "red"})
        after = await self.call("GET", "/1.0/instances/web1")
        self.assertEqual(after.metadata["config"]["user.team"], "red")
        self.assertNotEqual(after.headers["etag"], before.headers["etag"])
        listed = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(listed[0]["config"]["user.team"], "red")

    async def test_aStopIsSeenByTheNextRead(self) -> None:
        await self.launch("web1")
        await self.call("GET", "/1.0/instances/web1")
        await self.call("GET", "/1.0/instances?recursion=1")
        await self.settle(await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"}))
        shown = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(shown["status"], "Stopped")
        listed = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(listed[0]["status"], "Stopped")

    async def test_anAgentStatusChangeIsSeenByTheNextRead(self) -> None:
        await self.launch("web1")
        await self.call("GET", "/1.0/instances/web1")
        await self.call("GET", "/1.0/instances?recursion=1")
        self.patch(self.lifecycle.running, "agent_status", lambda name: AgentStatus.CONNECTED)
        shown = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(shown["agent"]["status"], "connected")
        listed = (await self.call("GET", "/1.0/instances?recursion=1")).metadata
        self.assertEqual(listed[0]["agent"]["status"], "connected")

    async def test_anInstanceGetIsAnsweredWhileALongListIsStillBeingRead(self) -> None:
        await self.launch("web1")
        await self.launch("web2")
        self.api.list_slice = 1
        answered: list[str] = []

        def answer(what: str) -> Callable[[Any], Any]:
            def note(response: Any) -> Any:
                answered.append(what)
                return response

            return note

        listing = self.http.get("http://vmready/1.0/instances?recursion=1").addCallback(
            answer("list")
        )
        self.http.get("http://vmready/1.0/instances/web2").addCallback(answer("get"))
        self.http.flush()
        self.assertEqual(answered, ["get"])
        await deferLater(reactor, 0, lambda: None)
        self.http.flush()
        listed = json.loads(await self.http.content(await listing))["metadata"]
        self.assertEqual([shown["name"] for shown in listed], ["web1", "web2"])
        self.assertEqual(answered, ["get", "list"])

    async def test_theListIsTheInstancesAsEachIsShownByteForByte(self) -> None:
        await self.launch("web1")
        await self.launch("web2", {"user.team": "red"})
        shown = [
            (await self.call("GET", f"/1.0/instances/{name}")).metadata
            for name in ("web1", "web2")
        ]
        listed = await self.raw("/1.0/instances?recursion=1")
        self.assertEqual(listed, json.dumps(sync_envelope(shown)).encode("utf-8") + b"\n")


class ActionTests(APITestCase):
    """Rebuild, resize, confirm, revert, delete, and the action history."""

    async def act(self, action: str, body: Any = _NO_BODY) -> Reply:
        return await self.call("POST", f"/1.0/instances/web1/actions/{action}", body)

    async def test_rebuildKeepsItRunning(self) -> None:
        await self.launch("web1")
        await self.settle(await self.act("rebuild"))
        self.assertEqual((await self.state())["status"], "Running")

    async def test_resizeThenConfirm(self) -> None:
        await self.launch("web1")
        await self.settle(await self.act("resize", {"memory": "512", "cpus": 2}))
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["display_status"], "VERIFY_RESIZE")
        self.assertEqual(instance["operator_status"], "RESIZED")
        self.assertEqual(instance["limits"], {"memory_mib": 512, "cpus": 2})
        await self.settle(await self.act("confirm-resize"))
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["display_status"], "ACTIVE")
        self.assertEqual(instance["limits"], {"memory_mib": 512, "cpus": 2})

    async def test_resizeThenRevert(self) -> None:
        await self.launch("web1")
        await self.settle(await self.act("resize", {"memory": 1024}))
        await self.settle(await self.act("revert-resize"))
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["display_status"], "ACTIVE")
        self.assertEqual(instance["limits"], {"memory_mib": 256, "cpus": 1})

    async def test_badResizeBodiesAre400(self) -> None:
        await self.launch("web1")
        self.assertError(await self.act("resize", {}), 400, "resize needs memory and/or cpus")
        self.assertError(
            await self.act("resize", {"memory": 512, "disk": 10}),
            400,
            "Invalid field 'disk': resize takes no such parameter",
        )
        self.assertError(
            await self.act("resize", {"memory": [512]}),
            400,
            "Invalid field 'memory': expected a number or a string, got an array",
        )
        self.assertError(
            await self.act("rebuild", {"memory": 512}),
            400,
            "Invalid field 'memory': rebuild takes no such parameter",
        )

    async def test_confirmWithoutResizeIs409(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.act("confirm-resize"),
            409,
            "Cannot confirm-resize instance web1: it is running",
        )

    async def test_unknownActionIs404(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.act("explode"),
            404,
            "Unknown action 'explode': expected one of rebuild, resize, confirm-resize, "
            "revert-resize",
        )

    async def test_deleteRemovesItAndKeepsHistory(self) -> None:
        await self.launch("web1")
        await self.settle(await self.call("DELETE", "/1.0/instances/web1"))
        self.assertError(
            await self.call("GET", "/1.0/instances/web1"), 404, "Instance web1 not found"
        )
        history = (await self.call("GET", "/1.0/instances/web1/actions")).metadata
        self.assertEqual([action["action"] for action in history], ["delete", "create"])

    async def test_historyListsActionsNewestFirstWithSteps(self) -> None:
        await self.launch("web1")
        await self.settle(await self.act("resize", {"cpus": 2}))
        reply = await self.call("GET", "/1.0/instances/web1/actions")
        self.assertEqual(reply.code, 200)
        history = reply.metadata
        self.assertEqual([action["action"] for action in history], ["resize", "create"])
        self.assertEqual(history[0]["result"], "success")
        tasks = [step["name"] for step in history[0]["steps"] if step["name"].startswith("resize")]
        self.assertEqual(
            tasks, ["resize-queued", "resize-prep", "resize-migrating", "resize-finish"]
        )
        self.assertEqual({step["result"] for step in history[0]["steps"]}, {"success"})
        self.assertEqual(history[0]["instance"], "web1")


class EventStreamTests(APITestCase):
    """``GET /1.0/events``: newline-delimited JSON, filtered, kept open."""

    async def open(self, query: str = "") -> tuple[Received, Any]:
        """Open the stream; returns its line collector and the response."""
        pending = self.http.get("http://vmready/1.0/events" + query)
        self.http.flush()
        response = await pending
        lines = Received()
        response.deliverBody(lines)
        return lines, response

    async def test_lifecycleFilterShowsTheCreateSequence(self) -> None:
        lines, response = await self.open("?type=lifecycle")
        self.assertEqual(response.code, 200)
        self.assertEqual(
            response.headers.getRawHeaders(b"content-type"), [b"application/x-ndjson"]
        )
        await self.launch("web1")
        self.http.flush()
        events = lines.events
        self.assertEqual({event["type"] for event in events}, {"lifecycle"})
        self.assertEqual(
            [event["metadata"]["action"] for event in events],
            ["instance-state", "instance-created", "instance-state", "instance-started"],
        )
        self.assertEqual(
            [event["metadata"]["context"].get("display_status") for event in events],
            ["BUILD", None, "ACTIVE", None],
        )
        self.assertEqual(events[0]["metadata"]["source"], "/1.0/instances/web1")
        self.assertRegex(events[0]["timestamp"], _RFC3339)
        self.assertFalse(lines.closed.called)

    async def test_operationFilterShowsOnlyOperations(self) -> None:
        lines, _ = await self.open("?type=operation")
        await self.launch("web1")
        self.http.flush()
        events = lines.events
        self.assertEqual({event["type"] for event in events}, {"operation"})
        self.assertEqual([event["metadata"]["status"] for event in events], ["Running", "Success"])

    async def test_noFilterShowsBoth(self) -> None:
        lines, _ = await self.open()
        await self.launch("web1")
        self.http.flush()
        self.assertEqual({event["type"] for event in lines.events}, {"lifecycle", "operation"})

    async def test_unknownTypeIs400(self) -> None:
        self.assertError(
            await self.call("GET", "/1.0/events?type=lifecycle,logging"),
            400,
            "Invalid event type 'logging': expected lifecycle, operation",
        )

    async def test_disconnectUnsubscribes(self) -> None:
        unsubscribed: list[bool] = []
        subscribe = self.lifecycle.events.subscribe

        def spy(listener: Any, types: frozenset[str] | None = None) -> Any:
            unsubscribe = subscribe(listener, types)

            def recorded() -> None:
                unsubscribed.append(True)
                unsubscribe()

            return recorded

        self.patch(self.lifecycle.events, "subscribe", spy)
        lines, _ = await self.open()
        self.assertEqual(unsubscribed, [])
        assert lines.transport is not None
        lines.transport.stopProducing()  # type: ignore[attr-defined]
        self.http.flush()
        self.assertEqual(unsubscribed, [True])
        self.lifecycle.events.lifecycle("instance-ready", "web1")


class OperationTests(APITestCase):
    """``/1.0/operations``, ``/1.0/operations/<id>`` and ``/wait``."""

    async def test_listGroupsByStatus(self) -> None:
        reply = await self.call("POST", "/1.0/instances", {"name": "web1", "start": True})
        operation = self.operation(reply)
        running = await self.call("GET", "/1.0/operations")
        self.assertEqual(running.metadata, {"running": [f"/1.0/operations/{operation.id}"]})
        await self.settle(reply)
        done = await self.call("GET", "/1.0/operations?recursion=1")
        self.assertEqual([op["id"] for op in done.metadata["success"]], [operation.id])

    async def test_getOne(self) -> None:
        reply = await self.call("POST", "/1.0/instances", {"name": "web1"})
        operation = await self.settle(reply)
        got = await self.call("GET", f"/1.0/operations/{operation.id}")
        self.assertEqual(got.metadata["status"], "Success")
        self.assertEqual(got.metadata["status_code"], 200)
        self.assertEqual(got.metadata["description"], "Creating instance web1")

    async def test_unknownOperationIs404(self) -> None:
        self.assertError(
            await self.call("GET", "/1.0/operations/nope"), 404, "Operation nope not found"
        )
        self.assertError(
            await self.call("GET", "/1.0/operations/nope/wait"), 404, "Operation nope not found"
        )

    async def test_waitAnswersWhenTheOperationFinishes(self) -> None:
        reply = await self.call("POST", "/1.0/instances", {"name": "web1", "start": True})
        operation = self.operation(reply)
        pending = self.http.get(f"http://vmready/1.0/operations/{operation.id}/wait")
        self.http.flush()
        self.assertNoResult(pending)
        await operation.when_done()
        self.http.flush()
        response = await pending
        body = json.loads(await self.http.content(response))
        self.assertEqual(response.code, 200)
        self.assertEqual(body["metadata"]["status"], "Success")

    async def test_waitTimeoutAnswersWithTheRunningOperation(self) -> None:
        await self.launch("web1")
        reply = await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"})
        operation = self.operation(reply)
        pending = self.http.get(f"http://vmready/1.0/operations/{operation.id}/wait?timeout=0.05")
        self.http.flush()
        await deferLater(reactor, 0.1)
        self.http.flush()
        response = await pending
        body = json.loads(await self.http.content(response))
        self.assertEqual(body["metadata"]["status"], "Running")
        self.assertEqual(body["metadata"]["status_code"], 103)
        await self.settle(reply)

    async def test_aCancelledWaitEndsAsCancelledNotAsAnError(self) -> None:
        """The client of a ``/wait?timeout=`` went away (Klein cancels the handler): the
        wait ends as cancelled, which Klein drops quietly, not as a FailureGroup it logs."""
        await self.launch("web1")
        reply = await self.call("PUT", "/1.0/instances/web1/state", {"action": "stop"})
        operation = self.operation(reply)
        request = DummyRequest([b"1.0", b"operations", operation.id.encode(), b"wait"])
        request.args = {b"timeout": [b"30"]}
        waiting = Deferred.fromCoroutine(
            self.api.wait_operation(request, operation_id=operation.id)
        )
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        await self.settle(reply)

    async def test_waitOnAFailedOperationShowsItsError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        operation = await self.operation(
            await self.call("POST", "/1.0/instances/web1/actions/rebuild")
        ).when_done()
        reply = await self.call("GET", f"/1.0/operations/{operation.id}/wait")
        self.assertEqual(reply.metadata["status"], "Failure")
        self.assertEqual(reply.metadata["status_code"], 400)
        self.assertIn("'/nonexistent/qemu' is not installed", reply.metadata["err"])
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["status"], "Error")
        self.assertEqual(instance["error"], reply.metadata["err"])

    async def test_badWaitTimeoutIs400(self) -> None:
        operation = await self.settle(
            await self.call("POST", "/1.0/instances", {"name": "web1", "start": True})
        )
        for value in ("soon", "inf", "nan"):
            self.assertError(
                await self.call("GET", f"/1.0/operations/{operation.id}/wait?timeout={value}"),
                400,
                f"Invalid timeout {value!r}: expected seconds",
            )


class _RecordingRequest:
    """Records what an EventStream does to its request."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.lost = False
        self.transport = self

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abortConnection(self) -> None:
        self.lost = True


class EventStreamBackpressureTests(SynchronousTestCase):
    """A /1.0/events reader that stops reading is cut off instead of buffered forever."""

    def event(self, size: int) -> Event:
        return Event(
            "lifecycle", 0.0, {"action": "instance-updated", "context": {"x": "y" * size}}
        )

    def stream(self) -> tuple[EventStream, _RecordingRequest]:
        request = _RecordingRequest()
        return EventStream(request), request  # type: ignore[arg-type]

    def test_eventsAreWrittenAsJSONLines(self) -> None:
        stream, request = self.stream()
        stream.deliver(self.event(3))
        self.assertEqual(json.loads(request.written[0])["metadata"]["context"], {"x": "yyy"})
        self.assertTrue(request.written[0].endswith(b"\n"))

    def test_pausedReaderIsCutOffPastTheLimit(self) -> None:
        stream, request = self.stream()
        stream.pauseProducing()
        size = MAX_PENDING_BYTES // 4
        for _ in range(10):
            stream.deliver(self.event(size))
        self.assertTrue(request.lost)
        self.assertLessEqual(len(request.written), 4)
        written = sum(len(chunk) for chunk in request.written)
        self.assertLessEqual(written, MAX_PENDING_BYTES)

    def test_readerThatCatchesUpIsKept(self) -> None:
        stream, request = self.stream()
        size = MAX_PENDING_BYTES // 4
        for _ in range(10):
            stream.pauseProducing()
            stream.deliver(self.event(size))
            stream.resumeProducing()
        self.assertFalse(request.lost)
        self.assertEqual(len(request.written), 10)

    def test_nothingIsWrittenAfterStop(self) -> None:
        stream, request = self.stream()
        stream.stopProducing()
        stream.deliver(self.event(1))
        self.assertEqual(request.written, [])


SNAPSHOTS = "/1.0/instances/web1/snapshots"


class SnapshotAPITests(APITestCase):
    """``/1.0/instances/<name>/snapshots`` and LXD's restore (``PUT`` with ``restore``)."""

    async def test_snapshotListAndRestore(self) -> None:
        await self.launch("web1", {"user.role": "db"})
        await self.settle(
            await self.call(
                "POST", "/1.0/instances/web1/snapshots", {"name": "s1", "stateful": True}
            )
        )
        listed = (await self.call("GET", "/1.0/instances/web1/snapshots?recursion=1")).metadata
        self.assertEqual(
            [(s["name"], s["stateful"], s["serial_layout"]) for s in listed],
            [("s1", True, "current")],
        )
        await self.call("PATCH", "/1.0/instances/web1", {"config": {"user.role": "web"}})
        await self.settle(await self.call("PUT", "/1.0/instances/web1", {"restore": "s1"}))
        self.assertEqual(self.lifecycle.store.view.get_instance("web1").config["user.role"], "db")

    async def test_statefulRestoreIntoAnotherLayoutIs409AndChangesNothing(self) -> None:
        await self.launch("web1")
        await self.settle(
            await self.call(
                "POST", "/1.0/instances/web1/snapshots", {"name": "s1", "stateful": True}
            )
        )
        self.patch(self.lifecycle.booting, "serial_layout", LEGACY_LAYOUT)
        before = self.lifecycle.store.view.get_instance("web1")
        reply = await self.call("PUT", "/1.0/instances/web1", {"restore": "s1", "stateful": True})
        self.assertEqual(reply.code, 409)
        self.assertIn(
            "Cannot restore the state of snapshot s1 of instance web1", reply.body["error"]
        )
        self.assertEqual(self.lifecycle.store.view.get_instance("web1"), before)

    async def test_badSnapshotRequestsAreRefused(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.call("POST", "/1.0/instances/web1/snapshots", {}),
            400,
            "Invalid field 'name': the snapshot's name is required",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/web1/snapshots", {"name": "s", "x": 1}),
            400,
            "Invalid field 'x': expected name, stateful, expires_at",
        )
        self.assertError(
            await self.call("PUT", "/1.0/instances/web1", {"restore": "nope"}),
            404,
            "Snapshot nope of instance web1 not found",
        )
        self.assertError(
            await self.call("PUT", "/1.0/instances/web1", {"restore": "s", "stateful": "yes"}),
            400,
            "Invalid field 'stateful': expected true or false, got a string",
        )

    async def test_deleteAnswersWithTheSnapshotAndItIsGone(self) -> None:
        await self.launch("web1")
        for name in ("s1", "s2"):
            await self.settle(await self.call("POST", SNAPSHOTS, {"name": name}))
        reply = await self.call("DELETE", f"{SNAPSHOTS}/s1")
        self.assertEqual((reply.code, reply.metadata["status"]), (202, "Success"))
        deleted = reply.metadata["metadata"]
        self.assertEqual((deleted["name"], deleted["stateful"]), ("s1", False))
        listed = (await self.call("GET", SNAPSHOTS + "?recursion=1")).metadata
        self.assertEqual([s["name"] for s in listed], ["s2"])
        self.assertError(
            await self.call("DELETE", f"{SNAPSHOTS}/s1"),
            404,
            "Snapshot s1 of instance web1 not found",
        )

    async def test_deleteWhileARestoreFromItRunsIs409(self) -> None:
        await self.launch("web1")
        await self.settle(await self.call("POST", SNAPSHOTS, {"name": "s1"}))
        restoring = await self.call("PUT", "/1.0/instances/web1", {"restore": "s1"})
        self.assertError(
            await self.call("DELETE", f"{SNAPSHOTS}/s1"),
            409,
            "Cannot delete snapshot s1 of instance web1: the instance is being restored from it",
        )
        await self.settle(restoring)
        self.assertEqual((await self.call("DELETE", f"{SNAPSHOTS}/s1")).code, 202)

    async def test_badSnapshotDeletesAreRefused(self) -> None:
        await self.launch("web1")
        self.assertError(
            await self.call("DELETE", "/1.0/instances/nope/snapshots/s1"),
            404,
            "Instance nope not found",
        )
        reply = await self.call("DELETE", f"{SNAPSHOTS}/a%20b")
        self.assertEqual(reply.code, 400)
        self.assertIn("Invalid snapshot name", reply.body["error"])

    async def test_instanceShowsItsSerialLayout(self) -> None:
        await self.launch("web1")
        instance = (await self.call("GET", "/1.0/instances/web1")).metadata
        self.assertEqual(instance["serial_layout"]["name"], "current")


class RenameTests(APITestCase):
    """``POST /1.0/instances/<name> {"name": NEW}``: LXD's rename, as an operation."""

    async def stopped(self, name: str = "web1") -> None:
        await self.launch(name)
        await self.settle(
            await self.call(
                "PUT", f"/1.0/instances/{name}/state", {"action": "stop", "force": True}
            )
        )

    async def test_aStoppedInstanceIsRenamedByAnOperation(self) -> None:
        await self.stopped()
        reply = await self.call("POST", "/1.0/instances/web1", {"name": "api1"})
        self.assertEqual(reply.metadata["description"], "Renaming instance web1 to api1")
        await self.settle(reply)
        self.assertError(
            await self.call("GET", "/1.0/instances/web1"), 404, "Instance web1 not found"
        )
        renamed = await self.call("GET", "/1.0/instances/api1")
        self.assertEqual(
            (renamed.metadata["name"], renamed.metadata["status"]), ("api1", "Stopped")
        )
        history = await self.call("GET", "/1.0/instances/api1/actions")
        self.assertEqual(history.metadata[0]["action"], "rename")

    async def test_refusalsComeBeforeAnyOperationInTheOperatorsWords(self) -> None:
        await self.launch("web1")
        await self.stopped("db1")
        self.assertError(
            await self.call("POST", "/1.0/instances/web1", {"name": "api1"}),
            409,
            "Cannot rename instance web1: it is running; only a stopped instance can be renamed",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/db1", {"name": "web1"}),
            409,
            "Cannot rename db1 to web1: instance web1 exists",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/db1", {"name": "-x"}),
            400,
            "Invalid instance name '-x': use 1-63 letters, digits and hyphens, "
            "starting with a letter and not ending with a hyphen",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/db1", {}),
            400,
            "Invalid field 'name': the instance's new name is required",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/db1", {"name": "x", "migration": True}),
            400,
            "Invalid field 'migration': migrations (not supported by vmready), got True",
        )
        self.assertError(
            await self.call("POST", "/1.0/instances/nope", {"name": "x"}),
            404,
            "Instance nope not found",
        )
        descriptions = [op.description for op in self.lifecycle.operations.list()]
        self.assertFalse([d for d in descriptions if d.startswith("Renaming")])


class ServerConfigTests(APITestCase):
    async def test_theDaemonsOptionsAreTheServersConfig(self) -> None:
        self.api = OperatorAPI(self.lifecycle, "fakeqemu", config={"stop-timeout": "30"})
        self.http = StubTreq(self.api.app.resource())
        reply = await self.call("GET", "/1.0")
        self.assertEqual(reply.metadata["config"], {"stop-timeout": "30"})
