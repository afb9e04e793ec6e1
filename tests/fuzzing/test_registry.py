"""The registry of fuzz targets: none silently dropped."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests.fuzzing.registry import all_targets

# The wire parsers' targets; the HTTP side's are its own module's to list.
WIRE_TARGETS = {
    "ring-reader",
    "ring-host",
    "ring-guest",
    "connect-line",
    "connect-port-daemon",
    "qmp-client",
    "qmp-server",
    "qmp-splitter",
    "transcript",
    "endpoint-string",
}


class RegistryTests(SynchronousTestCase):
    """``all_targets`` is what ``benchmarks/fuzz.py`` runs by default."""

    def test_everyWireTargetIsRegistered(self) -> None:
        """A wire target removed or renamed fails here, not silently in the long run."""
        missing = WIRE_TARGETS - set(all_targets())
        self.assertEqual(missing, set())

    def test_targetsAreDescribed(self) -> None:
        """Every target says what it fuzzes, under a name usable on the command line."""
        for name, target in all_targets().items():
            self.assertEqual(name, target.name)
            self.assertRegex(name, r"^[a-z0-9][a-z0-9-]*$")
            self.assertTrue(target.description, name)
