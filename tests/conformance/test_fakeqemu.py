"""The conformance checks against a fakeqemu process."""

from tests.conformance import checks, device_checks, help_checks, port_event_checks
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


class FakeQemuContractLine(device_checks.ContractLineChecks):
    """The issue 11 command line and its devices on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuDeviceRefusals(device_checks.DeviceRefusalChecks):
    """The new options' refusals on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuDeviceLogfile(device_checks.DeviceLogfileChecks):
    """Where the new options' refusals go with -daemonize -D, on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuDeviceMigration(device_checks.DeviceMigrationChecks):
    """Restoring a VM with the contract's devices, on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuDeviceGuest(device_checks.DeviceGuestChecks):
    """Guest-side device checks: fakeqemu only, since real QEMU needs a booted guest OS."""

    backend = FAKEQEMU


class FakeQemuSocketChardev(checks.SocketChardevChecks):
    """Socket chardev checks on fakeqemu."""

    backend = FAKEQEMU


class FakeQemuPortEvents(port_event_checks.FakeQemuPortEventChecks):
    """VSERPORT_CHANGE as a guest program causes it, on fakeqemu (guest sockets)."""

    backend = FAKEQEMU


class FakeQemuHelp(help_checks.HelpChecks):
    """Help requests on fakeqemu."""

    backend = FAKEQEMU
