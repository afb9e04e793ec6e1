"""fakeqemu's answers to help requests, beside the conformance checks against real QEMU."""

from __future__ import annotations

import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._cmdline import CommandLineError, parse_arguments
from fakeqemu._devices import _PROPERTIES
from fakeqemu._help import HelpRequested, device_help, machine_help, usage


class HelpRequestTests(SynchronousTestCase):
    """Which request a command line makes, and which wins when it makes several."""

    def kind(self, *argv: str) -> str:
        request: HelpRequested = self.assertRaises(HelpRequested, parse_arguments, argv)
        return request.kind

    def test_eachOptionsHelpValue(self) -> None:
        self.assertEqual(self.kind("-h"), "usage")
        self.assertEqual(self.kind("--help"), "usage")
        self.assertEqual(self.kind("-machine", "help"), "machine")
        self.assertEqual(self.kind("-machine", "type=?"), "machine")
        self.assertEqual(self.kind("-accel", "help"), "accel")
        self.assertEqual(self.kind("-cpu", "?"), "cpu")
        self.assertEqual(self.kind("-device", "help"), "device")

    def test_helpComesBeforeTheOptionsAfterIt(self) -> None:
        self.assertEqual(self.kind("-h", "-m", "bogus"), "usage")
        self.assertRaises(CommandLineError, parse_arguments, ["-m", "bogus", "-h"])
        self.assertRaises(CommandLineError, parse_arguments, ["-h", "-bogus"])

    def test_severalRequestsAreAnsweredInQEMUsOrder(self) -> None:
        # Measured: machine, then accel, then cpu, then device, wherever each was given.
        self.assertEqual(self.kind("-device", "help", "-machine", "help"), "machine")
        self.assertEqual(self.kind("-device", "help", "-accel", "help"), "accel")
        self.assertEqual(self.kind("-device", "help", "-cpu", "help"), "cpu")

    def test_versionWinsOverALaterHelpValue(self) -> None:
        self.assertTrue(parse_arguments(["-version", "-device", "help"]).show_version)


class HelpTextTests(SynchronousTestCase):
    """The texts list what fakeqemu models, no more and no less."""

    def test_everyDeviceModelIsListedOnce(self) -> None:
        listed = [line.split('"')[1] for line in device_help().splitlines() if line[:5] == "name "]
        self.assertEqual(sorted(listed), sorted(_PROPERTIES))

    def test_everyMachineTypeIsListed(self) -> None:
        names = [line.split()[0] for line in machine_help().splitlines()[1:]]
        self.assertEqual(sorted(names), ["none", "pc", "pc-i440fx-7.2", "pc-q35-7.2", "q35"])
        for name in names:
            parse_arguments(["-machine", name])  # each one is accepted

    def test_longOptionsWrapTheirTextUnderAnIndent(self) -> None:
        lines = usage("fakeqemu", "QEMU emulator version 7.2.22").splitlines()
        index = lines.index("-machine [type=]name[,prop[=value][,...]]")
        self.assertTrue(lines[index + 1].startswith(" " * 16 + "selects emulated machine"))

    def test_theProgramPrintsTheHelpOnStdoutAndExits0(self) -> None:
        completed = subprocess.run(
            [sys.executable, "-m", "fakeqemu", "-device", "help"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        self.assertEqual((completed.returncode, completed.stderr), (0, ""))
        self.assertEqual(completed.stdout, device_help())
