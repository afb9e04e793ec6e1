"""Every fuzz target, briefly, under hypothesis: one test per target, deterministic.

The long runs are ``benchmarks/fuzz.py``'s; these keep the targets and the
parsers honest on every run of the suite.  Each target's test is named after
it (``ring-reader``: ``test_ringReader``), so a target added gets its test.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing import web, wire
from tests.fuzzing.registry import all_targets
from tests.fuzzing.trialcase import method_name, with_target_tests

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


@with_target_tests(wire.TARGETS)
class WireFuzzTests(SynchronousTestCase):
    """The wire parsers take whatever their peer sends without a crash or a broken property."""


@with_target_tests(web.TARGETS)
class WebFuzzTests(SynchronousTestCase):
    """API bodies, queries, config and certificates: no crash, no broken property."""

    def test_everyWebTargetIsRegistered(self) -> None:
        self.assertEqual(WEB_TARGETS - set(all_targets()), set())


class MethodNameTests(SynchronousTestCase):
    """A target's test is named after it."""

    def test_aTargetsTestIsItsNameInCamelCase(self) -> None:
        target = next(t for t in wire.TARGETS if t.name == "connect-port-daemon")
        self.assertEqual(method_name(target), "test_connectPortDaemon")
