"""vmready.hypervisor.guestimage (the demo guest's builder) and vmready.guestfiles (the loader).

The pure parts run everywhere, with fake apt answers and a fake builder
behind ``ensure_guest``'s command-runner seam. The loader's
``install.sh --root`` runs for real on a fake guest tree. One test builds the
real guest into ``$VMREADY_GUEST_CACHE`` (default ``~/.cache/vmready/guest``)
and looks inside what it made; it skips where the tools, root or the Debian
mirror are missing, and fails instead under ``VMREADY_REQUIRE_QEMU=1`` (CI).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import urllib.parse
from collections.abc import Sequence

from twisted.trial.unittest import SynchronousTestCase

from tests.conformance.support import cannot_run
from vmready.guestfiles import LOADER_FILES, boothook, executable, loader_files
from vmready.hypervisor.bootfiles import has_pvh_entry
from vmready.hypervisor.guestimage import inputs as guest_inputs
from vmready.hypervisor.guestimage import kernel as guest_kernel
from vmready.hypervisor.guestimage.build import ensure_guest
from vmready.hypervisor.guestimage.cache import (
    GuestImage,
    default_cache_dir,
    mounts_under,
    remove_stale_builds,
)
from vmready.hypervisor.guestimage.commands import (
    CommandResult,
    GuestImageError,
    run_command,
    run_step,
)
from vmready.hypervisor.guestimage.content import (
    BUILDER_VERSION,
    BUSYBOX_APPLETS,
    INIT_SCRIPT,
    KERNEL_CONFIG_FILE,
    ROOT_PACKAGES,
    USER_DATA_UNIT,
)
from vmready.hypervisor.guestimage.earlyagent import (
    EARLY_AGENT_DROPIN,
    EARLY_AGENT_DROPIN_PATH,
    EARLY_AGENT_PATH,
    EARLY_AGENT_SCRIPT,
)
from vmready.hypervisor.guestimage.fetch import Package
from vmready.hypervisor.guestimage.initramfs import ArchiveEntry, initramfs_entries, newc_archive
from vmready.hypervisor.guestimage.inputs import GuestInputs, image_files, resolve_inputs
from vmready.hypervisor.guestimage.kernel import missing_build_packages
from vmready.hypervisor.guestimage.kernelconfig import KERNEL_CONFIG, config_problems
from vmready.hypervisor.guestimage.rootfs import customize_root

# --- Fakes -------------------------------------------------------------------------------


def fake_pvh_kernel(pvh: bool = True) -> bytes:
    """An ELF kernel with one PT_NOTE segment, holding Xen's PVH entry note or another one."""
    note_type = 18 if pvh else 17
    note = struct.pack("<III", 4, 4, note_type) + b"Xen\0" + struct.pack("<I", 0x1000000)
    elf = bytearray(64 + 56) + note
    elf[:4] = b"\x7fELF"
    elf[4:6] = b"\x02\x01"
    struct.pack_into("<Q", elf, 0x20, 64)
    struct.pack_into("<HH", elf, 0x36, 56, 1)
    struct.pack_into("<IIQQQQ", elf, 64, 4, 0, 120, 0, 0, len(note))
    return bytes(elf)


def read_newc(archive: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """A newc cpio archive's members: path -> (mode, data, (rdevmajor, rdevminor))."""
    members: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    at = 0
    while True:
        header = archive[at : at + 110]
        assert header[:6] == b"070701", header[:6]
        fields = [int(header[6 + 8 * i : 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, name_size = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name = archive[at + 110 : at + 110 + name_size - 1].decode()
        at += 110 + name_size
        at += -at % 4
        data = archive[at : at + size]
        at += size
        at += -at % 4
        if name == "TRAILER!!!":
            return members
        members[name] = (mode, data, rdev)


def apt_show_packages(**versions: str) -> str:
    defaults = {
        "linux-source-6.1": "6.1.192-3",
        "busybox-static": "1:1.35.0-4+deb12u1+b1",
        "systemd-sysv": "252.39-1~deb12u2",
        "python3": "3.11.2-1+b1",
        "udev": "252.39-1~deb12u2",
        "dbus": "1.14.10-1~deb12u1",
        "iproute2": "6.1.0-3",
        "kmod": "30+20221128-1",
    }
    defaults.update({name.replace("_", "-"): v for name, v in versions.items()})
    return "".join(
        f"Package: {name}\nVersion: {version}\nDescription: a package\n  more of it\n\n"
        for name, version in defaults.items()
    )


class FakeApt:
    """The command runner seam: answers ``apt-cache show`` as a Debian bookworm host would."""

    def __init__(self, packages: str | None = None, status: int = 0) -> None:
        self.packages = apt_show_packages() if packages is None else packages
        self.status = status
        self.commands: list[list[str]] = []

    def __call__(self, argv: Sequence[str], cwd: str | None = None) -> CommandResult:
        self.commands.append(list(argv))
        if self.status:
            return CommandResult(self.status, b"", b"E: No packages found\n")
        if argv[:2] == ["apt-cache", "show"]:
            return CommandResult(0, self.packages.encode(), b"")
        raise AssertionError(f"unexpected command {argv}")


def inputs(**changes: object) -> GuestInputs:
    """Inputs as a bookworm host resolves them today, with ``changes``."""
    base = resolve_inputs(FakeApt())
    values = {
        "kernel": base.kernel,
        "busybox": base.busybox,
        "root_packages": base.root_packages,
        "files": base.files,
    }
    values.update(changes)
    return GuestInputs(**values)  # type: ignore[arg-type]


# --- The initramfs ---------------------------------------------------------------------


class InitramfsTests(SynchronousTestCase):
    """The initramfs is a newc cpio archive the kernel can unpack (uncompressed)."""

    def test_newcMembersRoundTrip(self) -> None:
        archive = newc_archive(
            [
                ArchiveEntry("bin", stat.S_IFDIR | 0o755),
                ArchiveEntry("bin/busybox", stat.S_IFREG | 0o755, b"ELF..."),
                ArchiveEntry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
                ArchiveEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
            ]
        )
        self.assertEqual(len(archive) % 512, 0)
        self.assertEqual(
            read_newc(archive),
            {
                "bin": (stat.S_IFDIR | 0o755, b"", (0, 0)),
                "bin/busybox": (stat.S_IFREG | 0o755, b"ELF...", (0, 0)),
                "bin/sh": (stat.S_IFLNK | 0o777, b"busybox", (0, 0)),
                "dev/console": (stat.S_IFCHR | 0o600, b"", (5, 1)),
            },
        )

    def test_entriesHoldInitAndBusyboxWithItsApplets(self) -> None:
        members = read_newc(newc_archive(initramfs_entries(b"BUSYBOX")))
        self.assertEqual(members["bin/busybox"][1], b"BUSYBOX")
        for applet in BUSYBOX_APPLETS:
            self.assertEqual(members[f"bin/{applet}"], (stat.S_IFLNK | 0o777, b"busybox", (0, 0)))
        self.assertEqual(members["init"][0], stat.S_IFREG | 0o755)
        self.assertTrue(members["init"][1].startswith(b"#!/bin/sh\n"))
        self.assertEqual(members["dev/console"][2], (5, 1))
        # The kernel has its drivers built in: nothing to load.
        self.assertFalse([name for name in members if name.startswith("lib/")])

    def test_initPowersOffOnFailure(self) -> None:
        init = INIT_SCRIPT
        self.assertIn("poweroff -f", init)
        for applet in ("poweroff", "switch_root", "mount", "sleep", "dmesg", "chroot"):
            self.assertIn(applet, BUSYBOX_APPLETS)

    def test_initIsValidShell(self) -> None:
        path = os.path.join(self.mktemp())
        with open(path, "w") as f:
            f.write(INIT_SCRIPT)
        subprocess.run(["sh", "-n", path], check=True)


# --- Inputs and the cache key ------------------------------------------------------------


class InputsTests(SynchronousTestCase):
    """What apt would fetch decides the inputs; every input changes the key."""

    def test_theKernelIsBuiltFromDebiansSourcePackage(self) -> None:
        resolved = resolve_inputs(FakeApt())
        self.assertEqual(resolved.kernel, Package("linux-source-6.1", "6.1.192-3"))
        self.assertEqual(resolved.busybox, Package("busybox-static", "1:1.35.0-4+deb12u1+b1"))
        self.assertEqual([p.name for p in resolved.root_packages], list(ROOT_PACKAGES))

    def test_unknownPackagesAreNamed(self) -> None:
        packages = apt_show_packages().replace("Package: dbus\n", "Package: dbus-x11\n")
        with self.assertRaises(GuestImageError) as caught:
            resolve_inputs(FakeApt(packages))
        self.assertEqual(
            str(caught.exception),
            "resolving the guest's packages failed: apt knows no dbus (apt-get update, or add "
            "Debian bookworm to apt's sources)",
        )

    def test_aptFailingIsTheStepsError(self) -> None:
        with self.assertRaises(GuestImageError) as caught:
            resolve_inputs(FakeApt(status=100))
        self.assertEqual(
            str(caught.exception),
            "resolving the guest's packages failed: apt-cache show exited with status 100: "
            "E: No packages found",
        )

    def test_sameInputsSameKey(self) -> None:
        self.assertEqual(inputs().key, inputs().key)
        self.assertRegex(inputs().key, r"^[0-9a-f]{16}$")

    def test_kernelVersionChangesTheKey(self) -> None:
        newer = inputs(kernel=Package("linux-source-6.1", "6.1.192-4"))
        self.assertNotEqual(newer.key, inputs().key)

    def test_aRootPackageVersionChangesTheKey(self) -> None:
        packages = apt_show_packages(python3="3.11.2-1+b2")
        self.assertNotEqual(resolve_inputs(FakeApt(packages)).key, inputs().key)

    def test_theLoaderChangesTheKey(self) -> None:
        files = dict(inputs().files)
        files["loader/install.sh"] += b"\n# changed\n"
        self.assertNotEqual(inputs(files=files).key, inputs().key)

    def test_theBuilderVersionChangesTheKey(self) -> None:
        before = inputs().key
        self.patch(guest_inputs, "BUILDER_VERSION", BUILDER_VERSION + 1)
        self.assertNotEqual(inputs().key, before)

    def test_theKernelsConfigurationChangesTheKey(self) -> None:
        before = inputs().key
        self.patch(guest_kernel, "KERNEL_CONFIG", (*KERNEL_CONFIG, "CONFIG_VFAT_FS=y"))
        self.assertNotEqual(inputs().key, before)

    def test_imageFilesHoldTheLoaderAndTheDemosOwn(self) -> None:
        files = image_files()
        for name in LOADER_FILES:
            self.assertEqual(files[f"loader/{name}"], loader_files()[name])
        self.assertIn("initramfs/init", files)
        self.assertIn("demo/vmready-user-data.service", files)


class StepTests(SynchronousTestCase):
    """A failed step is one line: the step, the command, its status and its stderr's tail."""

    def test_aFailingCommandNamesTheStepAndTheTailOfItsStderr(self) -> None:
        stderr = b"I: chroot architecture amd64\nW: a warning\nE: apt-get update failed\n\n"

        def run(argv: Sequence[str], cwd: str | None = None) -> CommandResult:
            return CommandResult(1, b"", b"line 0\n" + stderr)

        with self.assertRaises(GuestImageError) as caught:
            run_step(run, "bootstrapping the root filesystem", ["mmdebstrap", "-q", "x"])
        self.assertEqual(
            str(caught.exception),
            "bootstrapping the root filesystem failed: mmdebstrap -q exited with status 1: "
            "I: chroot architecture amd64 / W: a warning / E: apt-get update failed",
        )

    def test_aMissingCommandSaysWhichPackageHasIt(self) -> None:
        def run(argv: Sequence[str], cwd: str | None = None) -> CommandResult:
            raise FileNotFoundError(2, "No such file or directory")

        with self.assertRaises(GuestImageError) as caught:
            run_step(run, "making the root filesystem", ["mkfs.ext4", "-d", "x"])
        self.assertEqual(
            str(caught.exception),
            "making the root filesystem failed: cannot run mkfs.ext4: No such file or directory "
            "(Debian: apt-get install e2fsprogs)",
        )

    def test_theRealRunnerCapturesOutput(self) -> None:
        result = run_command(["sh", "-c", "echo out; echo err >&2; exit 3"])
        self.assertEqual(result, CommandResult(3, b"out\n", b"err\n"))


# --- The cache ---------------------------------------------------------------------------


class FakeBuilder:
    """Stands in for the build: writes the artifacts, or fails as told."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.builds: list[str] = []

    def __call__(self, inputs: GuestInputs, workdir: str, run: object, log: object) -> None:
        self.builds.append(workdir)
        for name in ("vmlinuz", "vmlinux", "initrd.img", "disk.qcow2"):
            with open(os.path.join(workdir, name), "wb") as f:
                f.write(name.encode())
        if self.error is not None:
            raise self.error
        with open(os.path.join(workdir, "guest.json"), "w") as f:
            f.write("{}\n")


class CacheTests(SynchronousTestCase):
    """Builds are published whole, once, under a lock; failures leave nothing behind."""

    def setUp(self) -> None:
        self.cache = self.mktemp()
        self.log: list[str] = []
        self.key = inputs().key

    def ensure(self, builder: FakeBuilder, apt: FakeApt | None = None) -> GuestImage:
        return ensure_guest(self.cache, self.log.append, apt or FakeApt(), builder)

    def test_buildsOnceThenReuses(self) -> None:
        builder = FakeBuilder()
        first = self.ensure(builder)
        again = self.ensure(builder)
        self.assertEqual(first, again)
        self.assertEqual(len(builder.builds), 1)
        self.assertEqual(first.key, self.key)
        self.assertEqual(first.image, os.path.join(self.cache, self.key, "disk.qcow2"))
        self.assertEqual(first.kernel, os.path.join(self.cache, self.key, "vmlinuz"))
        self.assertEqual(first.vmlinux, os.path.join(self.cache, self.key, "vmlinux"))
        self.assertIn("console=ttyS0", first.append)
        self.assertEqual(sorted(os.listdir(self.cache)), [".lock", self.key])

    def test_theBuildHappensBesideTheCacheThenIsRenamed(self) -> None:
        builder = FakeBuilder()
        self.ensure(builder)
        (workdir,) = builder.builds
        self.assertEqual(os.path.dirname(workdir), self.cache)
        self.assertTrue(os.path.basename(workdir).startswith(f".build-{self.key}-"))
        self.assertFalse(os.path.exists(workdir))
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.cache, self.key)).st_mode), 0o755)

    def test_aFailedBuildLeavesNothingThatLooksCached(self) -> None:
        with self.assertRaises(GuestImageError):
            self.ensure(FakeBuilder(GuestImageError("making the initramfs failed: no")))
        self.assertEqual(os.listdir(self.cache), [".lock"])
        builder = FakeBuilder()
        self.ensure(builder)
        self.assertEqual(len(builder.builds), 1)

    def test_anInterruptedBuildLeavesNothingThatLooksCached(self) -> None:
        with self.assertRaises(KeyboardInterrupt):
            self.ensure(FakeBuilder(KeyboardInterrupt()))
        self.assertEqual(os.listdir(self.cache), [".lock"])

    def test_aKilledBuildsLeftoversAreRemoved(self) -> None:
        os.makedirs(os.path.join(self.cache, f".build-{self.key}-killed", "root", "etc"))
        self.ensure(FakeBuilder())
        self.assertEqual(sorted(os.listdir(self.cache)), [".lock", self.key])
        self.assertIn(
            f"guest image: removing .build-{self.key}-killed, left by an interrupted build",
            self.log,
        )

    def test_anIncompleteBuildIsBuiltAgain(self) -> None:
        os.makedirs(os.path.join(self.cache, self.key))
        builder = FakeBuilder()
        guest = self.ensure(builder)
        self.assertEqual(len(builder.builds), 1)
        self.assertTrue(os.path.isfile(guest.image))

    def test_anotherInputIsAnotherBuild(self) -> None:
        builder = FakeBuilder()
        first = self.ensure(builder)
        second = self.ensure(builder, FakeApt(apt_show_packages(udev="252.40-1")))
        self.assertNotEqual(first.key, second.key)
        self.assertEqual(len(builder.builds), 2)

    def test_withoutAptTheNewestCachedBuildIsUsed(self) -> None:
        built = self.ensure(FakeBuilder())
        guest = self.ensure(FakeBuilder(), FakeApt(status=100))
        self.assertEqual(guest, built)
        self.assertIn("using the newest cached build", self.log[-1])

    def test_withoutAptAndWithoutACacheTheErrorStands(self) -> None:
        with self.assertRaises(GuestImageError):
            self.ensure(FakeBuilder(), FakeApt(status=100))

    def test_aSecondBuilderWaitsForTheLockThenReuses(self) -> None:
        os.makedirs(self.cache)
        waiting = threading.Event()

        def log(line: str) -> None:
            self.log.append(line)
            if line.startswith("guest image: waiting for another build"):
                waiting.set()

        builder = FakeBuilder()
        results: list[GuestImage] = []
        waiter = threading.Thread(
            target=lambda: results.append(ensure_guest(self.cache, log, FakeApt(), builder))
        )
        with open(os.path.join(self.cache, ".lock"), "a+b") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            waiter.start()
            self.assertTrue(waiting.wait(30))
            # Meanwhile the lock's holder publishes its own build of the same inputs.
            staging = os.path.join(self.cache, "staging")
            os.makedirs(staging)
            FakeBuilder()(inputs(), staging, None, None)
            os.rename(staging, os.path.join(self.cache, self.key))
        waiter.join(30)
        self.assertEqual(builder.builds, [])
        self.assertEqual([guest.key for guest in results], [self.key])


class MountedLeftoversTests(SynchronousTestCase):
    """A killed mmdebstrap leaves the host's /dev, /proc and /sys mounted in its tree: unmount
    them before removing it, never remove across them."""

    def setUp(self) -> None:
        self.cache = os.path.realpath(self.mktemp())
        self.stale = os.path.join(self.cache, ".build-0123456789abcdef-x1")
        os.makedirs(os.path.join(self.stale, "root", "sys"))
        self.mountinfo = os.path.join(self.cache, "mountinfo")
        self.mounted = [
            "/",
            "/proc",
            f"{self.stale}/root/proc",
            f"{self.stale}/root/sys",
            f"{self.stale}/root/sys/fs/cgroup",
            f"{self.cache}/other dir",
        ]
        self.write_mountinfo()
        self.log: list[str] = []
        self.commands: list[list[str]] = []

    def write_mountinfo(self) -> None:
        with open(self.mountinfo, "w") as f:
            for i, point in enumerate(self.mounted):
                escaped = point.replace(" ", "\\040")
                f.write(f"{i + 20} 1 0:{i} / {escaped} rw,relatime shared:1 - proc proc rw\n")

    def umount(self, argv: Sequence[str], cwd: str | None = None) -> CommandResult:
        self.commands.append(list(argv))
        self.mounted.remove(argv[-1])
        self.write_mountinfo()
        return CommandResult(0, b"", b"")

    def test_mountsUnderAPathDeepestFirst(self) -> None:
        self.assertEqual(
            mounts_under(self.stale, self.mountinfo),
            [
                f"{self.stale}/root/sys/fs/cgroup",
                f"{self.stale}/root/proc",
                f"{self.stale}/root/sys",
            ],
        )

    def test_escapedMountPointsAreDecoded(self) -> None:
        self.assertEqual(
            mounts_under(f"{self.cache}/other dir", self.mountinfo),
            [f"{self.cache}/other dir"],
        )

    def test_staleBuildsAreUnmountedThenRemoved(self) -> None:
        remove_stale_builds(self.cache, self.umount, self.log.append, self.mountinfo)
        self.assertEqual(
            self.commands,
            [
                ["umount", "--lazy", f"{self.stale}/root/sys/fs/cgroup"],
                ["umount", "--lazy", f"{self.stale}/root/proc"],
                ["umount", "--lazy", f"{self.stale}/root/sys"],
            ],
        )
        self.assertFalse(os.path.exists(self.stale))

    def test_whatStaysMountedIsNotRemoved(self) -> None:
        def umount_that_fails_silently(
            argv: Sequence[str], cwd: str | None = None
        ) -> CommandResult:
            return CommandResult(0, b"", b"")

        with self.assertRaises(GuestImageError) as caught:
            remove_stale_builds(
                self.cache, umount_that_fails_silently, self.log.append, self.mountinfo
            )
        self.assertEqual(
            str(caught.exception),
            f"removing {self.stale} failed: {self.stale}/root/sys/fs/cgroup is still mounted; "
            f"unmount it (umount --recursive {self.stale}) and remove {self.stale}",
        )
        self.assertTrue(os.path.isdir(os.path.join(self.stale, "root", "sys")))


# --- The loader --------------------------------------------------------------------------


def fake_guest_root(directory: str, python: str = "python3.11", systemd: bool = True) -> str:
    """A guest tree with what install.sh checks for: systemd, /usr/bin/python3, /etc/shadow."""
    os.makedirs(os.path.join(directory, "usr", "bin"))
    os.makedirs(os.path.join(directory, "etc"))
    os.symlink(python, os.path.join(directory, "usr", "bin", "python3"))
    if systemd:
        os.makedirs(os.path.join(directory, "lib", "systemd"))
        with open(os.path.join(directory, "lib", "systemd", "systemd"), "w") as f:
            f.write("")
    with open(os.path.join(directory, "etc", "shadow"), "w") as f:
        f.write("root:*:20000:0:99999:7:::\nmessagebus:!:20000::::::\n")
    with open(os.path.join(directory, "etc", "resolv.conf"), "w") as f:
        f.write("nameserver 10.255.255.53\n")
    return directory


def write_loader(directory: str) -> str:
    """The loader's files laid out as on a config drive; the path of install.sh."""
    for name, data in loader_files().items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755 if executable(name) else 0o644)
    return os.path.join(directory, "install.sh")


class LoaderFilesTests(SynchronousTestCase):
    """The loader's files, keyed by their path on the config drive."""

    def test_theLoadersFiles(self) -> None:
        self.assertEqual(
            sorted(loader_files()),
            [
                "install.sh",
                "systemd/cloud-init-local.conf",
                "systemd/vmready-agent-setup",
                "systemd/vmready-agent.service",
                "udev/99-vmready-agent.rules",
            ],
        )

    def test_scriptsAreExecutable(self) -> None:
        self.assertEqual(
            sorted(name for name in loader_files() if executable(name)),
            ["install.sh", "systemd/vmready-agent-setup"],
        )

    def test_scriptsAreValidShell(self) -> None:
        install = write_loader(self.mktemp())
        for name in ("install.sh", "systemd/vmready-agent-setup"):
            subprocess.run(["sh", "-n", os.path.join(os.path.dirname(install), name)], check=True)
        subprocess.run(["sh", "-n"], input=boothook(), check=True)

    def test_theUnitRunsTheAgentFromTheCopiedDrive(self) -> None:
        unit = loader_files()["systemd/vmready-agent.service"].decode()
        self.assertIn(
            "ExecStart=/usr/bin/python3 -S -I /run/vmready-agent/vmready-agent.pyz "
            "--config-drive /run/vmready-agent\n",
            unit,
        )
        self.assertIn("ExecStartPre=/usr/local/lib/vmready/vmready-agent-setup\n", unit)
        self.assertIn("Restart=on-failure\n", unit)
        self.assertIn("DefaultDependencies=no\n", unit)
        # Started (for what is ordered after it: cloud-init) only once it says READY=1.
        self.assertIn("Type=notify\n", unit)
        self.assertIn("Before=cloud-init-local.service", unit)
        self.assertIn("WantedBy=multi-user.target\n", unit)

    def test_setupUnmountsTheDrive(self) -> None:
        setup = loader_files()["systemd/vmready-agent-setup"].decode()
        self.assertIn("mount -t 9p -o trans=virtio,version=9p2000.L,ro", setup)
        self.assertIn('umount "$MNT"', setup)


class InstallTests(SynchronousTestCase):
    """install.sh --root installs the loader into a guest tree, as the image builder uses it."""

    def install(self, root: str, *args: str) -> subprocess.CompletedProcess[str]:
        script = write_loader(self.mktemp())
        return subprocess.run(
            ["sh", script, "--root", root, *args], capture_output=True, text=True, check=False
        )

    def test_installsAndEnablesTheUnit(self) -> None:
        root = fake_guest_root(self.mktemp())
        result = self.install(root)
        self.assertEqual((result.returncode, result.stderr), (0, ""))
        files = loader_files()
        for source, installed in [
            ("systemd/vmready-agent.service", "etc/systemd/system/vmready-agent.service"),
            ("systemd/vmready-agent-setup", "usr/local/lib/vmready/vmready-agent-setup"),
            ("udev/99-vmready-agent.rules", "etc/udev/rules.d/99-vmready-agent.rules"),
        ]:
            with open(os.path.join(root, installed), "rb") as f:
                self.assertEqual(f.read(), files[source])
        self.assertEqual(
            os.readlink(
                os.path.join(
                    root, "etc/systemd/system/multi-user.target.wants/vmready-agent.service"
                )
            ),
            "/etc/systemd/system/vmready-agent.service",
        )
        wrapper = os.path.join(root, "usr/local/bin/vmready-agent")
        self.assertEqual(stat.S_IMODE(os.stat(wrapper).st_mode), 0o755)
        with open(wrapper) as f:
            self.assertIn(
                'exec /usr/bin/python3 -S -I /run/vmready-agent/vmready-agent.pyz "$@"', f.read()
            )
        setup = os.path.join(root, "usr/local/lib/vmready/vmready-agent-setup")
        self.assertEqual(stat.S_IMODE(os.stat(setup).st_mode), 0o755)

    def test_installingTwiceChangesNothing(self) -> None:
        root = fake_guest_root(self.mktemp())
        self.install(root)
        result = self.install(root)
        self.assertEqual(result.returncode, 0)
        self.assertNotIn("installed", result.stdout.replace("enabled in", ""))

    def test_theRootMayComeFromTheEnvironment(self) -> None:
        root = fake_guest_root(self.mktemp())
        script = write_loader(self.mktemp())
        result = subprocess.run(
            ["sh", script],
            env=dict(os.environ, VMREADY_ROOT=root),
            capture_output=True,
            text=True,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(
            os.path.exists(os.path.join(root, "etc/systemd/system/vmready-agent.service"))
        )

    def test_refusesAGuestWithoutSystemd(self) -> None:
        root = fake_guest_root(self.mktemp(), systemd=False)
        result = self.install(root)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.stderr,
            f"install.sh: {os.path.abspath(root)} has no systemd (no /lib/systemd/systemd): "
            "the loader needs a systemd guest\n",
        )

    def test_refusesAPythonOlderThan39(self) -> None:
        root = fake_guest_root(self.mktemp(), python="python3.8")
        result = self.install(root)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.stderr,
            f"install.sh: the agent needs Python 3.9 or newer, and {os.path.abspath(root)}"
            "/usr/bin/python3 is Python 3.8\n",
        )

    def test_acceptsPython310(self) -> None:
        root = fake_guest_root(self.mktemp(), python="python3.10")
        self.assertEqual(self.install(root).returncode, 0)

    def test_refusesUnknownArguments(self) -> None:
        result = self.install(fake_guest_root(self.mktemp()), "--now")
        self.assertEqual(result.returncode, 1)
        self.assertIn("install.sh: unknown argument '--now'", result.stderr)


class CustomizeTests(SynchronousTestCase):
    """The bootstrapped tree becomes the demo guest: the loader and the demo's own settings."""

    def setUp(self) -> None:
        self.root = fake_guest_root(self.mktemp())
        loader = os.path.dirname(write_loader(self.mktemp()))
        customize_root(self.root, run_command, loader)

    def read(self, path: str) -> str:
        with open(os.path.join(self.root, path)) as f:
            return f.read()

    def test_theLoaderIsInstalledByItsOwnScript(self) -> None:
        self.assertEqual(
            self.read("etc/systemd/system/vmready-agent.service"),
            loader_files()["systemd/vmready-agent.service"].decode(),
        )

    def test_theUserDataRunnerIsEnabled(self) -> None:
        wants = "etc/systemd/system/multi-user.target.wants/vmready-user-data.service"
        self.assertEqual(
            os.readlink(os.path.join(self.root, wants)),
            "/etc/systemd/system/vmready-user-data.service",
        )
        unit = self.read("etc/systemd/system/vmready-user-data.service")
        # Among systemd's first jobs: the agent runs already, the root disk is mounted.
        self.assertNotIn("After=", unit)
        self.assertIn("DefaultDependencies=no", unit)
        self.assertIn("StandardOutput=journal+console", unit)
        runner = self.read("usr/local/lib/vmready-demo/run-user-data")
        self.assertIn("/run/vmready-agent/cloud-init/user-data", runner)

    def test_theEarlyAgentAndItsDropInAreInstalled(self) -> None:
        script = os.path.join(self.root, EARLY_AGENT_PATH.lstrip("/"))
        self.assertTrue(os.access(script, os.X_OK))
        self.assertEqual(self.read(EARLY_AGENT_PATH.lstrip("/")), EARLY_AGENT_SCRIPT)
        self.assertEqual(self.read(EARLY_AGENT_DROPIN_PATH.lstrip("/")), EARLY_AGENT_DROPIN)

    def test_theRunnerStartsNoProgramToReadTheUserData(self) -> None:
        # Each program costs under emulation: the shell reads the #! itself.
        runner = self.read("usr/local/lib/vmready-demo/run-user-data")
        self.assertIn('read -r first <"$user_data"', runner)
        self.assertNotIn("head ", runner)

    def test_theWorkloadIsAheadOfTheRestOfTheBootAsTheAgentIs(self) -> None:
        unit = self.read("etc/systemd/system/vmready-user-data.service")
        self.assertIn("\nNice=-10\n", unit)
        self.assertIn("\nNice=-10\n", self.read("etc/systemd/system/vmready-agent.service"))

    def test_settings(self) -> None:
        self.assertEqual(self.read("etc/hostname"), "vmready-demo\n")
        self.assertIn("/dev/vda / ext4 rw 0 1\n", self.read("etc/fstab"))
        self.assertTrue(self.read("etc/shadow").startswith("root:!*:"))
        self.assertFalse(os.path.exists(os.path.join(self.root, "etc/resolv.conf")))

    def test_slowUnitsAreMasked(self) -> None:
        for unit in ("getty@tty1.service", "apt-daily.timer", "e2scrub_all.timer"):
            self.assertEqual(
                os.readlink(os.path.join(self.root, "etc/systemd/system", unit)), "/dev/null"
            )

    def test_theUserDataRunnerIsValidShell(self) -> None:
        subprocess.run(
            ["sh", "-n", os.path.join(self.root, "usr/local/lib/vmready-demo/run-user-data")],
            check=True,
        )


# --- The real build ----------------------------------------------------------------------

TOOLS = {
    "apt-get": "apt",
    "apt-cache": "apt",
    "dpkg": "dpkg",
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "debugfs": "e2fsprogs",
    "qemu-img": "qemu-utils",
}


def unavailable_reason(cache: str) -> str | None:
    """Why the real build cannot run here, or None."""
    missing = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        return f"the guest build needs {', '.join(missing)} (apt-get install {' '.join(missing)})"
    if os.geteuid() != 0:
        return "the guest build needs root (mmdebstrap, mkfs.ext4 -d)"
    try:
        wanted = resolve_inputs()
    except GuestImageError as e:
        return str(e)
    if os.path.isfile(os.path.join(cache, wanted.key, "guest.json")):
        return None
    toolchain = missing_build_packages()
    if toolchain:
        return (
            f"the guest's kernel build needs {', '.join(toolchain)} "
            f"(apt-get install {' '.join(toolchain)})"
        )
    uris = subprocess.run(
        ["apt-get", "download", "--print-uris", f"{wanted.kernel.name}={wanted.kernel.version}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in uris.splitlines():
        url = urllib.parse.urlsplit(line.split()[0].strip("'"))
        if url.hostname:
            try:
                socket.create_connection((url.hostname, url.port or 80), timeout=5).close()
            except OSError as e:
                return f"the Debian mirror {url.hostname} is unreachable: {e}"
    return None


class RealBuildTests(SynchronousTestCase):
    """Builds (or reuses) the real demo guest and checks what is inside it."""

    def setUp(self) -> None:
        self.cache = default_cache_dir()
        reason = unavailable_reason(self.cache)
        if reason is not None:
            cannot_run(self, f"the demo guest cannot be built: {reason}")
        self.guest = ensure_guest(self.cache, log=lambda line: None)

    def test_theKernelIsABzImageAndItsPVHForm(self) -> None:
        with open(self.guest.kernel, "rb") as f:
            kernel = f.read()
        self.assertEqual(kernel[0x1FE:0x200], b"\x55\xaa")
        self.assertEqual(kernel[0x202:0x206], b"HdrS")
        with open(self.guest.vmlinux, "rb") as f:
            self.assertTrue(has_pvh_entry(f))

    def test_theInitramfsHoldsInitAndBusyboxOnly(self) -> None:
        with open(self.guest.initrd, "rb") as f:
            members = read_newc(f.read())
        self.assertIn("init", members)
        self.assertTrue(members["bin/busybox"][1].startswith(b"\x7fELF"))
        self.assertFalse([name for name in members if name.startswith("lib/")])

    def test_theKernelHasEveryLineOfItsConfiguration(self) -> None:
        config = os.path.join(os.path.dirname(self.guest.kernel), KERNEL_CONFIG_FILE)
        with open(config, encoding="utf-8") as f:
            text = f.read()
        self.assertEqual(config_problems(text), [])
        self.assertIn("# CONFIG_MODULES is not set", text)

    def test_qemuImgAcceptsTheDisk(self) -> None:
        check = subprocess.run(
            ["qemu-img", "check", "-f", "qcow2", self.guest.image], capture_output=True, text=True
        )
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)

    def test_theDiskHoldsTheLoaderAndTheUserDataRunner(self) -> None:
        raw = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(self.guest.image)), "disk.raw")
        self.addCleanup(shutil.rmtree, os.path.dirname(raw))
        subprocess.run(["qemu-img", "convert", "-O", "raw", self.guest.image, raw], check=True)

        def cat(path: str) -> bytes:
            return subprocess.run(
                ["debugfs", "-R", f"cat {path}", raw], capture_output=True, check=True
            ).stdout

        files = loader_files()
        self.assertEqual(
            cat("/etc/systemd/system/vmready-agent.service"),
            files["systemd/vmready-agent.service"],
        )
        self.assertEqual(
            cat("/usr/local/lib/vmready/vmready-agent-setup"), files["systemd/vmready-agent-setup"]
        )
        self.assertEqual(
            cat("/etc/udev/rules.d/99-vmready-agent.rules"), files["udev/99-vmready-agent.rules"]
        )
        self.assertIn(b"vmready-agent.pyz", cat("/usr/local/bin/vmready-agent"))
        self.assertEqual(
            cat("/etc/systemd/system/vmready-user-data.service"),
            USER_DATA_UNIT.encode(),
        )
        links = subprocess.run(
            ["debugfs", "-R", "ls /etc/systemd/system/multi-user.target.wants", raw],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        self.assertIn("vmready-agent.service", links)
        self.assertIn("vmready-user-data.service", links)
        (root,) = [line for line in cat("/etc/shadow").splitlines() if line.startswith(b"root:")]
        self.assertTrue(root.startswith(b"root:!"), root)
        self.assertIn(b"/dev/vda / ext4 rw 0 1", cat("/etc/fstab"))
