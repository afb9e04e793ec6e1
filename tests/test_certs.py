"""Tests for vmready.certs."""

from __future__ import annotations

import datetime
import os
import shutil
import stat
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from vmready.certs import (
    SERVER_CERT,
    SERVER_KEY,
    ensure_server_certificate,
    fingerprint,
    generate,
    is_valid_at,
    write_config_drive,
)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


class ServerCertificateTests(SynchronousTestCase):
    """The daemon's certificate is made once and kept, its key private."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-cert-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_firstStartCreatesCertificateAndOwnerOnlyKey(self) -> None:
        pair = ensure_server_certificate(self.directory)
        self.assertEqual(_mode(os.path.join(self.directory, SERVER_KEY)), 0o600)
        with open(os.path.join(self.directory, SERVER_CERT), "rb") as f:
            self.assertEqual(f.read(), pair.cert_pem)
        leftovers = [name for name in os.listdir(self.directory) if name.startswith(".tmp-")]
        self.assertEqual(leftovers, [])

    def test_laterStartsReuseTheSameCertificate(self) -> None:
        first = ensure_server_certificate(self.directory)
        second = ensure_server_certificate(self.directory)
        self.assertEqual(first.fingerprint, second.fingerprint)

    def test_loosenedKeyModeIsTightenedAgain(self) -> None:
        ensure_server_certificate(self.directory)
        key = os.path.join(self.directory, SERVER_KEY)
        os.chmod(key, 0o644)
        ensure_server_certificate(self.directory)
        self.assertEqual(_mode(key), 0o600)


class InstanceCertificateTests(SynchronousTestCase):
    """Each instance has its own identity, with a validity period."""

    def test_everyInstanceGetsADistinctFingerprint(self) -> None:
        a, b = generate("vm-a"), generate("vm-b")
        self.assertNotEqual(a.fingerprint, b.fingerprint)
        self.assertEqual(len(a.fingerprint), 64)
        self.assertEqual(fingerprint(a.cert_pem), a.fingerprint)

    def test_validityPeriod(self) -> None:
        now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        pair = generate("vm-a", days=1, now=now)
        self.assertTrue(is_valid_at(pair.cert_pem, now))
        self.assertFalse(is_valid_at(pair.cert_pem, now + datetime.timedelta(days=2)))

    def test_zeroDaysIsRefused(self) -> None:
        with self.assertRaises(ValueError):
            generate("vm-a", days=0)

    def test_configDriveHoldsIdentityAndPinnedServerCertificate(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-drive-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        client, server = generate("vm-a"), generate("vmready")
        write_config_drive(os.path.join(directory, "drive"), client, server.cert_pem)
        drive = os.path.join(directory, "drive")
        self.assertEqual(sorted(os.listdir(drive)), ["agent.crt", "agent.key", "server.crt"])
        self.assertEqual(_mode(os.path.join(drive, "agent.key")), 0o600)
        self.assertEqual(_mode(drive), 0o700)
        with open(os.path.join(drive, "server.crt"), "rb") as f:
            self.assertEqual(fingerprint(f.read()), server.fingerprint)
