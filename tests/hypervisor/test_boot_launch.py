"""Launching from a boot source: what is refused, and what a refusal leaves behind (nothing).

A launch whose image, kernel or initrd cannot boot is a 400 from
``Lifecycle.create`` before any instance, overlay or VM process exists; these
tests look at the store, the data dir and the processes afterwards.
"""

from __future__ import annotations

import os
import subprocess

from tests.hypervisor.test_launch_sources import LaunchTestCase
from tests.lifecycle.test_lifecycle import _async
from vmready.domain.model import BadRequest
from vmready.hypervisor.bootsource import BootSource
from vmready.lifecycle.settings import LaunchSettings


def fake_kernel(path: str) -> str:
    """A file with a bzImage's boot-sector signature and setup header magic."""
    data = bytearray(0x400)
    data[0x1FE:0x200] = b"\x55\xaa"
    data[0x202:0x206] = b"HdrS"
    with open(path, "wb") as f:
        f.write(bytes(data))
    return path


class RefusedLaunchTests(LaunchTestCase):
    """Every refusal is one clear message; nothing is left behind."""

    def path(self, name: str) -> str:
        return os.path.join(self.directory, "files", name)

    def write(self, name: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
        with open(self.path(name), "wb") as f:
            f.write(data)
        return self.path(name)

    async def refusal(self, config: dict[str, str]) -> str:
        """The message of the 400 that launching with ``config`` gets; nothing may be left."""
        with self.assertRaises(BadRequest) as caught:
            await self.lifecycle.create("vm1", config)
        self.assertEqual(self.store.instances.list_instances(), [])
        for left in ("run", "disks"):
            where = os.path.join(self.directory, left)
            self.assertEqual(os.listdir(where) if os.path.isdir(where) else [], [], left)
        self.assertEqual(self.lifecycle.running.vms, {})
        message: str = caught.exception.message
        return message

    @_async
    async def test_missingImage(self) -> None:
        missing = self.path("gone.qcow2")
        self.assertEqual(
            await self.refusal({"boot.image": missing}), f"image {missing} does not exist"
        )

    @_async
    async def test_textFileIsNotAnImage(self) -> None:
        text = self.write("notes.txt", b"hello\n")
        self.assertIn(
            f"image {text} is not a disk image", await self.refusal({"boot.image": text})
        )

    @_async
    async def test_directoryIsNotAnImage(self) -> None:
        os.makedirs(self.path("dir"))
        self.assertEqual(
            await self.refusal({"boot.image": self.path("dir")}),
            f"image {self.path('dir')} is a directory, not a file",
        )

    @_async
    async def test_backingChainToAMissingFile(self) -> None:
        base = self.write("base.raw", b"\0" * 510 + b"\x55\xaa" + b"\0" * 512)
        top = self.path("top.qcow2")
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", base, top], check=True
        )
        os.unlink(base)
        self.assertEqual(
            await self.refusal({"boot.image": top}),
            f"image {top} is backed by {base}, which does not exist",
        )

    @_async
    async def test_kernelThatIsNotAKernel(self) -> None:
        text = self.write("vmlinuz", b"#!/bin/sh\n")
        self.assertIn(
            f"kernel {text} is not a Linux kernel", await self.refusal({"boot.kernel": text})
        )

    @_async
    async def test_initrdWithoutAKernel(self) -> None:
        initrd = self.write("initrd.img", b"\x1f\x8b\x08\x00" + bytes(60))
        self.assertEqual(
            await self.refusal({"boot.initrd": initrd}),
            "Invalid boot.initrd: it needs boot.kernel (a kernel to boot)",
        )

    @_async
    async def test_relativePath(self) -> None:
        self.assertEqual(
            await self.refusal({"boot.image": "disk.qcow2"}),
            "Invalid boot.image 'disk.qcow2': expected an absolute path",
        )

    @_async
    async def test_unknownAccelerator(self) -> None:
        self.assertIn("Invalid value for boot.accel", await self.refusal({"boot.accel": "hvf"}))

    @_async
    async def test_kvmWhereKvmCannotBeUsed(self) -> None:
        self.lifecycle = self.new_lifecycle(
            settings=LaunchSettings(
                kvm_problem="/dev/kvm cannot be opened: No such file or directory"
            )
        )
        self.assertEqual(
            await self.refusal({"boot.accel": "kvm"}),
            "Cannot launch vm1 with boot.accel=kvm: "
            "/dev/kvm cannot be opened: No such file or directory",
        )

    @_async
    async def test_anotherInstancesOverlayIsNotAnImage(self) -> None:
        overlay = os.path.join(self.directory, "disks", "0123456789abcdef.qcow2")
        os.makedirs(os.path.dirname(overlay))
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", overlay, "1M"], check=True)
        message = await self.refusal_keeping(overlay)
        self.assertEqual(
            message, f"image {overlay} is an instance's disk overlay; boot its image instead"
        )

    async def refusal_keeping(self, overlay: str) -> str:
        with self.assertRaises(BadRequest) as caught:
            await self.lifecycle.create("vm1", {"boot.image": overlay})
        self.assertEqual(self.store.instances.list_instances(), [])
        self.assertEqual(os.listdir(os.path.dirname(overlay)), [os.path.basename(overlay)])
        message: str = caught.exception.message
        return message

    @_async
    async def test_theDaemonsDefaultIsCheckedToo(self) -> None:
        settings = LaunchSettings(default_boot=BootSource(kernel=self.write("k", b"not one")))
        self.lifecycle = self.new_lifecycle(settings=settings)
        self.assertIn("is not a Linux kernel", await self.refusal({}))

    @_async
    async def test_bootKeysCannotChangeAfterLaunch(self) -> None:
        os.makedirs(self.path(""), exist_ok=True)
        kernel = fake_kernel(self.path("vmlinuz"))
        self.store.instances.create_instance("vm1", {"boot.kernel": kernel}, {})
        with self.assertRaises(BadRequest) as caught:
            await self.lifecycle.configuring.update_config("vm1", {"boot.append": "quiet"})
        self.assertEqual(
            caught.exception.message,
            "Cannot change boot.append of instance vm1: the boot source and accelerator are "
            "chosen at launch (launch a new instance to boot another)",
        )
