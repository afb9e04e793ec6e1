"""The agent loader's scripts, run for real against a fake guest: every message an operator sees.

``vmready-agent-setup`` (the unit's ExecStartPre), ``install.sh`` run live (as
an operator runs it in a guest) and the NoCloud vendor-data's boothook are run
with ``sh``, as the guest runs them.  What they touch of the guest is under a
temporary root (``VMREADY_TEST_ROOT``: its /proc, /sys, /run, /dev, /etc, /usr),
and the programs that would touch the kernel (``mount``, ``umount``, ``blkid``,
``modprobe``) or systemd (``systemctl``, ``journalctl``) are small fakes first
on ``PATH`` that act on that tree as the kernel would: a mount copies the 9p
export's or the seed's files into the mount point and adds its line to
``/proc/mounts``.  A real guest runs them in ``tests/endtoend/test_stock_images.py``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from vmready.guestfiles import boothook, executable, loader_files

# The fakes: each acts on the fake guest ($VMREADY_TEST_ROOT, $FAKE for their settings).
FAKES = {
    "mount": r"""#!/bin/sh
# mount [-t TYPE] [-o OPTIONS] SOURCE TARGET, as the kernel would do it to the fake guest.
while [ $# -gt 2 ]; do shift; done
source=$1 target=$2
echo "$source $target" >>"$FAKE/mount-calls"
if [ "$source" = config ]; then
    if [ -e "$FAKE/9p-busy-race" ]; then
        echo "config $VMREADY_TEST_ROOT/elsewhere 9p ro 0 0" >>"$VMREADY_TEST_ROOT/proc/mounts"
        echo "mount: $target: config already mounted or mount point busy." >&2
        exit 32
    fi
    [ ! -e "$FAKE/9p-fails" ] || { cat "$FAKE/9p-fails" >&2; exit 32; }
    tree=$FAKE/drive type=9p
else
    [ ! -e "$FAKE/seed-fails" ] || { cat "$FAKE/seed-fails" >&2; exit 32; }
    tree=$FAKE/seed type=iso9660
fi
cp -R "$tree/." "$target/"
echo "$source $target $type ro 0 0" >>"$VMREADY_TEST_ROOT/proc/mounts"
""",
    "umount": r"""#!/bin/sh
target=$1
[ ! -e "$FAKE/umount-fails" ] || { echo "umount: $target: target is busy." >&2; exit 32; }
grep -v " $target " "$VMREADY_TEST_ROOT/proc/mounts" >"$FAKE/mounts.new" || true
cat "$FAKE/mounts.new" >"$VMREADY_TEST_ROOT/proc/mounts"
find "$target" -mindepth 1 -delete
""",
    "blkid": r"""#!/bin/sh
# blkid -L LABEL: the seed's device once it has "appeared" (after $FAKE/seed-after calls).
calls=$(($(cat "$FAKE/blkid-calls" 2>/dev/null || echo 0) + 1))
echo "$calls" >"$FAKE/blkid-calls"
[ "$2" = cidata ] && [ -e "$FAKE/seed-device" ] || exit 2
[ "$calls" -gt "$(cat "$FAKE/seed-after" 2>/dev/null || echo 0)" ] || exit 2
cat "$FAKE/seed-device"
""",
    "modprobe": r"""#!/bin/sh
echo "$*" >>"$FAKE/modprobe-calls"
if [ -e "$FAKE/modprobe-loads-9p" ] && [ "$2" = 9p ]; then
    printf 'nodev\t9p\n' >>"$VMREADY_TEST_ROOT/proc/filesystems"
fi
""",
    "systemctl": r"""#!/bin/sh
# systemd as install.sh sees it: start and restart run the unit's ExecStartPre (the setup).
echo "$*" >>"$FAKE/systemctl-calls"
case $1 in
    is-active) [ -e "$FAKE/active" ] ;;
    start|restart)
        [ ! -e "$FAKE/start-fails" ] || exit 1
        "$VMREADY_TEST_ROOT/usr/local/lib/vmready/vmready-agent-setup" 2>>"$FAKE/journal" || exit 1
        touch "$FAKE/active" ;;
esac
""",
    "journalctl": r"""#!/bin/sh
[ -s "$FAKE/journal" ] || exit 0
tail -n 1 "$FAKE/journal" | sed 's/^vmready-agent-setup: //'
""",
    "udevadm": "#!/bin/sh\n",
}
PYTHON = """#!/bin/sh
# The guest's python3, as install.sh asks it: its version, then whether it has ssl.
case "$*" in
    *version_info*) [ ! -e "$FAKE/python-broken" ] || exit 1; cat "$FAKE/python-version" ;;
    *ssl*) [ ! -e "$FAKE/python-without-ssl" ] ;;
esac
"""


class FakeGuest:
    """A guest for the loader's scripts: its tree, the fakes, a 9p export and a NoCloud seed."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.test = test
        self.base = os.path.abspath(test.mktemp())
        self.root = os.path.join(self.base, "guest")
        self.fake = os.path.join(self.base, "fake")
        self.bin = os.path.join(self.base, "bin")
        for directory in ("proc", "run/systemd/system", "dev", "usr/bin", "mnt"):
            os.makedirs(os.path.join(self.root, directory))
        os.makedirs(self.fake)
        os.makedirs(self.bin)
        for name, script in FAKES.items():
            self.script(os.path.join(self.bin, name), script)
        self.script(os.path.join(self.root, "usr/bin/python3"), PYTHON)
        self.put("fake/python-version", "3.11\n")
        self.put("guest/proc/filesystems", "nodev\tsysfs\nnodev\t9p\n\text4\n")
        self.put("guest/proc/mounts", "/dev/vda / ext4 rw 0 0\n")
        # The 9p export's tag as sysfs shows it: a NUL at the end and no newline.
        tags = os.path.join(self.root, "sys/bus/virtio/drivers/9pnet_virtio/virtio2")
        os.makedirs(tags)
        self.put(os.path.join(tags, "mount_tag"), "config\0")
        self.loader = os.path.join(self.fake, "drive")
        self.drive({"agent.json": "{}", "vmready-agent.pyz": "PK", "agent.key": "KEY"})
        self.seed_files({"agent.json": '{"from": "seed"}', "vmready-agent.pyz": "PK"})

    @staticmethod
    def script(path: str, text: str) -> None:
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)

    def put(self, relative: str, text: str) -> None:
        path = os.path.join(self.base, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def drive(self, files: dict[str, str]) -> None:
        """The 9p export: these files and the loader's, as the daemon writes them."""
        shutil.rmtree(self.loader, True)
        for name, data in loader_files().items():
            path = os.path.join(self.loader, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, 0o755 if executable(name) else 0o644)
        for name, text in files.items():
            self.put(f"fake/drive/{name}", text)

    def seed_files(self, files: dict[str, str]) -> None:
        for name, text in files.items():
            self.put(f"fake/seed/vmready/{name}", text)

    def no_9p(self) -> None:
        self.put("guest/proc/filesystems", "nodev\tsysfs\n\text4\n")

    def seed(self, device: str = "/dev/vdb", after: int = 0) -> None:
        """The seed's disk: blkid finds it (after ``after`` unsuccessful looks)."""
        self.put("fake/seed-device", device + "\n")
        self.put("fake/seed-after", str(after))

    def flag(self, name: str, text: str = "") -> None:
        self.put(f"fake/{name}", text)

    def mounts(self) -> list[str]:
        with open(os.path.join(self.root, "proc/mounts")) as f:
            return [line.split()[1] for line in f if line.strip()]

    def run(
        self, argv: list[str], tries: int = 0, cwd: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = dict(
            os.environ,
            PATH=f"{self.bin}:{os.environ['PATH']}",
            VMREADY_TEST_ROOT=self.root,
            VMREADY_SEED_TRIES=str(tries),
            FAKE=self.fake,
        )
        return subprocess.run(argv, env=env, capture_output=True, text=True, cwd=cwd, check=False)

    def setup(self, tries: int = 0) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", os.path.join(self.loader, "systemd/vmready-agent-setup")], tries)

    @property
    def dest(self) -> str:
        return os.path.join(self.root, "run/vmready-agent")

    def copied(self) -> dict[str, str]:
        found = {}
        for name in sorted(os.listdir(self.dest)):
            path = os.path.join(self.dest, name)
            if os.path.isfile(path):
                with open(path) as f:
                    found[name] = f.read()
        return found


SETUP = "vmready-agent-setup: "


class SetupFromTheDriveTests(SynchronousTestCase):
    """The 9p export: mounted, copied, unmounted; or copied where it is mounted already."""

    def test_theDriveIsCopiedAndUnmounted(self) -> None:
        guest = FakeGuest(self)
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                0,
                f"{SETUP}copied the config drive (9p tag 'config') to {guest.dest} "
                "and unmounted it\n",
            ),
        )
        copied = guest.copied()
        self.assertEqual(
            (copied["agent.json"], copied["agent.key"], copied["vmready-agent.pyz"]),
            ("{}", "KEY", "PK"),
        )
        self.assertEqual(guest.mounts(), ["/"])

    def test_theSetupDatesItsShareOfTheBootOnTheGuestsClock(self) -> None:
        guest = FakeGuest(self)
        guest.put("guest/proc/uptime", "12.34 20.00\n")
        result = guest.setup()
        self.assertEqual(
            result.stderr.splitlines()[-1], f"{SETUP}boot: setup [12.34] copied [12.34]"
        )

    def test_theCopyIsRootsAlone(self) -> None:
        guest = FakeGuest(self)
        guest.setup()
        mode = os.stat(os.path.join(guest.dest, "agent.key")).st_mode
        self.assertEqual(stat.S_IMODE(mode), 0o600)

    def test_aTagEndingInANulWithoutANewlineIsFound(self) -> None:
        # sysfs's mount_tag: "config\0", no newline; read reports end of file.
        guest = FakeGuest(self)
        guest.setup()
        with open(os.path.join(guest.fake, "mount-calls")) as f:
            self.assertTrue(f.read().startswith("config "))

    def test_aDriveMountedAlreadyIsBusyAndCopiedFromThere(self) -> None:
        guest = FakeGuest(self)
        mnt = os.path.join(guest.root, "mnt")
        shutil.copytree(guest.loader, mnt, dirs_exist_ok=True)
        with open(os.path.join(guest.root, "proc/mounts"), "a") as f:
            f.write(f"config {mnt} 9p ro,trans=virtio 0 0\n")
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                0,
                f"{SETUP}the config drive (9p tag 'config') is busy: mounted at {mnt}; copying "
                f"it from there\n{SETUP}copied the config drive from {mnt} to {guest.dest}\n",
            ),
        )
        self.assertEqual(guest.copied()["agent.key"], "KEY")
        self.assertEqual(guest.mounts(), ["/", mnt])  # the operator's mount is theirs

    def test_aMountThatFailsSaysWhy(self) -> None:
        guest = FakeGuest(self)
        guest.flag("9p-fails", "mount: /run/x: permission denied.\n")
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{SETUP}cannot mount the config drive (9p tag 'config'): mount: /run/x: "
                "permission denied.\n",
            ),
        )
        self.assertFalse(os.path.exists(guest.dest))

    def test_aTagMountedMeanwhileIsBusyNotMissing(self) -> None:
        guest = FakeGuest(self)
        guest.flag("9p-busy-race")
        result = guest.setup()
        elsewhere = os.path.join(guest.root, "elsewhere")
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{SETUP}cannot mount the config drive: its 9p tag 'config' is busy "
                f"(mounted at {elsewhere})\n",
            ),
        )

    def test_9pIsLoadedWhenTheKernelHasItAsAModule(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        guest.flag("modprobe-loads-9p")
        result = guest.setup()
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(guest.fake, "modprobe-calls")) as f:
            self.assertEqual(f.read(), "-q 9pnet_virtio\n-q 9p\n")

    def test_aDriveWithoutTheAgentIsAWarning(self) -> None:
        guest = FakeGuest(self)
        os.unlink(os.path.join(guest.loader, "vmready-agent.pyz"))
        result = guest.setup()
        self.assertEqual(result.returncode, 0)
        self.assertIn(
            f"{SETUP}warning: the config drive has no vmready-agent.pyz\n", result.stderr
        )

    def test_whatTheAgentKeptStays(self) -> None:
        guest = FakeGuest(self)
        os.makedirs(guest.dest)
        guest.put("guest/run/vmready-agent/ready", "1")
        guest.put("guest/run/vmready-agent/agent.json", "old")
        guest.setup()
        self.assertEqual((guest.copied()["ready"], guest.copied()["agent.json"]), ("1", "{}"))

    def test_aDriveThatCannotBeUnmountedIsAWarning(self) -> None:
        guest = FakeGuest(self)
        guest.flag("umount-fails")
        result = guest.setup()
        mnt = os.path.join(guest.root, "run/vmready-agent-setup.mnt")
        self.assertEqual(result.returncode, 32)
        self.assertTrue(
            result.stderr.endswith(
                f"{SETUP}warning: cannot unmount the config drive from {mnt}\n"
            ),
            result.stderr,
        )

    def test_leftoversOfAKilledSetupAreRemovedFirst(self) -> None:
        guest = FakeGuest(self)
        guest.put("guest/run/vmready-agent-setup.new/stale", "x")
        self.assertEqual(guest.setup().returncode, 0)
        self.assertNotIn("stale", guest.copied())
        self.assertFalse(os.path.exists(os.path.join(guest.root, "run/vmready-agent-setup.new")))


class SetupFromTheSeedTests(SynchronousTestCase):
    """Without the 9p export (a kernel without 9p, or no such device): the NoCloud seed."""

    def test_aKernelWithout9pUsesTheSeed(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        guest.seed()
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                0,
                f"{SETUP}this kernel has no 9p filesystem (modules 9p and 9pnet_virtio): using "
                f"the NoCloud seed /dev/vdb\n{SETUP}copied the NoCloud seed /dev/vdb to "
                f"{guest.dest} and unmounted it\n",
            ),
        )
        self.assertEqual(guest.copied()["agent.json"], '{"from": "seed"}')
        self.assertEqual(guest.mounts(), ["/"])

    def test_noDeviceWithTheTagUsesTheSeed(self) -> None:
        guest = FakeGuest(self)
        shutil.rmtree(os.path.join(guest.root, "sys/bus/virtio/drivers/9pnet_virtio/virtio2"))
        guest.seed()
        result = guest.setup()
        tags = os.path.join(guest.root, "sys/bus/virtio/drivers/9pnet_virtio")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(
            result.stderr.startswith(
                f"{SETUP}no virtio-9p device has the mount tag 'config' (looked in {tags}): "
                "using the NoCloud seed /dev/vdb\n"
            ),
            result.stderr,
        )

    def test_theSeedsDiskIsWaitedFor(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        guest.seed(after=2)
        self.assertEqual(guest.setup(tries=5).returncode, 0)

    def test_theUdevLinkServesWithoutBlkid(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        os.unlink(os.path.join(guest.bin, "blkid"))
        link = os.path.join(guest.root, "dev/disk/by-label/cidata")
        guest.put(link.removeprefix(guest.base + "/"), "")
        result = guest.setup()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"using the NoCloud seed {link}\n", result.stderr)

    def test_neither9pNorSeedSaysBoth(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{SETUP}no config drive: this kernel has no 9p filesystem (modules 9p and "
                "9pnet_virtio), and no volume labelled 'cidata' (the NoCloud seed) appeared\n",
            ),
        )

    def test_neitherTagNorSeedSaysBoth(self) -> None:
        guest = FakeGuest(self)
        shutil.rmtree(os.path.join(guest.root, "sys/bus/virtio/drivers/9pnet_virtio/virtio2"))
        tags = os.path.join(guest.root, "sys/bus/virtio/drivers/9pnet_virtio")
        result = guest.setup()
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{SETUP}no config drive: no virtio-9p device has the mount tag 'config' "
                f"(looked in {tags}), and no volume labelled 'cidata' (the NoCloud seed) "
                "appeared\n",
            ),
        )

    def test_aSeedThatCannotBeMountedSaysWhy(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        guest.seed()
        guest.flag("seed-fails", "mount: /run/x: unknown filesystem type 'iso9660'.\n")
        result = guest.setup()
        self.assertEqual(result.returncode, 1)
        self.assertTrue(
            result.stderr.endswith(
                f"{SETUP}cannot mount the NoCloud seed /dev/vdb: mount: /run/x: unknown "
                "filesystem type 'iso9660'.\n"
            ),
            result.stderr,
        )

    def test_aCidataVolumeVmreadyDidNotWriteIsNamed(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()
        guest.seed()
        shutil.rmtree(os.path.join(guest.fake, "seed", "vmready"))
        guest.put("fake/seed/user-data", "#cloud-config\n")
        result = guest.setup()
        self.assertEqual(result.returncode, 1)
        self.assertTrue(
            result.stderr.endswith(
                f"{SETUP}the volume /dev/vdb labelled 'cidata' has no vmready/ directory: not a "
                "seed vmready wrote\n"
            ),
            result.stderr,
        )
        self.assertEqual(guest.mounts(), ["/"])


INSTALL = "install.sh: "


class LiveInstallTests(SynchronousTestCase):
    """``install.sh`` run in a running guest, as the docs say, with systemd faked."""

    def install(self, guest: FakeGuest, *args: str) -> subprocess.CompletedProcess[str]:
        return guest.run(["sh", os.path.join(guest.loader, "install.sh"), *args])

    def calls(self, guest: FakeGuest) -> list[str]:
        with open(os.path.join(guest.fake, "systemctl-calls")) as f:
            return f.read().splitlines()

    def test_installsEnablesAndStarts(self) -> None:
        guest = FakeGuest(self)
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stdout.splitlines()[-1]),
            (0, f"{INSTALL}vmready-agent.service enabled and started"),
        )
        self.assertEqual(
            self.calls(guest),
            [
                "daemon-reload",
                "enable --quiet vmready-agent.service",
                "is-active --quiet vmready-agent.service",
                "start vmready-agent.service",
            ],
        )
        self.assertEqual(guest.copied()["agent.key"], "KEY")

    def test_saysWhatItInstalled(self) -> None:
        result = self.install(FakeGuest(self))
        self.assertEqual(
            result.stdout.splitlines()[:-1],
            [
                f"{INSTALL}installed /etc/systemd/system/vmready-agent.service",
                f"{INSTALL}installed /usr/local/lib/vmready/vmready-agent-setup",
                f"{INSTALL}installed /etc/udev/rules.d/99-vmready-agent.rules",
                f"{INSTALL}installed "
                "/etc/systemd/system/cloud-init-local.service.d/vmready-agent.conf",
                f"{INSTALL}installed /usr/local/bin/vmready-agent",
            ],
        )

    def test_cloudInitsLocalStageWaitsForTheAgent(self) -> None:
        guest = FakeGuest(self)
        self.install(guest)
        dropin = "etc/systemd/system/cloud-init-local.service.d/vmready-agent.conf"
        with open(os.path.join(guest.root, dropin)) as f:
            lines = f.read().splitlines()
        self.assertIn("Wants=vmready-agent.service", lines)
        self.assertIn("After=vmready-agent.service", lines)

    def test_theDocumentedCommandsWorkOnFirstTry(self) -> None:
        # mount … config /mnt && /mnt/install.sh && umount /mnt: the drive stays mounted
        # while the unit starts; its setup copies it from there.
        guest = FakeGuest(self)
        mnt = os.path.join(guest.root, "mnt")
        script = (
            f"mount -t 9p -o trans=virtio,version=9p2000.L,ro config {mnt} && "
            f"{mnt}/install.sh && umount {mnt}"
        )
        result = guest.run(["sh", "-c", script])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(guest.mounts(), ["/"])
        self.assertEqual(guest.copied()["agent.key"], "KEY")
        with open(os.path.join(guest.fake, "journal")) as f:
            self.assertIn(f"is busy: mounted at {mnt}; copying it from there", f.read())

    def test_aSecondRunChangesNothingAndStartsOnlyWhatIsStopped(self) -> None:
        guest = FakeGuest(self)
        self.install(guest)
        result = self.install(guest)
        self.assertEqual(result.stdout, f"{INSTALL}vmready-agent.service enabled and started\n")

    def test_aChangedLoaderRestartsARunningAgent(self) -> None:
        guest = FakeGuest(self)
        self.install(guest)
        with open(os.path.join(guest.loader, "udev/99-vmready-agent.rules"), "a") as f:
            f.write("# changed\n")
        result = self.install(guest)
        self.assertEqual(
            result.stdout.splitlines(),
            [
                f"{INSTALL}installed /etc/udev/rules.d/99-vmready-agent.rules",
                f"{INSTALL}vmready-agent.service enabled and restarted",
            ],
        )
        self.assertEqual(self.calls(guest)[-1], "restart vmready-agent.service")

    def test_anAgentThatDoesNotStartIsTheSetupsWord(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()  # and no seed
        result = self.install(guest)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.stderr,
            f"{INSTALL}vmready-agent.service did not start: no config drive: this kernel has "
            "no 9p filesystem (modules 9p and 9pnet_virtio), and no volume labelled 'cidata' "
            "(the NoCloud seed) appeared\n",
        )

    def test_anAgentThatDoesNotStartWithoutAWordPointsAtTheJournal(self) -> None:
        guest = FakeGuest(self)
        guest.flag("start-fails")
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}vmready-agent.service did not start: see journalctl -u "
                "vmready-agent.service\n",
            ),
        )

    def test_runFromAMountedDriveItSaysToUnmount(self) -> None:
        guest = FakeGuest(self)
        with open(os.path.join(guest.root, "proc/mounts"), "a") as f:
            f.write(f"config {guest.loader} 9p ro 0 0\n")
        result = self.install(guest)
        self.assertEqual(
            result.stdout.splitlines()[-1],
            f"{INSTALL}now 'umount {guest.loader}': a mounted config drive stops the VM from "
            "migrating",
        )

    def test_refusesWithoutRoot(self) -> None:
        guest = FakeGuest(self)
        FakeGuest.script(os.path.join(guest.bin, "id"), "#!/bin/sh\necho 1000\n")
        result = self.install(guest)
        self.assertEqual((result.returncode, result.stderr), (1, f"{INSTALL}run me as root\n"))

    def test_refusesAGuestWithoutSystemd(self) -> None:
        guest = FakeGuest(self)
        os.rmdir(os.path.join(guest.root, "run/systemd/system"))
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}this guest does not run systemd (no /run/systemd/system); start the "
                "agent from its init system instead: /usr/bin/python3 -S -I "
                "/run/vmready-agent/vmready-agent.pyz --config-drive /run/vmready-agent\n",
            ),
        )

    def test_refusesAGuestWithoutPython(self) -> None:
        guest = FakeGuest(self)
        os.unlink(os.path.join(guest.root, "usr/bin/python3"))
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}this guest has no /usr/bin/python3: the agent needs Python 3.9 or "
                "newer with its ssl module\n",
            ),
        )

    def test_refusesAPythonThatDoesNotRun(self) -> None:
        guest = FakeGuest(self)
        guest.flag("python-broken")
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr), (1, f"{INSTALL}/usr/bin/python3 does not run\n")
        )

    def test_refusesAnOldPython(self) -> None:
        guest = FakeGuest(self)
        guest.flag("python-version", "3.8\n")
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}the agent needs Python 3.9 or newer, and /usr/bin/python3 is "
                "Python 3.8\n",
            ),
        )

    def test_refusesAPythonWithoutSsl(self) -> None:
        guest = FakeGuest(self)
        guest.flag("python-without-ssl")
        result = self.install(guest)
        self.assertEqual(
            (result.returncode, result.stderr),
            (1, f"{INSTALL}the agent needs Python's ssl module, and /usr/bin/python3 has none\n"),
        )

    def test_refusesToRunFromElsewhereThanTheDrive(self) -> None:
        guest = FakeGuest(self)
        lone = os.path.join(guest.base, "lone")
        os.makedirs(lone)
        shutil.copy(os.path.join(guest.loader, "install.sh"), lone)
        result = guest.run(["sh", os.path.join(lone, "install.sh")])
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}{lone}/systemd/vmready-agent.service is missing: run install.sh "
                "from the vmready config drive\n",
            ),
        )

    def test_helpSaysHowToRunIt(self) -> None:
        result = self.install(FakeGuest(self), "--help")
        self.assertEqual(
            (result.returncode, result.stdout),
            (
                0,
                "usage: install.sh [--root DIR]\nInstalls the vmready agent's systemd unit; "
                "run it as root from the config drive.\n",
            ),
        )

    def test_rootNeedsADirectory(self) -> None:
        result = self.install(FakeGuest(self), "--root")
        self.assertEqual(
            (result.returncode, result.stderr), (1, f"{INSTALL}--root needs a directory\n")
        )

    def test_rootMustBeADirectory(self) -> None:
        guest = FakeGuest(self)
        missing = os.path.join(guest.base, "nothing")
        result = self.install(guest, "--root", missing)
        self.assertEqual(
            (result.returncode, result.stderr),
            (1, f"{INSTALL}--root {missing} is not a directory\n"),
        )

    def test_aTreeWithoutPythonIsRefused(self) -> None:
        guest = FakeGuest(self)
        tree = os.path.join(guest.base, "tree")
        os.makedirs(os.path.join(tree, "lib/systemd"))
        guest.put("tree/lib/systemd/systemd", "")
        result = self.install(guest, "--root", tree)
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                f"{INSTALL}{tree} has no /usr/bin/python3: the agent needs Python 3.9 or newer\n",
            ),
        )


HOOK = "vmready-boothook: "


class BoothookTests(SynchronousTestCase):
    """The vendor-data boothook: install.sh from the seed, every boot; a word when it cannot."""

    def hook(self, guest: FakeGuest) -> tuple[int, str]:
        """Run it as cloud-init does (the rest after its first line); its status and console."""
        path = os.path.join(guest.base, "boothook")
        FakeGuest.script(path, boothook().decode().split("\n", 1)[1])
        guest.put("guest/dev/console", "")
        result = guest.run([path])
        with open(os.path.join(guest.root, "dev/console")) as f:
            return result.returncode, f.read()

    def seeded(self) -> FakeGuest:
        guest = FakeGuest(self)
        guest.seed()
        guest.seed_files({"install.sh": '#!/bin/sh\necho "install.sh ran from $(dirname $0)"\n'})
        return guest

    def test_runsInstallFromTheSeedThenUnmountsIt(self) -> None:
        guest = self.seeded()
        status, console = self.hook(guest)
        self.assertEqual(status, 0, console)
        self.assertRegex(
            console, f"^install.sh ran from {guest.root}/run/vmready-boothook\\.[^/]+/vmready\n$"
        )
        self.assertEqual(guest.mounts(), ["/"])
        self.assertEqual([n for n in os.listdir(os.path.join(guest.root, "run"))], ["systemd"])

    def test_installsTheRealLoaderAndStartsTheAgent(self) -> None:
        guest = FakeGuest(self)
        guest.no_9p()  # a cloud kernel: the agent's setup reads the seed too
        guest.seed()
        shutil.copytree(
            guest.loader, os.path.join(guest.fake, "seed", "vmready"), dirs_exist_ok=True
        )
        status, console = self.hook(guest)
        self.assertEqual(status, 0, console)
        self.assertIn(f"{INSTALL}vmready-agent.service enabled and started\n", console)
        self.assertEqual(guest.copied()["agent.key"], "KEY")
        self.assertEqual(guest.mounts(), ["/"])

    def test_withoutASeedItSaysSo(self) -> None:
        self.assertEqual(
            self.hook(FakeGuest(self)),
            (
                1,
                f"{HOOK}no volume labelled 'cidata' (the NoCloud seed): the vmready agent is "
                "not installed\n",
            ),
        )

    def test_aSeedThatCannotBeMountedSaysWhy(self) -> None:
        guest = self.seeded()
        guest.flag("seed-fails", "mount: /run/x: wrong fs type.\n")
        self.assertEqual(
            self.hook(guest),
            (1, f"{HOOK}cannot mount the NoCloud seed /dev/vdb: mount: /run/x: wrong fs type.\n"),
        )

    def test_noMountPointSaysSo(self) -> None:
        guest = self.seeded()
        shutil.rmtree(os.path.join(guest.root, "run"))
        self.assertEqual(
            self.hook(guest),
            (1, f"{HOOK}cannot make a mount point in /run: the vmready agent is not installed\n"),
        )

    def test_aSeedWithoutTheLoaderSaysSo(self) -> None:
        guest = FakeGuest(self)
        guest.seed()
        self.assertEqual(
            self.hook(guest),
            (
                1,
                f"{HOOK}the NoCloud seed /dev/vdb has no vmready/install.sh: the vmready agent "
                "is not installed\n",
            ),
        )
