"""The demo guest's agent started by its initramfs and adopted by systemd, its script run for real.

``vmready-agent-early`` runs with ``sh`` against a fake guest under a temporary
root (``VMREADY_TEST_ROOT``: its /proc, /sys/fs/cgroup, /run and /usr): the
loader's setup and the guest's ``python3`` are small fakes that write down
what they were given, and the processes the script looks at are the fake
``/proc/PID/comm`` files the tests write.  A real guest boots it in
``tests/endtoend/test_real_guest.py``, where systemd adopts the agent.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from vmready.guestfiles import loader_files
from vmready.hypervisor.guestimage.content import BUSYBOX_APPLETS, INIT_SCRIPT, KERNEL_APPEND
from vmready.hypervisor.guestimage.earlyagent import (
    EARLY_AGENT_DROPIN,
    EARLY_AGENT_PATH,
    EARLY_AGENT_SCRIPT,
    PIDFILE,
)
from vmready.hypervisor.guestimage.inputs import image_files

UNIT_CGROUP = "/system.slice/vmready-agent.service"

# The loader's setup: says it ran, what the PID file held then, and fails on request.
SETUP = """#!/bin/sh
echo "pidfile=$(cat "$VMREADY_TEST_ROOT/run/vmready-agent.pid" 2>/dev/null)" >>"$FAKE/setup-calls"
echo "$PATH" >"$FAKE/setup-path"
[ ! -e "$FAKE/setup-fails" ] || { echo "vmready-agent-setup: no config drive" >&2; exit 1; }
"""

# The guest's python3: its PID and arguments, then it runs on a little, as the agent would.
PYTHON = """#!/bin/sh
echo "$$ $*" >>"$FAKE/python-calls"
"""


class FakeGuest:
    """A guest tree for ``vmready-agent-early``: the script, fakes, /proc and the unit's cgroup."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.base = os.path.abspath(test.mktemp())
        self.root = os.path.join(self.base, "guest")
        self.fake = os.path.join(self.base, "fake")
        os.makedirs(self.fake)
        for directory in ("run", "proc/self", "sys/fs/cgroup" + UNIT_CGROUP):
            os.makedirs(os.path.join(self.root, directory))
        self.put("proc/self/cgroup", f"0::{UNIT_CGROUP}\n")
        self.put("sys/fs/cgroup" + UNIT_CGROUP + "/cgroup.procs", "")
        self.script(EARLY_AGENT_PATH, EARLY_AGENT_SCRIPT)
        self.script("/usr/local/lib/vmready/vmready-agent-setup", SETUP)
        self.script("/usr/bin/python3", PYTHON)

    def path(self, guest_path: str) -> str:
        return os.path.join(self.root, guest_path.lstrip("/"))

    def put(self, guest_path: str, text: str) -> None:
        path = self.path(guest_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def read(self, guest_path: str) -> str:
        with open(self.path(guest_path)) as f:
            return f.read()

    def script(self, guest_path: str, text: str) -> None:
        self.put(guest_path, text)
        os.chmod(self.path(guest_path), 0o755)

    def process(self, pid: int, comm: str) -> None:
        """A process of the guest as /proc shows it: its PID and the program it runs."""
        self.put(f"/proc/{pid}/comm", comm + "\n")

    def fail_setup(self) -> None:
        """The loader's setup fails from now on, as it does without a config drive."""
        with open(os.path.join(self.fake, "setup-fails"), "w") as f:
            f.write("as without a config drive\n")

    def fake_file(self, name: str) -> str:
        try:
            with open(os.path.join(self.fake, name)) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def run(
        self, *args: str, tries: int | None = None, path: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        environ = dict(os.environ, VMREADY_TEST_ROOT=self.root, FAKE=self.fake)
        if tries is not None:
            environ["VMREADY_EARLY_TRIES"] = str(tries)
        if path is not None:
            environ["PATH"] = path
        return subprocess.run(
            ["sh", self.path(EARLY_AGENT_PATH), *args],
            env=environ,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def python_calls(self) -> list[list[str]]:
        """Each fake python3's run, once it has written it: its PID, then its arguments."""
        deadline = time.monotonic() + 10
        while not self.fake_file("python-calls") and time.monotonic() < deadline:
            time.sleep(0.01)
        return [line.split() for line in self.fake_file("python-calls").splitlines()]


AGENT_ARGS = [
    "-S",
    "-I",
    "/run/vmready-agent/vmready-agent.pyz",
    "--config-drive",
    "/run/vmready-agent",
]


class BootTests(SynchronousTestCase):
    """``boot``: run by the initramfs, it says who it is, copies the drive, becomes the agent."""

    def test_itWritesItsPIDBeforeTheSetupThenBecomesTheAgent(self) -> None:
        guest = FakeGuest(self)
        done = guest.run("boot")
        self.assertEqual(done.returncode, 0, done.stderr)
        pid = guest.read(PIDFILE).strip()
        self.assertEqual(guest.fake_file("setup-calls"), f"pidfile={pid}\n")
        # The same process: exec'd, not started beside it.
        self.assertEqual(guest.python_calls(), [[pid, *AGENT_ARGS]])

    def test_itRunsWithTheServicesPathNotTheInitramfss(self) -> None:
        guest = FakeGuest(self)
        done = guest.run("boot", path="/bin")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(
            guest.fake_file("setup-path"), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin\n"
        )

    def test_aFailedSetupLeavesNoPIDFileAndNoAgent(self) -> None:
        guest = FakeGuest(self)
        guest.fail_setup()
        done = guest.run("boot")
        self.assertEqual(done.returncode, 1)
        self.assertIn("vmready-agent-setup: no config drive", done.stderr)
        self.assertIn(
            "vmready-agent-early: the agent's setup failed; "
            "systemd's vmready-agent.service tries again",
            done.stderr,
        )
        self.assertFalse(os.path.exists(guest.path(PIDFILE)))
        self.assertEqual(guest.fake_file("python-calls"), "")

    def test_withoutAModeItSaysHowToRunIt(self) -> None:
        done = FakeGuest(self).run()
        self.assertEqual(done.returncode, 2)
        self.assertEqual(done.stderr, "usage: vmready-agent-early boot|start\n")


class StartTests(SynchronousTestCase):
    """``start``: systemd's unit adopts the agent started at boot, or starts one."""

    def test_theRunningAgentMovesIntoTheUnitsCgroup(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "4242\n")
        guest.process(4242, "python3")
        done = guest.run("start")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(guest.read(f"/sys/fs/cgroup{UNIT_CGROUP}/cgroup.procs"), "4242\n")
        self.assertEqual(
            done.stderr,
            "vmready-agent-early: the agent started at boot (process 4242) is this unit's now\n",
        )
        # systemd reads the PID from the file: it stays, and nothing else ran.
        self.assertEqual(guest.read(PIDFILE), "4242\n")
        self.assertEqual(guest.fake_file("setup-calls"), "")
        self.assertEqual(guest.fake_file("python-calls"), "")

    def test_withoutTheCgroupSystemdStillHasThePID(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "4242\n")
        guest.process(4242, "python3")
        os.unlink(guest.path(f"/sys/fs/cgroup{UNIT_CGROUP}/cgroup.procs"))
        os.rmdir(guest.path(f"/sys/fs/cgroup{UNIT_CGROUP}"))
        done = guest.run("start")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(
            "warning: cannot move the agent started at boot (process 4242) into this unit's "
            "cgroup; systemd supervises it by its PID",
            done.stderr,
        )
        self.assertEqual(guest.read(PIDFILE), "4242\n")
        self.assertEqual(guest.fake_file("python-calls"), "")

    def assertStartsAnAgent(self, guest: FakeGuest) -> None:
        done = guest.run("start")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(guest.fake_file("setup-calls"), "pidfile=\n")
        [[pid, *args]] = guest.python_calls()
        self.assertEqual(args, AGENT_ARGS)
        # Started beside the script, its PID for systemd in the file.
        self.assertEqual(guest.read(PIDFILE), f"{pid}\n")

    def test_noAgentStartedAtBootStartsOne(self) -> None:
        self.assertStartsAnAgent(FakeGuest(self))

    def test_anAgentGoneIsNotAdopted(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "4242\n")  # no /proc/4242: it exited
        self.assertStartsAnAgent(guest)

    def test_aPIDTakenByAnotherProgramIsNotAdopted(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "4242\n")
        guest.process(4242, "bash")
        self.assertStartsAnAgent(guest)
        self.assertEqual(guest.read(f"/sys/fs/cgroup{UNIT_CGROUP}/cgroup.procs"), "")

    def test_aGarbledPIDFileIsNotAdopted(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "42x\n")
        self.assertStartsAnAgent(guest)

    def test_anAgentStillInItsSetupIsWaitedFor(self) -> None:
        guest = FakeGuest(self)
        guest.put(PIDFILE, "4242\n")
        guest.process(4242, "vmready-agent-e")  # comm: the script's name, cut to 15
        becomes = threading.Timer(0.5, guest.process, (4242, "python3"))
        becomes.start()
        self.addCleanup(becomes.cancel)
        done = guest.run("start")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(guest.read(f"/sys/fs/cgroup{UNIT_CGROUP}/cgroup.procs"), "4242\n")
        self.assertEqual(guest.fake_file("python-calls"), "")

    def test_anAgentStuckInItsSetupIsStoppedAndAnotherStarted(self) -> None:
        guest = FakeGuest(self)
        stuck = subprocess.Popen(["sleep", "60"])
        self.addCleanup(stuck.kill)
        guest.put(PIDFILE, f"{stuck.pid}\n")
        guest.process(stuck.pid, "vmready-agent-e")
        done = guest.run("start", tries=3)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(
            f"the agent started at boot (process {stuck.pid}) is still in its setup; stopping it",
            done.stderr,
        )
        self.assertEqual(stuck.wait(10), -15)
        [[pid, *_]] = guest.python_calls()
        self.assertEqual(guest.read(PIDFILE), f"{pid}\n")

    def test_aFailedSetupFailsTheUnit(self) -> None:
        guest = FakeGuest(self)
        guest.fail_setup()
        done = guest.run("start")
        self.assertEqual(done.returncode, 1)
        self.assertIn("vmready-agent-setup: no config drive", done.stderr)
        self.assertEqual(guest.fake_file("python-calls"), "")


class WiringTests(SynchronousTestCase):
    """The initramfs, the unit's drop-in and the image agree on the script and its PID file."""

    def test_theInitramfsStartsTheScriptAndWaitsForItsPIDFile(self) -> None:
        self.assertIn(f"early={EARLY_AGENT_PATH}\n", INIT_SCRIPT)
        self.assertIn('chroot /newroot nice -n -10 "$early" boot', INIT_SCRIPT)
        self.assertIn(f"pidfile=/newroot{PIDFILE}\n", INIT_SCRIPT)
        self.assertIn("chroot", BUSYBOX_APPLETS)

    def test_noKernelPatchingWhileTheAgentRunsBesideSystemd(self) -> None:
        # systemd's first memory cgroups would turn kernel-memory and socket accounting
        # on, patching the allocator while the early agent runs in it: under TCG both
        # vCPUs then spun there (1 boot in about 12; none in 62 with this).
        self.assertIn(" cgroup.memory=nokmem,nosocket", KERNEL_APPEND)

    def test_theUnitAdoptsThePIDTheScriptNames(self) -> None:
        self.assertIn("Type=forking\n", EARLY_AGENT_DROPIN)
        self.assertIn(f"PIDFile={PIDFILE}\n", EARLY_AGENT_DROPIN)
        # The loader's setup and agent command are replaced, not run besides.
        self.assertIn("ExecStartPre=\nExecStart=\n", EARLY_AGENT_DROPIN)
        self.assertIn(f"ExecStart={EARLY_AGENT_PATH} start\n", EARLY_AGENT_DROPIN)

    def test_theWaitForAStuckSetupEndsBeforeSystemdGivesUpOnTheUnit(self) -> None:
        tenths = re.search(r"STARTING_TRIES=\$\{VMREADY_EARLY_TRIES:-(\d+)\}", EARLY_AGENT_SCRIPT)
        timeout = re.search(
            r"^TimeoutStartSec=(\d+)$",
            loader_files()["systemd/vmready-agent.service"].decode(),
            re.MULTILINE,
        )
        assert tenths is not None and timeout is not None
        # With time left for a setup of its own after stopping the stuck one.
        self.assertLessEqual(int(tenths.group(1)) / 10, int(timeout.group(1)) - 10)

    def test_theImageCarriesBoth(self) -> None:
        files = image_files()
        self.assertEqual(files["demo/vmready-agent-early"], EARLY_AGENT_SCRIPT.encode())
        self.assertEqual(files["demo/vmready-demo-early.conf"], EARLY_AGENT_DROPIN.encode())
