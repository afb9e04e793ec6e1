"""vmready.hypervisor.console: boot marks, the size cap, and reading the tail of the log."""

from __future__ import annotations

import os
import stat

from twisted.trial.unittest import SynchronousTestCase

from vmready.hypervisor.console import console_size, mark_boot, read_console, rotate_console

MARK = b"\n--- vmready: starting vm1: TCG ---\n"


class ConsoleTestCase(SynchronousTestCase):
    """A console log in a run directory of its own."""

    def setUp(self) -> None:
        self.run_dir = self.mktemp()
        os.makedirs(self.run_dir)
        self.log = os.path.join(self.run_dir, "console.log")
        self.rotated = self.log + ".1"

    def guest_writes(self, data: bytes) -> None:
        """Append as QEMU does (O_APPEND)."""
        with open(self.log, "ab") as f:
            f.write(data)

    def contents(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()


class ConsoleSizeTests(ConsoleTestCase):
    """How much the log holds (the sign of life a KVM trial watches for)."""

    def test_missingLogHoldsNothing(self) -> None:
        self.assertEqual(console_size(self.log), 0)

    def test_sizeIsTheBytesWritten(self) -> None:
        self.guest_writes(b"Linux version 6.1.0\n")
        self.assertEqual(console_size(self.log), 20)


class MarkBootTests(ConsoleTestCase):
    """Every boot starts with a line of the daemon's own."""

    def test_markIsALineOfItsOwn(self) -> None:
        mark_boot(self.log, "starting vm1: TCG")
        self.assertEqual(self.contents(self.log), MARK)

    def test_markFollowsWhatTheGuestWrote(self) -> None:
        self.guest_writes(b"reboot: Power down")
        mark_boot(self.log, "starting vm1: TCG")
        self.assertEqual(self.contents(self.log), b"reboot: Power down" + MARK)

    def test_markReturnsTheSizeAfterIt(self) -> None:
        self.guest_writes(b"x" * 100)
        self.assertEqual(mark_boot(self.log, "starting vm1: TCG"), 100 + len(MARK))

    def test_returnedSizeIsWhereTheGuestsOutputBegins(self) -> None:
        since = mark_boot(self.log, "starting vm1: TCG")
        self.guest_writes(b"Linux version 6.1.0\n")
        self.assertEqual(self.contents(self.log)[since:], b"Linux version 6.1.0\n")

    def test_markMakesAPrivateRunDirectory(self) -> None:
        log = os.path.join(self.run_dir, "vm2", "console.log")
        mark_boot(log, "starting vm2: KVM")
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(log)).st_mode), 0o700)


class RotateConsoleTests(ConsoleTestCase):
    """Past its cap the log's tail moves to ``console.log.1`` and the log starts again."""

    def test_missingLogIsNotRotated(self) -> None:
        self.assertFalse(rotate_console(self.log, 10))
        self.assertEqual(os.listdir(self.run_dir), [])

    def test_logUnderItsCapIsNotRotated(self) -> None:
        self.guest_writes(b"x" * 9)
        self.assertFalse(rotate_console(self.log, 10))
        self.assertEqual(
            (self.contents(self.log), os.listdir(self.run_dir)), (b"x" * 9, ["console.log"])
        )

    def test_logAtItsCapIsNotRotated(self) -> None:
        self.guest_writes(b"x" * 10)
        self.assertFalse(rotate_console(self.log, 10))

    def test_logPastItsCapIsRotated(self) -> None:
        self.guest_writes(b"0123456789A")
        self.assertTrue(rotate_console(self.log, 10))

    def test_rotatedLogIsEmptied(self) -> None:
        self.guest_writes(b"0123456789A")
        rotate_console(self.log, 10)
        self.assertEqual(self.contents(self.log), b"")

    def test_rotatedPartKeepsTheTail(self) -> None:
        self.guest_writes(b"0123456789A")
        rotate_console(self.log, 10)
        self.assertEqual(self.contents(self.rotated), b"123456789A")

    def test_logFarPastItsCapKeepsOnlyItsCapInTheRotatedPart(self) -> None:
        self.guest_writes(b"old boot\n" * 1000 + b"the end\n")
        rotate_console(self.log, 16)
        self.assertEqual(self.contents(self.rotated), b"old boot\nthe end\n"[-16:])

    def test_rotationReplacesTheEarlierRotatedPart(self) -> None:
        self.guest_writes(b"first boot\n")
        rotate_console(self.log, 5)
        self.guest_writes(b"second boot\n")
        rotate_console(self.log, 5)
        self.assertEqual(self.contents(self.rotated), b"boot\n")

    def test_rotationLeavesNoPartialFile(self) -> None:
        self.guest_writes(b"0123456789A")
        rotate_console(self.log, 10)
        self.assertEqual(sorted(os.listdir(self.run_dir)), ["console.log", "console.log.1"])

    def test_guestCarriesOnAtTheStartOfTheEmptiedLog(self) -> None:
        with open(self.log, "ab", buffering=0) as qemu:
            qemu.write(b"before the rotation\n")
            rotate_console(self.log, 10)
            qemu.write(b"after\n")
        self.assertEqual(self.contents(self.log), b"after\n")


class ReadConsoleTests(ConsoleTestCase):
    """The tail of the console output, across the rotation."""

    def test_logNeverWrittenReadsEmpty(self) -> None:
        self.assertEqual(read_console(self.log, 100), b"")

    def test_runDirectoryNeverMadeReadsEmpty(self) -> None:
        self.assertEqual(read_console(os.path.join(self.run_dir, "gone", "console.log"), 10), b"")

    def test_wholeLogUnderTheLimit(self) -> None:
        self.guest_writes(b"Linux version 6.1.0\n")
        self.assertEqual(read_console(self.log, 100), b"Linux version 6.1.0\n")

    def test_tailOfTheLogOverTheLimit(self) -> None:
        self.guest_writes(b"0123456789")
        self.assertEqual(read_console(self.log, 4), b"6789")

    def test_rotatedPartComesFirst(self) -> None:
        self.guest_writes(b"first boot\n")
        rotate_console(self.log, 5)
        self.guest_writes(b"second boot\n")
        self.assertEqual(read_console(self.log, 100), b"boot\nsecond boot\n")

    def test_limitBoundsRotatedAndCurrentTogether(self) -> None:
        self.guest_writes(b"0123456789")
        rotate_console(self.log, 5)
        self.guest_writes(b"abcdef")
        self.assertEqual(read_console(self.log, 8), b"89abcdef")

    def test_limitWithinTheCurrentLogSkipsTheRotatedPart(self) -> None:
        self.guest_writes(b"0123456789")
        rotate_console(self.log, 5)
        self.guest_writes(b"abcdef")
        self.assertEqual(read_console(self.log, 3), b"def")

    def test_rotatedPartAloneIsRead(self) -> None:
        self.guest_writes(b"0123456789")
        rotate_console(self.log, 5)
        self.assertEqual(read_console(self.log, 100), b"56789")

    def test_zeroLimitReadsNothing(self) -> None:
        self.guest_writes(b"0123456789")
        self.assertEqual(read_console(self.log, 0), b"")
