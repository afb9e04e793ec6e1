"""fakeqemu: a mock hypervisor that speaks QEMU's QMP, ring buffers and virtio serial ports.

Run it as ``fakeqemu-system-x86_64`` (or ``python -m fakeqemu``) with a
``qemu-system-x86_64`` command line; host many VMs in one process with
``fakeqemu-host``; embed it in trial tests with :mod:`fakeqemu.testing`.
"""

from fakeqemu._cmdline import CommandLineError, MachineConfig, parse_command_line
from fakeqemu._machine import Machine
from fakeqemu._migration import IncomingMigrationError
from fakeqemu._ringbuf import RingBuffer
from fakeqemu._runstate import MachineError, RunState
from fakeqemu._vm import RunningVM, StartError, guest_directory

__version__ = "0.1.0"

__all__ = [
    "CommandLineError",
    "IncomingMigrationError",
    "Machine",
    "MachineConfig",
    "MachineError",
    "RingBuffer",
    "RunState",
    "RunningVM",
    "StartError",
    "__version__",
    "guest_directory",
    "parse_command_line",
]
