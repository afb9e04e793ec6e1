"""``--log-format json``: one JSON object per line, for journald and Loki."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import datetime
from typing import Any

from twisted.logger import Logger
from twisted.python import usage
from twisted.scripts._twistd_unix import ServerOptions  # what twistd runs on Linux
from twisted.trial.unittest import SynchronousTestCase

from tests.daemon.test_daemon import DEADLINE, twistd, wait_for_api
from vmready.daemon.logformat import json_observer, rfc3339, twistd_observer


def lines(text: str) -> list[dict[str, Any]]:
    """Each line as the JSON object it must be, with the fields every record has."""
    records = []
    for line in text.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        for field in ("time", "level", "namespace", "message"):
            assert isinstance(record[field], str), (field, line)
        datetime.fromisoformat(record["time"])  # RFC 3339
        records.append(record)
    return records


class FormatTests(SynchronousTestCase):
    """Events through the JSON observer."""

    def setUp(self) -> None:
        self.out = io.StringIO()
        self.log = Logger(namespace="vmready.test", observer=json_observer(self.out))

    def test_aStructuredEvent(self) -> None:
        self.log.info("recovered {count} instances of {names}", count=2, names=["a", "b"])
        [record] = lines(self.out.getvalue())
        self.assertEqual(
            {key: record[key] for key in ("level", "namespace", "message", "fields")},
            {
                "level": "info",
                "namespace": "vmready.test",
                "message": "recovered 2 instances of ['a', 'b']",
                "fields": {"count": 2, "names": ["a", "b"]},
            },
        )

    def test_timeIsRFC3339InUTC(self) -> None:
        self.assertEqual(rfc3339(0), "1970-01-01T00:00:00.000000Z")
        self.assertEqual(rfc3339(1700000000.25), "2023-11-14T22:13:20.250000Z")
        before = time.time()
        self.log.warn("now")
        [record] = lines(self.out.getvalue())
        stamp = datetime.fromisoformat(record["time"]).timestamp()
        self.assertTrue(before - 0.001 <= stamp <= time.time(), (before, stamp))
        self.assertEqual(record["level"], "warn")

    def test_fieldsJSONCannotHoldAreLeftOut(self) -> None:
        self.log.error("odd {thing} {ratio}", thing=object(), ratio=float("nan"), fine="yes")
        [record] = lines(self.out.getvalue())
        self.assertEqual(record["fields"], {"fine": "yes"})
        self.assertTrue(record["message"].startswith("odd <object object at "), record)

    def test_aFailureCarriesItsTraceback(self) -> None:
        table: dict[str, int] = {}
        try:
            table["missing"]
        except KeyError:
            self.log.failure("looking up {key}", key="missing")
        [record] = lines(self.out.getvalue())
        self.assertEqual(record["level"], "critical")
        self.assertEqual(record["message"], "looking up missing")
        self.assertEqual(record["error"], "'missing'")
        self.assertIn("Traceback", record["traceback"])
        self.assertIn("KeyError", record["traceback"])
        self.assertIn("test_aFailureCarriesItsTraceback", record["traceback"])

    def test_oneLineEvenForMultilineMessages(self) -> None:
        self.log.info("two\nlines {more}", more="and\nthree")
        self.assertEqual(len(self.out.getvalue().splitlines()), 1)
        [record] = lines(self.out.getvalue())
        self.assertEqual(record["message"], "two\nlines and\nthree")


class TwistdOptionTests(SynchronousTestCase):
    """--log-format json makes twistd's log observer the JSON one, where stdout is the log."""

    def parsed(self, *twistd_options: str, log_format: str = "json") -> ServerOptions:
        config = ServerOptions()
        vmready = ["--config", "", "--data-dir", "/tmp/vmr-lf", "--log-format", log_format]
        config.parseOptions([*twistd_options, "vmready", *vmready])
        return config

    def test_jsonUnderNodaemon(self) -> None:
        self.assertIs(self.parsed("--nodaemon")["logger"], twistd_observer)
        self.assertIs(self.parsed("--nodaemon", "--logfile", "-")["logger"], twistd_observer)

    def test_textLeavesTwistdAlone(self) -> None:
        self.assertIsNone(self.parsed("--nodaemon", log_format="text")["logger"])

    def test_refused(self) -> None:
        for twistd_options, said in (
            ((), "--log-format json writes to standard output"),
            (("--nodaemon", "--logfile", "/tmp/vmr-lf.log"), "without --logfile"),
            (("--nodaemon", "--syslog"), "not with --syslog or --logger"),
            (
                ("--nodaemon", "--logger", "twisted.logger.textFileLogObserver"),
                "not with --syslog or --logger",
            ),
        ):
            with self.assertRaises(usage.UsageError) as caught:
                self.parsed(*twistd_options)
            self.assertIn(said, str(caught.exception))
        with self.assertRaises(usage.UsageError) as caught:
            self.parsed("--nodaemon", log_format="xml")
        self.assertEqual(str(caught.exception), "--log-format must be one of text, json")


class DaemonJSONLogTests(SynchronousTestCase):
    """``twistd -n vmready --log-format json``: stdout holds JSON lines only, stderr nothing."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-lf-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_everyLineIsAJSONObject(self) -> None:
        daemon = subprocess.Popen(
            twistd(self.directory, "--config", "", "--log-format", "json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.addCleanup(_kill, daemon)
        api = os.path.join(self.directory, "vmready.sock")
        wait_for_api(self, daemon, api)
        daemon.send_signal(signal.SIGTERM)
        out, err = daemon.communicate(timeout=DEADLINE)
        self.assertEqual(err, b"")
        records = lines(out.decode())
        messages = [record["message"] for record in records]
        self.assertIn("recovered 0 instances", messages)
        self.assertEqual(messages[-1], "Server Shut Down.")
        summary = next(r for r in records if r["namespace"] == "vmready.daemon.tap")
        self.assertEqual(summary["fields"]["data_dir"], self.directory)
        self.assertTrue(summary["message"].startswith(f"data dir {self.directory}, API on "))


def _kill(daemon: subprocess.Popen[bytes]) -> None:
    """A daemon the test did not see stop is stopped now."""
    if daemon.poll() is None:
        daemon.kill()
        daemon.communicate(timeout=DEADLINE)
