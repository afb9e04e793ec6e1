"""Every wire fuzz target, briefly, under hypothesis: one test per target, deterministic.

The long runs are ``benchmarks/fuzz.py``'s; these keep the targets and the
parsers honest on every run of the suite.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing import wire
from tests.fuzzing.trialcase import fuzzed, tested_targets

_TARGETS = {target.name: target for target in wire.TARGETS}


def _fuzzed(name: str) -> Any:
    """A test method that runs target ``name`` on 200 inputs, the same ones every run."""
    return fuzzed(_TARGETS[name])


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
        self.assertEqual(tested_targets(type(self)) & set(_TARGETS), set(_TARGETS))
