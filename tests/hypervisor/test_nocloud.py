"""vmready.hypervisor.nocloud: the NoCloud seed, read back with an independent reader (isoinfo).

The seed is written with pycdlib; every test reads it with ``isoinfo`` (Debian's
``genisoimage``), which knows nothing of pycdlib: the names a guest sees (Rock
Ridge, and Joliet), their bytes and modes, the volume label.  The tests skip
where ``isoinfo`` is missing, and fail instead under ``VMREADY_REQUIRE_QEMU=1``
(CI installs it).  That a real guest's cloud-init reads the seed is the
real-guest tests' to show (``tests/endtoend/test_stock_images.py``).
"""

from __future__ import annotations

import email
import json
import os
import shutil
import stat
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from tests.conformance.support import REQUIRE_QEMU_VARIABLE
from vmready.guestfiles import boothook
from vmready.hypervisor.cmdline import VMSpec, build_command_line
from vmready.hypervisor.configdrive import DriveContents, write_identity, write_settings
from vmready.hypervisor.guestdata import GuestData
from vmready.hypervisor.nocloud import (
    SEED_FILE,
    SeedFile,
    seed_files,
    seed_image,
    seed_path,
    vendor_data,
    write_seed,
)
from vmready.trust.certs import CertificatePair

UUID = "6f1c3a52-9d2e-4b7a-8c11-0123456789ab"
CLIENT = CertificatePair(
    cert_pem=b"-----BEGIN CERTIFICATE-----\nclient\n-----END CERTIFICATE-----\n",
    key_pem=b"-----BEGIN PRIVATE KEY-----\nclient\n-----END PRIVATE KEY-----\n",
)
SERVER_CERT = b"-----BEGIN CERTIFICATE-----\nserver\n-----END CERTIFICATE-----\n"
LOADER = {
    "install.sh": b"#!/bin/sh\necho install\n",
    "systemd/vmready-agent-setup": b"#!/bin/sh\necho setup\n",
    "systemd/vmready-agent.service": b"[Service]\n",
}


class Seed:
    """A written seed, as isoinfo reads it: Rock Ridge names, modes, contents; Joliet names."""

    def __init__(self, test: SynchronousTestCase, path: str) -> None:
        self.test = test
        self.path = path

    def isoinfo(self, *args: str) -> bytes:
        return subprocess.run(
            ["isoinfo", "-i", self.path, *args], capture_output=True, check=True
        ).stdout

    def label(self) -> str:
        for line in self.isoinfo("-d").decode().splitlines():
            if line.startswith("Volume id: "):
                return line[len("Volume id: ") :]
        raise AssertionError("no volume id")

    def listing(self, names: str = "-R") -> dict[str, str]:
        """Every file's path (as the guest sees it) and its mode string, from ``isoinfo -l``."""
        found: dict[str, str] = {}
        directory = ""
        for line in self.isoinfo(names, "-l").decode().splitlines():
            if line.startswith("Directory listing of "):
                directory = line[len("Directory listing of ") :].strip("/")
                continue
            fields = line.split()
            if len(fields) < 2 or fields[-1] in (".", ".."):
                continue
            name = line.split("]", 1)[1].strip()
            found[f"{directory}/{name}".lstrip("/")] = fields[0]
        return found

    def files(self) -> dict[str, str]:
        """The regular files and their modes (``-rw-r--r--``)."""
        return {path: mode for path, mode in self.listing().items() if mode.startswith("-")}

    def read(self, path: str) -> bytes:
        return self.isoinfo("-R", "-x", "/" + path)


def need_isoinfo(test: SynchronousTestCase) -> None:
    if shutil.which("isoinfo") is not None:
        return
    reason = "isoinfo is not installed (Debian: genisoimage)"
    if os.environ.get(REQUIRE_QEMU_VARIABLE) == "1":
        test.fail(f"{REQUIRE_QEMU_VARIABLE}=1 but {reason}")
    test.skipTest(reason)


class SeedImageTests(SynchronousTestCase):
    """``seed_image``: any files, any names, read back as they went in."""

    def setUp(self) -> None:
        need_isoinfo(self)
        self.path = os.path.join(self.mktemp())

    def write(self, files: list[SeedFile]) -> Seed:
        with open(self.path, "wb") as f:
            f.write(seed_image(files))
        return Seed(self, self.path)

    def test_theVolumeIsLabelledCidata(self) -> None:
        self.assertEqual(self.write([SeedFile("meta-data", b"")]).label(), "cidata")

    def test_rockRidgeNamesAndContentsAsGiven(self) -> None:
        seed = self.write(
            [
                SeedFile("meta-data", b"instance-id: x\n"),
                SeedFile("network-config", b"version: 2\n"),
                SeedFile("vmready/systemd/vmready-agent.service", b"[Unit]\n"),
            ]
        )
        self.assertEqual(
            {path: seed.read(path) for path in seed.files()},
            {
                "meta-data": b"instance-id: x\n",
                "network-config": b"version: 2\n",
                "vmready/systemd/vmready-agent.service": b"[Unit]\n",
            },
        )

    def test_modesAsGiven(self) -> None:
        seed = self.write(
            [
                SeedFile("vmready/agent.key", b"k", 0o600),
                SeedFile("vmready/install.sh", b"#!/bin/sh\n", 0o755),
                SeedFile("meta-data", b""),
            ]
        )
        self.assertEqual(
            seed.files(),
            {
                "vmready/agent.key": "-rw-------",
                "vmready/install.sh": "-rwxr-xr-x",
                "meta-data": "-rw-r--r--",
            },
        )

    def test_jolietNamesToo(self) -> None:
        seed = self.write([SeedFile("user-data", b""), SeedFile("vmready/agent.json", b"{}")])
        self.assertEqual(
            sorted(seed.listing("-J")), ["user-data", "vmready", "vmready/agent.json"]
        )

    def test_namesThatMeetInISO9660StayApart(self) -> None:
        # Both are USER_DATA in ISO 9660's alphabet; each keeps its own name and bytes.
        seed = self.write([SeedFile("user-data", b"dash"), SeedFile("user_data", b"underscore")])
        self.assertEqual(
            (seed.read("user-data"), seed.read("user_data")), (b"dash", b"underscore")
        )

    def test_longAndOddNames(self) -> None:
        name = "vmready/a.very-long.name with spaces+plus/99-vmready-agent.rules"
        seed = self.write([SeedFile(name, b"rule")])
        self.assertEqual(seed.read(name), b"rule")

    def test_aLargeFileIsWhole(self) -> None:
        data = bytes(range(256)) * 20000  # 5 MB, past many 2 KiB sectors
        self.assertEqual(self.write([SeedFile("user-data", data)]).read("user-data"), data)


class SeedOfAnInstanceTests(SynchronousTestCase):
    """What ``write_settings`` puts on the seed of an instance that boots an image."""

    def setUp(self) -> None:
        need_isoinfo(self)
        self.run_dir = self.mktemp()
        self.drive = os.path.join(self.run_dir, "config-drive")
        write_identity(self.drive, CLIENT, SERVER_CERT)
        self.zipapp = os.path.join(self.run_dir, "agent.pyz")
        with open(self.zipapp, "wb") as f:
            f.write(b"PK the agent")

    def seed(self, config: dict[str, str]) -> Seed:
        guest = GuestData(UUID, "web1", config, {"eth0": {"type": "nic"}}, image=True)
        write_settings(self.drive, {"instance": "web1"}, DriveContents(self.zipapp, LOADER), guest)
        return Seed(self, os.path.join(self.run_dir, SEED_FILE))

    def test_nocloudFilesAtTheTop(self) -> None:
        seed = self.seed(
            {"cloud-init.user-data": "#cloud-config\nruncmd: [true]\n", "user.meta-data": "a: 1"}
        )
        self.assertEqual(
            (seed.read("meta-data"), seed.read("user-data")),
            (
                f"instance-id: {UUID}\nlocal-hostname: web1\na: 1".encode(),
                b"#cloud-config\nruncmd: [true]\n",
            ),
        )

    def test_unsetUserDataIsAnEmptyFile(self) -> None:
        self.assertEqual(self.seed({}).read("user-data"), b"")

    def test_vendorDataIsTheBoothook(self) -> None:
        self.assertEqual(self.seed({}).read("vendor-data"), boothook())

    def test_networkConfigOnlyWhenSet(self) -> None:
        self.assertNotIn("network-config", self.seed({}).files())
        seed = self.seed({"cloud-init.network-config": "version: 2\nethernets: {}\n"})
        self.assertEqual(seed.read("network-config"), b"version: 2\nethernets: {}\n")

    def test_theConfigDriveIsUnderVmready(self) -> None:
        seed = self.seed({"user.role": "web"})
        self.assertEqual(
            sorted(path for path in seed.files() if path.startswith("vmready/")),
            [
                "vmready/agent.crt",
                "vmready/agent.json",
                "vmready/agent.key",
                "vmready/cloud-init/meta-data",
                "vmready/cloud-init/user-data",
                "vmready/guest-api.json",
                "vmready/install.sh",
                "vmready/server.crt",
                "vmready/systemd/vmready-agent-setup",
                "vmready/systemd/vmready-agent.service",
                "vmready/vmready-agent.pyz",
            ],
        )
        self.assertEqual(seed.read("vmready/agent.key"), CLIENT.key_pem)
        self.assertEqual(
            json.loads(seed.read("vmready/guest-api.json"))["config"], {"user.role": "web"}
        )

    def test_secretsAndScriptsKeepTheirModes(self) -> None:
        files = self.seed({}).files()
        self.assertEqual(
            (
                files["vmready/agent.key"],
                files["vmready/install.sh"],
                files["user-data"],
                files["vendor-data"],
            ),
            ("-rw-------", "-rwxr-xr-x", "-rw-------", "-rw-------"),
        )

    def test_theSeedIsTheDaemonsAloneOnTheHost(self) -> None:
        self.seed({})
        mode = os.stat(os.path.join(self.run_dir, SEED_FILE)).st_mode
        self.assertEqual(stat.S_IMODE(mode), 0o600)

    def test_rewritingReplacesTheSeedWhole(self) -> None:
        self.seed({"cloud-init.user-data": "first"})
        seed = self.seed({"cloud-init.user-data": "second"})
        self.assertEqual(seed.read("user-data"), b"second")
        self.assertEqual(
            sorted(os.listdir(self.run_dir)), ["agent.pyz", "config-drive", SEED_FILE]
        )

    def test_eachSeedHoldsItsOwnInstanceOnly(self) -> None:
        self.seed({"cloud-init.user-data": "alpha's"})
        other_run = self.mktemp()
        other_drive = os.path.join(other_run, "config-drive")
        write_identity(other_drive, CLIENT, SERVER_CERT)
        bravo = GuestData(
            "11111111-2222-3333-4444-555555555555", "bravo", {"user.secret": "BRAVO-SECRET"}
        )
        write_seed(seed_path(other_drive), bravo, other_drive)
        with open(os.path.join(self.run_dir, SEED_FILE), "rb") as f:
            alpha = f.read()
        for marker in (b"bravo", b"BRAVO-SECRET", b"11111111-2222"):
            self.assertNotIn(marker, alpha)


class VendorDataTests(SynchronousTestCase):
    """vmready's boothook, alone or before the instance's own vendor-data."""

    def test_aloneItIsTheBoothook(self) -> None:
        self.assertEqual(vendor_data(), boothook().decode())

    def test_theBoothookRunsAShellScript(self) -> None:
        # cloud-init strips the first line and executes the rest: it needs its #!.
        self.assertEqual(boothook().split(b"\n")[:2], [b"#cloud-boothook", b"#!/bin/sh"])

    def test_withTheInstancesOwnBothAreParts(self) -> None:
        message = email.message_from_string(vendor_data("#cloud-config\npackages: [htop]\n"))
        parts = [part for part in message.walk() if not part.is_multipart()]
        self.assertEqual(
            [(part.get_content_type(), part.get_payload(decode=True)) for part in parts],
            [
                ("text/cloud-boothook", boothook()),
                ("text/plain", b"#cloud-config\npackages: [htop]\n"),
            ],
        )

    def test_theInstancesOwnMultipartIsKeptWhole(self) -> None:
        own = (
            'Content-Type: multipart/mixed; boundary="xyz"\nMIME-Version: 1.0\n\n'
            "--xyz\nContent-Type: text/x-shellscript\n\n#!/bin/sh\necho own\n--xyz--\n"
        )
        message = email.message_from_string(vendor_data(own))
        parts = [part for part in message.walk() if not part.is_multipart()]
        self.assertEqual(
            [(part.get_content_type(), part.get_payload(decode=True)) for part in parts],
            # MIME: the line break before a boundary belongs to the boundary.
            [
                ("text/cloud-boothook", boothook()),
                ("text/x-shellscript", b"#!/bin/sh\necho own"),
            ],
        )


class SeedDriveTests(SynchronousTestCase):
    """The seed on QEMU's command line: read-only, after the root disk, only with one."""

    def spec(self, disk: str | None) -> VMSpec:
        return VMSpec(
            name="web1",
            uuid=UUID,
            memory_mib=512,
            cpus=1,
            run_dir="/srv/run/abc",
            config_drive="/srv/run/abc/config-drive",
            disk=disk,
        )

    def test_aVMWithARootDiskGetsItsSeedReadOnlyAfterIt(self) -> None:
        argv = build_command_line(self.spec("/srv/disks/abc.qcow2"), ["qemu"])
        blockdevs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-blockdev"]
        self.assertEqual(
            blockdevs[1],
            "driver=raw,node-name=nocloud-seed,read-only=on,file.driver=file,"
            f"file.filename=/srv/run/abc/{SEED_FILE}",
        )
        self.assertTrue(blockdevs[0].startswith("driver=qcow2,node-name=root,"))
        devices = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-device"]
        self.assertEqual(
            [d for d in devices if d.startswith("virtio-blk-pci")],
            ["virtio-blk-pci,drive=root", "virtio-blk-pci,drive=nocloud-seed"],
        )

    def test_aVMWithoutARootDiskHasNoSeed(self) -> None:
        self.assertNotIn("-blockdev", build_command_line(self.spec(None), ["qemu"]))

    def test_theSeedLivesBesideTheConfigDrive(self) -> None:
        self.assertEqual(seed_path("/srv/run/abc/config-drive"), f"/srv/run/abc/{SEED_FILE}")


class SeedFilesTests(SynchronousTestCase):
    """``seed_files`` leaves a drive's partial files out (a write cut short)."""

    def test_partialFilesAreLeftOut(self) -> None:
        drive = self.mktemp()
        os.makedirs(drive)
        for name in ("agent.json", "agent.json.tmp"):
            with open(os.path.join(drive, name), "w") as f:
                f.write("{}")
        paths = [seed_file.path for seed_file in seed_files(GuestData(UUID, "web1"), drive)]
        self.assertEqual(paths, ["meta-data", "user-data", "vendor-data", "vmready/agent.json"])
