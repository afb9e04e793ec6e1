"""Tests for vmready.domain.config: an instance's name, its config keys, memory and CPUs."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from vmready.domain.config import (
    config_changes,
    config_updates,
    is_launch_key,
    parse_cpus,
    parse_memory,
    restored_config,
    snapshot_config,
    validate_config,
    validate_name,
)
from vmready.domain.model import BadRequest


class NameTests(SynchronousTestCase):
    """Instance names as LXD allows them."""

    def test_lettersDigitsAndInnerHyphensAreANameUpTo63(self) -> None:
        for name in ("a", "web-1", "a" * 63):
            validate_name(name)

    def test_anythingElseIsRefusedSayingWhatANameIs(self) -> None:
        for name in ("", "1web", "web-", "we_b", "a" * 64, "wéb"):
            error = self.assertRaises(BadRequest, validate_name, name)
            self.assertIn("use 1-63 letters, digits and hyphens", error.message)


class LimitTests(SynchronousTestCase):
    """limits.memory in MiB (or with a unit), limits.cpu a count."""

    def test_memoryUnitsAreMiBOrGiB(self) -> None:
        self.assertEqual(
            [parse_memory(v) for v in ("512", "512MiB", "2GiB", "2G", " 64 MB ", 16)],
            [512, 512, 2048, 2048, 64, 16],
        )

    def test_memoryOutOfRangeNamesTheRange(self) -> None:
        error = self.assertRaises(BadRequest, parse_memory, "8")
        self.assertEqual(error.message, "Invalid limits.memory '8': must be 16 MiB to 1048576 MiB")

    def test_cpusAreACountFrom1To64(self) -> None:
        self.assertEqual([parse_cpus(v) for v in ("1", " 64 ", 2)], [1, 64, 2])
        for value in ("0", "65", "+1", "1_0", "two"):
            self.assertRaises(BadRequest, parse_cpus, value)


class ConfigTests(SynchronousTestCase):
    """Which keys a user sets, and how a change removes one."""

    def test_valuesAreTextAndLimitsNormalised(self) -> None:
        self.assertEqual(
            validate_config({"limits.memory": "1GiB", "limits.cpu": 2, "user.role": "db"}),
            {"limits.memory": "1024", "limits.cpu": "2", "user.role": "db"},
        )

    def test_anUnknownKeyIsRefusedListingTheAllowedOnes(self) -> None:
        error = self.assertRaises(BadRequest, validate_config, {"volatile.x": "1"})
        self.assertIn("allowed are limits.memory, limits.cpu, user.*", error.message)

    def test_aRemovalIsAllowedWhereSettingIs(self) -> None:
        self.assertEqual(
            config_changes({"user.role": None, "limits.cpu": None}),
            {"user.role": None, "limits.cpu": None},
        )
        self.assertRaises(BadRequest, config_changes, {"volatile.x": None})

    def test_theBootSourceAndAcceleratorAreLaunchKeys(self) -> None:
        self.assertEqual(
            [is_launch_key(k) for k in ("boot.image", "boot.accel", "user.boot", "limits.cpu")],
            [True, True, False, False],
        )


class SnapshotConfigTests(SynchronousTestCase):
    """A snapshot keeps what users set; a restore brings it back over the volatile keys."""

    def test_aSnapshotKeepsUserKeysOnly(self) -> None:
        config = {"user.role": "db", "limits.cpu": "2", "volatile.accel": "tcg"}
        self.assertEqual(snapshot_config(config), {"user.role": "db", "limits.cpu": "2"})

    def test_aRestoreReplacesUserKeysAndKeepsVolatileOnes(self) -> None:
        current = {"user.role": "web", "user.extra": "x", "volatile.accel": "kvm"}
        saved = {"config": {"user.role": "db", "volatile.accel": "tcg"}}
        restored = restored_config(current, saved)
        self.assertEqual(restored, {"volatile.accel": "kvm", "user.role": "db"})
        self.assertEqual(
            config_updates(current, restored), {"user.extra": None, "user.role": "db"}
        )
