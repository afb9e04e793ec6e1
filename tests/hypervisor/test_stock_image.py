"""vmready.hypervisor.guestimage.stock: the stock-like cloud image's inputs, key and cache.

The build itself (mmdebstrap, mkfs.ext4, qemu-img, as root) runs for real in
the real-guest tests (``tests/endtoend/test_stock_images.py``), which boot
all three of its disks; here apt's answers and the builder are fakes behind
their seams, as for the demo guest.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence

from twisted.trial.unittest import SynchronousTestCase

from vmready.guestfiles import loader_files
from vmready.hypervisor.guestimage.__main__ import print_stock
from vmready.hypervisor.guestimage.commands import CommandResult, GuestImageError
from vmready.hypervisor.guestimage.stock import (
    DOCUMENTED_INSTALL,
    MANUAL_SCRIPT,
    StockGuest,
    StockInputs,
    ensure_stock_guest,
    resolve_stock_inputs,
    stock_files,
)

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "docs")
KERNEL = "Package: linux-image-cloud-amd64\nVersion: 6.1.192-2\nDepends: linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)\n\n"  # noqa: E501
PACKAGES = "".join(
    f"Package: {name}\nVersion: {version}\n\n"
    for name, version in (
        ("linux-image-6.1.0-56-cloud-amd64", "6.1.192-2"),
        ("cloud-init", "22.4.2-1+deb12u4"),
        ("systemd-sysv", "252.39-1~deb12u2"),
        ("udev", "252.39-1~deb12u2"),
        ("dbus", "1.14.10-1~deb12u1"),
    )
)


class FakeApt:
    """``apt-cache show`` as a bookworm host answers it (or fails, or misses a package)."""

    def __init__(self, packages: str = PACKAGES, status: int = 0) -> None:
        self.packages = packages
        self.status = status

    def __call__(self, argv: Sequence[str], cwd: str | None = None) -> CommandResult:
        if self.status:
            return CommandResult(self.status, b"", b"E: No packages found\n")
        if "linux-image-cloud-amd64" in argv:
            return CommandResult(0, KERNEL.encode(), b"")
        return CommandResult(0, self.packages.encode(), b"")


class FakeStockBuilder:
    """Writes the six artifacts (or fails as told)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.builds: list[str] = []

    def __call__(self, inputs: StockInputs, workdir: str, run: object, log: object) -> None:
        self.builds.append(workdir)
        if self.error is not None:
            raise self.error
        for name in (
            "vmlinuz",
            "initrd.img",
            "stock.qcow2",
            "loader.qcow2",
            "manual.qcow2",
            "stock.json",
        ):
            with open(os.path.join(workdir, name), "w") as f:
                f.write(name)


class InputsTests(SynchronousTestCase):
    def test_theKernelIsTheCloudMetapackagesDependency(self) -> None:
        inputs = resolve_stock_inputs(FakeApt())
        self.assertEqual(
            (inputs.kernel.name, inputs.kernel.version),
            ("linux-image-6.1.0-56-cloud-amd64", "6.1.192-2"),
        )
        self.assertEqual(
            [p.name for p in inputs.packages], ["cloud-init", "systemd-sysv", "udev", "dbus"]
        )

    def test_aMissingPackageIsNamed(self) -> None:
        error = self.assertRaises(
            GuestImageError, resolve_stock_inputs, FakeApt(PACKAGES.replace("cloud-init", "x"))
        )
        self.assertEqual(
            str(error), "resolving the stock image's packages failed: apt knows no cloud-init"
        )

    def test_theLoaderIsAnInput(self) -> None:
        files = stock_files()
        self.assertEqual(
            {name[len("loader/") :] for name in files if name.startswith("loader/")},
            set(loader_files()),
        )

    def test_aNewCloudInitIsANewKey(self) -> None:
        newer = PACKAGES.replace("22.4.2-1+deb12u4", "22.4.2-1+deb12u5")
        self.assertNotEqual(
            resolve_stock_inputs(FakeApt()).key, resolve_stock_inputs(FakeApt(newer)).key
        )


class DocumentedInstallTests(SynchronousTestCase):
    """The manual image runs the install exactly as the docs give it to an operator."""

    def test_theScriptRunsTheDocumentedCommands(self) -> None:
        self.assertEqual(MANUAL_SCRIPT.splitlines()[2], DOCUMENTED_INSTALL)

    def test_theDocsGiveTheseCommandsWordForWord(self) -> None:
        with open(os.path.join(DOCS, "real-guests.md")) as f:
            self.assertIn(f"\n{DOCUMENTED_INSTALL}\n", f.read())


class StockCacheTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.cache = self.mktemp()

    def test_builtOnceThenReused(self) -> None:
        builder = FakeStockBuilder()
        first = ensure_stock_guest(self.cache, lambda line: None, FakeApt(), builder)
        again = ensure_stock_guest(self.cache, lambda line: None, FakeApt(), builder)
        self.assertEqual((first, len(builder.builds)), (again, 1))
        key = resolve_stock_inputs(FakeApt()).key
        self.assertEqual(first.stock, os.path.join(self.cache, key, "stock.qcow2"))
        self.assertEqual(
            (first.loader, first.manual, first.kernel, first.initrd),
            tuple(
                os.path.join(self.cache, key, name)
                for name in ("loader.qcow2", "manual.qcow2", "vmlinuz", "initrd.img")
            ),
        )
        self.assertEqual(first.append, "root=/dev/vda ro console=ttyS0")

    def test_aFailedBuildLeavesNothing(self) -> None:
        with self.assertRaises(GuestImageError):
            ensure_stock_guest(
                self.cache,
                lambda line: None,
                FakeApt(),
                FakeStockBuilder(GuestImageError("bootstrapping failed")),
            )
        self.assertEqual(os.listdir(self.cache), [".lock"])

    def test_withoutAptTheNewestCachedBuildServes(self) -> None:
        built = ensure_stock_guest(self.cache, lambda line: None, FakeApt(), FakeStockBuilder())
        said: list[str] = []
        again = ensure_stock_guest(
            self.cache, said.append, FakeApt(status=100), FakeStockBuilder()
        )
        self.assertEqual(again, built)
        self.assertTrue(said[0].startswith("guest image: warning: resolving the stock image's"))


class PrintStockTests(SynchronousTestCase):
    """What ``python -m vmready.hypervisor.guestimage --stock`` prints is guest-image.md's."""

    def test_theDocumentedTranscriptIsWhatItPrints(self) -> None:
        with open(os.path.join(DOCS, "guest-image.md"), encoding="utf-8") as f:
            docs = f.read()
        command = "$ sudo .venv/bin/python -m vmready.hypervisor.guestimage --stock\n"
        self.assertIn(command, docs)
        documented = docs.split(command, 1)[1].split("```", 1)[0]
        directory = "/root/.cache/vmready/stock/35077521622cafd0"
        stock = StockGuest(
            kernel=f"{directory}/vmlinuz",
            initrd=f"{directory}/initrd.img",
            stock=f"{directory}/stock.qcow2",
            loader=f"{directory}/loader.qcow2",
            manual=f"{directory}/manual.qcow2",
        )
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_stock(stock)
        self.assertEqual(printed.getvalue(), documented)
