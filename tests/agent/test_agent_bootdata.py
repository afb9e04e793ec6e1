"""vmready.agent.bootdata: this boot's meta-data, config and devices, answered as the host does."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from vmready.agent.answers import Answer
from vmready.agent.bootdata import BOOT_DATA, BootData, load_boot_data, parse_boot_data

META = "instance-id: 6f1c3a52\nlocal-hostname: web1\n"
DATA = BootData(
    META,
    {
        "user.role": "web",
        "cloud-init.user-data": "#cloud-config\nruncmd: [true]\n",
        "user.empty": "",
        "user.a/b c": "spaced",
    },
    {"root": {"type": "disk", "path": "/"}},
)
RAW = "application/octet-stream"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"


class AnswerTests(SynchronousTestCase):
    """Each route as the host's guest API answers it, unwrapped as the proxy unwraps it."""

    def test_metaDataIsRawText(self) -> None:
        self.assertEqual(DATA.answer("GET", "/1.0/meta-data"), Answer(200, RAW, META.encode()))

    def test_configListsEveryGuestKeySorted(self) -> None:
        answer = DATA.answer("GET", "/1.0/config")
        assert answer is not None
        self.assertEqual((answer.code, answer.content_type), (200, JSON))
        self.assertEqual(
            json.loads(answer.body),
            [
                "/1.0/config/cloud-init.user-data",
                "/1.0/config/user.a/b c",
                "/1.0/config/user.empty",
                "/1.0/config/user.role",
            ],
        )

    def test_configListEndsWithANewlineAsLXDsEncoder(self) -> None:
        answer = DATA.answer("GET", "/1.0/config")
        assert answer is not None
        self.assertTrue(answer.body.endswith(b"]\n"))

    def test_configValueIsRaw(self) -> None:
        self.assertEqual(
            DATA.answer("GET", "/1.0/config/cloud-init.user-data"),
            Answer(200, RAW, b"#cloud-config\nruncmd: [true]\n"),
        )

    def test_configKeyIsPercentDecoded(self) -> None:
        self.assertEqual(
            DATA.answer("GET", "/1.0/config/user.a%2Fb%20c"), Answer(200, RAW, b"spaced")
        )

    def test_unsetKeyIsNotFound(self) -> None:
        self.assertEqual(
            DATA.answer("GET", "/1.0/config/user.missing"), Answer(404, TEXT, b"not found\n")
        )

    def test_emptyKeyIsNotFound(self) -> None:
        self.assertEqual(
            DATA.answer("GET", "/1.0/config/user.empty"), Answer(404, TEXT, b"not found\n")
        )

    def test_otherPrefixIsNotAuthorized(self) -> None:
        self.assertEqual(
            DATA.answer("GET", "/1.0/config/volatile.last_state.ready"),
            Answer(403, TEXT, b"not authorized\n"),
        )

    def test_devicesAreJson(self) -> None:
        answer = DATA.answer("GET", "/1.0/devices")
        assert answer is not None
        self.assertEqual(
            (answer.code, answer.content_type, json.loads(answer.body)),
            (200, JSON, {"root": {"type": "disk", "path": "/"}}),
        )

    def test_stateIsTheHostsAlone(self) -> None:
        self.assertIsNone(DATA.answer("GET", "/1.0"))

    def test_eventsAreTheHostsAlone(self) -> None:
        self.assertIsNone(DATA.answer("GET", "/1.0/events"))

    def test_otherMethodsAreTheHostsAlone(self) -> None:
        self.assertIsNone(DATA.answer("PATCH", "/1.0/meta-data"))


class ParseTests(SynchronousTestCase):
    """``guest-api.json`` as the host writes it, and what is refused."""

    def test_wholeFile(self) -> None:
        raw = json.dumps({"meta-data": META, "config": {"user.a": "1"}, "devices": {}})
        self.assertEqual(parse_boot_data(raw.encode()), BootData(META, {"user.a": "1"}, {}))

    def test_configAndDevicesMayBeAbsent(self) -> None:
        self.assertEqual(parse_boot_data(b'{"meta-data": ""}'), BootData("", {}, {}))

    def test_notJson(self) -> None:
        error = self.assertRaises(ValueError, parse_boot_data, b"{")
        self.assertTrue(str(error).startswith("not valid JSON: "), str(error))

    def test_notAnObject(self) -> None:
        error = self.assertRaises(ValueError, parse_boot_data, b"[]")
        self.assertEqual(str(error), "not a JSON object")

    def test_metaDataMustBeText(self) -> None:
        error = self.assertRaises(ValueError, parse_boot_data, b'{"meta-data": 1}')
        self.assertEqual(str(error), "its meta-data is not a string")

    def test_configValuesMustBeText(self) -> None:
        error = self.assertRaises(
            ValueError, parse_boot_data, b'{"meta-data": "", "config": {"user.a": 1}}'
        )
        self.assertEqual(str(error), "its config is not an object of strings")

    def test_devicesMustBeAnObject(self) -> None:
        error = self.assertRaises(ValueError, parse_boot_data, b'{"meta-data": "", "devices": []}')
        self.assertEqual(str(error), "its devices are not an object")


class LoadTests(SynchronousTestCase):
    """Reading the drive's file: absent is quiet, unusable is one warning, never fatal."""

    def setUp(self) -> None:
        self.drive = tempfile.mkdtemp(prefix="vra-")
        self.addCleanup(shutil.rmtree, self.drive, True)
        self.warnings: list[str] = []
        logger = logging.getLogger("vmready.agent.bootdata")

        class Collect(logging.Handler):
            def emit(handler, record: logging.LogRecord) -> None:
                self.warnings.append(record.getMessage())

        handler = Collect(logging.WARNING)
        logger.addHandler(handler)
        self.addCleanup(logger.removeHandler, handler)

    def write(self, data: bytes) -> None:
        with open(os.path.join(self.drive, BOOT_DATA), "wb") as f:
            f.write(data)

    def test_fileIsRead(self) -> None:
        self.write(json.dumps({"meta-data": META}).encode())
        self.assertEqual(load_boot_data(self.drive), BootData(META))

    def test_absentFileIsNoneAndQuiet(self) -> None:
        self.assertEqual((load_boot_data(self.drive), self.warnings), (None, []))

    def test_brokenFileIsNoneWithOneWarning(self) -> None:
        self.write(b"[]")
        path = os.path.join(self.drive, BOOT_DATA)
        self.assertEqual(
            (load_boot_data(self.drive), self.warnings),
            (None, [f"ignoring {path}: not a JSON object"]),
        )
