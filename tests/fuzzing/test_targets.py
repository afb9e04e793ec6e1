"""Every fuzz target, briefly, under hypothesis: one test per target, deterministic.

The long runs are ``benchmarks/fuzz.py``'s; these keep the targets and the
parsers honest on every run of the suite.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing import web, wire
from tests.fuzzing.registry import all_targets
from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.trialcase import fuzzed, tested_targets

_WIRE = {target.name: target for target in wire.TARGETS}
_WEB = {target.name: target for target in web.TARGETS}
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


def _untested(case: type, targets: Iterable[FuzzTarget]) -> set[str]:
    """The targets no ``fuzzed`` method of test case class ``case`` runs."""
    return {target.name for target in targets} - tested_targets(case)


def _fuzzed(name: str) -> Any:
    """A test method that runs target ``name`` on 200 inputs, the same ones every run."""
    return fuzzed({**_WIRE, **_WEB}[name])


class WireFuzzTests(SynchronousTestCase):
    """The wire parsers take whatever their peer sends without a crash or a broken property."""

    test_ringReader = _fuzzed("ring-reader")
    test_ringHost = _fuzzed("ring-host")
    test_ringGuest = _fuzzed("ring-guest")
    test_connectLine = _fuzzed("connect-line")
    test_connectPortDaemon = _fuzzed("connect-port-daemon")
    test_qmpClient = _fuzzed("qmp-client")
    test_qmpServer = _fuzzed("qmp-server")
    test_qmpSplitter = _fuzzed("qmp-splitter")
    test_transcript = _fuzzed("transcript")
    test_endpointString = _fuzzed("endpoint-string")

    def test_everyTargetHasItsTest(self) -> None:
        """A wire target added without a test here fails this test."""
        self.assertEqual(_untested(type(self), wire.TARGETS), set())


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
        self.assertEqual(_untested(type(self), web.TARGETS), set())
