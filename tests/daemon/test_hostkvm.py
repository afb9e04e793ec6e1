"""The hypervisor's version a KVM verdict is kept for: its ``--version`` line, or why not."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from twisted.internet.defer import Deferred
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from tests.reactor import reactor
from vmready.daemon.hostkvm import load_kvm_verdicts, program_version
from vmready.hypervisor.driver import HypervisorDriver


class ProgramVersionTests(TestCase):
    """``program_version``: the first line a program prints for ``--version``."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-version-")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.said: list[str] = []

        @implementer(ILogObserver)
        def observe(event: LogEvent) -> None:
            if event.get("log_namespace") == "vmready.daemon.hostkvm":
                self.said.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def program(self, script: str) -> str:
        """A shell script that does ``script`` when run."""
        path = os.path.join(self.directory, "qemu-system-x86_64")
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + script + "\n")
        os.chmod(path, stat.S_IRWXU)
        return path

    async def test_theFirstLineOfItsVersion(self) -> None:
        path = self.program('echo "QEMU emulator version 7.2.0"; echo "Copyright"')
        self.assertEqual(await program_version(reactor, [path]), "QEMU emulator version 7.2.0")
        self.assertEqual(self.said, [])

    async def test_aProgramNotOnThePathSaysSo(self) -> None:
        missing = os.path.join(self.directory, "no-such-qemu")
        version = await program_version(reactor, [missing])
        self.assertEqual(version, f"unknown ({missing} was not found)")
        self.assertEqual(
            self.said, [f"cannot tell the hypervisor's version: {missing} was not found"]
        )

    async def test_aFailingProgramGivesItsStatusAndFirstErrorLine(self) -> None:
        path = self.program('echo "qemu: unsupported option" >&2; echo more >&2; exit 3')
        self.assertEqual(
            await program_version(reactor, [path]),
            f"unknown ({path} --version exited with status 3: qemu: unsupported option)",
        )

    async def test_aProgramKilledBySignalSaysWhichSignal(self) -> None:
        path = self.program("kill -9 $$")
        self.assertEqual(
            await program_version(reactor, [path]),
            f"unknown ({path} --version could not run: killed by signal 9)",
        )

    async def test_aProgramThatPrintsNothingSaysSo(self) -> None:
        path = self.program("exit 0")
        self.assertEqual(
            await program_version(reactor, [path]), f"unknown ({path} --version printed nothing)"
        )


class KVMVerdictsTests(TestCase):
    """``load_kvm_verdicts``: the verdicts kept for this kernel and hypervisor build."""

    async def test_keptPerKernelProgramAndVersion(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-verdicts-")
        self.addCleanup(shutil.rmtree, directory, True)
        driver = HypervisorDriver(reactor, "fakeqemu")
        version = program_version(reactor, ["/nonexistent/qemu"])
        verdicts = await load_kvm_verdicts(directory, driver, Deferred.fromCoroutine(version))
        unknown = "unknown (/nonexistent/qemu was not found)"
        self.assertEqual(verdicts.key, f"{os.uname().release}|{driver.program_name}|{unknown}")
        self.assertEqual(verdicts.path, os.path.join(directory, "kvm-verdict.json"))
        self.assertIsNone(verdicts.verdict)
