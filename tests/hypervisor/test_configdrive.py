"""vmready.hypervisor.configdrive: what each guest's config drive holds, and its modes."""

from __future__ import annotations

import json
import os
import stat

from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.model import HypervisorError
from vmready.hypervisor.configdrive import DriveContents, write_identity, write_settings
from vmready.hypervisor.guestdata import MAX_GUEST_DATA, GuestData, meta_data
from vmready.trust.certs import CertificatePair

UUID = "6f1c3a52-9d2e-4b7a-8c11-0123456789ab"
SETTINGS = {"instance": "vm1", "port": "com.canonical.lxd", "transport": "vsock"}
LOADER = {
    "install.sh": b"#!/bin/sh\nset -eu\ncp systemd/vmready-agent.service /lib/systemd/system/\n",
    "systemd/vmready-agent.service": b"[Service]\nExecStartPre=/lib/vmready/vmready-agent-setup\n",
    "systemd/vmready-agent-setup": b"#!/bin/sh\nmount -t 9p config /run/vmready-agent\n",
    "udev/99-vmready-agent.rules": b'SYMLINK=="virtio-ports/com.canonical.lxd", TAG+="systemd"\n',
}
CLIENT = CertificatePair(
    cert_pem=b"-----BEGIN CERTIFICATE-----\nclient\n-----END CERTIFICATE-----\n",
    key_pem=b"-----BEGIN PRIVATE KEY-----\nclient\n-----END PRIVATE KEY-----\n",
)
SERVER_CERT = b"-----BEGIN CERTIFICATE-----\nserver\n-----END CERTIFICATE-----\n"


class DriveTestCase(SynchronousTestCase):
    """A config drive in a fresh run directory, and an agent zipapp to put on it."""

    def setUp(self) -> None:
        self.run_dir = self.mktemp()
        os.makedirs(self.run_dir)
        self.drive = os.path.join(self.run_dir, "config-drive")
        self.zipapp = os.path.join(self.run_dir, "build", "vmready-agent.pyz")
        os.makedirs(os.path.dirname(self.zipapp))
        with open(self.zipapp, "wb") as f:
            f.write(b"#!/usr/bin/env python3\nPK\x03\x04the agent")

    def write(
        self,
        settings: dict[str, str] | None = None,
        contents: DriveContents | None = None,
        user_data: str = "",
        extra_meta_data: str = "",
        config: dict[str, str] | None = None,
        image: bool = False,
    ) -> None:
        given = dict(config or {})
        if user_data:
            given["cloud-init.user-data"] = user_data
        if extra_meta_data:
            given["user.meta-data"] = extra_meta_data
        write_settings(
            self.drive,
            SETTINGS if settings is None else settings,
            DriveContents(self.zipapp, LOADER) if contents is None else contents,
            GuestData(UUID, "vm1", given, image=image),
        )

    def read(self, relative: str) -> bytes:
        with open(os.path.join(self.drive, relative), "rb") as f:
            return f.read()

    def mode(self, relative: str) -> int:
        return stat.S_IMODE(os.stat(os.path.join(self.drive, relative)).st_mode)

    def files(self) -> list[str]:
        """Every file on the drive, by its path on the drive."""
        found = []
        for directory, _, names in os.walk(self.drive):
            for name in names:
                found.append(os.path.relpath(os.path.join(directory, name), self.drive))
        return sorted(found)


class IdentityTests(DriveTestCase):
    """The instance's client pair and the daemon's certificate, secret to the owner."""

    def setUp(self) -> None:
        super().setUp()
        write_identity(self.drive, CLIENT, SERVER_CERT)

    def test_identityFiles(self) -> None:
        self.assertEqual(
            (self.read("agent.crt"), self.read("agent.key"), self.read("server.crt")),
            (CLIENT.cert_pem, CLIENT.key_pem, SERVER_CERT),
        )

    def test_keyIsReadableByItsOwnerOnly(self) -> None:
        self.assertEqual(self.mode("agent.key"), 0o600)

    def test_certificatesAreReadableByTheirOwnerOnly(self) -> None:
        self.assertEqual((self.mode("agent.crt"), self.mode("server.crt")), (0o600, 0o600))

    def test_driveIsPrivate(self) -> None:
        self.assertEqual(stat.S_IMODE(os.stat(self.drive).st_mode), 0o700)

    def test_identityLeavesNoPartialFile(self) -> None:
        self.assertEqual(self.files(), ["agent.crt", "agent.key", "server.crt"])

    def test_newServerCertificateReplacesTheOld(self) -> None:
        write_identity(self.drive, CLIENT, b"the new certificate\n")
        self.assertEqual(self.read("server.crt"), b"the new certificate\n")


class SettingsTests(DriveTestCase):
    """What ``write_settings`` puts on the drive before a boot."""

    def test_everyFileOfTheLayout(self) -> None:
        self.write()
        self.assertEqual(
            self.files(),
            [
                "agent.json",
                "cloud-init/meta-data",
                "cloud-init/user-data",
                "guest-api.json",
                "install.sh",
                "systemd/vmready-agent-setup",
                "systemd/vmready-agent.service",
                "udev/99-vmready-agent.rules",
                "vmready-agent.pyz",
            ],
        )

    def test_agentJsonHoldsTheSettings(self) -> None:
        settings = SETTINGS | {
            "network_mac": "52:54:00:67:89:ab",
            "network_address": "10.0.2.15/24",
        }
        self.write(settings)
        self.assertEqual(json.loads(self.read("agent.json")), settings)

    def test_agentJsonIsSortedIndentedText(self) -> None:
        self.write({"transport": "vsock", "instance": "vm1"})
        self.assertEqual(
            self.read("agent.json"), b'{\n  "instance": "vm1",\n  "transport": "vsock"\n}\n'
        )

    def test_agentJsonIsReadableByTheGuest(self) -> None:
        self.write()
        self.assertEqual(self.mode("agent.json"), 0o644)

    def test_agentIsTheBuiltZipapp(self) -> None:
        self.write()
        with open(self.zipapp, "rb") as f:
            self.assertEqual(self.read("vmready-agent.pyz"), f.read())

    def test_agentIsReadableByTheGuest(self) -> None:
        self.write()
        self.assertEqual(self.mode("vmready-agent.pyz"), 0o644)

    def test_noZipappMeansNoAgentFile(self) -> None:
        self.write(contents=DriveContents())
        self.assertNotIn("vmready-agent.pyz", self.files())

    def test_loaderFilesAreAtTheirPaths(self) -> None:
        self.write()
        self.assertEqual({path: self.read(path) for path in LOADER}, LOADER)

    def test_installScriptIsExecutable(self) -> None:
        self.write()
        self.assertEqual(self.mode("install.sh"), 0o755)

    def test_setupScriptIsExecutable(self) -> None:
        self.write()
        self.assertEqual(self.mode("systemd/vmready-agent-setup"), 0o755)

    def test_otherLoaderFilesAreNotExecutable(self) -> None:
        self.write()
        self.assertEqual(
            (self.mode("systemd/vmready-agent.service"), self.mode("udev/99-vmready-agent.rules")),
            (0o644, 0o644),
        )

    def test_loaderDirectoriesAreReadableByTheGuest(self) -> None:
        self.write()
        modes = [
            stat.S_IMODE(os.stat(os.path.join(self.drive, d)).st_mode) for d in ("systemd", "udev")
        ]
        self.assertEqual(modes, [0o755, 0o755])

    def test_loaderFileOutsideTheDriveIsRefused(self) -> None:
        outside = os.path.abspath(os.path.join(self.run_dir, "escaped"))
        for relative in (outside, "../escaped", "systemd/../../escaped", "./install.sh", "a//b"):
            with self.assertRaises(ValueError) as caught:
                self.write(contents=DriveContents(loader={relative: b"x"}))
            self.assertEqual(
                str(caught.exception),
                f"loader file {relative!r} is not a plain path inside the drive",
            )
        self.assertEqual(os.listdir(self.run_dir), ["build"])

    def test_metaDataNamesTheInstance(self) -> None:
        self.write()
        self.assertEqual(
            self.read("cloud-init/meta-data"),
            f"instance-id: {UUID}\nlocal-hostname: vm1\n".encode(),
        )

    def test_metaDataCarriesTheUsersMetaData(self) -> None:
        self.write(extra_meta_data="public-keys:\n  - ssh-ed25519 AAAA\n")
        self.assertEqual(
            self.read("cloud-init/meta-data"),
            f"instance-id: {UUID}\nlocal-hostname: vm1\n".encode()
            + b"public-keys:\n  - ssh-ed25519 AAAA\n",
        )

    def test_metaDataIsReadableByTheGuest(self) -> None:
        self.write()
        self.assertEqual(self.mode("cloud-init/meta-data"), 0o644)

    def test_userDataIsTheConfigValue(self) -> None:
        self.write(user_data="#!/bin/sh\necho héllo > /dev/ttyS0\n")
        self.assertEqual(
            self.read("cloud-init/user-data"), "#!/bin/sh\necho héllo > /dev/ttyS0\n".encode()
        )

    def test_unsetUserDataIsAnEmptyFile(self) -> None:
        self.write()
        self.assertEqual(self.read("cloud-init/user-data"), b"")

    def test_userDataIsReadableByItsOwnerOnly(self) -> None:
        self.write(user_data="#cloud-config\npassword: secret\n")
        self.assertEqual(self.mode("cloud-init/user-data"), 0o600)

    def test_userDataAliasIsUsedWhenTheCloudInitKeyIsUnset(self) -> None:
        self.write(config={"user.user-data": "#cloud-config\nhostname: old\n"})
        self.assertEqual(self.read("cloud-init/user-data"), b"#cloud-config\nhostname: old\n")

    def test_cloudInitKeyWinsOverItsUserAlias(self) -> None:
        self.write(
            config={
                "user.user-data": "#cloud-config\nhostname: old\n",
                "cloud-init.user-data": "#cloud-config\nhostname: new\n",
            }
        )
        self.assertEqual(self.read("cloud-init/user-data"), b"#cloud-config\nhostname: new\n")

    def test_guestApiHoldsMetaDataAndGuestVisibleConfig(self) -> None:
        self.write(config={"user.role": "web", "cloud-init.vendor-data": "#cloud-config\n"})
        self.assertEqual(
            json.loads(self.read("guest-api.json")),
            {
                "meta-data": f"instance-id: {UUID}\nlocal-hostname: vm1\n",
                "config": {"cloud-init.vendor-data": "#cloud-config\n", "user.role": "web"},
                "devices": {},
            },
        )

    def test_guestApiIsReadableByItsOwnerOnly(self) -> None:
        self.write()
        self.assertEqual(self.mode("guest-api.json"), 0o600)

    def test_aDriveWithoutAnImageHasNoSeed(self) -> None:
        self.write()
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "nocloud-seed.iso")))

    def test_aDriveOfAnImageGetsItsSeedBesideIt(self) -> None:
        self.write(image=True)
        seed = os.path.join(self.run_dir, "nocloud-seed.iso")
        with open(seed, "rb") as f:
            header = f.read(32774)
        self.assertEqual(
            (header[32769:32774], stat.S_IMODE(os.stat(seed).st_mode)), (b"CD001", 0o600)
        )

    def test_tooMuchGuestDataIsOneLineAndWritesNothing(self) -> None:
        big = "x" * (MAX_GUEST_DATA + 1)
        with self.assertRaises(HypervisorError) as caught:
            self.write(config={"user.big": big}, image=True)
        self.assertEqual(
            str(caught.exception),
            "cannot prepare the boot of vm1: the instance's user.* and cloud-init.* keys come "
            "to 4.1 MiB, more than the 4 MiB a guest is given at boot (its NoCloud seed and "
            "config drive); make them smaller",
        )
        self.assertEqual(os.listdir(self.run_dir), ["build"])

    def test_writeLeavesNoPartialFile(self) -> None:
        write_identity(self.drive, CLIENT, SERVER_CERT)
        self.write()
        self.assertEqual([path for path in self.files() if "tmp" in path], [])

    def test_settingsAloneMakeTheDrive(self) -> None:
        self.write()
        self.assertEqual(stat.S_IMODE(os.stat(self.drive).st_mode), 0o700)


class RewriteTests(DriveTestCase):
    """Before every boot the drive is rewritten: the new settings and agent replace the old."""

    def setUp(self) -> None:
        super().setUp()
        write_identity(self.drive, CLIENT, SERVER_CERT)
        self.write(user_data="#!/bin/sh\necho first\n")

    def test_newSettingsReplaceTheOld(self) -> None:
        self.write(SETTINGS | {"transport": "hvsock:/run/vm1/vsock"})
        self.assertEqual(json.loads(self.read("agent.json"))["transport"], "hvsock:/run/vm1/vsock")

    def test_newAgentReplacesTheOld(self) -> None:
        with open(self.zipapp, "wb") as f:
            f.write(b"the new agent")
        self.write()
        self.assertEqual(self.read("vmready-agent.pyz"), b"the new agent")

    def test_newLoaderReplacesTheOld(self) -> None:
        loader = LOADER | {"install.sh": b"#!/bin/sh\necho v2\n"}
        self.write(contents=DriveContents(self.zipapp, loader))
        self.assertEqual(self.read("install.sh"), b"#!/bin/sh\necho v2\n")

    def test_newUserDataReplacesTheOld(self) -> None:
        self.write(user_data="")
        self.assertEqual(self.read("cloud-init/user-data"), b"")

    def test_identityIsKept(self) -> None:
        self.write()
        self.assertEqual(
            (self.read("agent.key"), self.read("server.crt")), (CLIENT.key_pem, SERVER_CERT)
        )

    def test_modesAreKept(self) -> None:
        self.write()
        self.assertEqual(
            (self.mode("agent.key"), self.mode("install.sh"), self.mode("agent.json")),
            (0o600, 0o755, 0o644),
        )

    def test_rewriteLeavesNoPartialFile(self) -> None:
        self.write()
        self.assertEqual([path for path in self.files() if "tmp" in path], [])


class MetaDataTests(SynchronousTestCase):
    """cloud-init's meta-data, as the drive and the guest API's /1.0/meta-data give it."""

    def test_instanceIdAndHostname(self) -> None:
        self.assertEqual(meta_data(UUID, "vm1"), f"instance-id: {UUID}\nlocal-hostname: vm1\n")

    def test_usersMetaDataFollows(self) -> None:
        self.assertEqual(
            meta_data(UUID, "vm1", "region: lab\n"),
            f"instance-id: {UUID}\nlocal-hostname: vm1\nregion: lab\n",
        )
