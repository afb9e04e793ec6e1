"""vmready.hypervisor.kvmprobe: KVM's fate from a probe VM with no image, in well under a second.

``judge`` is tested as a rule; ``probe_kvm`` runs real processes: scripts
standing in for a QEMU that aborts under KVM, one whose firmware writes its
banner to the debug console file on its command line, and one that stays up
silent; and real ``qemu-system-x86_64`` (skipped where it is missing, unless
``VMREADY_REQUIRE_QEMU=1``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.conformance.support import require_program
from tests.lifecycle.test_lifecycle import _async
from tests.reactor import reactor
from vmready.hypervisor.accel import kvm_device_problem
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.kvmprobe import KVMProbe, judge, probe_arguments, probe_kvm

MSR = "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69"

ABORTS = f"""#!/bin/sh
echo "{MSR}" >&2
kill -ABRT $$
"""

# The firmware's debug console is "-chardev file,id=firmware,path=PATH": write there.
FIRMWARE_RUNS = """#!/bin/sh
for word in "$@"; do
    case $word in
        file,id=firmware,path=*) echo "SeaBIOS (version 1.16.2)" >"${word#*path=}" ;;
    esac
done
exec sleep 30
"""

SILENT = """#!/bin/sh
echo $$ >"$(dirname "$0")/pid"
exec sleep 30
"""


class JudgeTests(SynchronousTestCase):
    """Only QEMU ending is a verdict; firmware output or silence leaves the guest on trial."""

    def test_qemuThatEndsIsAVerdictAgainstKvmInItsOwnWords(self) -> None:
        probe = judge("qemu", (None, 6), MSR.encode() + b"\n", b"", 0.17)
        self.assertEqual(
            probe,
            KVMProbe(
                False,
                "qemu fails under KVM on this host (a probe VM with no image ended by "
                f"signal 6 after 0.17s: {MSR})",
            ),
        )

    def test_anExitStatusIsNamedWhenQemuSaysNothing(self) -> None:
        probe = judge("qemu", (1, None), b"", b"", 0.05)
        self.assertFalse(probe.starts)
        self.assertTrue(probe.reason.endswith("ended by status 1 after 0.05s)"), probe.reason)

    def test_firmwareOutputMeansQemuStartsAGuest(self) -> None:
        probe = judge("qemu", None, b"", b"SeaBIOS (version 1.16.2)\n", 0.04)
        self.assertEqual(probe, KVMProbe(True, "a probe VM's firmware ran under KVM within 0.04s"))

    def test_silenceIsNoVerdict(self) -> None:
        probe = judge("qemu", None, b"", b"", 2.0)
        self.assertTrue(probe.starts)
        self.assertIn("stayed up under KVM for 2.0s", probe.reason)

    def test_theCommandLineAsksForKvmTheHostCpuAndTheDebugConsole(self) -> None:
        argv = probe_arguments(["qemu"], "/tmp/a,b/firmware.log")
        self.assertEqual(argv[argv.index("-accel") + 1], "kvm")
        self.assertEqual(argv[argv.index("-cpu") + 1], "host")
        self.assertIn("file,id=firmware,path=/tmp/a,,b/firmware.log", argv)
        self.assertIn("isa-debugcon,iobase=0x402,chardev=firmware", argv)
        self.assertNotIn("-kernel", argv)


class ProbeTests(TestCase):
    """The probe runs the program, waits for its first word or its end, and leaves nothing."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-kp-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def script(self, text: str) -> str:
        path = os.path.join(self.directory, "qemu")
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
        return path

    @_async
    async def test_aQemuThatAbortsIsJudgedAtOnce(self) -> None:
        probe = await probe_kvm(reactor, reactor, [self.script(ABORTS)], "qemu", window=10.0)
        self.assertFalse(probe.starts)
        self.assertIn("ended by signal 6", probe.reason)
        self.assertIn("failed to set MSR 0x10a", probe.reason)

    @_async
    async def test_firmwareOutputEndsTheProbeAndTheProbeVM(self) -> None:
        probe = await probe_kvm(
            reactor, reactor, [self.script(FIRMWARE_RUNS)], "qemu", window=10.0
        )
        self.assertTrue(probe.starts)
        self.assertIn("firmware ran under KVM", probe.reason)

    @_async
    async def test_aSilentQemuIsStoppedAfterTheWindow(self) -> None:
        probe = await probe_kvm(reactor, reactor, [self.script(SILENT)], "qemu", window=0.3)
        self.assertTrue(probe.starts)
        self.assertIn("its firmware wrote nothing", probe.reason)
        with open(os.path.join(self.directory, "pid")) as f:
            pid = int(f.read())
        self.assertFalse(os.path.exists(f"/proc/{pid}"), "the probe VM was left running")

    @_async
    async def test_aMissingProgramIsNoKvm(self) -> None:
        probe = await probe_kvm(reactor, reactor, ["/nonexistent/qemu"], "qemu")
        self.assertFalse(probe.starts)
        self.assertIn("is not installed", probe.reason)

    @_async
    async def test_fakeqemuIsNotProbed(self) -> None:
        self.assertIsNone(await HypervisorDriver(reactor, "fakeqemu").probe_kvm())

    @_async
    async def test_realQemuGivesItsVerdictInWellUnderASecondOrRunsFirmware(self) -> None:
        require_program(self, "qemu-system-x86_64", "qemu-system-x86")
        probe = await HypervisorDriver(reactor, "qemu").probe_kvm()
        assert probe is not None
        if kvm_device_problem() is not None:
            # No usable /dev/kvm: QEMU refuses KVM at once and says so.
            self.assertFalse(probe.starts)
            self.assertIn("KVM", probe.reason)
        elif probe.starts:
            self.assertIn("firmware ran under KVM", probe.reason)
        else:
            self.assertIn("qemu-system-x86_64 fails under KVM on this host", probe.reason)
