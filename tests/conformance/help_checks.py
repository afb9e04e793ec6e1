"""Help requests answered as QEMU 7.2 answers them: ``-h``, ``-machine help``, ``-device help``.

The same checks run on fakeqemu and on real QEMU: every line expected here
was measured on ``qemu-system-x86_64`` 7.2, so a check that passes on both
shows fakeqemu prints QEMU's own lines for what it models.
"""

from __future__ import annotations

import os
import subprocess

from tests.conformance.checks import BackendTestCase
from tests.conformance.support import run_foreground

# The devices vmready's command line uses, as ``-device help`` lists them, by category.
DEVICE_LINES = {
    "Storage devices": [
        'name "virtio-9p-pci", bus PCI, alias "virtio-9p"',
        'name "virtio-blk-pci", bus PCI, alias "virtio-blk"',
    ],
    "Network devices": ['name "virtio-net-pci", bus PCI, alias "virtio-net"'],
    "Input devices": [
        'name "virtio-serial-pci", bus PCI, alias "virtio-serial"',
        'name "virtserialport", bus virtio-serial-bus',
    ],
    "Misc devices": [
        'name "pvpanic", bus ISA',
        'name "pvpanic-pci", bus PCI',
        'name "vhost-vsock-pci", bus PCI',
    ],
}
MACHINE_LINES = [
    "pc                   Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-7.2)",
    "pc-i440fx-7.2        Standard PC (i440FX + PIIX, 1996) (default)",
    "q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)",
    "pc-q35-7.2           Standard PC (Q35 + ICH9, 2009)",
    "none                 empty machine",
]


def sections(text: str) -> dict[str, list[str]]:
    """``-device help``'s output: each ``Category:`` header with the lines under it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith("name "):
            current = found.setdefault(line[:-1], [])
        elif line and current is not None:
            current.append(line)
    return found


class HelpChecks(BackendTestCase):
    """What each help request prints, and that it exits 0 having started nothing."""

    def ask(self, *args: str) -> str:
        """Run the backend with ``args``; its stdout, having checked it exited 0, silently."""
        completed = subprocess.run(
            [*self.backend.program, *args],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
            cwd=self.workspace.path,
        )
        self.assertEqual((completed.returncode, completed.stderr), (0, ""))
        self.assertEqual(os.listdir(self.workspace.path), [])
        return completed.stdout

    def test_helpNamesTheVersionAndTheUsageBeforeLaterOptionsAreActedOn(self) -> None:
        for option in ("-h", "-help", "--help"):
            lines = self.ask(option, "-m", "bogus").splitlines()
            self.assertTrue(lines[0].startswith("QEMU emulator version 7.2."), lines[0])
            self.assertIn(f"usage: {self.backend.message_prefix} [options] [disk_image]", lines)
            self.assertIn("Standard options:", lines)
            self.assertIn("-version        display version information and exit", lines)

    def test_anUnknownOptionAnywhereIsRefusedBeforeTheHelp(self) -> None:
        result = run_foreground(self.backend, ["-h", "-bogus"])
        self.assertEqual((result.returncode, result.messages), (1, ["-bogus: invalid option"]))

    def test_machineHelpListsTheMachinesVmreadyUses(self) -> None:
        for args in (("-machine", "help"), ("-M", "help"), ("-machine", "?")):
            lines = self.ask(*args).splitlines()
            self.assertEqual(lines[0], "Supported machines are:")
            for line in MACHINE_LINES:
                self.assertIn(line, lines)

    def test_deviceHelpListsTheDevicesVmreadyUsesUnderTheirCategories(self) -> None:
        listed = sections(self.ask("-device", "help"))
        for category, lines in DEVICE_LINES.items():
            for line in lines:
                self.assertIn(line, listed.get(category, []), category)

    def test_accelHelpListsTcgAndKvm(self) -> None:
        lines = self.ask("-accel", "help").splitlines()
        self.assertEqual(lines[0], "Accelerators supported in QEMU binary:")
        self.assertEqual(sorted(lines[1:]), ["kvm", "tcg"])

    def test_cpuHelpListsTheModelsVmreadyUses(self) -> None:
        lines = self.ask("-cpu", "help").splitlines()
        self.assertEqual(lines[0], "Available CPUs:")
        models = {line.split()[1] for line in lines[1:] if line.startswith("x86 ")}
        self.assertLessEqual({"host", "max", "qemu64"}, models)
