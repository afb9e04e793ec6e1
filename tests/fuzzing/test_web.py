"""Every HTTP-side fuzz target, briefly, under hypothesis: one test per target, deterministic.

The long runs are ``benchmarks/fuzz.py``'s; these keep the targets and the
parsers honest on every run of the suite.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing import web
from tests.fuzzing.registry import all_targets
from tests.fuzzing.trialcase import fuzzed, tested_targets

_TARGETS = {target.name: target for target in web.TARGETS}
# The HTTP side's targets: one removed or renamed fails here, not silently in the long run.
WEB_TARGETS = {
    "operator-body",
    "operator-query",
    "guest-body",
    "config-file",
    "config-values",
    "client-certificate",
    "trust-token",
}


def _fuzzed(name: str) -> Any:
    """A test method that runs target ``name`` on 200 inputs, the same ones every run."""
    return fuzzed(_TARGETS[name])


class WebFuzzTests(SynchronousTestCase):
    """API bodies, queries, config and certificates: no crash, no broken property."""

    test_operatorBody = _fuzzed("operator-body")
    test_operatorQuery = _fuzzed("operator-query")
    test_guestBody = _fuzzed("guest-body")
    test_configFile = _fuzzed("config-file")
    test_configValues = _fuzzed("config-values")
    test_clientCertificate = _fuzzed("client-certificate")
    test_trustToken = _fuzzed("trust-token")

    def test_everyWebTargetIsRegistered(self) -> None:
        self.assertEqual(WEB_TARGETS - set(all_targets()), set())

    def test_everyTargetHasItsTest(self) -> None:
        """A web target added without a test here fails this test."""
        self.assertEqual(tested_targets(type(self)) & set(_TARGETS), set(_TARGETS))
