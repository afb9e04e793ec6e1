"""Tests for vmready.trust.certs."""

from __future__ import annotations

import datetime
import os
import shutil
import stat
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from vmready.trust.certs import (
    SERVER_CERT,
    SERVER_KEY,
    CertificateError,
    certificate_facts,
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


class BrokenServerCertificateTests(SynchronousTestCase):
    """Half a pair, a foreign key or garbage is refused, never silently replaced."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-cert-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.pair = ensure_server_certificate(self.directory)
        self.cert = os.path.join(self.directory, SERVER_CERT)
        self.key = os.path.join(self.directory, SERVER_KEY)

    def assertRefusedAndKept(self, *wording: str) -> None:
        before = {
            name: _read(os.path.join(self.directory, name)) for name in os.listdir(self.directory)
        }
        error = self.assertRaises(CertificateError, ensure_server_certificate, self.directory)
        for words in wording:
            self.assertIn(words, str(error))
        self.assertEqual(len(str(error).splitlines()), 1)
        after = {
            name: _read(os.path.join(self.directory, name)) for name in os.listdir(self.directory)
        }
        self.assertEqual(after, before)

    def test_missingKeyIsRefused(self) -> None:
        os.unlink(self.key)
        self.assertRefusedAndKept(f"{self.cert} exists but {self.key} is missing: restore it")

    def test_missingCertificateIsRefused(self) -> None:
        os.unlink(self.cert)
        self.assertRefusedAndKept(f"{self.key} exists but {self.cert} is missing")

    def test_anotherCertificatesKeyIsRefused(self) -> None:
        with open(self.key, "wb") as f:
            f.write(generate("other").key_pem)
        self.assertRefusedAndKept(f"{self.key} is not the key of {self.cert}")

    def test_garbageIsRefused(self) -> None:
        with open(self.key, "wb") as f:
            f.write(b"not a key")
        self.assertRefusedAndKept("is not a PEM certificate and key")

    def test_removingBothIssuesANewPair(self) -> None:
        os.unlink(self.key)
        os.unlink(self.cert)
        self.assertNotEqual(
            ensure_server_certificate(self.directory).fingerprint, self.pair.fingerprint
        )


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


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


class CertificateFactsTests(SynchronousTestCase):
    """A certificate is parsed once: its fingerprint and validity are remembered by its bytes."""

    def test_factsAreTheCertificates(self) -> None:
        now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        pair = generate("vm-a", days=1, now=now)
        facts = certificate_facts(pair.cert_pem)
        self.assertEqual(facts.fingerprint, pair.fingerprint)
        self.assertEqual(facts.not_valid_before, now - datetime.timedelta(hours=1))
        self.assertEqual(facts.not_valid_after, now + datetime.timedelta(days=1))
        self.assertTrue(facts.is_valid_at(now))
        self.assertFalse(facts.is_valid_at(now + datetime.timedelta(days=2)))

    def test_sameBytesAreParsedOnce(self) -> None:
        pair = generate("vm-a")
        expected = pair.fingerprint  # parsed here
        now = datetime.datetime.now(datetime.UTC)
        before = certificate_facts.cache_info()
        for _ in range(3):
            # Equal bytes in a new object each time, as each TLS connection hands over.
            self.assertEqual(fingerprint(bytes(bytearray(pair.cert_pem))), expected)
            self.assertTrue(is_valid_at(bytes(bytearray(pair.cert_pem)), now))
        after = certificate_facts.cache_info()
        self.assertEqual((after.misses - before.misses, after.hits - before.hits), (0, 6))

    def test_otherCertificatesHaveTheirOwnFacts(self) -> None:
        a, b = generate("vm-a"), generate("vm-b")
        self.assertEqual(
            [fingerprint(a.cert_pem), fingerprint(b.cert_pem), fingerprint(a.cert_pem)],
            [a.fingerprint, b.fingerprint, a.fingerprint],
        )

    def test_garbageIsRefusedEveryTime(self) -> None:
        for _ in range(2):
            with self.assertRaises(ValueError):
                certificate_facts(b"not a certificate")
