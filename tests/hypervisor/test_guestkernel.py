"""The demo guest's own kernel: its configuration, its build's steps, its cache.

The build runs behind the builder's command-runner seam: a fake runner plays
apt, dpkg, tar and make (the files each would leave), so every step and every
failure is checked here in milliseconds.  The real build (minutes, a C
toolchain) runs in ``test_guestimage.RealBuildTests``, which checks every line
of the configuration in the kernel it made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from twisted.trial.unittest import SynchronousTestCase

from tests.hypervisor.test_guestimage import fake_pvh_kernel
from vmready.hypervisor.guestimage import kernel as guest_kernel
from vmready.hypervisor.guestimage.build import take_kernel
from vmready.hypervisor.guestimage.commands import CommandResult, GuestImageError
from vmready.hypervisor.guestimage.content import (
    KERNEL_CONFIG_FILE,
    KERNEL_FILE,
    PVH_KERNEL_FILE,
)
from vmready.hypervisor.guestimage.fetch import Package
from vmready.hypervisor.guestimage.kernel import (
    KERNEL_BUILDER_VERSION,
    KERNEL_CACHE_VARIABLE,
    GuestKernel,
    build_kernel,
    default_kernel_cache,
    ensure_kernel,
    kernel_key,
    missing_build_packages,
)
from vmready.hypervisor.guestimage.kernelconfig import (
    KERNEL_CONFIG,
    config_problems,
    config_values,
)

SOURCE = Package("linux-source-6.1", "6.1.192-3")


class ConfigTests(SynchronousTestCase):
    """A ``.config`` is read as the kernel writes it; every wanted line is checked."""

    def test_setAndUnsetSymbols(self) -> None:
        text = (
            "#\n# Automatically generated file; DO NOT EDIT.\n#\n"
            'CONFIG_64BIT=y\nCONFIG_NR_CPUS=64\nCONFIG_LOCALVERSION="-vmready"\n'
            "# CONFIG_MODULES is not set\n\n# General setup\n"
        )
        self.assertEqual(
            config_values(text),
            {
                "CONFIG_64BIT": "y",
                "CONFIG_NR_CPUS": "64",
                "CONFIG_LOCALVERSION": '"-vmready"',
                "CONFIG_MODULES": "n",
            },
        )

    def test_everyWantedLineHeldIsNoProblem(self) -> None:
        text = "CONFIG_PVH=y\n# CONFIG_MODULES is not set\nCONFIG_EXT4_FS=y\n"
        wanted = ("CONFIG_PVH=y", "# CONFIG_MODULES is not set")
        self.assertEqual(config_problems(text, wanted), [])

    def test_aSymbolThatDidNotTakeIsNamed(self) -> None:
        text = "CONFIG_9P_FS=m\nCONFIG_MODULES=y\n"
        wanted = ("CONFIG_9P_FS=y", "# CONFIG_MODULES is not set", "CONFIG_VIRTIO_VSOCKETS=y")
        self.assertEqual(
            config_problems(text, wanted),
            [
                "CONFIG_9P_FS=y (the kernel's configuration has it m)",
                "# CONFIG_MODULES is not set (the kernel's configuration has it y)",
                "CONFIG_VIRTIO_VSOCKETS=y (the kernel's configuration has it not set)",
            ],
        )

    def test_anAbsentSymbolIsUnset(self) -> None:
        self.assertEqual(config_problems("", ("# CONFIG_IPV6 is not set",)), [])

    def test_aWantedLineThatIsNoConfigurationIsRefused(self) -> None:
        with self.assertRaises(ValueError):
            config_problems("", ("PVH=y",))

    def test_theGuestsConfigurationIsWellFormedAndSaysEachSymbolOnce(self) -> None:
        symbols = [symbol for line in KERNEL_CONFIG for symbol in config_values(line)]
        self.assertEqual(len(symbols), len(KERNEL_CONFIG))
        self.assertEqual(len(set(symbols)), len(symbols))

    def test_everyDeviceVmreadyGivesAVMHasItsDriverBuiltIn(self) -> None:
        wanted = config_values("\n".join(KERNEL_CONFIG))
        for symbol in (
            "CONFIG_PVH",  # QEMU boots the ELF kernel by its PVH entry
            "CONFIG_VIRTIO_BLK",  # the root disk
            "CONFIG_EXT4_FS",
            "CONFIG_VIRTIO_CONSOLE",  # the agent's serial ports
            "CONFIG_NET_9P_VIRTIO",  # the config drive
            "CONFIG_9P_FS",
            "CONFIG_VIRTIO_VSOCKETS",  # the vsock transport
            "CONFIG_VIRTIO_NET",  # the fallback transport
            "CONFIG_HW_RANDOM_VIRTIO",
            "CONFIG_ACPI_BUTTON",  # system_powerdown
            "CONFIG_PVPANIC_MMIO",
            "CONFIG_SERIAL_8250_CONSOLE",  # the console log
            "CONFIG_RTC_DRV_CMOS",  # the date, for TLS
        ):
            self.assertEqual(wanted[symbol], "y", symbol)
        self.assertEqual(wanted["CONFIG_MODULES"], "n")


class KeyTests(SynchronousTestCase):
    """The kernel's key changes with its source, its configuration and its builder."""

    def test_sameSourceSameKey(self) -> None:
        self.assertEqual(kernel_key(SOURCE), kernel_key(Package(SOURCE.name, SOURCE.version)))
        self.assertRegex(kernel_key(SOURCE), r"^[0-9a-f]{16}$")

    def test_anotherSourceVersionAnotherKey(self) -> None:
        self.assertNotEqual(kernel_key(Package(SOURCE.name, "6.1.192-4")), kernel_key(SOURCE))

    def test_anotherConfigurationAnotherKey(self) -> None:
        before = kernel_key(SOURCE)
        self.patch(guest_kernel, "KERNEL_CONFIG", (*KERNEL_CONFIG, "CONFIG_VFAT_FS=y"))
        self.assertNotEqual(kernel_key(SOURCE), before)

    def test_anotherBuilderAnotherKey(self) -> None:
        before = kernel_key(SOURCE)
        self.patch(guest_kernel, "KERNEL_BUILDER_VERSION", KERNEL_BUILDER_VERSION + 1)
        self.assertNotEqual(kernel_key(SOURCE), before)


class ToolchainTests(SynchronousTestCase):
    """What the build needs is named by Debian package."""

    def test_nothingMissing(self) -> None:
        self.assertEqual(missing_build_packages(lambda name: "/usr/bin/x", lambda p: True), [])

    def test_missingCommandsAndHeadersByPackage(self) -> None:
        missing = missing_build_packages(
            lambda name: None if name in ("flex", "bison") else f"/usr/bin/{name}",
            lambda path: path != "/usr/include/gelf.h",
        )
        self.assertEqual(missing, ["flex", "bison", "libelf-dev"])

    def test_aBuildWithoutTheToolchainSaysWhatToInstall(self) -> None:
        self.patch(guest_kernel, "missing_build_packages", lambda: ["flex", "libelf-dev"])
        make = FakeMake()
        with self.assertRaises(GuestImageError) as caught:
            build_kernel(SOURCE, self.mktemp(), make, lambda line: None)
        self.assertEqual(
            str(caught.exception),
            "building the demo guest's kernel failed: this host lacks flex, libelf-dev; install "
            "them: apt-get install flex libelf-dev",
        )
        self.assertEqual(make.commands, [])


class FakeMake:
    """The command-runner seam for a kernel build: apt, dpkg, tar and make, by their files."""

    def __init__(
        self,
        olddefconfig: Callable[[str], str] = lambda text: text,
        vmlinux: bytes | None = None,
        fail: str | None = None,
    ) -> None:
        self.olddefconfig = olddefconfig
        self.vmlinux = fake_pvh_kernel() if vmlinux is None else vmlinux
        self.fail = fail
        self.commands: list[tuple[list[str], str | None]] = []

    def _write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def __call__(self, argv: Sequence[str], cwd: str | None = None) -> CommandResult:
        argv = list(argv)
        self.commands.append((argv, cwd))
        if self.fail is not None and self.fail in argv:
            return CommandResult(
                2, b"", b"scripts/Makefile.build:250: error 1\nmake: *** Error 2\n"
            )
        if argv[:2] == ["apt-get", "download"]:
            assert cwd is not None
            self._write(os.path.join(cwd, "linux-source-6.1_6.1.192-3_all.deb"), b"deb")
        elif argv[0] == "dpkg":
            self._write(os.path.join(argv[3], "usr/src/linux-source-6.1.tar.xz"), b"xz")
        elif argv[0] == "tar":
            self._write(os.path.join(argv[argv.index("-C") + 1], "Makefile"), b"all:\n")
        elif argv[0] == "make" and argv[-1] == "tinyconfig":
            assert cwd is not None
            self._write(os.path.join(cwd, ".config"), b"CONFIG_64BIT=y\n")
        elif argv[0] == "make" and argv[-1] == "olddefconfig":
            assert cwd is not None
            with open(os.path.join(cwd, ".config"), encoding="utf-8") as f:
                text = self.olddefconfig(f.read())
            self._write(os.path.join(cwd, ".config"), text.encode())
        elif argv[0] == "make" and argv[-1] == "bzImage":
            assert cwd is not None
            self._write(os.path.join(cwd, "vmlinux"), self.vmlinux)
            self._write(os.path.join(cwd, "arch/x86/boot/bzImage"), b"bzImage")
        else:
            raise AssertionError(f"unexpected command {argv}")
        return CommandResult(0, b"", b"")


class BuildTests(SynchronousTestCase):
    """``build_kernel``: the source fetched and unpacked, configured, checked, compiled, kept."""

    def setUp(self) -> None:
        self.patch(guest_kernel, "missing_build_packages", lambda: [])
        self.workdir = self.mktemp()
        os.makedirs(self.workdir)
        self.log: list[str] = []

    def build(self, make: FakeMake) -> None:
        build_kernel(SOURCE, self.workdir, make, self.log.append, jobs=3)

    def test_theStepsInOrder(self) -> None:
        make = FakeMake()
        self.build(make)
        tree = os.path.join(self.workdir, "src")
        self.assertEqual(
            [argv for argv, cwd in make.commands],
            [
                ["apt-get", "download", "-q", "linux-source-6.1=6.1.192-3"],
                make.commands[1][0],  # dpkg -x the .deb into unpacked/
                [
                    "tar",
                    "-xJf",
                    os.path.join(
                        self.workdir,
                        "unpacked",
                        "linux-source-6.1",
                        "usr/src/linux-source-6.1.tar.xz",
                    ),
                    "-C",
                    tree,
                    "--strip-components=1",
                ],
                ["make", "-s", "tinyconfig"],
                ["make", "-s", "olddefconfig"],
                [
                    "make",
                    "-s",
                    "-j3",
                    "KBUILD_BUILD_USER=vmready",
                    "KBUILD_BUILD_HOST=vmready",
                    "bzImage",
                ],
            ],
        )
        self.assertEqual(make.commands[1][0][:2], ["dpkg", "-x"])
        self.assertEqual([cwd for argv, cwd in make.commands[3:]], [tree] * 3)

    def test_theKernelItsPVHFormAndItsConfigurationAreKept(self) -> None:
        self.build(FakeMake())
        self.assertEqual(
            sorted(os.listdir(self.workdir)), ["bzImage", "config", "kernel.json", "vmlinux"]
        )
        with open(os.path.join(self.workdir, "vmlinux"), "rb") as f:
            self.assertEqual(f.read(), fake_pvh_kernel())
        with open(os.path.join(self.workdir, "config"), encoding="utf-8") as f:
            config = f.read()
        self.assertTrue(config.startswith("CONFIG_64BIT=y\n"))
        self.assertEqual(config_problems(config), [])
        with open(os.path.join(self.workdir, "kernel.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        self.assertEqual(manifest["source"], ["linux-source-6.1", "6.1.192-3"])
        self.assertEqual(manifest["key"], kernel_key(SOURCE))
        self.assertEqual(manifest["config"], list(KERNEL_CONFIG))

    def test_aLineThatDidNotTakeFailsTheBuildByName(self) -> None:
        def drop_9p(text: str) -> str:
            return text.replace("CONFIG_9P_FS=y\n", "")

        make = FakeMake(olddefconfig=drop_9p)
        with self.assertRaises(GuestImageError) as caught:
            self.build(make)
        self.assertEqual(
            str(caught.exception),
            "configuring the kernel failed: 1 line(s) did not take: CONFIG_9P_FS=y (the kernel's "
            "configuration has it not set)",
        )
        self.assertNotIn("bzImage", [argv[-1] for argv, cwd in make.commands])

    def test_aFailedCompileIsTheStepsError(self) -> None:
        with self.assertRaises(GuestImageError) as caught:
            self.build(FakeMake(fail="bzImage"))
        self.assertIn(
            "compiling the kernel failed: make -s exited with status 2:", str(caught.exception)
        )
        self.assertIn("make: *** Error 2", str(caught.exception))

    def test_aKernelWithoutAPVHEntryIsRefused(self) -> None:
        with self.assertRaises(GuestImageError) as caught:
            self.build(FakeMake(vmlinux=fake_pvh_kernel(pvh=False)))
        self.assertEqual(
            str(caught.exception), "compiling the kernel failed: vmlinux has no PVH entry point"
        )


class CacheTests(SynchronousTestCase):
    """One build per key, in the kernel's own cache, shared by every guest build."""

    def setUp(self) -> None:
        self.cache = self.mktemp()
        self.builds: list[tuple[Package, str]] = []

    def builder(self, source: Package, workdir: str, run: object, log: object) -> None:
        self.builds.append((source, workdir))
        for name in ("bzImage", "vmlinux", "config", "kernel.json"):
            with open(os.path.join(workdir, name), "w") as f:
                f.write(name)

    def ensure(self, source: Package = SOURCE) -> GuestKernel:
        return ensure_kernel(source, FakeMake(), lambda line: None, self.cache, self.builder)

    def test_builtOnceThenReused(self) -> None:
        first = self.ensure()
        second = self.ensure()
        self.assertEqual(first, second)
        self.assertEqual(len(self.builds), 1)
        self.assertEqual(first.key, kernel_key(SOURCE))
        self.assertEqual(first.vmlinux, os.path.join(self.cache, first.key, "vmlinux"))
        with open(first.bzimage) as f:
            self.assertEqual(f.read(), "bzImage")

    def test_anotherSourceIsAnotherBuild(self) -> None:
        self.ensure()
        newer = self.ensure(Package(SOURCE.name, "6.1.192-4"))
        self.assertEqual(len(self.builds), 2)
        self.assertNotEqual(newer.key, kernel_key(SOURCE))

    def test_theDefaultCacheIsBesideTheGuestsOrTheVariables(self) -> None:
        self.patch(os, "environ", {"VMREADY_GUEST_CACHE": "/var/cache/vmr/guest"})
        self.assertEqual(default_kernel_cache(), "/var/cache/vmr/kernel")
        self.patch(os, "environ", {KERNEL_CACHE_VARIABLE: "/k", "VMREADY_GUEST_CACHE": "/g"})
        self.assertEqual(default_kernel_cache(), "/k")

    def test_theGuestTakesTheKernelItsPVHFormAndItsConfiguration(self) -> None:
        kernel = self.ensure()
        image = self.mktemp()
        os.makedirs(image)
        take_kernel(kernel, image)
        for name, source in (
            (KERNEL_FILE, "bzImage"),
            (PVH_KERNEL_FILE, "vmlinux"),
            (KERNEL_CONFIG_FILE, "config"),
        ):
            with open(os.path.join(image, name)) as f:
                self.assertEqual(f.read(), source)
