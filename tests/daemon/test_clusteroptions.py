"""``--store``, ``--member-name``, ``--member-address``, ``--lease-seconds``: accepted, defaulted,
and refused in one line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon.test_daemon import DEADLINE, twistd
from vmready.daemon.clusteroptions import ClusterSettings
from vmready.daemon.tap import Options
from vmready.store import display_location

URL = "postgresql://vmready@db.example/vmready"


class ClusterOptionsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-co-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def parsed(self, *arguments: str) -> Options:
        options = Options()
        options.parseOptions(["--config", "", "--data-dir", self.directory, *arguments])
        return options

    def refused(self, *arguments: str) -> str:
        error = self.assertRaises(usage.UsageError, self.parsed, *arguments)
        self.assertNotIn("\n", str(error))
        return str(error)

    def test_aSingleHostKeepsItsSQLiteFile(self) -> None:
        options = self.parsed()
        self.assertEqual(options["store"], os.path.join(self.directory, "vmready.sqlite"))
        self.assertIsNone(options.cluster)
        self.assertEqual((options["member-name"], options["member-address"]), (None, None))
        self.assertEqual(options["lease-seconds"], 15.0)

    def test_aStorePathIsMadeAbsolute(self) -> None:
        self.assertEqual(
            self.parsed("--store", "elsewhere.sqlite")["store"],
            os.path.join(os.getcwd(), "elsewhere.sqlite"),
        )

    def test_aPostgreSQLStoreMakesAClusterMember(self) -> None:
        options = self.parsed("--store", URL, "--https-address", "10.0.0.5:9443")
        self.assertEqual(
            options.cluster, ClusterSettings(socket.gethostname(), "10.0.0.5:9443", 15.0)
        )
        self.assertEqual(options["store"], URL)
        self.assertEqual(options["member-name"], socket.gethostname())
        self.assertEqual(options["member-address"], "10.0.0.5:9443")

    def test_theMemberIsNamedAndAddressedAsTold(self) -> None:
        options = self.parsed(
            "--store",
            "postgres://u@/vmready?host=/run/postgresql",
            "--https-address",
            ":9443",
            "--member-name",
            "host-2.rack_1",
            "--member-address",
            "[fd00::2]:9443",
            "--lease-seconds",
            "3",
        )
        self.assertEqual(options.cluster, ClusterSettings("host-2.rack_1", "[fd00::2]:9443", 3.0))

    def test_aMembersVMsAreFencedOnlyWhenAskedFor(self) -> None:
        plain = self.parsed("--store", URL, "--https-address", "h:1")
        fenced = self.parsed("--store", URL, "--https-address", "h:1", "--fence", "vms")
        assert plain.cluster is not None and fenced.cluster is not None
        self.assertEqual((plain.cluster.fence_vms, fenced.cluster.fence_vms), (False, True))

    def test_anHttpsPortChosenAtBindTimeLeavesTheAddressOpen(self) -> None:
        options = self.parsed("--store", URL, "--https-address", "127.0.0.1:0")
        assert options.cluster is not None
        self.assertIsNone(options.cluster.address)

    def test_refusals(self) -> None:
        cases = [
            (
                ["--store", "mysql://h/db"],
                "--store mysql://h/db: a mysql:// URL is no store vmready knows: give a SQLite "
                "file path or a postgresql:// URL",
            ),
            (
                ["--store", "postgresql://h:port/db", "--https-address", "h:1"],
                "--store postgresql://h:port/db: not a usable URL: Port could not be cast to "
                "integer value as 'port'",
            ),
            (
                ["--store", URL],
                "a cluster member (--store postgresql://…) needs --https-address: the other "
                "members forward requests to its mutual-TLS API",
            ),
            (
                ["--store", URL, "--https-address", ":9443"],
                "--https-address :9443 listens on every interface: give --member-address "
                "HOST:PORT, the address the other members dial",
            ),
            (
                ["--member-name", "a"],
                "--member-name is for a cluster member: its store is a PostgreSQL URL "
                "(--store postgresql://…)",
            ),
            (
                ["--member-address", "h:1"],
                "--member-address is for a cluster member: its store is a PostgreSQL URL "
                "(--store postgresql://…)",
            ),
            (
                ["--store", URL, "--https-address", "h:1", "--member-name", "-a"],
                "--member-name '-a' is not a member name: 1-63 letters, digits, dots, hyphens "
                "and underscores, starting with a letter or a digit",
            ),
            (
                ["--store", URL, "--https-address", "h:1", "--member-address", "0.0.0.0:1"],
                "--member-address '0.0.0.0:1': name the host or address the other members "
                "dial, not every interface",
            ),
            (
                ["--store", URL, "--https-address", "h:1", "--member-address", "h:0"],
                "--member-address 'h:0': name the port the other members dial",
            ),
            (
                ["--store", URL, "--https-address", "h:1", "--member-address", "h:x"],
                "--member-address 'h:x': port 'x' is not a number from 0 to 65535",
            ),
            (["--lease-seconds", "soon"], "--lease-seconds must be a number of seconds"),
            (["--lease-seconds", "0.5"], "--lease-seconds must be 1 to 3600 seconds"),
            (["--lease-seconds", "nan"], "--lease-seconds must be 1 to 3600 seconds"),
            (
                ["--fence", "vms"],
                "--fence is for a cluster member: its store is a PostgreSQL URL "
                "(--store postgresql://…)",
            ),
            (
                ["--store", URL, "--https-address", "h:1", "--fence", "power"],
                "--fence must be one of none, vms",
            ),
        ]
        for arguments, message in cases:
            self.assertEqual(self.refused(*arguments), message, arguments)

    def test_aPasswordIsNeverShown(self) -> None:
        self.assertEqual(
            display_location("postgresql://vm:s3cret@db:5432/vmready?sslmode=require"),
            "postgresql://vm:***@db:5432/vmready?sslmode=require",
        )
        self.assertEqual(display_location(URL), URL)
        self.assertEqual(
            display_location("/var/lib/vmready/vmready.sqlite"), "/var/lib/vmready/vmready.sqlite"
        )
        refusal = self.refused("--store", "mysql://u:s3cret@h/db")
        self.assertNotIn("s3cret", refusal)

    def test_aStoreThatCannotBeReachedIsOneLineWithoutThePassword(self) -> None:
        result = subprocess.run(
            twistd(
                self.directory,
                "--store",
                f"postgresql://vm:s3cret@/vmready?host={self.directory}/nothing-here",
                "--https-address",
                "127.0.0.1:0",
            ),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        self.assertEqual(result.returncode, 1, result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(
            lines[0].startswith(
                f"vmready: cannot open store postgresql://vm:***@/vmready?host={self.directory}"
            ),
            lines[0],
        )
        self.assertNotIn("s3cret", result.stderr + result.stdout)

    def test_helpDocumentsThem(self) -> None:
        text = str(Options())
        for option in (
            "--store",
            "--member-name",
            "--member-address",
            "--lease-seconds",
            "--fence",
        ):
            self.assertIn(option, text)
