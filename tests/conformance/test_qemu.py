"""The conformance checks against real qemu-system-x86_64.

They skip where QEMU is not installed, unless VMREADY_REQUIRE_QEMU=1 (as CI
sets it), which turns the skip into a failure.
"""

from tests.conformance import checks, device_checks, help_checks, port_event_checks
from tests.conformance.support import REAL_QEMU


class QemuMonitor(checks.MonitorChecks):
    """Monitor checks on real QEMU."""

    backend = REAL_QEMU


class QemuRingBuffer(checks.RingBufferChecks):
    """Ring-buffer checks on real QEMU."""

    backend = REAL_QEMU


class QemuCommandLine(checks.CommandLineChecks):
    """Command-line checks on real QEMU."""

    backend = REAL_QEMU


class QemuMigration(checks.MigrationChecks):
    """Migration checks on real QEMU."""

    backend = REAL_QEMU


class QemuLogfile(checks.LogfileChecks):
    """-D log file checks on real QEMU."""

    backend = REAL_QEMU


class QemuIncomingWait(checks.IncomingWaitChecks):
    """Awaited-stream checks on real QEMU."""

    backend = REAL_QEMU


class QemuContractLine(device_checks.ContractLineChecks):
    """The issue 11 command line and its devices on real QEMU."""

    backend = REAL_QEMU


class QemuDeviceRefusals(device_checks.DeviceRefusalChecks):
    """The new options' refusals on real QEMU."""

    backend = REAL_QEMU


class QemuDeviceLogfile(device_checks.DeviceLogfileChecks):
    """Where the new options' refusals go with -daemonize -D, on real QEMU."""

    backend = REAL_QEMU


class QemuDeviceMigration(device_checks.DeviceMigrationChecks):
    """Restoring a VM with the contract's devices, on real QEMU."""

    backend = REAL_QEMU


class QemuSocketChardev(checks.SocketChardevChecks):
    """Socket chardev checks on real QEMU."""

    backend = REAL_QEMU


class QemuPortEvents(port_event_checks.QemuPortEventChecks):
    """VSERPORT_CHANGE as a real Linux guest causes it, on real QEMU."""

    backend = REAL_QEMU


class QemuHelp(help_checks.HelpChecks):
    """Help requests on real QEMU."""

    backend = REAL_QEMU
