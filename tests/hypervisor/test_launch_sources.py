"""Booting from a source on fakeqemu: overlays made, replaced and removed; KVM tried, then TCG.

Real processes throughout: the lifecycle drives fakeqemu VMs, ``qemu-img``
makes the overlays, and a fake "KVM that aborts" is a real script standing in
for the QEMU binary.  What a booting guest would do (write to its console,
panic) a test does through fakeqemu's guest sockets.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from fakeqemu.testing import write_kernel
from tests.conformance.support import require_program
from tests.lifecycle.test_lifecycle import _async, guest_ends, lifecycle_actions
from tests.reactor import reactor
from vmready.agentlink.transport import CID_KEY, TRANSPORT_KEY
from vmready.domain.model import InstanceRecord
from vmready.domain.states import READY_KEY, VMState
from vmready.hypervisor.accel import KVMVerdicts
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.kvmprobe import KVMProbe
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.events import Event, EventBus
from vmready.lifecycle.settings import LaunchSettings
from vmready.store.sqlite import Store

KVM_ABORTS = """#!/bin/sh
# A QEMU that aborts under KVM, as nested KVM does on some hosts; TCG runs fakeqemu.
for word in "$@"; do
    if [ "$word" = kvm ]; then
        echo "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69" >&2
        exit 1
    fi
done
exec {python} -m fakeqemu "$@"
"""


async def until(condition: Any, limit: float = 30.0) -> None:
    """Poll ``condition`` on the reactor (bounded)."""
    waited = 0.0
    while not condition():
        if waited >= limit:
            raise AssertionError(f"condition not met within {limit:g}s")
        await deferLater(reactor, 0.05, lambda: None)
        waited += 0.05


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def image_info(path: str) -> dict[str, Any]:
    done = subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", path], capture_output=True, check=True
    )
    info: dict[str, Any] = json.loads(done.stdout)
    return info


class LaunchTestCase(TestCase):
    """A lifecycle on a fresh data dir, driving fakeqemu (or a stand-in binary)."""

    def setUp(self) -> None:
        require_program(self, "qemu-img", "qemu-utils")
        self.directory = tempfile.mkdtemp(prefix="vmr-ls-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.store = Store.open(os.path.join(self.directory, "vmready.sqlite"))
        self.addCleanup(self.store.close)
        self.files = os.path.join(self.directory, "files")
        os.makedirs(self.files)
        self.image = os.path.join(self.files, "base.qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", self.image, "8M"], check=True)
        self.kernel = os.path.join(self.files, "vmlinuz")
        write_kernel(self.kernel)
        self.lifecycle = self.new_lifecycle()
        self.addCleanup(self._kill_everything)

    def new_lifecycle(
        self, binary: str | None = None, settings: LaunchSettings | None = None
    ) -> Lifecycle:
        self.events: list[Event] = []
        bus = EventBus(reactor.seconds)
        bus.subscribe(self.events.append)
        lifecycle = Lifecycle(
            reactor,
            self.store,
            HypervisorDriver(reactor, "fakeqemu", binary),
            bus,
            os.path.join(self.directory, "run"),
            stop_timeout=0.3,
            settings=settings,
        )
        return lifecycle

    def console_log(self, name: str, limit: int) -> bytes:
        """The tail of the instance's console log, as ``vmready console --show-log`` reads it."""
        return self.lifecycle.specs.console_log(
            self.lifecycle.store.view.get_instance(name), limit
        )

    async def _kill_everything(self) -> None:
        for vm in list(self.lifecycle.running.vms.values()):
            if not vm.gone:
                await vm.force_stop()
        await self.lifecycle.shutdown()

    async def launch(self, name: str = "vm1", **config: str) -> InstanceRecord:
        operation = await self.lifecycle.create(name, config)
        await operation.when_done()
        self.assertEqual(operation.error, "")
        return self.lifecycle.store.view.get_instance(name)

    def actions(self, name: str) -> list[str]:
        return lifecycle_actions(self.events, name)


class OverlayTests(LaunchTestCase):
    """The image is never written: each instance boots its own overlay."""

    @_async
    async def test_launchBootsAnOverlayOfTheImage(self) -> None:
        record = await self.launch(**{"boot.image": self.image, "boot.accel": "tcg"})
        overlay = self.lifecycle.specs.disk_path(record)
        assert overlay is not None
        self.assertEqual(os.path.dirname(overlay), os.path.join(self.directory, "disks"))
        made = image_info(overlay)
        self.assertEqual((made["format"], made["backing-filename"]), ("qcow2", self.image))
        self.assertEqual(self.lifecycle.running.vms["vm1"].spec.disk, overlay)

    @_async
    async def test_rebuildReplacesTheOverlay(self) -> None:
        record = await self.launch(**{"boot.image": self.image, "boot.accel": "tcg"})
        overlay = self.lifecycle.specs.disk_path(record)
        assert overlay is not None
        with open(overlay, "ab") as f:
            f.write(b"\0" * 65536)  # what the guest wrote
        grown = os.path.getsize(overlay)
        await (await self.lifecycle.act("vm1", "rebuild")).when_done()
        self.assertEqual(self.lifecycle.store.view.get_instance("vm1").vm_state, VMState.ACTIVE)
        self.assertLess(os.path.getsize(overlay), grown)
        self.assertEqual(image_info(overlay)["backing-filename"], self.image)

    @_async
    async def test_deleteRemovesTheOverlay(self) -> None:
        record = await self.launch(**{"boot.image": self.image, "boot.accel": "tcg"})
        overlay = self.lifecycle.specs.disk_path(record)
        assert overlay is not None
        await (await self.lifecycle.act("vm1", "delete")).when_done()
        self.assertFalse(os.path.exists(overlay))
        self.assertEqual(os.listdir(os.path.dirname(overlay)), [])

    @_async
    async def test_startWithoutItsOverlaySaysRebuild(self) -> None:
        record = await self.launch(**{"boot.image": self.image, "boot.accel": "tcg"})
        await (await self.lifecycle.act("vm1", "stop", force=True)).when_done()
        overlay = self.lifecycle.specs.disk_path(record)
        assert overlay is not None
        os.unlink(overlay)
        operation = await self.lifecycle.act("vm1", "start")
        await operation.when_done()
        self.assertEqual(
            self.lifecycle.store.view.get_instance("vm1").error,
            f"the root disk of vm1, {overlay}, is missing; rebuild the instance to boot its "
            f"image {self.image} afresh",
        )

    @_async
    async def test_theImageItselfIsNeverWritten(self) -> None:
        before = read(self.image)
        await self.launch(**{"boot.image": self.image, "boot.accel": "tcg"})
        await (await self.lifecycle.act("vm1", "rebuild")).when_done()
        await (await self.lifecycle.act("vm1", "delete")).when_done()
        self.assertEqual(read(self.image), before)


class VsockCIDTests(LaunchTestCase):
    """On the vsock transport each VM gets a guest CID of its own, kept across restarts."""

    def setUp(self) -> None:
        super().setUp()
        # fakeqemu opens this as QEMU opens /dev/vhost-vsock (absent on this kind of machine).
        device = os.path.join(self.files, "vhost-vsock")
        pathlib.Path(device).touch()
        previous = os.environ.get("FAKEQEMU_VHOST_VSOCK_DEVICE")
        os.environ["FAKEQEMU_VHOST_VSOCK_DEVICE"] = device
        self.addCleanup(self._restore_environment, previous)
        self.lifecycle = self.new_lifecycle(settings=LaunchSettings(transport="vsock"))

    @staticmethod
    def _restore_environment(previous: str | None) -> None:
        if previous is None:
            os.environ.pop("FAKEQEMU_VHOST_VSOCK_DEVICE", None)
        else:
            os.environ["FAKEQEMU_VHOST_VSOCK_DEVICE"] = previous

    def qemu_cid(self, name: str) -> int:
        """The guest-cid on the command line of the instance's running QEMU."""
        with open(self.lifecycle.running.vms[name].spec.pidfile) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode().split("\0")
        device = next(w for w in words if w.startswith("vhost-vsock-pci,"))
        return int(dict(kv.split("=", 1) for kv in device.split(",")[1:])["guest-cid"])

    @_async
    async def test_eachInstanceGetsItsOwnCIDOnItsCommandLine(self) -> None:
        first = await self.launch("vm1", **{"boot.accel": "tcg"})
        second = await self.launch("vm2", **{"boot.accel": "tcg"})
        cids = [int(r.config[CID_KEY]) for r in (first, second)]
        self.assertEqual(len(set(cids)), 2)
        self.assertTrue(all(3 <= cid < 2**32 - 1 for cid in cids), cids)
        self.assertEqual([self.qemu_cid("vm1"), self.qemu_cid("vm2")], cids)
        self.assertEqual(first.config[TRANSPORT_KEY], "vsock")

    @_async
    async def test_theCIDIsKeptAcrossRestartsAndDaemons(self) -> None:
        cid = int((await self.launch(**{"boot.accel": "tcg"})).config[CID_KEY])
        await (await self.lifecycle.act("vm1", "restart", force=True)).when_done()
        after_restart = self.qemu_cid("vm1")
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle(settings=LaunchSettings(transport="vsock"))
        await self.lifecycle.recovery.recover()
        await (await self.lifecycle.act("vm1", "stop", force=True)).when_done()
        await (await self.lifecycle.act("vm1", "start")).when_done()
        self.assertEqual(
            (
                after_restart,
                self.qemu_cid("vm1"),
                self.lifecycle.store.view.get_instance("vm1").config[CID_KEY],
            ),
            (cid, cid, str(cid)),
        )


class ConsoleWriter(Protocol):
    """A booting guest writing to its serial console."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"Linux version 6.1.0 (a guest that runs)\n")


class AcceleratorTests(LaunchTestCase):
    """auto: KVM where a guest runs under it, else TCG, said out loud."""

    def kvm_lifecycle(self, binary: str | None = None, probe: float = 30.0) -> Lifecycle:
        # As on a host where /dev/kvm opens.
        settings = LaunchSettings(kvm_probe_timeout=probe, kvm_problem=None)
        lifecycle = self.new_lifecycle(binary, settings)
        verdicts = os.path.join(self.directory, "kvm-verdict.json")
        lifecycle.booting.use_kvm_verdicts(KVMVerdicts(verdicts, "test-host"))
        return lifecycle

    def aborting_qemu(self) -> str:
        path = os.path.join(self.files, "qemu-that-aborts-under-kvm")
        with open(path, "w") as f:
            f.write(KVM_ABORTS.format(python=sys.executable))
        os.chmod(path, 0o755)
        return path

    @_async
    async def test_qemuThatAbortsUnderKvmIsRestartedUnderTcg(self) -> None:
        self.lifecycle = self.kvm_lifecycle(self.aborting_qemu())
        record = await self.launch(**{"boot.kernel": self.kernel})
        self.assertEqual(record.config["volatile.accel"], "tcg")
        self.assertIn("failed to set MSR 0x10a", record.config["volatile.accel.reason"])
        self.assertIn("instance-accelerator-changed", self.actions("vm1"))
        changed = [
            e for e in self.events if e.metadata.get("action") == "instance-accelerator-changed"
        ]
        self.assertEqual(
            (changed[0].metadata["context"]["from"], changed[0].metadata["context"]["to"]),
            ("kvm", "tcg"),
        )
        assert self.lifecycle.booting.kvm is not None
        verdict = self.lifecycle.booting.kvm.verdict
        assert verdict is not None
        self.assertFalse(verdict.works)
        self.assertIn("accelerator", [a.action for a in self.store.actions.list_actions("vm1")])

    @_async
    async def test_aVerdictAgainstKvmGoesStraightToTcg(self) -> None:
        self.lifecycle = self.kvm_lifecycle(self.aborting_qemu())
        await self.launch(**{"boot.kernel": self.kernel})
        fresh = self.kvm_lifecycle(self.aborting_qemu())  # a restarted daemon
        await self._kill_everything()
        self.lifecycle = fresh
        record = await self.launch("vm2", **{"boot.kernel": self.kernel})
        self.assertEqual(record.config["volatile.accel"], "tcg")
        self.assertIn(
            "KVM does not run guests on this host", record.config["volatile.accel.reason"]
        )
        self.assertNotIn("instance-accelerator-changed", self.actions("vm2"))

    @_async
    async def test_aProbeThatFailsUnderKvmStartsTcgWithoutTryingTheGuest(self) -> None:
        self.lifecycle = self.kvm_lifecycle()
        said = "qemu fails under KVM on this host (a probe VM with no image ended by signal 6)"

        async def probe() -> KVMProbe:
            return KVMProbe(False, said)

        self.patch(self.lifecycle.booting.driver, "probe_kvm", probe)
        record = await self.launch(**{"boot.kernel": self.kernel})
        self.assertEqual(record.config["volatile.accel"], "tcg")
        self.assertEqual(record.config["volatile.accel.reason"], f"TCG: KVM failed here ({said})")
        self.assertNotIn("KVM, on trial", self.console_log("vm1", 4096).decode())
        assert self.lifecycle.booting.kvm is not None
        verdict = self.lifecycle.booting.kvm.verdict
        self.assertEqual((verdict.works, verdict.reason) if verdict else None, (False, said))
        self.assertIn("instance-accelerator-changed", self.actions("vm1"))

    @_async
    async def test_silentGuestUnderKvmIsRestartedUnderTcg(self) -> None:
        self.lifecycle = self.kvm_lifecycle(probe=0.5)
        record = await self.launch(**{"boot.kernel": self.kernel})
        self.assertEqual(record.config["volatile.accel"], "tcg")
        self.assertIn("showed no sign of life within 0.5s", record.config["volatile.accel.reason"])
        self.assertIn("-accel tcg", " ".join(self.command_line("vm1")))

    @_async
    async def test_guestThatWritesToItsConsoleProvesKvm(self) -> None:
        self.lifecycle = self.kvm_lifecycle(probe=30.0)
        operation = await self.lifecycle.create("vm1", {"boot.kernel": self.kernel})
        await until(lambda: "vm1" in self.lifecycle.running.vms)
        console = os.path.join(self.lifecycle.running.vms["vm1"].spec.guest_dir, "console")
        await until(lambda: os.path.exists(console))
        await connectProtocol(UNIXClientEndpoint(reactor, console), ConsoleWriter())
        await operation.when_done()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.config["volatile.accel"], "kvm")
        assert (
            self.lifecycle.booting.kvm is not None
            and self.lifecycle.booting.kvm.verdict is not None
        )
        self.assertTrue(self.lifecycle.booting.kvm.verdict.works)
        self.assertIn("Linux version 6.1.0", self.console_log("vm1", 4096).decode())

    @_async
    async def test_explicitTcgIsNeverProbed(self) -> None:
        self.lifecycle = self.kvm_lifecycle(self.aborting_qemu())
        record = await self.launch(**{"boot.kernel": self.kernel, "boot.accel": "tcg"})
        self.assertEqual(record.config["volatile.accel"], "tcg")
        assert self.lifecycle.booting.kvm is not None
        self.assertIsNone(self.lifecycle.booting.kvm.verdict)

    @_async
    async def test_explicitKvmFailureIsTheInstancesError(self) -> None:
        self.lifecycle = self.kvm_lifecycle(self.aborting_qemu())
        operation = await self.lifecycle.create(
            "vm1", {"boot.kernel": self.kernel, "boot.accel": "kvm"}
        )
        await operation.when_done()
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertEqual(record.vm_state, VMState.ERROR)
        self.assertIn("failed to set MSR 0x10a", record.error or "")

    def command_line(self, name: str) -> list[str]:
        pid = self.lifecycle.running.vms[name].pid
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")


class GuestEventTests(LaunchTestCase):
    """What the guest does reaches the instance: panics, consoles."""

    @_async
    async def test_guestPanicIsAnErrorWithItsReason(self) -> None:
        await self.launch(**{"boot.accel": "tcg"})
        vm = self.lifecycle.running.vms["vm1"]
        await guest_ends(vm, b"panic\n")
        await until(
            lambda: self.lifecycle.store.view.get_instance("vm1").vm_state is VMState.ERROR
        )
        record = self.lifecycle.store.view.get_instance("vm1")
        self.assertIn("guest kernel panicked", record.error or "")
        self.assertIn("vmready console vm1 --show-log", record.error or "")
        self.assertEqual(record.config.get(READY_KEY), "false")

    @_async
    async def test_consoleLogIsCappedAndRotated(self) -> None:
        self.lifecycle = self.new_lifecycle(settings=LaunchSettings(console_max_bytes=4096))
        await self.launch(**{"boot.accel": "tcg"})
        vm = self.lifecycle.running.vms["vm1"]
        with open(vm.spec.console_log, "ab") as f:
            f.write(b"x" * 10000 + b"\nthe last line\n")
        self.lifecycle.rotate_consoles()
        self.assertEqual(os.path.getsize(vm.spec.console_log), 0)
        self.assertLessEqual(os.path.getsize(vm.spec.console_log + ".1"), 4096)
        self.assertTrue(self.console_log("vm1", 4096).endswith(b"the last line\n"))

    @_async
    async def test_everyBootIsMarkedInTheConsoleLog(self) -> None:
        await self.launch(**{"boot.accel": "tcg"})
        await (await self.lifecycle.act("vm1", "restart", force=True)).when_done()
        log = self.console_log("vm1", 65536).decode()
        self.assertEqual(log.count("--- vmready: starting vm1: TCG, as the instance asks"), 2)
