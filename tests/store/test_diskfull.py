"""The store on a disk that fills up: writes retried, nothing lost, failures said clearly.

A real small filesystem (a tmpfs of a few hundred KiB, mounted for the test,
which needs root) filled by a file: SQLite itself then reports "database or
disk is full", through the real database thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import tempfile
from typing import Any

from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, TestCase

from tests.reactor import reactor
from vmready.store.asyncstore import AsyncStore
from vmready.store.executor import DatabaseThread, StoreHealth, StoreWriteFailed
from vmready.store.sqlite import Store

# Bigger than whatever room SQLite's files keep: this write needs new blocks.
_LARGE = "x" * 200_000


def small_filesystem(test: TestCase, size: str) -> str:
    """A real filesystem of ``size`` (tmpfs), unmounted after the test; skips without root."""
    if os.geteuid() != 0:
        raise SkipTest("mounting a small tmpfs needs root; run as root to test a full disk")
    root = tempfile.mkdtemp(prefix="vmr-full-", dir="/tmp")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", root],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        os.rmdir(root)
        raise SkipTest(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def unmount() -> None:
        subprocess.run(["umount", root], check=False)
        os.rmdir(root)

    test.addCleanup(unmount)
    return root


def fill(root: str) -> str:
    """Fill the filesystem with one file; returns it (remove it to free the space)."""
    filler = os.path.join(root, "filler")
    with contextlib.suppress(OSError), open(filler, "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return filler


def committed(path: str, name: str) -> dict[str, str]:
    """The instance's config as committed on disk, read on a connection of its own."""
    connection = sqlite3.connect(path)
    try:
        row = connection.execute("SELECT config FROM instances WHERE name = ?", (name,)).fetchone()
    finally:
        connection.close()
    return dict(json.loads(row[0]))


class DiskFullTests(TestCase):
    def setUp(self) -> None:
        root = small_filesystem(self, "1m")
        self.path = os.path.join(root, "vmready.sqlite")
        engine = Store.open(self.path)
        engine.instances.create_instance("vm1", {}, {})
        self.store = AsyncStore.threaded(reactor, engine)
        self.addCleanup(self.store.close)
        self.root = root
        self.changes: list[str | None] = []

        def changed(health: StoreHealth) -> None:
            self.changes.append(health.error)

        self.store.health.subscribe(changed)

    async def test_aWriteOnAFullDiskWaitsAndLandsOnceThereIsSpace(self) -> None:
        filler = fill(self.root)
        written = self.store.instances.update_config("vm1", {"user.big": _LARGE})
        after = self.store.instances.update_config(
            "vm1", {"user.after": "1"}
        )  # waits behind it, in order
        while not self.changes:
            await deferLater(reactor, 0.02, lambda: None)
        self.assertIn("disk is full", self.changes[0] or "")
        self.assertIsNotNone(self.store.health.failing_since)
        self.assertFalse(written.called)
        self.assertNotIn("user.big", self.store.view.get_instance("vm1").config)
        os.unlink(filler)
        record = await written
        self.assertEqual(record.config["user.big"], _LARGE)
        self.assertEqual((await after).config["user.after"], "1")
        self.assertEqual(committed(self.path, "vm1")["user.after"], "1")
        self.assertIsNone(self.store.health.failing_since)
        self.assertEqual(self.changes[-1], None)  # recovered, and said so

    async def test_aDiskStillFullAfterTheRetriesFailsTheCallsAndKeepsNothing(self) -> None:
        executor = self.store.executor
        assert isinstance(executor, DatabaseThread)
        executor.retry_for = 0.3
        filler = fill(self.root)
        failed = self.store.instances.update_config("vm1", {"user.big": _LARGE})
        error: Any = await self.assertFailure(failed, StoreWriteFailed)
        self.assertIn("database or disk is full", error.message)
        self.assertIn("nothing of this change was kept", error.message)
        self.assertEqual(error.http_status, 503)
        self.assertNotIn("user.big", self.store.view.get_instance("vm1").config)
        self.assertNotIn("user.big", committed(self.path, "vm1"))
        self.assertIsNotNone(self.store.health.failing_since)
        os.unlink(filler)
        record = await self.store.instances.update_config("vm1", {"user.big": _LARGE})
        self.assertEqual(record.config["user.big"], _LARGE)
        self.assertIsNone(self.store.health.failing_since)
