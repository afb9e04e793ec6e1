"""Tests for fakeqemu._qcow2 and fakeqemu.testing.write_qcow2: the header as QEMU 7.2 reads it."""

from __future__ import annotations

import os
import struct
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._qcow2 import ImageError, Qcow2Header, parse_qcow2_header
from fakeqemu.testing import write_qcow2
from tests.conformance.support import require_program


class Qcow2HeaderTests(SynchronousTestCase):
    """parse_qcow2_header on images write_qcow2 makes (qemu-img's layout)."""

    def image(self, **kwargs: object) -> bytes:
        """The bytes of an image write_qcow2 makes with ``kwargs``."""
        path = self.mktemp()
        write_qcow2(path, **kwargs)  # type: ignore[arg-type]
        with open(path, "rb") as f:
            return f.read()

    def test_plainImage(self) -> None:
        self.assertEqual(
            parse_qcow2_header(self.image(size=1 << 30)), Qcow2Header(3, 16, 1 << 30, None, None)
        )

    def test_backingFileAndFormat(self) -> None:
        header = parse_qcow2_header(
            self.image(backing_file="../base.qcow2", backing_format="qcow2")
        )
        self.assertEqual((header.backing_file, header.backing_format), ("../base.qcow2", "qcow2"))

    def test_backingFileWithoutFormat(self) -> None:
        header = parse_qcow2_header(self.image(backing_file="/images/base.img"))
        self.assertEqual((header.backing_file, header.backing_format), ("/images/base.img", None))

    def test_version2HasNoHeaderLengthField(self) -> None:
        data = bytearray(self.image())
        struct.pack_into(">I", data, 4, 2)
        struct.pack_into(">I", data, 100, 0)  # past v2's 72 bytes: not read
        self.assertEqual(parse_qcow2_header(bytes(data)).version, 2)

    def test_shortFileReadsAsZeros(self) -> None:
        error = self.assertRaises(ImageError, parse_qcow2_header, b"QFI\xfb")
        self.assertEqual(str(error), "Unsupported qcow2 version 0")

    def test_notQcow2(self) -> None:
        error = self.assertRaises(ImageError, parse_qcow2_header, b"hello\n")
        self.assertEqual(str(error), "Image is not in qcow2 format")

    def test_encryptedImagesAreNotOpened(self) -> None:
        # fakeqemu's own refusal: QEMU would ask for the secret.
        data = bytearray(self.image())
        struct.pack_into(">I", data, 32, 2)
        error = self.assertRaises(ImageError, parse_qcow2_header, bytes(data))
        self.assertEqual(str(error), "fakeqemu does not open encrypted qcow2 images")


class WriteQcow2Tests(SynchronousTestCase):
    """write_qcow2's images are ones real QEMU accepts (checked where qemu-img is installed)."""

    def qemu_img(self) -> str:
        """qemu-img, or skip: this checks the helper against the real tool."""
        return require_program(self, "qemu-img", "qemu-utils")

    def test_qemuImgChecksTheImageClean(self) -> None:
        qemu_img = self.qemu_img()
        directory = self.mktemp()
        os.makedirs(directory)
        base = os.path.join(directory, "base.qcow2")
        overlay = os.path.join(directory, "overlay.qcow2")
        write_qcow2(base, size=2 << 30)
        write_qcow2(overlay, backing_file="base.qcow2", backing_format="qcow2")
        checks = [
            subprocess.run([qemu_img, "check", path], capture_output=True, text=True)
            for path in (base, overlay)
        ]
        info = subprocess.run(
            [qemu_img, "info", "--output=json", overlay], capture_output=True, text=True
        )
        self.assertEqual(
            ([c.returncode for c in checks], '"backing-filename": "base.qcow2"' in info.stdout),
            ([0, 0], True),
        )

    def test_headerMatchesQemuImgsBytes(self) -> None:
        qemu_img = self.qemu_img()
        directory = self.mktemp()
        os.makedirs(directory)
        ours, theirs = os.path.join(directory, "ours"), os.path.join(directory, "theirs")
        write_qcow2(ours)
        subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", theirs, "16M"], check=True)
        with open(ours, "rb") as a, open(theirs, "rb") as b:
            self.assertEqual(a.read(104), b.read(104))
