"""The config file: every option settable by its long name, the command line winning, refusals."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, ClassVar

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon.test_daemon import DEADLINE, twistd
from vmready.daemon import configfile
from vmready.daemon.configfile import CONFIG_VARIABLE
from vmready.daemon.tap import Options

# A value each option accepts that is not its default: the file must reach the option.
SAMPLES = {
    "log-format": "json",
    "data-dir": "/tmp/vmr-config-data",
    "listen": "unix:/tmp/vmr-config-data/api.sock",
    "hypervisor": "qemu",
    "https-address": "127.0.0.1:9443",
    "qemu-binary": "/usr/bin/qemu-system-x86_64",
    "power-sync-interval": "12.5",
    "stop-timeout": "7",
    "sync-concurrency": "3",
    "gc-sweep-interval": "0",
    "serial-layout": "legacy",
    "fence": "vms",
    "guest-listen": "vsock:port=0",
    "agent-follow-up": "0.25",
    "agent-follow-up-window": "9",
    "agent-poll-agentless": "3",
    "agent-poll-safety": "90",
    "agent-reopen-grace": "4",
    "agent-silence-timeout": "20",
    "record-dir": "/tmp/vmr-config-transcripts",
    "record-max-bytes": "2048",
    "record-keep": "5",
    "guest-transport": "forward",
    "default-image": "/tmp/vmr-config-image.qcow2",
    "default-kernel": "/tmp/vmr-config-vmlinuz",
    "default-initrd": "/tmp/vmr-config-initrd",
    "default-append": "console=ttyS0",
    "kvm-probe-timeout": "45",
    "console-max-bytes": "8192",
    "store": "postgresql://vmready@db.example/vmready",
    "member-name": "node-7",
    "member-address": "10.1.1.1:9443",
    "lease-seconds": "3",
}
# What an option needs beside it to be accepted at all (the cluster's options need a cluster).
_CLUSTER = ("--store", "postgresql://vmready@db.example/vmready", "--https-address", "10.1.1.2:1")
COMPANIONS = {
    "store": ("--https-address", "10.1.1.2:1"),
    "member-name": _CLUSTER,
    "member-address": _CLUSTER,
    "fence": _CLUSTER,
}
# Tried, in order, for an option added since SAMPLES was written.
CANDIDATES = ("7", "1", "120", "/tmp/vmr-config-sample", "yes")


class ConfigFileCase(SynchronousTestCase):
    """A temporary directory for config files, and no $VMREADY_CONFIG from outside."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-cf-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.patch(os, "environ", {k: v for k, v in os.environ.items() if k != CONFIG_VARIABLE})
        self.patch(configfile, "DEFAULT_PATH", os.path.join(self.directory, "absent.yaml"))

    def write(self, text: str, name: str = "vmready.yaml") -> str:
        path = os.path.join(self.directory, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def parsed(self, *arguments: str, options: Options | None = None) -> dict[str, Any]:
        """The options as parsed, less which file was read."""
        options = options or Options()
        options.parseOptions(list(arguments))
        return {key: value for key, value in options.items() if key != "config"}

    def refusal(self, text: str, options: Options | None = None) -> str:
        """The one line the daemon stops with for a config file holding ``text``."""
        path = self.write(text)
        with self.assertRaises(SystemExit) as caught:
            self.parsed("--config", path, options=options)
        line = str(caught.exception.code)
        self.assertEqual(len(line.splitlines()), 1, line)
        return line.removeprefix(f"vmready: config file {path}")


class EveryOptionTests(ConfigFileCase):
    """Each of Options' parameters and flags, set in the file, acts as on the command line."""

    def sample(self, key: str, default: object) -> str:
        if key in SAMPLES:
            return SAMPLES[key]
        baseline = self.parsed("--config", "")
        for candidate in CANDIDATES:
            try:
                if self.parsed("--config", "", f"--{key}", candidate) != baseline:
                    return candidate
            except usage.UsageError:
                continue
        self.fail(f"no value found that --{key} takes besides {default!r}: add one to SAMPLES")

    def test_everyParameter(self) -> None:
        for option in Options.optParameters:
            key, default = str(option[0]), option[2]
            if key == "config":
                continue
            value = self.sample(key, default)
            companions = COMPANIONS.get(key, ())
            baseline = self.parsed("--config", "", *companions)
            from_file = self.parsed("--config", self.write(f"{key}: '{value}'\n"), *companions)
            self.assertEqual(
                from_file, self.parsed("--config", "", *companions, f"--{key}", value), key
            )
            self.assertNotEqual(from_file[key], baseline[key], key)

    def test_numbersAreWrittenAsNumbers(self) -> None:
        path = self.write("agent-poll-safety: 120\nstop-timeout: 2.5\nrecord-keep: 4\n")
        parsed = self.parsed("--config", path)
        self.assertEqual(
            (parsed["agent-poll-safety"], parsed["stop-timeout"], parsed["record-keep"]),
            (120.0, 2.5, 4),
        )

    def test_everyFlag(self) -> None:
        for key, *_rest in getattr(Options, "optFlags", []):
            self.assertEqual(self.parsed("--config", self.write(f"{key}: true\n"))[key], 1, key)
            self.assertEqual(self.parsed("--config", self.write(f"{key}: false\n"))[key], 0, key)

    def test_aFlagOfAnOptionsWithFlags(self) -> None:
        # Options has no flag today: one added tomorrow takes true and false from the file.
        class WithFlag(Options):
            optFlags: ClassVar[list[list[str | None]]] = [["dry-run", None, "Do nothing."]]

        on = self.parsed("--config", self.write("dry-run: true\n"), options=WithFlag())
        self.assertEqual(on["dry-run"], 1)
        off = self.parsed("--config", self.write("dry-run: false\n"), options=WithFlag())
        self.assertEqual(off["dry-run"], 0)
        self.assertIn(
            "line 1: dry-run is a flag: true or false, not text 'on please'",
            self.refusal("dry-run: on please\n", options=WithFlag()),
        )

    def test_anEmptyFileSetsNothing(self) -> None:
        for text in ("", "# only a comment\n"):
            self.assertEqual(
                self.parsed("--config", self.write(text)), self.parsed("--config", "")
            )


class WhichFileTests(ConfigFileCase):
    """--config, else $VMREADY_CONFIG, else the default path when it exists."""

    def test_theCommandLineWins(self) -> None:
        path = self.write("stop-timeout: 5\ndata-dir: /tmp/vmr-config-file\n")
        parsed = self.parsed("--config", path, "--stop-timeout", "7", "-d", "/tmp/vmr-config-cli")
        self.assertEqual(
            (parsed["stop-timeout"], parsed["data-dir"]), (7.0, "/tmp/vmr-config-cli")
        )
        before = self.parsed("--stop-timeout", "7", "--config", path)
        self.assertEqual(before["stop-timeout"], 7.0)

    def test_theCommandLineWinsEvenWithAValueTheFileWouldRefuse(self) -> None:
        path = self.write("stop-timeout: 99999\n")
        self.assertEqual(self.parsed("--config", path, "--stop-timeout", "3")["stop-timeout"], 3.0)

    def test_environmentVariable(self) -> None:
        os.environ[CONFIG_VARIABLE] = self.write("stop-timeout: 5\n")
        self.assertEqual(self.parsed()["stop-timeout"], 5.0)
        other = self.write("stop-timeout: 6\n", "other.yaml")
        self.assertEqual(self.parsed("--config", other)["stop-timeout"], 6.0)
        self.assertEqual(self.parsed("--config", "")["stop-timeout"], 30.0)

    def test_theDefaultPathOnlyWhenItExists(self) -> None:
        self.assertEqual(self.parsed()["stop-timeout"], 30.0)
        self.patch(configfile, "DEFAULT_PATH", self.write("stop-timeout: 8\n"))
        self.assertEqual(self.parsed()["stop-timeout"], 8.0)
        self.assertEqual(self.parsed("--config=")["stop-timeout"], 30.0)

    def test_helpDoesNotReadTheFile(self) -> None:
        os.environ[CONFIG_VARIABLE] = self.write("not: [valid\n")
        self.patch(sys, "stdout", io.StringIO())
        with self.assertRaises(SystemExit) as caught:
            Options().parseOptions(["--help"])
        self.assertIn(caught.exception.code, (0, None))


class RefusalTests(ConfigFileCase):
    """What the file gets wrong: one line naming the file, the line and the key."""

    def test_unknownKey(self) -> None:
        self.assertEqual(
            self.refusal("stop-timeout: 5\ndata_dir: /x\n"),
            ", line 2: unknown key 'data_dir' (did you mean data-dir?)",
        )
        self.assertEqual(self.refusal("colour: blue\n"), ", line 1: unknown key 'colour'")

    def test_keysMustBeNames(self) -> None:
        self.assertEqual(self.refusal("3: x\n"), ", line 1: a key must be an option's long name")

    def test_theConfigOptionItself(self) -> None:
        self.assertEqual(
            self.refusal("config: /etc/other.yaml\n"),
            ", line 1: config can be given on the command line only",
        )

    def test_wrongTypes(self) -> None:
        for text, said in (
            ("listen: [a, b]\n", "listen takes a string or a number, not a list"),
            ("listen: {a: b}\n", "listen takes a string or a number, not a mapping"),
            ("qemu-binary:\n", "qemu-binary takes a string or a number, not nothing"),
            ("hypervisor: yes\n", "hypervisor takes a string or a number, not true (a YAML"),
        ):
            line = self.refusal("stop-timeout: 5\n" + text)
            self.assertTrue(line.startswith(f", line 2: {said}"), line)

    def test_aValueTheOptionRefuses(self) -> None:
        self.assertEqual(
            self.refusal("# limits\nstop-timeout: 99999\n"),
            ", line 2: stop-timeout: must be 0 to 3600 seconds",
        )
        self.assertEqual(
            self.refusal("agent-poll-safety: soon\n"),
            ", line 1: agent-poll-safety: must be a number of seconds",
        )
        self.assertEqual(
            self.refusal("log-format: xml\n"),
            ", line 1: log-format: must be one of text, json",
        )

    def test_setTwice(self) -> None:
        self.assertEqual(
            self.refusal("hypervisor: qemu\nstop-timeout: 5\nhypervisor: fakeqemu\n"),
            ", line 3: hypervisor is set twice (first on line 1)",
        )

    def test_malformedYAML(self) -> None:
        self.assertEqual(
            self.refusal("listen: unix:/x\n  bad: indent\n"),
            ", line 2, column 6: not valid YAML: mapping values are not allowed here",
        )
        self.assertEqual(
            self.refusal('listen: "unterminated\n'),
            ", line 2, column 1: not valid YAML: found unexpected end of stream",
        )
        self.assertEqual(
            self.refusal("- data-dir\n- listen\n"),
            ", line 1: expected a mapping of option names to values",
        )
        self.assertEqual(
            self.refusal("a: 1\n---\nb: 2\n"),
            ", line 2, column 1: not valid YAML: but found another document",
        )

    def test_notUTF8(self) -> None:
        path = os.path.join(self.directory, "latin1.yaml")
        with open(path, "wb") as f:
            f.write(b"default-append: caf\xe9\n")
        with self.assertRaises(SystemExit) as caught:
            self.parsed("--config", path)
        self.assertEqual(
            caught.exception.code,
            f"vmready: config file {path}: not UTF-8 text (invalid continuation byte)",
        )

    def test_missingOrUnreadable(self) -> None:
        missing = os.path.join(self.directory, "missing.yaml")
        with self.assertRaises(SystemExit) as caught:
            self.parsed("--config", missing)
        self.assertEqual(
            caught.exception.code,
            f"vmready: config file {missing}: cannot read it: No such file or directory",
        )
        with self.assertRaises(SystemExit) as caught:
            self.parsed("--config", self.directory)
        self.assertEqual(
            caught.exception.code,
            f"vmready: config file {self.directory}: cannot read it: Is a directory",
        )


class DaemonRefusalTests(ConfigFileCase):
    """``twistd vmready`` with a bad file: one line on stderr, status 1, no traceback."""

    def test_oneLineAndStatus1(self) -> None:
        path = self.write("agent-poll-safety: 120\nsync_concurrency: 3\n")
        result = subprocess.run(
            twistd(self.directory, "--config", path),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.stderr,
            f"vmready: config file {path}, line 2: unknown key 'sync_concurrency' "
            "(did you mean sync-concurrency?)\n",
        )
        self.assertEqual(result.stdout, "")


class ShippedFilesTests(ConfigFileCase):
    """contrib/: the example config file and the systemd unit say what the daemon expects."""

    contrib = os.path.join(os.path.dirname(__file__), "..", "..", "contrib")

    def test_theExampleConfigFileIsAccepted(self) -> None:
        path = os.path.join(self.contrib, "vmready.yaml")
        parsed = self.parsed("--config", path)
        self.assertEqual((parsed["hypervisor"], parsed["data-dir"]), ("qemu", "/var/lib/vmready"))

    def test_theUnitStartsTwistdInTheForegroundAndKillsOnlyTheDaemon(self) -> None:
        with open(os.path.join(self.contrib, "systemd", "vmready.service")) as f:
            settings = [
                line.split("=", 1)
                for line in f.read().splitlines()
                if "=" in line and not line.startswith("#")
            ]
        unit = dict(settings)
        self.assertEqual(unit["Type"], "notify")
        self.assertEqual(unit["KillMode"], "process")  # the VMs outlive a restart
        self.assertEqual(unit["StateDirectory"], "vmready")
        self.assertNotIn("RuntimeDirectory", unit)
        self.assertNotIn("PrivateDevices", unit)
        self.assertIn(["DeviceAllow", "/dev/kvm rw"], settings)
        command = unit["ExecStart"].split()
        self.assertEqual(command[:4], ["twistd", "--nodaemon", "--pidfile=", "vmready"])
        # What follows vmready on that line, twistd vmready accepts.
        self.parsed("--config", "", *command[4:])
        self.assertIn("WatchdogSec", unit)
