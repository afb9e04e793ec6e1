"""The main job (``./dev run``) as a user runs it: a real fakeqemu VM and the handshake."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase


class DemoTests(SynchronousTestCase):
    """``python -m vmready.demo`` walks STARTED → CONNECT → CONNECTED and shuts the VM down."""

    def test_demoCompletesTheHandshakeAndShutsDown(self) -> None:
        workdir = tempfile.mkdtemp(prefix="vmr-demo-", dir="/tmp")
        self.addCleanup(shutil.rmtree, workdir, True)
        result = subprocess.run(
            [sys.executable, "-m", "vmready.demo", "--workdir", workdir, "--name", "t1"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        steps = [line.strip() for line in result.stdout.splitlines()]
        expected = [
            "QMP: query-status → running",
            "ring buffer: agent says STARTED",
            "host: wrote 'CONNECT 2:49152' with ringbuf-write",
            "guest: received 'CONNECT 2:49152'; reports CONNECTED",
            "ring buffer: our own CONNECT 2:49152 echoed back, skipped",
            "ring buffer: agent says CONNECTED",
            "host: agent link is CONNECTED",
            "QMP events seen: SHUTDOWN",
            "vmready demo: VM shut down cleanly",
        ]
        positions = [steps.index(line) for line in expected]
        self.assertEqual(positions, sorted(positions))
        self.assertFalse(os.path.exists(os.path.join(workdir, "vm.pid")))
