"""The daemon's recorders: who is recorded, at no cost when nobody is, and the config key."""

from __future__ import annotations

import json
import os

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from tests.agentlink.test_agentlink import INTERVALS
from tests.agentlink.test_agentmonitor import FakeRing
from vmready.agentlink.link import AgentLink
from vmready.agentlink.monitor import AgentMonitor
from vmready.daemon.tap import Options
from vmready.domain.config import validate_config
from vmready.domain.model import BadRequest, Conflict, HypervisorError
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.hypervisor.cmdline import CURRENT_LAYOUT, LEGACY_LAYOUT, VMSpec
from vmready.hypervisor.kvmprobe import KVMProbe
from vmready.hypervisor.runningvm import RunningVM
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import EventBus
from vmready.protocols.qmp import QMPEvent
from vmready.record.recording import Recorders, transcript_path
from vmready.store.sqlite import Store


class _Subscribers:
    """Listeners of a fake VM or its QMP connection."""

    def __init__(self) -> None:
        self.listeners: list[object] = []

    def subscribe(self, listener: object, first: bool = False) -> object:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)


class _FakeVM:
    """What ``Lifecycle._attach`` follows: a VM's events and its QMP events."""

    def __init__(self, spec: object) -> None:
        self.spec = spec
        self.events = _Subscribers()
        self.qmp = _Subscribers()

    def subscribe(self, listener: object) -> object:
        return self.events.subscribe(listener)

    def qmp_event(self, name: str) -> None:
        for listener in list(self.qmp.listeners):
            listener(QMPEvent(name, {}, 0.0))  # type: ignore[operator]


def kinds_of(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line).get("kind") for line in f][1:]


class _NothingRuns:
    """A driver with no VM: none starts, none runs to adopt or to stop."""

    kind = "none"

    async def launch(
        self, spec: VMSpec, paused: bool = False, incoming: str | None = None
    ) -> RunningVM:
        raise HypervisorError("nothing starts here")

    async def adopt(self, spec: VMSpec) -> RunningVM | None:
        return None

    def kill_owned(self, spec: VMSpec) -> Deferred[bool]:
        return succeed(False)

    async def wait_released(self, spec: VMSpec) -> None:
        """Nothing to wait for."""

    async def probe_kvm(self) -> KVMProbe | None:
        """No VM runs here: no verdict."""
        return None


class RecordersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.store = Store.open(":memory:", clock=self.clock.seconds)
        self.addCleanup(self.store.close)
        self.lifecycle = Lifecycle(
            self.clock,
            self.store,
            _NothingRuns(),
            EventBus(self.clock.seconds),
            self.mktemp(),
        )
        self.directory = self.mktemp()

    def recorders(self, record_all: bool) -> Recorders:
        recorders = Recorders(self.lifecycle, self.directory, record_all=record_all)
        self.addCleanup(recorders.close)
        return recorders

    def test_recordingOffWritesNothing(self) -> None:
        recorders = self.recorders(record_all=False)
        self.store.instances.create_instance("vm1", {}, {})
        self.assertFalse(recorders.maybe_recording)
        self.assertIsNone(recorders.recorder_for("vm1"))
        self.assertFalse(os.path.exists(self.directory))

    def test_theDaemonOptionRecordsEveryInstance(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {"user.a": "b"}, {})
        recorder = recorders.recorder_for("vm1")
        assert recorder is not None
        recorder.ring_write(b"CONNECT 2:9\n")
        recorder.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            header, record = (json.loads(line) for line in f)
        self.assertEqual(
            (header["side"], header["instance"], header["origin"], header["config"]),
            ("host", "vm1", "create", {"user.a": "b"}),
        )
        self.assertEqual((record["kind"], record["text"]), ("ring-write", "CONNECT 2:9\n"))

    def test_theInstanceKeyOptsOut(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {"vmready.record": "false"}, {})
        self.assertIsNone(recorders.recorder_for("vm1"))

    def test_theInstanceKeyOptsIn(self) -> None:
        self.store.instances.create_instance("vm1", {"vmready.record": "true"}, {})
        self.store.instances.create_instance("vm2", {}, {})
        recorders = self.recorders(record_all=False)
        self.assertIsNotNone(recorders.recorder_for("vm1"))
        self.assertIsNone(recorders.recorder_for("vm2"))

    def test_lifecycleEventsOfTheInstanceAreRecorded(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {}, {})
        self.lifecycle.events.lifecycle("instance-ready", "vm1")
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            kinds = [json.loads(line).get("action") for line in f]
        self.assertEqual(kinds, [None, "instance-ready"])

    def running(self, name: str, config: dict[str, str] | None = None) -> None:
        self.store.instances.create_instance(name, config or {}, {})
        self.store.instances.finish_task(
            name, TaskState.SPAWNING, VMState.ACTIVE, PowerState.RUNNING
        )

    def test_anOperatorActionIsRecordedBeforeTheStateItCauses(self) -> None:
        recorders = self.recorders(record_all=True)
        self.lifecycle.recording.use(recorders)
        self.running("vm1")
        self.successResultOf(
            Deferred.fromCoroutine(self.lifecycle.act("vm1", "stop", force=True, timeout=7))
        )
        self.clock.advance(0)
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            records = [json.loads(line) for line in f][1:]
        self.assertEqual(
            (records[0]["kind"], records[0]["action"], records[0]["params"]),
            ("operator-action", "stop", {"timeout": 7.0, "force": True}),
        )
        self.assertEqual(
            (records[1]["kind"], records[1]["context"]["task_state"]), ("state", "powering-off")
        )
        self.assertIn("instance-stopped", [record.get("action") for record in records])

    def test_aRefusedActionOrAnUnrecordedInstanceIsNotRecorded(self) -> None:
        recorders = self.recorders(record_all=True)
        self.lifecycle.recording.use(recorders)
        self.running("vm1", {"vmready.record": "false"})
        self.store.instances.create_instance("vm2", {}, {})  # still building: a restart is refused
        self.assertIsNotNone(recorders.recorder_for("vm2"))
        self.failureResultOf(
            Deferred.fromCoroutine(self.lifecycle.act("vm2", "restart")), Conflict
        )
        self.successResultOf(Deferred.fromCoroutine(self.lifecycle.act("vm1", "freeze")))
        self.clock.advance(0)
        recorders.close()
        self.assertFalse(os.path.exists(transcript_path(self.directory, "vm1")))
        with open(transcript_path(self.directory, "vm2")) as f:
            kinds = [json.loads(line).get("kind") for line in f][1:]
        self.assertNotIn("operator-action", kinds)

    def test_secretConfigIsRedactedInTheHeader(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {"user.api-key": "k"}, {})
        recorders.recorder_for("vm1")
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            header = json.loads(f.readline())
        self.assertEqual(header["config"], {"user.api-key": "[REDACTED]"})

    def test_requestIdsContinueAfterADaemonRestart(self) -> None:
        self.store.instances.create_instance("vm1", {}, {})
        first = Recorders(self.lifecycle, self.directory, record_all=True)
        recorder = first.recorder_for("vm1")
        assert recorder is not None
        self.assertEqual(recorder.guest_request("GET", "/1.0", b""), 1)
        self.assertEqual(recorder.guest_request("GET", "/1.0", b""), 2)
        first.close()
        again = self.recorders(record_all=True)  # the daemon restarted
        recorder = again.recorder_for("vm1")
        assert recorder is not None
        self.assertEqual(recorder.guest_request("GET", "/1.0", b""), 3)
        again.close()
        self.assertEqual(kinds_of(transcript_path(self.directory, "vm1")).count("daemon-start"), 1)

    def test_recordingSwitchedOffAndOnGoesOnRecordingTheRunningVM(self) -> None:
        recorders = self.recorders(record_all=False)
        self.lifecycle.recording.use(recorders)
        self.running("vm1", {"vmready.record": "true"})
        vm = _FakeVM(self.lifecycle.specs.spec_for(self.store.instances.get_instance("vm1")))
        self.lifecycle.watching.attach("vm1", vm)  # type: ignore[arg-type]
        ring = FakeRing(self.clock)
        monitor = AgentMonitor(
            self.clock,
            ring,
            AgentLink("vm1", ring_size=4096, port=49152, intervals=INTERVALS),
            "vmready",
            lambda change: None,
            lambda: recorders.recorder_for("vm1"),
        )
        for record in ("false", "true"):
            self.successResultOf(
                Deferred.fromCoroutine(
                    self.lifecycle.configuring.update_config("vm1", {"vmready.record": record})
                )
            )
        vm.qmp_event("SHUTDOWN")
        ring.pending.append(b"STARTED\n")
        monitor.start(advertise=False)
        self.clock.advance(0)
        monitor.stop()
        recorders.close()
        kinds = kinds_of(transcript_path(self.directory, "vm1"))
        self.assertNotIn("daemon-start", kinds)  # the daemon never restarted
        self.assertEqual(
            [k for k in kinds if k != "state"], ["qmp-event", "ring-read", "ring-write"]
        )

    def test_aNewVMsHeaderNamesTheLayoutItWillRunWith(self) -> None:
        self.lifecycle.booting.serial_layout = LEGACY_LAYOUT
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {}, {})
        recorders.recorder_for("vm1")
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            header = json.loads(f.readline())
        self.assertEqual(header["layout"], LEGACY_LAYOUT.name)
        self.assertNotEqual(LEGACY_LAYOUT.name, CURRENT_LAYOUT.name)

    def test_aPemBlockSplitAcrossRingReadsIsRedactedWhole(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance("vm1", {}, {})
        recorder = recorders.recorder_for("vm1")
        assert recorder is not None
        recorder.ring_read(b"x -----BEGIN PRIVATE KEY-----\nAAAA")
        recorder.ring_read(b"SECRETHALF\n-----END PRIVATE KEY-----\nSTARTED\n")
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            written = f.read()
        self.assertNotIn("SECRETHALF", written)
        self.assertNotIn("AAAA", written)
        self.assertIn("STARTED", written)

    def test_cloudInitUserDataIsRedacted(self) -> None:
        recorders = self.recorders(record_all=True)
        self.store.instances.create_instance(
            "vm1", {"cloud-init.user-data": "#cloud-config\npassword: hunter2"}, {}
        )
        recorders.recorder_for("vm1")
        recorders.close()
        with open(transcript_path(self.directory, "vm1")) as f:
            self.assertNotIn("hunter2", f.read())


class ConfigKeyTests(SynchronousTestCase):
    def test_theRecordKeyTakesTrueOrFalse(self) -> None:
        self.assertEqual(validate_config({"vmready.record": "true"}), {"vmready.record": "true"})
        error = self.assertRaises(BadRequest, validate_config, {"vmready.record": "yes"})
        self.assertIn("expected true or false", error.message)

    def test_otherVmreadyKeysAreRefused(self) -> None:
        self.assertRaises(BadRequest, validate_config, {"vmready.other": "x"})


class DaemonOptionTests(SynchronousTestCase):
    def test_recordOptionsAreParsed(self) -> None:
        options = Options()
        options.parseOptions(
            ["--data-dir", "/tmp/d", "--record-dir", "rec", "--record-max-bytes", "4096"]
        )
        self.assertEqual(
            (options["record-dir"], options["record-max-bytes"], options["record-keep"]),
            (os.path.abspath("rec"), 4096, 3),
        )

    def test_aTinyBoundIsRefused(self) -> None:
        options = Options()
        self.assertRaises(usage.UsageError, options.parseOptions, ["--record-max-bytes", "10"])
