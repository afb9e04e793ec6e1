"""``lxc`` 5.0 (Debian's lxd-client), unchanged, against ``twistd vmready`` with fakeqemu VMs.

Each test runs the real binary through ``LXD_SOCKET`` and checks what it
printed and the state the daemon was left in (through ``lxc`` and through
``vmready``).  See ``tests/lxdclients/support.py``.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import time

import yaml
from twisted.trial.unittest import SynchronousTestCase

import vmready
from tests.lxdclients.support import Lxc
from tests.system import DEADLINE, READY_KEY, System


class LxcTestCase(SynchronousTestCase):
    """A daemon, and ``lxc`` pointed at it."""

    def setUp(self) -> None:
        self.system = System(self)
        self.lxc = Lxc(self, self.system)
        self.system.start_daemon()

    def launch(self, name: str = "c1") -> None:
        """``lxc launch NAME --empty --vm``: created and started."""
        self.lxc.run("launch", name, "--empty", "--vm")

    def assertListedAfter(self, status: str, *command: str) -> None:
        """``lxc COMMAND``, after which the daemon lists c1 as ``status``."""
        self.lxc.run(*command)
        self.assertEqual(self.system.listed_status("c1"), status)


class ListTests(LxcTestCase):
    """``lxc list``: the table, the formats, columns and filters."""

    def test_listShowsInstancesInEveryFormat(self) -> None:
        self.launch("c1")
        self.lxc.run("init", "c2", "--empty", "--vm")
        table = self.lxc.out("list")
        self.assertIn("| c1   | RUNNING |", table)
        self.assertIn("| c2   | STOPPED |", table)
        listed = json.loads(self.lxc.out("list", "--format", "json"))
        self.assertEqual(
            [(i["name"], i["status"]) for i in listed], [("c1", "Running"), ("c2", "Stopped")]
        )
        self.assertEqual(listed[0]["state"]["status"], "Running")
        from_yaml = yaml.safe_load(self.lxc.out("list", "--format", "yaml"))
        self.assertEqual([i["name"] for i in from_yaml], ["c1", "c2"])
        self.assertEqual(
            self.lxc.out("list", "--format", "csv", "-c", "ns"), "c1,RUNNING\nc2,STOPPED\n"
        )

    def test_listFiltersByStatus(self) -> None:
        self.launch("c1")
        self.lxc.run("init", "c2", "--empty", "--vm")
        self.assertEqual(
            self.lxc.out("list", "status=running", "-c", "n", "--format", "csv"), "c1\n"
        )
        self.assertEqual(
            self.lxc.out("list", "status=stopped", "-c", "n", "--format", "csv"), "c2\n"
        )


class PowerTests(LxcTestCase):
    """``lxc init``, ``launch``, ``start``, ``stop``, ``restart``, ``pause``: each as it says."""

    def test_initCreatesAStoppedInstance(self) -> None:
        self.lxc.run("init", "c1", "--empty", "--vm")
        self.assertEqual(self.lxc.status("c1"), "STOPPED")
        self.assertEqual(self.system.listed_status("c1"), "STOPPED")

    def test_launchCreatesAndStarts(self) -> None:
        self.launch("c1")
        self.assertEqual(self.lxc.status("c1"), "RUNNING")
        self.assertEqual(self.system.listed_status("c1"), "RUNNING")

    def test_stopStartAndForcedStop(self) -> None:
        self.launch("c1")
        self.assertListedAfter("STOPPED", "stop", "c1")
        self.assertListedAfter("RUNNING", "start", "c1")
        self.lxc.run("stop", "c1", "--force")
        self.assertEqual(self.lxc.status("c1"), "STOPPED")

    def test_restartLeavesItRunning(self) -> None:
        self.launch("c1")
        self.lxc.run("restart", "c1")
        self.assertEqual(self.system.listed_status("c1"), "RUNNING")
        # lxc pads the description column to its longest entry.
        self.assertRegex(
            self.lxc.out("operation", "list"), r"\| Restart instance c1 +\| SUCCESS +\|"
        )

    def test_pauseThenStartUnfreezes(self) -> None:
        self.launch("c1")
        self.lxc.run("pause", "c1")
        self.assertEqual(self.lxc.status("c1"), "FROZEN")
        self.assertListedAfter("RUNNING", "start", "c1")


class InfoTests(LxcTestCase):
    """``lxc info``, its log, the console log, ``lxc query``, ``lxc version``."""

    def test_infoShowsTheInstance(self) -> None:
        self.launch("c1")
        info = self.lxc.out("info", "c1")
        self.assertIn("Name: c1\n", info)
        self.assertIn("Status: RUNNING\n", info)
        self.assertIn("Type: virtual-machine\n", info)

    def test_infoShowLogAndConsoleShowLogShowTheConsole(self) -> None:
        self.launch("c1")
        self.assertIn("--- vmready: starting c1", self.lxc.out("info", "c1", "--show-log"))
        self.assertIn("--- vmready: starting c1", self.lxc.out("console", "c1", "--show-log"))

    def test_queryAnswersTheServer(self) -> None:
        server = json.loads(self.lxc.out("query", "/1.0"))
        self.assertIn("instances", server["api_extensions"])
        self.assertEqual(server["environment"]["server"], "vmready")

    def test_versionIsTheDaemonsAndTheCLIs(self) -> None:
        self.assertIn(f"Server version: {vmready.__version__}\n", self.lxc.out("version"))
        self.assertEqual(self.system.cli("--version").stdout, f"vmready {vmready.__version__}\n")


class ConfigTests(LxcTestCase):
    """``lxc config show/get/set/unset/edit``: PUT of the whole instance, with its ETag."""

    def test_configSetGetUnset(self) -> None:
        self.launch("c1")
        self.lxc.run("config", "set", "c1", "user.role", "web")
        self.assertEqual(self.lxc.out("config", "get", "c1", "user.role"), "web\n")
        self.assertEqual(self.system.info("c1")["config"]["user.role"], "web")
        self.lxc.run("config", "unset", "c1", "user.role")
        self.assertNotIn("user.role", self.system.info("c1")["config"])

    def test_configShowAndEditFromStdin(self) -> None:
        self.launch("c1")
        shown = yaml.safe_load(self.lxc.out("config", "show", "c1"))
        self.assertEqual((shown["architecture"], shown["profiles"]), ("x86_64", ["default"]))
        shown["config"]["user.tier"] = "gold"
        self.lxc.run("config", "edit", "c1", stdin=yaml.safe_dump(shown))
        self.assertEqual(self.lxc.out("config", "get", "c1", "user.tier"), "gold\n")

    def test_aRefusedEditSaysWhy(self) -> None:
        self.launch("c1")
        shown = yaml.safe_load(self.lxc.out("config", "show", "c1"))
        shown["ephemeral"] = True
        refused = self.lxc.run("config", "edit", "c1", stdin=yaml.safe_dump(shown), check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("ephemeral instances (not supported by vmready)", refused.stderr)


class SnapshotRenameDeleteTests(LxcTestCase):
    """``lxc snapshot``/``restore``/``rename``/``delete``."""

    def test_snapshotAndRestore(self) -> None:
        self.launch("c1")
        self.lxc.run("config", "set", "c1", "user.v", "1")
        self.lxc.run("snapshot", "c1", "s1")
        self.lxc.run("config", "set", "c1", "user.v", "2")
        self.assertIn("| s1   |", self.lxc.out("info", "c1"))
        self.lxc.run("restore", "c1", "s1")
        self.assertEqual(self.lxc.out("config", "get", "c1", "user.v"), "1\n")

    def test_renameAStoppedInstance(self) -> None:
        self.lxc.run("init", "c1", "--empty", "--vm")
        self.lxc.run("rename", "c1", "c2")
        self.assertEqual(self.lxc.out("list", "-c", "n", "--format", "csv"), "c2\n")

    def test_deleteAndForcedDelete(self) -> None:
        self.lxc.run("init", "c1", "--empty", "--vm")
        self.launch("c2")
        self.lxc.run("delete", "c1")
        refused = self.lxc.run("delete", "c2", check=False)
        self.assertIn("stop it first or pass --force", refused.stderr)
        self.lxc.run("delete", "c2", "--force")
        self.assertEqual(self.lxc.out("list", "--format", "csv"), "")


class OperationAndMonitorTests(LxcTestCase):
    """``lxc operation list/show`` and ``lxc monitor`` (the events WebSocket)."""

    def test_operationListAndShow(self) -> None:
        self.launch("c1")
        listed = self.lxc.out("operation", "list", "--format", "csv")
        start = [line for line in listed.splitlines() if "Start instance c1" in line]
        self.assertEqual(len(start), 1, listed)
        operation_id = start[0].split(",")[0]
        shown = yaml.safe_load(self.lxc.out("operation", "show", operation_id))
        self.assertEqual((shown["status"], shown["description"]), ("Success", "Start instance c1"))

    def test_monitorSeesInstanceReady(self) -> None:
        self.launch("c1")
        _assert_monitor_sees_ready(self, self.lxc, self.system)
        self.assertEqual(self.system.info("c1")["config"][READY_KEY], "true")


class UnsupportedTests(LxcTestCase):
    """What vmready does not do answers in LXD's error shape, saying so."""

    def test_execFileAndImagesAreNotSupported(self) -> None:
        self.launch("c1")
        for args in (
            ("exec", "c1", "--", "true"),
            ("file", "pull", "c1/etc/hosts", "-"),
            ("image", "list"),
        ):
            refused = self.lxc.run(*args, check=False)
            self.assertNotEqual(refused.returncode, 0)
            self.assertIn("not supported by vmready", refused.stderr, args)

    def test_onlyTheEmptyDefaultProfile(self) -> None:
        profile = yaml.safe_load(self.lxc.out("profile", "show", "default"))
        self.assertEqual((profile["config"], profile["devices"]), ({}, {}))
        refused = self.lxc.run("profile", "create", "p2", check=False)
        self.assertIn("not supported by vmready", refused.stderr)


class RemoteTests(SynchronousTestCase):
    """``lxc remote add`` over HTTPS with a trust token, then ``lxc`` through that remote."""

    def setUp(self) -> None:
        self.system = System(self)
        self.lxc = Lxc(self, self.system)
        # Nothing through the unix socket: every request goes to the remote.
        self.lxc.env["LXD_SOCKET"] = os.path.join(self.system.directory, "no-such.sock")
        self.system.start_daemon("--https-address", "127.0.0.1:0")

    def token(self, name: str) -> str:
        """``vmready config trust add NAME`` on the daemon's host: the token's text."""
        return self.system.cli("config", "trust", "add", name).stdout.splitlines()[-1]

    def trusted_names(self) -> list[str]:
        listed = json.loads(self.system.cli("config", "trust", "list", "--format", "json").stdout)
        return [entry["name"] for entry in listed]

    def test_remoteAddWithATokenTrustsLxcForEveryCommand(self) -> None:
        self.lxc.run("remote", "add", "vmr", self.token("laptop"))
        self.assertEqual(self.trusted_names(), ["laptop"])
        self.assertEqual(self.lxc.out("list", "vmr:", "--format", "csv"), "")
        # Waited for through /1.0/events as a WebSocket over the remote API.
        self.lxc.run("launch", "vmr:c1", "--empty", "--vm")
        self.assertEqual(self.system.listed_status("c1"), "RUNNING")
        self.assertEqual(
            self.lxc.out("list", "vmr:", "-c", "ns", "--format", "csv"), "c1,RUNNING\n"
        )
        self.lxc.run("stop", "vmr:c1")
        self.assertEqual(self.system.listed_status("c1"), "STOPPED")

    def test_remoteAddWithAddressAndTheTokenAsPassword(self) -> None:
        token = self.token("laptop")
        [address] = json.loads(base64.b64decode(token))["addresses"]
        added = self.lxc.out(
            "remote",
            "add",
            "vmr",
            f"https://{address}",
            "--accept-certificate",
            "--password",
            token,
        )
        self.assertIn("Client certificate now trusted by server: vmr", added)
        self.assertEqual(self.trusted_names(), ["laptop"])
        self.assertEqual(self.lxc.out("list", "vmr:", "--format", "csv"), "")

    def test_monitorThroughTheRemoteSeesInstanceReady(self) -> None:
        self.lxc.run("remote", "add", "vmr", self.token("laptop"))
        self.system.cli("launch", "c1")
        _assert_monitor_sees_ready(self, self.lxc, self.system, "vmr:")


def _assert_monitor_sees_ready(
    case: SynchronousTestCase, lxc: Lxc, system: System, *remote: str
) -> None:
    """``lxc monitor [REMOTE:] --type=lifecycle`` prints c1's ``instance-ready``.

    c1 runs; its agent is started and its workload declares Ready.
    """
    monitor = subprocess.Popen(
        [lxc.binary, "monitor", *remote, "--type=lifecycle"],
        env=lxc.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    case.addCleanup(monitor.wait, DEADLINE)
    case.addCleanup(monitor.kill)
    system.start_agent("c1")
    system.cli("wait", "c1", "agent", "--timeout", "30")
    notified = system.notify("c1")
    case.assertEqual(notified.returncode, 0, notified.stderr)
    seen = _read_until(monitor, b"action: instance-ready")
    case.assertIn(b"source: /1.0/instances/c1", seen)


def _read_until(process: subprocess.Popen[bytes], wanted: bytes) -> bytes:
    """What ``process`` printed up to and including ``wanted`` (AssertionError past DEADLINE)."""
    assert process.stdout is not None
    seen = b""
    deadline = time.monotonic() + DEADLINE
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or process.poll() is not None:
            raise AssertionError(f"lxc monitor never printed {wanted!r}; it printed {seen!r}")
        readable, _, _ = select.select([process.stdout], [], [], min(left, 0.5))
        if readable:
            seen += os.read(process.stdout.fileno(), 65536)
    return seen
