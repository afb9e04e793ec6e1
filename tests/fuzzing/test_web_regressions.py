"""Inputs that broke an HTTP-side parser (found by fuzzing or while writing its target), kept.

Each was a crash (a 500, a traceback instead of the precise error) or a value
accepted that the documentation does not allow.
"""

from __future__ import annotations

import base64
import json

from OpenSSL import crypto
from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing import web_certs, web_config, web_guest, web_operator, web_tokens
from tests.fuzzing.web_http import RUNNING, WORLDS, request
from vmready.api.guest import instance_for_certificate
from vmready.daemon.configfile import ConfigFileError, parse_settings
from vmready.domain.config import parse_cpus, parse_memory, validate_config
from vmready.domain.model import BadRequest
from vmready.trust.certs import generate
from vmready.trust.tls import MutualServerTLS
from vmready.trust.tokens import TokenError, TrustToken

_PARAMETERS, _FLAGS = web_config._PARAMETERS, web_config._FLAGS


class ConfigFileRegressionTests(SynchronousTestCase):
    """The config file: every mistake is ConfigFileError, in one line."""

    def assertRefused(self, text: str, says: str) -> None:
        error = self.assertRaises(
            ConfigFileError, parse_settings, text, "vmready.yaml", _PARAMETERS, _FLAGS
        )
        self.assertIn(says, str(error))
        self.assertTrue(str(error).startswith("config file vmready.yaml"), str(error))

    def test_characterYAMLDoesNotAllow(self) -> None:
        """A NUL was PyYAML's ReaderError, raised before the loader's errors were caught."""
        self.assertRefused("data-dir: a\x00b\n", "unacceptable character #x0000")

    def test_tagNoOptionTakes(self) -> None:
        """``!!timestamp 2001-9``: PyYAML's timestamp constructor raised AttributeError (found
        by the long run); a date or bytes is no option's value anyway."""
        self.assertRefused(
            "sync-concurrency: !!timestamp 2001-9\n",
            "line 1: sync-concurrency: a timestamp is not a value of any option",
        )
        self.assertRefused("stop-timeout: 2001-12-14\n", "a timestamp is not a value")
        self.assertRefused("stop-timeout: [1, !!binary aGk=]\n", "a binary is not a value")

    def test_scalarItsTagCannotBe(self) -> None:
        """A date that is no date, ``!!float x``: ValueError from PyYAML's constructor (a date
        is now refused before it is read, as no option takes one)."""
        self.assertRefused(
            "data-dir: 2001-13-45\n", "line 1: data-dir: a timestamp is not a value"
        )
        self.assertRefused("stop-timeout: !!float x\n", "stop-timeout: not a value")

    def test_integerOfMoreDigitsThanPythonConverts(self) -> None:
        self.assertRefused("stop-timeout: " + "1" * 5000 + "\n", "stop-timeout: not a value")

    def test_nestedDeeperThanPythonRecurses(self) -> None:
        """PyYAML composes recursively: RecursionError."""
        self.assertRefused("[" * 5000, "nested too deeply")
        self.assertRefused("data-dir: " + "[" * 5000, "nested too deeply")

    def test_fuzzTargetChecksThem(self) -> None:
        for data in (b"data-dir: a\x00", b"data-dir: 2001-13-45", b"[" * 3000, b"\xff: 1"):
            web_config.check_config_file(data)


class ConfigValueRegressionTests(SynchronousTestCase):
    """Instance config: a 400 naming the key, never a 500; only ASCII digits are numbers."""

    def assertRefused(self, config: dict[str, object], says: str) -> None:
        error = self.assertRaises(BadRequest, validate_config, config)
        self.assertIn(says, error.message)

    def test_memoryOfMoreDigitsThanPythonConverts(self) -> None:
        """``int()`` of 5,000 digits was a ValueError: a 500 for a JSON string."""
        self.assertRefused({"limits.memory": "9" * 5000}, "must be 16 MiB to 1048576 MiB")
        self.assertRaises(BadRequest, parse_memory, "9" * 5000)
        self.assertEqual(parse_memory("0" * 30 + "512"), 512)

    def test_integerValueOfMoreDigitsThanPythonWrites(self) -> None:
        """``str()`` of a 5,000-digit integer was a ValueError."""
        self.assertRefused(
            {"user.a": 10**5000}, "Invalid value for user.a: a number with too many"
        )
        self.assertRaises(BadRequest, parse_cpus, 10**5000)

    def test_digitsOfOtherScriptsAreRefused(self) -> None:
        """``\\d`` and ``int()`` took Arabic-Indic and fullwidth digits: '٥١٢' was 512 MiB."""
        self.assertRefused({"limits.memory": "\u0665\u0661\u0662"}, "expected MiB")
        self.assertRefused({"limits.memory": "\uff15\uff11\uff12"}, "expected MiB")
        self.assertRefused({"limits.cpu": "\u0664"}, "expected a number of CPUs")

    def test_cpuCountsIntTookButTheDocsDoNot(self) -> None:
        """``int()`` read ``1_0`` as 10 and ``+2`` as 2."""
        self.assertRefused({"limits.cpu": "1_0"}, "expected a number of CPUs")
        self.assertRefused({"limits.cpu": "+2"}, "expected a number of CPUs")
        self.assertEqual(validate_config({"limits.cpu": " 4 "}), {"limits.cpu": "4"})
        self.assertRefused({"limits.cpu": "-1"}, "must be 1 to 64")

    def test_fuzzTargetChecksThem(self) -> None:
        web_config.check_config_values({"limits.memory": "9" * 5000, "user.a": web_config._HUGE})


class OperatorAPIRegressionTests(SynchronousTestCase):
    """Through the operator API: a 400 with the envelope, the world unchanged."""

    def test_memoryOfMoreDigitsThanPythonConverts(self) -> None:
        """Was a 500 ("internal error") and a logged traceback."""
        body = b'{"name": "new1", "config": {"limits.memory": "' + b"9" * 5000 + b'"}}'
        world = WORLDS.current()
        answer = request(world.operator, b"POST", b"/1.0/instances", body)
        assert answer is not None
        self.assertEqual(answer.status, 400)
        self.assertIn("Invalid limits.memory", answer.json()["error"])
        web_operator.check_operator_body(("POST", "/1.0/instances", RUNNING, body))
        resize = b'{"memory": "' + b"9" * 5000 + b'"}'
        web_operator.check_operator_body(
            ("POST", "/1.0/instances/{name}/actions/resize", RUNNING, resize)
        )

    def test_guestStateOfManyDigits(self) -> None:
        web_guest.check_guest_request(
            ("patch", b"PATCH", b"/1.0", b'{"state": 1' + b"0" * 5000 + b"}")
        )


class TextURLRegressionTests(SynchronousTestCase):
    """A URL that is not UTF-8 once percent-decoded: the server's own 400, not Klein's."""

    def test_operatorPathThatIsNotText(self) -> None:
        """Was Klein's plain-text 400 "Non-UTF-8 encoding in URL." and a logged traceback."""
        world = WORLDS.current()
        before = world.state()
        answer = request(world.operator, b"GET", b"/1.0/instances/%ff")
        assert answer is not None
        self.assertEqual(answer.status, 400)
        self.assertEqual(answer.headers[b"content-type"], b"application/json")
        self.assertEqual(answer.json()["error"], "Invalid URL: its path is not UTF-8 text")
        self.assertEqual(world.state(), before)
        self.assertEqual(self.flushLoggedErrors(), [])
        web_operator.check_operator_body(("PATCH", "/1.0/instances/{name}", "%ff", b"{}"))

    def test_guestPathThatIsNotText(self) -> None:
        world = WORLDS.current()
        answer = request(world.guest, b"GET", b"/1.0/config/%ff")
        assert answer is not None
        self.assertEqual(answer.status, 400)
        self.assertEqual(self.flushLoggedErrors(), [])
        web_guest.check_guest_request(("config", b"GET", b"/1.0/config/%ff", None))


class ClientCertificateRegressionTests(SynchronousTestCase):
    """A certificate OpenSSL parses and cryptography refuses is refused, not raised."""

    def test_validityTimeCryptographyRefuses(self) -> None:
        """A month 13 in notBefore: ValueError escaped the TLS verify callback."""
        pair = generate("vmready-agent-web1")
        der = bytearray(
            crypto.dump_certificate(
                crypto.FILETYPE_ASN1, crypto.load_certificate(crypto.FILETYPE_PEM, pair.cert_pem)
            )
        )
        # The first UTCTime (tag 0x17, 13 bytes YYMMDDhhmmssZ): month "13".
        at = der.index(b"\x17\x0d") + 2
        der[at + 2 : at + 4] = b"13"
        certificate = crypto.load_certificate(crypto.FILETYPE_ASN1, bytes(der))
        tls = MutualServerTLS(generate("vmready"), lambda pem: True)
        connection = tls.serverConnectionForTLS(None)
        self.assertFalse(tls._verify(connection, certificate, 18, 0, 0))
        pem = (
            b"-----BEGIN CERTIFICATE-----\n"
            + base64.encodebytes(bytes(der))
            + b"-----END CERTIFICATE-----\n"
        )
        web_certs.check_client_certificate(pem)

    def test_versionX509DoesNotHave(self) -> None:
        """Version 34: cryptography's InvalidVersion (not a ValueError) escaped identifying
        the caller on every request, and the TLS verify callback (found by the long run)."""
        pair = generate("vmready-agent-web1")
        der = bytearray(
            crypto.dump_certificate(
                crypto.FILETYPE_ASN1, crypto.load_certificate(crypto.FILETYPE_PEM, pair.cert_pem)
            )
        )
        # The explicit [0] version: A0 03 02 01 02 (v3); 0x22 is no version X.509 has.
        at = der.index(b"\xa0\x03\x02\x01\x02") + 4
        der[at] = 0x22
        pem = (
            b"-----BEGIN CERTIFICATE-----\n"
            + base64.encodebytes(bytes(der))
            + b"-----END CERTIFICATE-----\n"
        )
        self.assertIsNone(
            instance_for_certificate(web_certs._STORE.certificates, pem, web_certs._NOW)
        )
        certificate = crypto.load_certificate(crypto.FILETYPE_ASN1, bytes(der))
        tls = MutualServerTLS(generate("vmready"), lambda pem: True)
        self.assertFalse(tls._verify(tls.serverConnectionForTLS(None), certificate, 18, 0, 0))
        web_certs.check_client_certificate(pem)

    def test_textAfterTheEndLine(self) -> None:
        """cryptography reads the live certificate with text after its END line, OpenSSL does
        not: the caller is the same certificate either way (the check compared with OpenSSL's
        reading and raised)."""
        web_certs.check_client_certificate(web_certs._LIVE.cert_pem.rstrip(b"\n") + b"J")


class LiteralPathRegressionTests(SynchronousTestCase):
    """A path with ``//``: no route (404 in the envelope), not werkzeug's 308 redirect."""

    def test_guestConfigKeyAfterTwoSlashes(self) -> None:
        world = WORLDS.current()
        answer = request(world.guest, b"GET", b"/1.0/config//user.x")
        assert answer is not None
        self.assertEqual((answer.status, answer.json()["error"]), (404, "not found"))
        web_guest.check_guest_request(
            ("config", b"GET", b"/1.0/config//%F2%83%BE%9F%C3%B3%10", None)
        )

    def test_operatorPathWithTwoSlashes(self) -> None:
        world = WORLDS.current()
        answer = request(world.operator, b"GET", b"/1.0/instances//web1")
        assert answer is not None
        self.assertEqual(answer.status, 404)


class TrustTokenRegressionTests(SynchronousTestCase):
    """A trust token is read in one line's error whatever it holds."""

    def test_jsonNestedDeeperThanPythonRecurses(self) -> None:
        """RecursionError escaped TrustToken.decode: a 500 for a remote client redeeming it."""
        token = base64.b64encode(b"[" * 5000 + b"]" * 5000).decode("ascii")
        error = self.assertRaises(TokenError, TrustToken.decode, token)
        self.assertEqual(str(error), "not a trust token: its JSON is nested too deeply")
        web_tokens.check_trust_token(token)

    def test_aYearOfFewerThanFourDigitsReadsBack(self) -> None:
        """Year 26 was written back as ``26-11-28T…``, which decode refused (the long run)."""
        body = {
            "client_name": "laptop",
            "fingerprint": "ab" * 32,
            "addresses": ["vmready.example:8443"],
            "secret": "0f" * 32,
            "expires_at": "0026-11-28T17:13:57Z",
        }
        token = base64.b64encode(json.dumps(body).encode()).decode("ascii")
        decoded = TrustToken.decode(token)
        self.assertEqual(TrustToken.decode(decoded.encode()), decoded)
        web_tokens.check_trust_token(token)

    def test_aTimeBeforeTheFirstOneADatetimeHolds(self) -> None:
        body = {
            "client_name": "laptop",
            "fingerprint": "ab" * 32,
            "addresses": [],
            "secret": "0f" * 32,
            "expires_at": "0001-01-01T00:00:00+14:00",
        }
        token = base64.b64encode(json.dumps(body).encode()).decode("ascii")
        error = self.assertRaises(TokenError, TrustToken.decode, token)
        self.assertEqual(
            str(error), "trust token: expires_at '0001-01-01T00:00:00+14:00' is out of range"
        )
