"""The main job (``./dev run``) as a user runs it: a real fakeqemu VM and the handshake."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.processes import kill_if_named


def assertInOrder(case: SynchronousTestCase, lines: list[str], expected: list[str]) -> None:
    """Each expected line is among ``lines``, in the order given."""
    positions = [lines.index(line) for line in expected]
    case.assertEqual(positions, sorted(positions))


class DemoTests(SynchronousTestCase):
    """``python -m vmready.daemon.demo`` walks STARTED → CONNECT → CONNECTED, then shuts down."""

    def test_demoCompletesTheHandshakeAndShutsDown(self) -> None:
        workdir = tempfile.mkdtemp(prefix="vmr-demo-", dir="/tmp")
        self.addCleanup(shutil.rmtree, workdir, True)
        result = subprocess.run(
            [sys.executable, "-m", "vmready.daemon.demo", "--workdir", workdir, "--name", "t1"],
            capture_output=True,
            text=True,
            # A hang guard, not a speed check: a loaded 2-core machine takes minutes.
            timeout=600,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        steps = [line.strip() for line in result.stdout.splitlines()]
        expected = [
            "QMP: query-status → running",
            "guest: agent opened /dev/virtio-ports/com.canonical.lxd and vmready.connect",
            "ring buffer: agent says STARTED",
            "host: wrote 'CONNECT 2:49152' to vmready.connect",
            "guest: received 'CONNECT 2:49152'; reports CONNECTED",
            "ring buffer: agent says CONNECTED",
            "host: agent link is CONNECTED",
            "QMP events seen: VSERPORT_CHANGE, VSERPORT_CHANGE, SHUTDOWN",
            "vmready demo: VM shut down cleanly",
        ]
        assertInOrder(self, steps, expected)
        self.assertFalse(os.path.exists(os.path.join(workdir, "vm.pid")))


class RunDemoTests(SynchronousTestCase):
    """``./dev run``: the daemon on its defaults and a demo instance that reaches READY."""

    def setUp(self) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="vmr-run-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.data_dir, True)
        self.addCleanup(self._kill_vms)

    def _kill_vms(self) -> None:
        run = os.path.join(self.data_dir, "run")
        for entry in os.listdir(run) if os.path.isdir(run) else []:
            for pidfile in (
                os.path.join(run, entry, "vm.pid"),
                os.path.join(run, entry, "guest", "agent.pid"),
            ):
                if not os.path.exists(pidfile):
                    continue
                with open(pidfile) as f:
                    try:
                        kill_if_named(int(f.read().strip()), run)
                    except (OSError, ValueError):
                        continue

    def run_demo(self) -> list[str]:
        # Its own session, so that a hang's cleanup ends the daemon it started too (left
        # running, that daemon would hold trial's pipes open and trial would never end);
        # no stdin, so that nothing it starts holds trial's.
        demo = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vmready.daemon.rundemo",
                "--data-dir",
                self.data_dir,
                "--exit",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            # A hang guard, not a speed check: a loaded 2-core machine takes minutes.
            out, err = demo.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            out, err = demo.communicate()
            self.fail(f"./dev run did not end within 600 s:\n{out}{err}")
        self.assertEqual(demo.returncode, 0, out + err)
        return out.splitlines()

    def test_firstRunLaunchesDemoAndItsAgentMakesItReady(self) -> None:
        lines = self.run_demo()
        steps = [
            "$ vmready launch demo --memory 256 --cpus 1",
            "demo: RUNNING",
            "demo: agent CONNECTED",
            "$ vmready-agent notify ready   # in the guest, by its workload",
            "demo: READY",
        ]
        assertInOrder(self, lines, steps)
        row = next(line for line in lines if line.startswith("demo "))
        self.assertEqual(row.split(), ["demo", "READY", "256MiB", "1"])

    def test_secondRunReadoptsTheVMAndItsAgentReReportsReady(self) -> None:
        self.run_demo()
        lines = self.run_demo()
        outlived = [line for line in lines if line.endswith("its VM outlived the last daemon")]
        self.assertEqual(len(outlived), 1, lines)
        self.assertNotIn("$ vmready launch demo --memory 256 --cpus 1", lines)
        self.assertIn("vmready: demo is READY again: its agent re-reported Ready by itself", lines)
        self.assertNotIn("$ vmready-agent notify ready   # in the guest, by its workload", lines)
        row = next(line for line in lines if line.startswith("demo "))
        self.assertEqual(row.split(), ["demo", "READY", "256MiB", "1"])


class HostPackagesTests(SynchronousTestCase):
    """``./dev run --hypervisor qemu`` names (or installs) what real guests need, the kernel's
    toolchain included."""

    def test_withoutRootItSaysWhatToInstall(self) -> None:
        from vmready.daemon import rundemo
        from vmready.hypervisor import guestimage

        self.patch(shutil, "which", lambda tool: None if tool == "socat" else f"/usr/bin/{tool}")
        self.patch(guestimage, "missing_build_packages", lambda: ["libelf-dev", "flex"])
        self.patch(os, "geteuid", lambda: 1000)
        with self.assertRaises(SystemExit) as caught:
            rundemo.ensure_host_packages()
        self.assertEqual(
            str(caught.exception),
            "vmready: real guests need flex, libelf-dev, socat; install them with: "
            "sudo apt-get install -y --no-install-recommends flex libelf-dev socat",
        )
