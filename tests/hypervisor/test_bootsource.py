"""Tests for vmready.hypervisor.bootsource, bootfiles and imagetool: config, file checks, qemu-img.

The checks of kernels, initrds and raw images read real files made here.
``ImageTool`` and ``check_boot_source_now`` run the real ``qemu-img`` on tiny
images made with ``qemu-img`` itself; those tests skip where it is not
installed, unless ``VMREADY_REQUIRE_QEMU=1`` (as in CI) turns the skip into a
failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from typing import Any

from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.conformance.support import require_program
from tests.hypervisor.test_guestimage import fake_pvh_kernel
from tests.reactor import reactor
from vmready.domain import APPEND_KEY, IMAGE_KEY, INITRD_KEY, KERNEL_KEY
from vmready.domain.model import BadRequest, HypervisorError
from vmready.hypervisor.bootfiles import check_files, check_initrd, check_kernel, check_raw_image
from vmready.hypervisor.bootsource import MAX_APPEND_BYTES, BootSource
from vmready.hypervisor.imagetool import QEMU_IMG, ImageInfo, ImageTool, parse_image_info

MIB = 1 << 20
NOT_A_DISK = "holds no partition table or filesystem"


def write(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` (its directory made) and return the path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def blank(size: int) -> bytearray:
    return bytearray(size)


def put(image: bytearray, offset: int, data: bytes) -> bytearray:
    image[offset : offset + len(data)] = data
    return image


def le(value: int, length: int) -> bytes:
    return value.to_bytes(length, "little")


def fake_kernel(path: str) -> str:
    """A file with a bzImage's boot-sector signature and setup header magic."""
    kernel = put(put(blank(4096), 0x1FE, b"\x55\xaa"), 0x202, b"HdrS")
    return write(path, bytes(kernel))


def mbr_disk(size: int = MIB, partition_end: int | None = None) -> bytes:
    """A raw disk of ``size`` bytes with one Linux partition ending at ``partition_end``."""
    end = size if partition_end is None else partition_end
    entry = b"\x80" + b"\x00" * 3 + b"\x83" + b"\x00" * 3 + le(1, 4) + le(end // 512 - 1, 4)
    return bytes(put(put(blank(size), 446, entry), 510, b"\x55\xaa"))


def gpt_disk(size: int = MIB, disk_size: int | None = None) -> bytes:
    """A raw GPT disk of ``size`` bytes whose header says it has ``disk_size`` bytes."""
    sectors = (size if disk_size is None else disk_size) // 512
    protective = b"\x00" * 4 + b"\xee" + b"\x00" * 3 + le(1, 4) + le(sectors - 1, 4)
    image = put(put(blank(size), 446, protective), 510, b"\x55\xaa")
    header = b"EFI PART" + le(0x10000, 4) + le(92, 4) + le(0, 4) + le(0, 4)
    header += le(1, 8) + le(sectors - 1, 8)
    return bytes(put(image, 512, header))


def ext_filesystem(size: int = MIB, blocks: int | None = None) -> bytes:
    """A raw ext filesystem image of ``size`` bytes whose superblock counts ``blocks`` 1 KiB."""
    count = size // 1024 if blocks is None else blocks
    return bytes(put(put(blank(size), 1024 + 4, le(count, 4)), 1080, b"\x53\xef"))


def qemu_img(*args: str) -> str:
    """Run qemu-img to make a fixture; its output."""
    done = subprocess.run([QEMU_IMG, *args], capture_output=True, check=True, text=True)
    return done.stdout


def image_info(path: str) -> dict[str, Any]:
    """qemu-img's own description of ``path``."""
    info: dict[str, Any] = json.loads(qemu_img("info", "-U", "--output=json", path))
    return info


def left_in(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


class BootSourceConfigTests(SynchronousTestCase):
    """The boot source as the instance's config keys record it."""

    def test_fromConfigReadsTheFourKeys(self) -> None:
        config = {
            IMAGE_KEY: "/images/disk.qcow2",
            KERNEL_KEY: "/boot/vmlinuz",
            INITRD_KEY: "/boot/initrd.img",
            APPEND_KEY: "console=ttyS0",
            "limits.memory": "512MiB",
        }
        self.assertEqual(
            BootSource.from_config(config),
            BootSource("/images/disk.qcow2", "/boot/vmlinuz", "/boot/initrd.img", "console=ttyS0"),
        )

    def test_emptyValuesAreUnset(self) -> None:
        config = {IMAGE_KEY: "", KERNEL_KEY: "", INITRD_KEY: "", APPEND_KEY: ""}
        self.assertEqual(BootSource.from_config(config), BootSource())

    def test_configRecordsOnlyTheSetParts(self) -> None:
        boot = BootSource(kernel="/boot/vmlinuz", append="quiet")
        self.assertEqual(boot.config(), {KERNEL_KEY: "/boot/vmlinuz", APPEND_KEY: "quiet"})

    def test_configRoundTrips(self) -> None:
        boot = BootSource("/d.qcow2", "/vmlinuz", "/initrd.img", "root=/dev/vda")
        self.assertEqual(BootSource.from_config(boot.config()), boot)

    def test_nothingToBootIsEmpty(self) -> None:
        self.assertTrue(BootSource().empty)

    def test_imageOrKernelIsSomethingToBoot(self) -> None:
        self.assertFalse(BootSource(image="/d.qcow2").empty)
        self.assertFalse(BootSource(kernel="/vmlinuz").empty)

    def test_describeNamesEachPart(self) -> None:
        boot = BootSource("/d.qcow2", "/vmlinuz", "/initrd.img", "root=/dev/vda rw")
        self.assertEqual(
            boot.describe(),
            "image /d.qcow2, kernel /vmlinuz, initrd /initrd.img, append 'root=/dev/vda rw'",
        )

    def test_describeSaysWhenThereIsNothing(self) -> None:
        self.assertEqual(BootSource().describe(), "nothing (no image, no kernel)")


class BootSourceShapeTests(SynchronousTestCase):
    """What ``check_shape`` refuses before any file is opened."""

    def assertRefused(self, boot: BootSource, message: str) -> None:
        with self.assertRaises(BadRequest) as caught:
            boot.check_shape()
        self.assertEqual(caught.exception.message, message)

    def test_absolutePathsAndAnAppendPass(self) -> None:
        BootSource("/d.qcow2", "/vmlinuz", "/initrd.img", "root=/dev/vda rw").check_shape()

    def test_relativeImagePathIsRefused(self) -> None:
        self.assertRefused(
            BootSource(image="disk.qcow2"),
            "Invalid boot.image 'disk.qcow2': expected an absolute path",
        )

    def test_relativeKernelPathIsRefused(self) -> None:
        self.assertRefused(
            BootSource(kernel="boot/vmlinuz"),
            "Invalid boot.kernel 'boot/vmlinuz': expected an absolute path",
        )

    def test_relativeInitrdPathIsRefused(self) -> None:
        self.assertRefused(
            BootSource(kernel="/vmlinuz", initrd="./initrd.img"),
            "Invalid boot.initrd './initrd.img': expected an absolute path",
        )

    def test_pathWithNulIsRefused(self) -> None:
        self.assertRefused(
            BootSource(image="/d.qcow2\0x"),
            "Invalid boot.image '/d.qcow2\\x00x': expected an absolute path",
        )

    def test_initrdWithoutKernelIsRefused(self) -> None:
        self.assertRefused(
            BootSource(image="/d.qcow2", initrd="/initrd.img"),
            "Invalid boot.initrd: it needs boot.kernel (a kernel to boot)",
        )

    def test_appendWithoutKernelIsRefused(self) -> None:
        self.assertRefused(
            BootSource(image="/d.qcow2", append="console=ttyS0"),
            "Invalid boot.append: it needs boot.kernel (a kernel to boot)",
        )

    def test_appendOfTheLongestKernelCommandLinePasses(self) -> None:
        BootSource(kernel="/vmlinuz", append="x" * MAX_APPEND_BYTES).check_shape()

    def test_overlongAppendIsRefused(self) -> None:
        self.assertRefused(
            BootSource(kernel="/vmlinuz", append="x" * 2048),
            "Invalid boot.append: 2048 bytes; a kernel command line holds at most 2047",
        )

    def test_appendIsMeasuredInUtf8Bytes(self) -> None:
        self.assertRefused(
            BootSource(kernel="/vmlinuz", append="é" * 1024),
            "Invalid boot.append: 2048 bytes; a kernel command line holds at most 2047",
        )

    def test_appendOnSeveralLinesIsRefused(self) -> None:
        self.assertRefused(
            BootSource(kernel="/vmlinuz", append="quiet\ninit=/bin/sh"),
            "Invalid boot.append: a kernel command line is one line",
        )


class FileKindTests(SynchronousTestCase):
    """What every file check says of a path that is not a regular file."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        os.makedirs(self.directory)

    def test_missingKernel(self) -> None:
        path = os.path.join(self.directory, "vmlinuz")
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertEqual(caught.exception.message, f"kernel {path} does not exist")

    def test_kernelThatIsADirectory(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_kernel(self.directory)
        self.assertEqual(
            caught.exception.message, f"kernel {self.directory} is a directory, not a file"
        )

    def test_kernelThatIsAFifo(self) -> None:
        path = os.path.join(self.directory, "fifo")
        os.mkfifo(path)
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertEqual(caught.exception.message, f"kernel {path} is not a regular file")

    def test_kernelThatIsADevice(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_kernel("/dev/null")
        self.assertEqual(caught.exception.message, "kernel /dev/null is not a regular file")

    def test_kernelBehindAPathThroughAFile(self) -> None:
        path = write(os.path.join(self.directory, "file"), b"x")
        with self.assertRaises(BadRequest) as caught:
            check_kernel(os.path.join(path, "vmlinuz"))
        self.assertEqual(
            caught.exception.message,
            f"kernel {path}/vmlinuz cannot be examined: Not a directory",
        )

    def test_missingInitrd(self) -> None:
        path = os.path.join(self.directory, "initrd.img")
        with self.assertRaises(BadRequest) as caught:
            check_initrd(path)
        self.assertEqual(caught.exception.message, f"initrd {path} does not exist")

    def test_initrdThatIsADirectory(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_initrd(self.directory)
        self.assertEqual(
            caught.exception.message, f"initrd {self.directory} is a directory, not a file"
        )

    def test_missingRawImage(self) -> None:
        path = os.path.join(self.directory, "disk.raw")
        with self.assertRaises(BadRequest) as caught:
            check_raw_image(path)
        self.assertEqual(
            caught.exception.message, f"image {path} cannot be read: No such file or directory"
        )


class KernelTests(SynchronousTestCase):
    """A kernel must be a Linux bzImage."""

    def setUp(self) -> None:
        self.directory = self.mktemp()

    def test_bzImageIsAKernel(self) -> None:
        check_kernel(fake_kernel(os.path.join(self.directory, "vmlinuz")))

    def test_elfKernelWithAPvhEntryIsAKernel(self) -> None:
        check_kernel(write(os.path.join(self.directory, "vmlinux"), fake_pvh_kernel()))

    def test_elfWithoutAPvhEntryIsRefused(self) -> None:
        path = write(os.path.join(self.directory, "vmlinux"), fake_pvh_kernel(pvh=False))
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertEqual(
            caught.exception.message,
            f"kernel {path} is an ELF file without a PVH entry note: QEMU boots an "
            "uncompressed kernel only through PVH (use the bzImage, /boot/vmlinuz-*)",
        )

    def test_textFileIsNotAKernel(self) -> None:
        path = write(os.path.join(self.directory, "notes.txt"), b"not a kernel\n" * 100)
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertEqual(
            caught.exception.message,
            f"kernel {path} is not a Linux kernel: no bzImage header "
            "(expected a vmlinuz such as /boot/vmlinuz-*)",
        )

    def test_emptyFileIsNotAKernel(self) -> None:
        path = write(os.path.join(self.directory, "vmlinuz"), b"")
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertIn("is not a Linux kernel: no bzImage header", caught.exception.message)

    def test_diskWithABootSectorIsNotAKernel(self) -> None:
        path = write(os.path.join(self.directory, "disk.raw"), mbr_disk())
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertIn(f"kernel {path} is not a Linux kernel", caught.exception.message)

    def test_kernelCutShortBeforeItsSetupHeaderIsNotAKernel(self) -> None:
        whole = fake_kernel(os.path.join(self.directory, "whole"))
        with open(whole, "rb") as f:
            head = f.read(0x204)
        path = write(os.path.join(self.directory, "vmlinuz"), head)
        with self.assertRaises(BadRequest) as caught:
            check_kernel(path)
        self.assertIn("is not a Linux kernel", caught.exception.message)


class InitrdTests(SynchronousTestCase):
    """An initrd must be an initramfs: cpio, plain or compressed as the kernel unpacks it."""

    def setUp(self) -> None:
        self.directory = self.mktemp()

    def test_everyFormatTheKernelUnpacksIsAccepted(self) -> None:
        magics = {
            "gzip": b"\x1f\x8b\x08\x00",
            "zstd": b"\x28\xb5\x2f\xfd",
            "xz": b"\xfd7zXZ\x00",
            "lz4-legacy": b"\x02\x21\x4c\x18",
            "lz4": b"\x04\x22\x4d\x18",
            "bzip2": b"BZh9",
            "lzma": b"\x5d\x00\x00\x80",
            "lzo": b"\x89LZO\x00",
            "cpio-newc": b"070701",
            "cpio-crc": b"070702",
            "cpio-odc": b"070707",
        }
        for name, magic in magics.items():
            check_initrd(write(os.path.join(self.directory, name), magic + b"\x00" * 64))

    def test_emptyInitrdIsRefused(self) -> None:
        path = write(os.path.join(self.directory, "initrd.img"), b"")
        with self.assertRaises(BadRequest) as caught:
            check_initrd(path)
        self.assertEqual(caught.exception.message, f"initrd {path} is empty")

    def test_textFileIsNotAnInitramfs(self) -> None:
        path = write(os.path.join(self.directory, "initrd.img"), b"#!/bin/sh\necho hi\n")
        with self.assertRaises(BadRequest) as caught:
            check_initrd(path)
        self.assertEqual(
            caught.exception.message,
            f"initrd {path} is not an initramfs: neither a cpio archive nor one compressed "
            "with gzip, zstd, xz, lz4, bzip2, lzma or lzo",
        )

    def test_kernelIsNotAnInitramfs(self) -> None:
        path = fake_kernel(os.path.join(self.directory, "vmlinuz"))
        with self.assertRaises(BadRequest) as caught:
            check_initrd(path)
        self.assertIn("is not an initramfs", caught.exception.message)


class RawImageTests(SynchronousTestCase):
    """A raw image must hold a partition table or a filesystem, whole."""

    def setUp(self) -> None:
        self.directory = self.mktemp()

    def raw(self, data: bytes, name: str = "disk.raw") -> str:
        return write(os.path.join(self.directory, name), data)

    def assertRefused(self, path: str) -> str:
        with self.assertRaises(BadRequest) as caught:
            check_raw_image(path)
        message: str = caught.exception.message
        return message

    def test_diskWithAnMBRIsAccepted(self) -> None:
        self.assertEqual(check_raw_image(self.raw(mbr_disk())), "an MBR partition table")

    def test_diskWithAGPTIsNamedGPT(self) -> None:
        self.assertEqual(check_raw_image(self.raw(gpt_disk())), "a GPT partition table")

    def test_extFilesystemIsAccepted(self) -> None:
        self.assertEqual(check_raw_image(self.raw(ext_filesystem())), "an ext2/3/4 filesystem")

    def test_ext4MadeByMkfsIsAccepted(self) -> None:
        if shutil.which("mkfs.ext4") is None:
            self.skipTest("mkfs.ext4 is not installed (Debian: apt-get install e2fsprogs)")
        path = self.raw(b"", "rootfs.ext4")
        os.truncate(path, MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", path], capture_output=True, check=True)
        self.assertEqual(check_raw_image(path), "an ext2/3/4 filesystem")

    def test_otherFilesystemsAreAccepted(self) -> None:
        signatures = {
            "an XFS filesystem": (0, b"XFSB"),
            "a btrfs filesystem": (0x10040, b"_BHRfS_M"),
            "an ISO 9660 filesystem": (0x8001, b"CD001"),
            "a squashfs filesystem": (0, b"hsqs"),
        }
        for what, (offset, magic) in signatures.items():
            path = self.raw(bytes(put(blank(MIB), offset, magic)), what.replace(" ", "-"))
            self.assertEqual(check_raw_image(path), what)

    def test_diskLargerThanItsPartitionsIsAccepted(self) -> None:
        path = self.raw(mbr_disk(2 * MIB, partition_end=MIB))
        self.assertEqual(check_raw_image(path), "an MBR partition table")

    def test_bootSectorWithoutPartitionEntriesIsAccepted(self) -> None:
        boot_code = put(put(blank(MIB), 0, b"\xeb\x3c\x90MSWIN4.1"), 446, b"\xfa\x33" * 32)
        path = self.raw(bytes(put(boot_code, 510, b"\x55\xaa")))
        self.assertEqual(check_raw_image(path), "an MBR partition table")

    def test_textFileIsNotADiskImage(self) -> None:
        path = self.raw(b"hello, world\n", "notes.txt")
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} is not a disk image: qemu-img reads it as raw, but it holds no "
            "partition table or filesystem (expected a qcow2 image, or a raw disk or "
            "filesystem image)",
        )

    def test_zeroedFileIsNotADiskImage(self) -> None:
        self.assertIn(NOT_A_DISK, self.assertRefused(self.raw(bytes(MIB))))

    def test_emptyFileIsNotADiskImage(self) -> None:
        self.assertIn(NOT_A_DISK, self.assertRefused(self.raw(b"")))

    def test_kernelIsNotADiskImage(self) -> None:
        path = fake_kernel(os.path.join(self.directory, "vmlinuz"))
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} is a Linux kernel, not a disk image (boot it as boot.kernel)",
        )

    def test_sizeThatIsNotWholeSectorsIsTruncated(self) -> None:
        path = self.raw(mbr_disk()[:-100])
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} holds an MBR partition table but its size ({MIB - 100} bytes) is "
            "not a multiple of 512: a truncated disk image",
        )

    def test_partitionPastTheEndIsTruncated(self) -> None:
        path = self.raw(mbr_disk(2 * MIB)[:MIB])
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} holds an MBR partition table of {2 * MIB} bytes but the file has "
            f"only {MIB}: a truncated disk image",
        )

    def test_gptDiskCutShortIsTruncated(self) -> None:
        path = self.raw(gpt_disk(MIB, disk_size=4 * MIB))
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} holds a GPT partition table of {4 * MIB} bytes but the file has "
            f"only {MIB}: a truncated disk image",
        )

    def test_filesystemShorterThanItsSuperblockSaysIsTruncated(self) -> None:
        path = self.raw(ext_filesystem(MIB, blocks=4096))
        self.assertEqual(
            self.assertRefused(path),
            f"image {path} holds an ext2/3/4 filesystem of {4 * MIB} bytes but the file has "
            f"only {MIB}: a truncated disk image",
        )

    def test_ext4MadeByMkfsAndCutShortIsTruncated(self) -> None:
        if shutil.which("mkfs.ext4") is None:
            self.skipTest("mkfs.ext4 is not installed (Debian: apt-get install e2fsprogs)")
        path = self.raw(b"", "rootfs.ext4")
        os.truncate(path, 2 * MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", path], capture_output=True, check=True)
        os.truncate(path, MIB)
        self.assertIn("a truncated disk image", self.assertRefused(path))


def qcow2_layer(
    path: str, backing: str | None = None, backing_format: str = "raw"
) -> dict[str, Any]:
    """One entry of ``qemu-img info --output=json --backing-chain``, as qemu-img 7.2 writes it."""
    layer: dict[str, Any] = {
        "virtual-size": MIB,
        "filename": path,
        "cluster-size": 65536,
        "format": "qcow2",
        "actual-size": 200704,
        "dirty-flag": False,
    }
    if backing is not None:
        layer |= {
            "backing-filename-format": backing_format,
            "full-backing-filename": backing,
            "backing-filename": os.path.basename(backing),
        }
    return layer


def raw_layer(path: str, image_format: str = "raw") -> dict[str, Any]:
    return {"virtual-size": MIB, "filename": path, "format": image_format, "actual-size": 4096}


def chain(*layers: dict[str, Any]) -> bytes:
    return json.dumps(list(layers), indent=4).encode()


class ParseImageInfoTests(SynchronousTestCase):
    """What ``parse_image_info`` makes of qemu-img's JSON."""

    def assertRefused(self, output: bytes) -> str:
        with self.assertRaises(BadRequest) as caught:
            parse_image_info("/images/top.qcow2", output)
        message: str = caught.exception.message
        return message

    def test_standaloneQcow2(self) -> None:
        info = parse_image_info("/images/top.qcow2", chain(qcow2_layer("/images/top.qcow2")))
        self.assertEqual(info, ImageInfo("/images/top.qcow2", "qcow2", MIB))

    def test_outputWithoutTheChainIsOneLayer(self) -> None:
        output = json.dumps(raw_layer("/images/disk.raw")).encode()
        self.assertEqual(
            parse_image_info("/images/disk.raw", output), ImageInfo("/images/disk.raw", "raw", MIB)
        )

    def test_backingChainIsListedNearestFirst(self) -> None:
        output = chain(
            qcow2_layer("/images/top.qcow2", "/images/middle.qcow2", "qcow2"),
            qcow2_layer("/images/middle.qcow2", "/images/base.raw"),
            raw_layer("/images/base.raw"),
        )
        info = parse_image_info("/images/top.qcow2", output)
        self.assertEqual(info.backing, ("/images/middle.qcow2", "/images/base.raw"))
        self.assertEqual(info.backing_formats, ("qcow2", "raw"))

    def test_backingIsNamedByTheFileQemuImgOpened(self) -> None:
        top = qcow2_layer("/images/top.qcow2")
        top["backing-filename"] = "base.raw"
        info = parse_image_info("/images/top.qcow2", chain(top, raw_layer("/images/base.raw")))
        self.assertEqual(info.backing, ("/images/base.raw",))

    def test_vmdkImageIsRefused(self) -> None:
        output = chain(raw_layer("/images/top.qcow2", "vmdk"))
        self.assertEqual(
            self.assertRefused(output),
            "image /images/top.qcow2 is a vmdk image; vmready boots qcow2 and raw images "
            "(convert it: qemu-img convert -O qcow2 …)",
        )

    def test_imageOfNoNamedFormatIsRefused(self) -> None:
        output = json.dumps([{"virtual-size": MIB, "filename": "/images/top.qcow2"}]).encode()
        self.assertIn("is an image of unknown format;", self.assertRefused(output))

    def test_vmdkBackingFileIsRefused(self) -> None:
        output = chain(
            qcow2_layer("/images/top.qcow2", "/images/base.vmdk", "vmdk"),
            raw_layer("/images/base.vmdk", "vmdk"),
        )
        self.assertEqual(
            self.assertRefused(output),
            "image /images/top.qcow2 is backed by /images/base.vmdk, a vmdk image; "
            "only qcow2 and raw backing files are followed",
        )

    def test_chainThatEndsInAnUnopenedBackingFileIsRefused(self) -> None:
        output = chain(qcow2_layer("/images/top.qcow2", "/images/gone.raw"))
        self.assertEqual(
            self.assertRefused(output),
            "image /images/top.qcow2: its backing chain points to /images/gone.raw, "
            "which is missing",
        )

    def test_imageOfNoSizeIsRefused(self) -> None:
        output = chain(raw_layer("/images/top.qcow2") | {"virtual-size": 0})
        self.assertEqual(
            self.assertRefused(output), "image /images/top.qcow2 has no usable size (0)"
        )

    def test_outputThatIsNotJsonIsQemuImgsFault(self) -> None:
        with self.assertRaises(HypervisorError) as caught:
            parse_image_info("/images/top.qcow2", b"qemu-img: oops")
        self.assertEqual(
            caught.exception.message,
            "qemu-img info /images/top.qcow2 answered something that is not JSON: "
            "b'qemu-img: oops'",
        )

    def test_outputOfAnotherShapeIsQemuImgsFault(self) -> None:
        for output in (b"[]", b"[1]", b'"qcow2"', b"null"):
            with self.assertRaises(HypervisorError) as caught:
                parse_image_info("/images/top.qcow2", output)
            self.assertIn("answered an unexpected shape", caught.exception.message)

    def test_describeSaysFormatSizeContentAndChain(self) -> None:
        info = ImageInfo(
            "/images/top.qcow2",
            "qcow2",
            2 << 30,
            ("/images/base.raw",),
            ("raw",),
            "an ext2/3/4 filesystem",
        )
        self.assertEqual(
            info.describe(),
            "qcow2 image /images/top.qcow2 (2.0 GiB, an ext2/3/4 filesystem, "
            "backed by /images/base.raw)",
        )

    def test_describeStandaloneImage(self) -> None:
        self.assertEqual(
            ImageInfo("/images/disk.qcow2", "qcow2", 1 << 30).describe(),
            "qcow2 image /images/disk.qcow2 (1.0 GiB)",
        )


class ImageToolTestCase(TestCase):
    """Runs the real qemu-img on images made in a fresh directory."""

    def setUp(self) -> None:
        require_program(self, QEMU_IMG, "qemu-utils")
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)
        self.tool = ImageTool(reactor)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def qcow2(self, name: str, backing: str | None = None, backing_format: str = "raw") -> str:
        """A qcow2 image (1 MiB, or on ``backing``)."""
        path = self.path(name)
        if backing is None:
            qemu_img("create", "-q", "-f", "qcow2", path, "1M")
        else:
            qemu_img("create", "-q", "-f", "qcow2", "-F", backing_format, "-b", backing, path)
        return path

    async def refusal(self, path: str) -> str:
        with self.assertRaises(BadRequest) as caught:
            await self.tool.info(path)
        message: str = caught.exception.message
        return message


class ImageToolInfoTests(ImageToolTestCase):
    """``ImageTool.info``: which images boot, and what is said of the others."""

    async def test_qcow2ImageIsDescribed(self) -> None:
        path = self.qcow2("disk.qcow2")
        self.assertEqual(await self.tool.info(path), ImageInfo(path, "qcow2", MIB))

    async def test_rawDiskIsDescribedWithWhatItHolds(self) -> None:
        path = write(self.path("disk.raw"), mbr_disk())
        self.assertEqual(
            await self.tool.info(path),
            ImageInfo(path, "raw", MIB, content="an MBR partition table"),
        )

    async def test_rawFilesystemIsAccepted(self) -> None:
        path = write(self.path("rootfs.raw"), ext_filesystem())
        self.assertEqual((await self.tool.info(path)).content, "an ext2/3/4 filesystem")

    async def test_qcow2OnARawDiskNamesItsChainAndContent(self) -> None:
        base = write(self.path("base.raw"), ext_filesystem())
        top = self.qcow2("top.qcow2", base)
        self.assertEqual(
            await self.tool.info(top),
            ImageInfo(top, "qcow2", MIB, (base,), ("raw",), "an ext2/3/4 filesystem"),
        )

    async def test_backingRecordedRelativeToItsImageIsChecked(self) -> None:
        base = write(self.path("base.raw"), b"hello, world\n")
        top = self.path("top.qcow2")
        qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "base.raw", top)
        self.assertIn(f"image {base} is not a disk image", await self.refusal(top))

    async def test_chainOfQcow2ImagesIsFollowed(self) -> None:
        base = self.qcow2("base.qcow2")
        middle = self.qcow2("middle.qcow2", base, "qcow2")
        top = self.qcow2("top.qcow2", middle, "qcow2")
        info = await self.tool.info(top)
        self.assertEqual(
            (info.backing, info.backing_formats), ((middle, base), ("qcow2", "qcow2"))
        )

    async def test_textFileIsNotADiskImage(self) -> None:
        path = write(self.path("notes.txt"), b"hello, world\n")
        self.assertEqual(
            await self.refusal(path),
            f"image {path} is not a disk image: qemu-img reads it as raw, but it holds no "
            "partition table or filesystem (expected a qcow2 image, or a raw disk or "
            "filesystem image)",
        )

    async def test_truncatedRawDiskIsRefused(self) -> None:
        path = write(self.path("disk.raw"), mbr_disk(2 * MIB)[:MIB])
        self.assertIn(f"image {path} holds an MBR partition table", await self.refusal(path))
        self.assertIn("a truncated disk image", await self.refusal(path))

    async def test_kernelIsNotADiskImage(self) -> None:
        path = fake_kernel(self.path("vmlinuz"))
        self.assertEqual(
            await self.refusal(path),
            f"image {path} is a Linux kernel, not a disk image (boot it as boot.kernel)",
        )

    async def test_emptyFileHasNoUsableSize(self) -> None:
        path = write(self.path("empty.raw"), b"")
        self.assertEqual(await self.refusal(path), f"image {path} has no usable size (0)")

    async def test_qcow2BackedByAMissingFileIsRefusedByName(self) -> None:
        base = write(self.path("base.raw"), mbr_disk())
        top = self.qcow2("top.qcow2", base)
        os.unlink(base)
        self.assertEqual(
            await self.refusal(top), f"image {top} is backed by {base}, which does not exist"
        )

    async def test_qcow2BackedByANetworkExportIsRefusedUnopened(self) -> None:
        top = self.path("top.qcow2")
        qemu_img(
            "create", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b", "nbd:127.0.0.1:1", top, "1M"
        )
        self.assertEqual(
            await self.refusal(top),
            f"image {top} is backed by 'nbd:127.0.0.1:1', which is not a local file; "
            "vmready follows only local backing files",
        )

    async def test_backingChainThatLoopsIsRefused(self) -> None:
        first, second = self.path("first.qcow2"), self.path("second.qcow2")
        qemu_img("create", "-q", "-f", "qcow2", first, "1M")
        qemu_img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", first, second)
        qemu_img("rebase", "-q", "-u", "-F", "qcow2", "-b", second, first)
        self.assertEqual(
            await self.refusal(second), f"image {second}: its backing chain loops back to {second}"
        )

    async def test_qcow2BackedByATextFileIsRefused(self) -> None:
        base = write(self.path("notes.txt"), b"hello, world\n")
        top = self.qcow2("top.qcow2", base)
        self.assertIn(f"image {base} is not a disk image", await self.refusal(top))

    async def test_qcow2BackedByATruncatedDiskIsRefused(self) -> None:
        base = write(self.path("base.raw"), ext_filesystem(MIB, blocks=2048))
        top = self.qcow2("top.qcow2", base)
        self.assertEqual(
            await self.refusal(top),
            f"image {base} holds an ext2/3/4 filesystem of {2 * MIB} bytes but the file has "
            f"only {MIB}: a truncated disk image",
        )

    async def test_qcow2BackedByADeviceIsRefused(self) -> None:
        top = self.path("top.qcow2")
        qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/dev/null", top, "1M")
        self.assertEqual(
            await self.refusal(top),
            f"image {top} is backed by /dev/null, which is not a regular file",
        )

    async def test_vmdkImageIsRefused(self) -> None:
        path = self.path("disk.vmdk")
        qemu_img("create", "-q", "-f", "vmdk", path, "1M")
        self.assertEqual(
            await self.refusal(path),
            f"image {path} is a vmdk image; vmready boots qcow2 and raw images "
            "(convert it: qemu-img convert -O qcow2 …)",
        )

    async def test_qcow2BackedByAVmdkImageIsRefused(self) -> None:
        base = self.path("base.vmdk")
        qemu_img("create", "-q", "-f", "vmdk", base, "1M")
        top = self.qcow2("top.qcow2", base, "vmdk")
        self.assertEqual(
            await self.refusal(top),
            f"image {top} is backed by {base}, a vmdk image; "
            "only qcow2 and raw backing files are followed",
        )

    async def test_missingImage(self) -> None:
        path = self.path("disk.qcow2")
        self.assertEqual(await self.refusal(path), f"image {path} does not exist")

    async def test_imageThatIsADirectory(self) -> None:
        self.assertEqual(
            await self.refusal(self.directory),
            f"image {self.directory} is a directory, not a file",
        )

    async def test_imageThatIsAFifo(self) -> None:
        path = self.path("fifo")
        os.mkfifo(path)
        self.assertEqual(await self.refusal(path), f"image {path} is not a regular file")

    async def test_imageIsNotWrittenByTheCheck(self) -> None:
        path = write(self.path("disk.raw"), mbr_disk())
        before = os.stat(path)
        await self.tool.info(path)
        after = os.stat(path)
        self.assertEqual((after.st_size, after.st_mtime_ns), (before.st_size, before.st_mtime_ns))

    async def test_missingQemuImgIsAHypervisorError(self) -> None:
        program = self.path("bin/qemu-img")
        path = self.qcow2("disk.qcow2")
        with self.assertRaises(HypervisorError) as caught:
            await ImageTool(reactor, program).info(path)
        self.assertEqual(
            caught.exception.message,
            f"{program} is not installed; it makes and checks disk overlays "
            "(Debian: apt-get install qemu-utils)",
        )

    async def test_qemuImgKilledBySignalIsAHypervisorError(self) -> None:
        # A stand-in that dies as a qemu-img killed by the OOM killer would.
        program = write(self.path("bin/qemu-img"), b"#!/bin/sh\necho dying >&2\nkill -KILL $$\n")
        os.chmod(program, 0o755)
        path = self.qcow2("disk.qcow2")
        with self.assertRaises(HypervisorError) as caught:
            await ImageTool(reactor, program).info(path)
        self.assertEqual(
            caught.exception.message, f"{program} info did not finish: killed by SIGKILL: dying"
        )


class CreateOverlayTests(ImageToolTestCase):
    """``ImageTool.create_overlay``: a fresh qcow2 on the image, made atomically."""

    def setUp(self) -> None:
        super().setUp()
        self.overlay = self.path("disks/vm1.qcow2")

    async def overlay_on(self, image: str) -> ImageInfo:
        info = await self.tool.info(image)
        await self.tool.create_overlay(info, self.overlay)
        return info

    async def test_overlayIsAQcow2BackedByTheImage(self) -> None:
        image = self.qcow2("base.qcow2")
        await self.overlay_on(image)
        made = image_info(self.overlay)
        self.assertEqual(
            (made["format"], made["backing-filename"], made["backing-filename-format"]),
            ("qcow2", image, "qcow2"),
        )

    async def test_overlayOfARawImageRecordsItsFormat(self) -> None:
        image = write(self.path("rootfs.raw"), ext_filesystem())
        await self.overlay_on(image)
        made = image_info(self.overlay)
        self.assertEqual(
            (made["backing-filename"], made["backing-filename-format"], made["virtual-size"]),
            (image, "raw", MIB),
        )

    async def test_overlayPassesTheImageCheck(self) -> None:
        image = write(self.path("disk.raw"), mbr_disk())
        await self.overlay_on(image)
        self.assertEqual(
            await self.tool.info(self.overlay),
            ImageInfo(self.overlay, "qcow2", MIB, (image,), ("raw",), "an MBR partition table"),
        )

    async def test_overlayIsReadableByItsOwnerOnly(self) -> None:
        await self.overlay_on(self.qcow2("base.qcow2"))
        self.assertEqual(stat.S_IMODE(os.stat(self.overlay).st_mode), 0o600)

    async def test_overlayDirectoryIsMadePrivate(self) -> None:
        await self.overlay_on(self.qcow2("base.qcow2"))
        self.assertEqual(stat.S_IMODE(os.stat(self.path("disks")).st_mode), 0o700)

    async def test_successLeavesOnlyTheOverlay(self) -> None:
        await self.overlay_on(self.qcow2("base.qcow2"))
        self.assertEqual(left_in(self.path("disks")), ["vm1.qcow2"])

    async def test_imageIsNeverWritten(self) -> None:
        image = self.qcow2("base.qcow2")
        with open(image, "rb") as f:
            before = hashlib.sha256(f.read()).hexdigest()
        await self.overlay_on(image)
        with open(image, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), before)

    async def test_existingOverlayIsReplaced(self) -> None:
        write(self.overlay, b"the old overlay, written by a guest\n")
        image = self.qcow2("base.qcow2")
        await self.overlay_on(image)
        made = image_info(self.overlay)
        self.assertEqual((made["format"], made["backing-filename"]), ("qcow2", image))

    async def test_overlayOnAnotherImageReplacesTheFirst(self) -> None:
        await self.overlay_on(self.qcow2("first.qcow2"))
        second = write(self.path("second.raw"), mbr_disk())
        await self.overlay_on(second)
        self.assertEqual(image_info(self.overlay)["backing-filename"], second)

    async def test_partialOverlayLeftByACrashIsReplaced(self) -> None:
        write(self.overlay + ".tmp", b"half an overlay")
        await self.overlay_on(self.qcow2("base.qcow2"))
        self.assertEqual(left_in(self.path("disks")), ["vm1.qcow2"])

    async def test_failureSaysQemuImgsWords(self) -> None:
        image = self.qcow2("base.qcow2")
        info = await self.tool.info(image)
        os.unlink(image)
        with self.assertRaises(HypervisorError) as caught:
            await self.tool.create_overlay(info, self.overlay)
        message = caught.exception.message
        self.assertTrue(
            message.startswith(
                f"qemu-img could not create the overlay {self.overlay} on {image}: "
            ),
            message,
        )
        self.assertIn(f"Could not open '{image}'", message)

    async def test_failureLeavesNoPartialFile(self) -> None:
        image = self.qcow2("base.qcow2")
        info = await self.tool.info(image)
        os.unlink(image)
        with self.assertRaises(HypervisorError):
            await self.tool.create_overlay(info, self.overlay)
        self.assertEqual(left_in(self.path("disks")), [])

    async def test_failureKeepsTheExistingOverlay(self) -> None:
        write(self.overlay, b"the old overlay")
        image = self.qcow2("base.qcow2")
        info = await self.tool.info(image)
        os.unlink(image)
        with self.assertRaises(HypervisorError):
            await self.tool.create_overlay(info, self.overlay)
        self.assertEqual(left_in(self.path("disks")), ["vm1.qcow2"])
        with open(self.overlay, "rb") as f:
            self.assertEqual(f.read(), b"the old overlay")


class CheckFilesTests(SynchronousTestCase):
    """``check_files``: what is checked without qemu-img (the daemon's default source, launch)."""

    def setUp(self) -> None:
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)
        self.kernel = fake_kernel(self.path("vmlinuz"))
        self.initrd = write(self.path("initrd.img"), b"\x1f\x8b\x08\x00" + bytes(60))

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def test_kernelBootIsAccepted(self) -> None:
        check_files(BootSource(kernel=self.kernel, initrd=self.initrd, append="console=ttyS0"))

    def test_shapeIsCheckedFirst(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_files(BootSource(image="disk.qcow2"))
        self.assertEqual(
            caught.exception.message, "Invalid boot.image 'disk.qcow2': expected an absolute path"
        )

    def test_kernelThatIsNotAKernelIsRefused(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_files(BootSource(kernel=self.initrd))
        self.assertIn(f"kernel {self.initrd} is not a Linux kernel", caught.exception.message)

    def test_initrdThatIsNotAnInitramfsIsRefused(self) -> None:
        with self.assertRaises(BadRequest) as caught:
            check_files(BootSource(kernel=self.kernel, initrd=self.kernel))
        self.assertIn(f"initrd {self.kernel} is not an initramfs", caught.exception.message)

    def test_missingImageIsRefused(self) -> None:
        path = self.path("disk.qcow2")
        with self.assertRaises(BadRequest) as caught:
            check_files(BootSource(image=path))
        self.assertEqual(caught.exception.message, f"image {path} does not exist")

    def test_anOverlayOfTheDaemonIsNotAnImage(self) -> None:
        disks = self.path("disks")
        overlay = write(os.path.join(disks, "4f3c2d1e.qcow2"), b"QFI\xfb")
        with self.assertRaises(BadRequest) as caught:
            check_files(BootSource(image=overlay), forbidden_dir=disks)
        self.assertEqual(
            caught.exception.message,
            f"image {overlay} is an instance's disk overlay; boot its image instead",
        )

    def test_imagesOutsideTheOverlayDirectoryAreFine(self) -> None:
        image = write(self.path("disks-of-mine.raw"), mbr_disk())
        check_files(BootSource(image=image), forbidden_dir=self.path("disks"))
