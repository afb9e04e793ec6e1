"""Tests for vmready.agent.memory: the workload's Ready, remembered for this boot."""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.memory import PENDING_FILE, READY_FILE, ReadyMemory


class ReadyMemoryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.base = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.state_dir = os.path.join(self.base, "run", "vmready-agent")

    def test_nothingRememberedAtFirst(self) -> None:
        self.assertFalse(ReadyMemory(self.state_dir).is_ready())

    def test_readyIsRemembered(self) -> None:
        memory = ReadyMemory(self.state_dir)
        memory.remember(True)
        self.assertTrue(memory.is_ready())

    def test_aHeldStateIsKeptUntilTheHostAcceptsOne(self) -> None:
        memory = ReadyMemory(self.state_dir)
        self.assertIsNone(memory.pending())
        memory.hold("Ready")
        self.assertEqual(ReadyMemory(self.state_dir).pending(), "Ready")  # an agent restart too
        self.assertFalse(memory.is_ready())  # not before the host has it
        memory.hold("Started")
        self.assertEqual(memory.pending(), "Started")
        memory.remember(False)
        self.assertIsNone(memory.pending())

    def test_onlyTheWorkloadsStatesAreHeld(self) -> None:
        memory = ReadyMemory(self.state_dir)
        self.assertRaises(ValueError, memory.hold, "Frozen")
        os.makedirs(self.state_dir, exist_ok=True)
        with open(os.path.join(self.state_dir, PENDING_FILE), "wb") as f:
            f.write(b"\xff garbage")
        self.assertIsNone(memory.pending())

    def test_readySurvivesAnAgentRestart(self) -> None:
        ReadyMemory(self.state_dir).remember(True)
        self.assertTrue(ReadyMemory(self.state_dir).is_ready())

    def test_startedForgetsReady(self) -> None:
        memory = ReadyMemory(self.state_dir)
        memory.remember(True)
        memory.remember(False)
        self.assertFalse(ReadyMemory(self.state_dir).is_ready())

    def test_startedWithoutReadyIsHarmless(self) -> None:
        ReadyMemory(self.state_dir).remember(False)
        self.assertFalse(os.path.exists(self.state_dir))

    def test_stateDirIsCreatedOwnerOnly(self) -> None:
        ReadyMemory(self.state_dir).remember(True)
        self.assertEqual(os.stat(self.state_dir).st_mode & 0o777, 0o700)

    def test_onlyTheReadyFileIsLeftBehind(self) -> None:
        memory = ReadyMemory(self.state_dir)
        memory.remember(True)
        memory.remember(True)
        self.assertEqual(os.listdir(self.state_dir), [READY_FILE])

    def test_aLeftoverOfAKilledAgentIsWrittenOver(self) -> None:
        # An agent killed mid-write left its temporary file; a new one with the same PID
        # (another boot) writes over it and leaves only the state.
        os.makedirs(self.state_dir)
        leftover = os.path.join(self.state_dir, f".ready-{os.getpid()}.tmp")
        with open(leftover, "wb") as f:
            f.write(b"half a")
        ReadyMemory(self.state_dir).hold("Ready")
        self.assertEqual(os.listdir(self.state_dir), [PENDING_FILE])
        self.assertEqual(ReadyMemory(self.state_dir).pending(), "Ready")

    def test_aSymlinkInPlaceOfTheTemporaryIsNotFollowed(self) -> None:
        os.makedirs(self.state_dir)
        target = os.path.join(self.base, "elsewhere")
        os.symlink(target, os.path.join(self.state_dir, f".ready-{os.getpid()}.tmp"))
        self.assertRaises(OSError, ReadyMemory(self.state_dir).remember, True)
        self.assertFalse(os.path.exists(target))
