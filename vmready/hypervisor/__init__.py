"""QEMU.

Its command line (``cmdline``); the process driver (``driver``) and the
``RunningVM`` it hands out (``runningvm``: ``following``, ``commands``,
``stopping``), with VM events (``vmevents``), QEMU's error lines
(``qemulog``) and VM processes (``vmprocess``); boot sources (``bootsource``),
their file checks (``bootfiles``) and qemu-img (``imagetool``); config drives
(``configdrive``) and the agent zipapp on them (``agentbundle``), accelerators
(``accel``), console logs (``console``), snapshots on disk (``snapshots``) and
the demo guest (the ``guestimage`` package).

``guestimage`` has a face of its own, outside this one: the daemon never loads the
image builder; so has ``agentbundle``, a command too (``python -m``), which must
run unloaded. The builder, run on its own, still loads this whole face first
(Twisted included); its builds take minutes, so that is kept rather than split
this face module by module.
"""

from vmready.hypervisor.accel import (
    ACCEL_REASON_KEY,
    CURRENT_ACCEL_KEY,
    AccelChoice,
    KVMVerdicts,
    choose_accel,
    kvm_device_problem,
)
from vmready.hypervisor.bootfiles import check_files
from vmready.hypervisor.bootsource import BOOT_KEYS, BootSource
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    AGENT_RING,
    CONNECT_PORT,
    CONSOLE_LOG_NAME,
    CURRENT_LAYOUT,
    FORWARD_GUEST_ADDRESS,
    FORWARD_GUEST_PORT,
    LEGACY_PORT,
    SERIAL_LAYOUTS,
    STARTABLE_LAYOUTS,
    UNRECORDED_LAYOUT,
    GuestForward,
    SerialLayout,
    SerialPort,
    VMSpec,
    build_command_line,
    device_problem,
    fakeqemu_guest_paths,
)
from vmready.hypervisor.configdrive import (
    AGENT_CONFIG,
    AGENT_ZIPAPP,
    DriveContents,
    write_identity,
    write_settings,
)
from vmready.hypervisor.console import (
    DEFAULT_CONSOLE_MAX_BYTES,
    console_size,
    mark_boot,
    read_console,
    rotate_console,
)
from vmready.hypervisor.driver import HypervisorDriver
from vmready.hypervisor.guestdata import check_guest_data, guest_data, meta_data
from vmready.hypervisor.imagetool import ImageInfo, ImageTool
from vmready.hypervisor.kvmprobe import KVMProbe
from vmready.hypervisor.noagent import AGENT_CONNECT_WITHIN, AGENT_EXPECTED_WITHIN, agent_absence
from vmready.hypervisor.qemulog import read_log_lines
from vmready.hypervisor.runningvm import RunningVM
from vmready.hypervisor.snapshots import (
    STATE_FILE,
    describe_layout,
    remove_instance_snapshots,
    saved_rng,
    snapshot_directory,
    state_mismatch,
    validate_snapshot_name,
    write_metadata,
)
from vmready.hypervisor.vmevents import VMEvent, VMEventKind

__all__ = [
    "ACCEL_REASON_KEY",
    "AGENT_CONFIG",
    "AGENT_CONNECT_WITHIN",
    "AGENT_EXPECTED_WITHIN",
    "AGENT_PORT",
    "AGENT_RING",
    "AGENT_ZIPAPP",
    "BOOT_KEYS",
    "CONNECT_PORT",
    "CONSOLE_LOG_NAME",
    "CURRENT_ACCEL_KEY",
    "CURRENT_LAYOUT",
    "DEFAULT_CONSOLE_MAX_BYTES",
    "FORWARD_GUEST_ADDRESS",
    "FORWARD_GUEST_PORT",
    "LEGACY_PORT",
    "SERIAL_LAYOUTS",
    "STARTABLE_LAYOUTS",
    "STATE_FILE",
    "UNRECORDED_LAYOUT",
    "AccelChoice",
    "BootSource",
    "DriveContents",
    "GuestForward",
    "HypervisorDriver",
    "ImageInfo",
    "ImageTool",
    "KVMProbe",
    "KVMVerdicts",
    "RunningVM",
    "SerialLayout",
    "SerialPort",
    "VMEvent",
    "VMEventKind",
    "VMSpec",
    "agent_absence",
    "build_command_line",
    "check_files",
    "check_guest_data",
    "choose_accel",
    "console_size",
    "describe_layout",
    "device_problem",
    "fakeqemu_guest_paths",
    "guest_data",
    "kvm_device_problem",
    "mark_boot",
    "meta_data",
    "read_console",
    "read_log_lines",
    "remove_instance_snapshots",
    "rotate_console",
    "saved_rng",
    "snapshot_directory",
    "state_mismatch",
    "validate_snapshot_name",
    "write_identity",
    "write_metadata",
    "write_settings",
]
