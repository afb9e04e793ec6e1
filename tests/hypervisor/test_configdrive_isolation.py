"""Config drives are isolated: each guest is handed its own drive, and nothing of another's.

Two instances launched as the daemon launches them (fakeqemu VMs, drives with
the daemon's agent and loader, certificates issued by the lifecycle).  Checked
on the real directories, on the command line each running VM process really
got (``/proc/<pid>/cmdline``), and through fakeqemu's view of the 9p export
(``<guest dir>/9p/config``, and ``fakeqemu.testing.InMemoryVM.share_path``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile

from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from fakeqemu.testing import InMemoryVM
from tests.fixtures import make_lifecycle
from tests.reactor import reactor
from vmready.daemon.assembly import drive_contents
from vmready.domain.model import InstanceRecord
from vmready.hypervisor.cmdline import VMSpec
from vmready.hypervisor.configdrive import DriveContents, write_settings
from vmready.hypervisor.guestdata import GuestData
from vmready.lifecycle.core import Lifecycle
from vmready.lifecycle.guestlink import GuestLink
from vmready.lifecycle.settings import LaunchSettings
from vmready.lifecycle.specs import CONFIG_DRIVE
from vmready.trust.certs import ensure_server_certificate, fingerprint

SECRET = "BRAVO-SECRET"
UUID = "6f1c3a52-9d2e-4b7a-8c11-0123456789ab"
ALPHA_CONFIG = {"user.owner": "alpha", "cloud-init.user-data": "#cloud-config\nhostname: alpha\n"}
BRAVO_CONFIG = {
    "user.owner": f"{SECRET}-owner",
    "user.meta-data": f"{SECRET}-meta: 1",
    "cloud-init.user-data": f"#cloud-config\npassword: {SECRET}\n",
}
# Files only the daemon's user may read, anywhere: the identity and the user-data.
PRIVATE_FILES = ("agent.key", "agent.crt", "server.crt", "cloud-init/user-data", "guest-api.json")


def _files(top: str) -> dict[str, os.stat_result]:
    """Every entry under ``top`` by its relative path, not following links (lstat)."""
    found = {}
    for directory, subdirectories, files in os.walk(top):
        for name in subdirectories + files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, top)] = os.lstat(path)
    return found


def _fsdev_paths(argv: list[str]) -> list[str]:
    """The ``path=`` of every ``-fsdev`` on a QEMU command line (``,,`` is a literal comma)."""
    paths = []
    for flag, value in itertools.pairwise(argv):
        if flag != "-fsdev":
            continue
        options = value.replace(",,", "\0").split(",")
        paths += [o[len("path=") :].replace("\0", ",") for o in options if o.startswith("path=")]
    return paths


class ConfigDriveIsolationTests(TestCase):
    """alpha's drive, its VM's command line and its 9p export: alpha's, nothing of bravo's."""

    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        data_dir = tempfile.mkdtemp(prefix="vmr-drive-")
        self.addCleanup(shutil.rmtree, data_dir, True)
        server = ensure_server_certificate(data_dir)
        settings = LaunchSettings(drive=drive_contents(data_dir))
        self.lifecycle: Lifecycle = make_lifecycle(self, settings=settings)
        self.lifecycle.reach.listening(GuestLink(1024, server.cert_pem, "hvsock:/nonexistent"))
        self.alpha = await self.launch("alpha", ALPHA_CONFIG)
        self.bravo = await self.launch("bravo", BRAVO_CONFIG)
        self.alpha_spec = self.lifecycle.specs.spec_for(self.alpha)
        self.bravo_spec = self.lifecycle.specs.spec_for(self.bravo)

    async def launch(self, name: str, config: dict[str, str]) -> InstanceRecord:
        operation = await (await self.lifecycle.create(name, config)).when_done()
        await deferLater(reactor, 0, lambda: None)
        self.assertEqual(operation.error, "")
        return self.lifecycle.store.view.get_instance(name)

    def drive(self, record: InstanceRecord) -> str:
        return self.lifecycle.specs.config_drive(record)

    def bravo_markers(self) -> list[bytes]:
        """What would betray bravo in a file: its name, uuid, run dir, certificate, data."""
        with open(os.path.join(self.drive(self.bravo), "agent.crt"), "rb") as f:
            certificate = f.read()
        with open(os.path.join(self.drive(self.bravo), "agent.key"), "rb") as f:
            key = f.read()
        return [
            b"bravo",
            SECRET.encode(),
            self.bravo.uuid.encode(),
            os.fsencode(self.bravo_spec.run_dir),
            certificate,
            key,
            fingerprint(certificate).encode(),
        ]

    def assertOnlyAlpha(self, top: str) -> None:
        """Everything under ``top`` is a plain file or directory that says nothing of bravo."""
        markers = self.bravo_markers()
        entries = _files(top)
        self.assertIn("agent.crt", entries)
        for relative, status in entries.items():
            self.assertTrue(
                stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode),
                f"{relative} is neither a file nor a directory (a link could lead elsewhere)",
            )
            if stat.S_ISREG(status.st_mode):
                with open(os.path.join(top, relative), "rb") as f:
                    content = f.read()
                for marker in markers:
                    self.assertNotIn(marker, content, relative)
        with open(os.path.join(top, "agent.crt"), "rb") as f:
            found = self.lifecycle.store.view.instance_for_fingerprint(fingerprint(f.read()))
        assert found is not None
        self.assertEqual(found.uuid, self.alpha.uuid)

    def test_eachDriveHoldsItsOwnInstanceOnly(self) -> None:
        self.assertOnlyAlpha(self.drive(self.alpha))

    def test_drivesAreDisjointAndHoldNoRunFiles(self) -> None:
        alpha, bravo = (os.path.realpath(self.drive(r)) for r in (self.alpha, self.bravo))
        self.assertNotEqual(os.path.commonpath([alpha, bravo]), alpha)
        self.assertNotEqual(os.path.commonpath([alpha, bravo]), bravo)
        # The export is the drive, not the run dir that holds it (QMP socket, logs).
        self.assertEqual(os.path.basename(alpha), CONFIG_DRIVE)
        for run_file in (self.alpha_spec.qmp_socket, self.alpha_spec.console_log):
            self.assertNotEqual(os.path.commonpath([alpha, run_file]), alpha)

    def test_drivesAreReadableByTheDaemonsUserOnly(self) -> None:
        for record, spec in ((self.alpha, self.alpha_spec), (self.bravo, self.bravo_spec)):
            drive = self.drive(record)
            for directory in (spec.run_dir, drive):
                status = os.stat(directory)
                self.assertEqual(stat.S_IMODE(status.st_mode), 0o700, directory)
                self.assertEqual(status.st_uid, os.getuid(), directory)
            for relative in PRIVATE_FILES:
                mode = stat.S_IMODE(os.stat(os.path.join(drive, relative)).st_mode)
                self.assertEqual(mode, 0o600, relative)
            for relative, status in _files(drive).items():
                self.assertEqual(status.st_uid, os.getuid(), relative)
                self.assertEqual(stat.S_IMODE(status.st_mode) & 0o022, 0, f"{relative} writable")

    def running_command_line(self, spec: VMSpec) -> list[str]:
        """The argv of the VM process that runs ``spec`` (its pidfile), as the kernel has it."""
        with open(spec.pidfile) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1]]

    def test_eachVMsCommandLineExportsOnlyItsOwnDriveReadOnly(self) -> None:
        for mine, other in (
            (self.alpha_spec, self.bravo_spec),
            (self.bravo_spec, self.alpha_spec),
        ):
            argv = self.running_command_line(mine)
            assert mine.config_drive is not None
            self.assertEqual(_fsdev_paths(argv), [mine.config_drive])
            (fsdev,) = [value for flag, value in itertools.pairwise(argv) if flag == "-fsdev"]
            self.assertIn("readonly=on", fsdev.split(","))
            for arg in argv:
                self.assertNotIn(other.uuid, arg)
                self.assertNotIn(other.run_dir, arg)
                self.assertNotIn(f"guest={other.name}", arg)

    def test_fakeqemuShowsEachGuestItsOwnDrive(self) -> None:
        for spec in (self.alpha_spec, self.bravo_spec):
            seen = os.path.join(spec.guest_dir, "9p", "config")
            assert spec.config_drive is not None
            self.assertEqual(os.path.realpath(seen), os.path.realpath(spec.config_drive))
            argv = self.running_command_line(spec)
            in_memory = InMemoryVM(argv[argv.index("-name") :])  # past the program
            self.assertEqual(in_memory.share_path("config"), spec.config_drive)
        self.assertOnlyAlpha(os.path.join(self.alpha_spec.guest_dir, "9p", "config"))


class DriveFilesPrivateFromTheFirstByteTests(SynchronousTestCase):
    """A drive file is the daemon user's alone while it is written, whatever the umask."""

    def test_partialFilesAreOwnerOnlyUntilWhole(self) -> None:
        drive = os.path.join(self.mktemp(), CONFIG_DRIVE)
        os.makedirs(drive)
        self.addCleanup(os.umask, os.umask(0))
        modes_before_chmod: dict[str, int] = {}
        real_chmod = os.chmod

        def chmod(path: str, mode: int) -> None:
            modes_before_chmod[os.path.basename(path)] = stat.S_IMODE(os.stat(path).st_mode)
            real_chmod(path, mode)

        self.patch(os, "chmod", chmod)
        guest = GuestData(UUID, "alpha", {"cloud-init.user-data": SECRET})
        write_settings(drive, {"instance": "alpha"}, DriveContents(), guest)
        self.assertEqual(
            modes_before_chmod,
            {
                "agent.json.tmp": 0o600,
                "meta-data.tmp": 0o600,
                "user-data.tmp": 0o600,
                "guest-api.json.tmp": 0o600,
            },
        )
        user_data = os.path.join(drive, "cloud-init", "user-data")
        self.assertEqual(stat.S_IMODE(os.stat(user_data).st_mode), 0o600)
