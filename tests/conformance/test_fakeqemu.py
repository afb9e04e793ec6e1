"""The conformance checks against a fakeqemu process."""

from tests.conformance import checks
from tests.conformance.support import FAKEQEMU


class FakeQemuMonitor(checks.MonitorChecks):
    """Monitor checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuRingBuffer(checks.RingBufferChecks):
    """Ring-buffer checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuCommandLine(checks.CommandLineChecks):
    """Command-line checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuMigration(checks.MigrationChecks):
    """Migration checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuLogfile(checks.LogfileChecks):
    """-D log file checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuIncomingWait(checks.IncomingWaitChecks):
    """Awaited-stream checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuGuest(checks.GuestChecks):
    """Guest checks: fakeqemu only, since real QEMU needs a booted guest OS to open a port."""

    backend = FAKEQEMU
